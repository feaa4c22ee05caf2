"""Benchmark: does a training step slow down as training goes on, and why?

The profile times a recipe in short blocks near the start of training (a few dozen steps, the LR
still warming up); an epoch then runs a hundred steps in a row at the full LR. Where the epochs run
slower than the profile's blocks, this tells apart the two usual causes by running the same recipe
(the pipeline's own `build_setup` and `train_step`, as `fit` runs them) for `--steps` steps in a row,
each case in a fresh process, the cases in turns:

- `schedule`: the recipe as it trains (its LR schedule from step 0);
- `frozen`: the same with every LR at 0 (the weights never move: the numbers stay those of the start);
- `ftz`: the schedule with the CPU flushing denormal floats to zero (`torch.set_flush_denormal`,
  called before any thread pool starts, so every thread inherits it);
- `probed`: the schedule after what the profile runs before its base: the probe's partial batch
  (`measure.probe_per_image`), then the first step.

A slowdown in `schedule` that `frozen` lacks comes from the values training produces; one that
`ftz` removes, from denormal floats. One that all three share is the machine (a VM slowing under
sustained load). `probed` slower than `schedule` would mean the profile's own probe slows the steps
its base then times. Prints each case's images/s per window of `--window` steps.

    python bench/long_run.py --variant optimized --steps 160 --rounds 2    # ~10 min at 32 px, 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("schedule", "frozen", "ftz", "probed")


def run_case(case: str, variant: str, steps: int, window: int, params: str, data: Path, tuned: Path) -> list[float]:
    """Images/s per window of `window` steps, in this process (set up for `case` first)."""
    import torch

    if case == "ftz":
        torch.set_flush_denormal(True)
    from recipe_speed import recipes  # bench/, this script's folder, is first on sys.path

    from cnnpipe.data.store.shards import open_split
    from cnnpipe.params import load_params
    from cnnpipe.profile.box import PROBE_IMAGES
    from cnnpipe.profile.measure import build_setup, probe_per_image, train_step
    from cnnpipe.train.distributed import init_distributed
    from cnnpipe.train.parts import set_threads

    info = init_distributed("auto")
    cfg = recipes(load_params(params), None, tuned, [], info.device)[variant]
    set_threads(cfg, info)
    s = build_setup(cfg, info, open_split(data, "train"))
    if case == "frozen":
        s.ctx.lr_for_step = lambda step: 0.0
    if case == "probed":
        probe_per_image(s, PROBE_IMAGES)
    train_step(s)  # allocation and kernel selection
    rates = []
    for _ in range(steps // window):
        t0 = time.perf_counter()
        for _ in range(window):
            train_step(s)
        rates.append(window * s.images_per_step / (time.perf_counter() - t0))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="optimized")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile"), help="holds <variant>_tuned.yaml")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.variant, args.steps, args.window, args.params, args.data,
                                  args.tuned)))
        return
    rates: dict[str, list[list[float]]] = {case: [] for case in args.cases}
    for r in range(args.rounds):
        for case in args.cases:
            out = subprocess.run([sys.executable, __file__, "--case", case, "--variant", args.variant,
                                  "--steps", str(args.steps), "--window", str(args.window), "--params", args.params,
                                  "--data", str(args.data), "--tuned", str(args.tuned)],
                                 capture_output=True, text=True, check=True)
            rates[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {case:9s} " + " ".join(f"{v:6.1f}" for v in rates[case][-1]), flush=True)
    print(f"\n{args.variant}: images/s per window of {args.window} steps, median over {args.rounds} round(s)")
    for case, runs in rates.items():
        windows = [statistics.median(v) for v in zip(*runs)]
        print(f"{case:9s} " + " ".join(f"{v:6.1f}" for v in windows)
              + f"   first {windows[0]:.1f}, last {windows[-1]:.1f} ({windows[-1] / windows[0]:.2f}x)")


if __name__ == "__main__":
    main()
