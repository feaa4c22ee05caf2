"""Benchmark: which oneDNN kernels a CPU training step of the optimized recipe runs, and their time.

Runs `--steps` training steps of the optimized recipe (the pipeline's own `train_step`, after
`--warmup` untimed ones) in a child process with `ONEDNN_VERBOSE=1`, which makes oneDNN print one
line per primitive it executes with the implementation it chose (`brgconv:avx512_core_bf16`,
`jit:uni`, `ref`...) and its time. Summed over the timed steps by primitive kind and
implementation, set against the steps' wall time, it shows where a step's time goes below
PyTorch: the convolutions' kernels, the reorders between layouts, and what runs outside oneDNN
(batch norm, elementwise, the optimizer in ATen's own loops).

    python bench/onednn_kernels.py --batch 256 --steps 2 --warmup 1
    python bench/onednn_kernels.py --batch 256 --steps 2 --warmup 1 --contiguous   # NCHW, for comparison
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

BEGIN, END = "@@timed-steps-begin", "@@timed-steps-end"


def parse(log: str) -> tuple[dict[tuple[str, str], list[float]], float]:
    """({(primitive kind, implementation): [ms per call]}, wall seconds) of the lines between the
    timed steps' markers (oneDNN 3's `onednn_verbose,v1,primitive,exec,cpu,KIND,IMPL,...,MS`)."""
    calls: dict[tuple[str, str], list[float]] = defaultdict(list)
    wall, inside = 0.0, False
    for line in log.splitlines():
        if line.startswith(BEGIN):
            inside = True
        elif line.startswith(END):
            inside, wall = False, float(line.split()[1])
        elif inside and line.startswith("onednn_verbose") and ",exec," in line:
            fields = line.split(",")
            at = fields.index("exec")
            calls[(fields[at + 2], fields[at + 3])].append(float(fields[-1]))
    return calls, wall


def child(args: argparse.Namespace) -> None:
    """The timed steps, between markers on stdout (oneDNN writes its lines there too)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from peer import optimized_config

    from cnnpipe.data.store.shards import open_split
    from cnnpipe.profile.measure import build_setup, train_step
    from cnnpipe.train.distributed import init_distributed
    from cnnpipe.train.parts import set_threads

    cfg, device = optimized_config(args)
    if args.contiguous:
        cfg = cfg.with_train(channels_last=False)
    info = init_distributed(device.type)
    set_threads(cfg, info)
    s = build_setup(cfg, info, open_split(args.data, "train"))
    for _ in range(args.warmup):
        train_step(s)
    print(BEGIN, flush=True)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(s)
    print(f"{END} {time.perf_counter() - t0:.6f} amp={s.ctx.amp} channels_last={cfg.train.channels_last}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile"))
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--contiguous", action="store_true", help="NCHW instead of the recipe's layout")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    done = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], capture_output=True, text=True,
                          env={**os.environ, "ONEDNN_VERBOSE": "1"})
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    calls, wall = parse(done.stdout)
    total = sum(sum(v) for v in calls.values()) / 1000
    print(f"{args.model}, {args.size} px, batch {args.batch}, {args.steps} timed steps: {wall:.2f} s wall, "
          f"{total:.2f} s in oneDNN primitives ({total / wall:.0%}); the rest is ATen's own loops and Python")
    print(f"{'primitive':14s} {'implementation':34s} {'calls':>6s} {'ms':>9s} {'share of wall':>13s}")
    for (kind, impl), ms in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind:14s} {impl:34s} {len(ms):6d} {sum(ms):9.1f} {sum(ms) / 1000 / wall:13.1%}")


if __name__ == "__main__":
    main()
