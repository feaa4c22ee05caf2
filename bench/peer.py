"""Benchmark: cnnpipe's optimized recipe against timm's own `train.py`, side by side, interleaved.

The peer is timm's reference training script, run from a checkout of
huggingface/pytorch-image-models (never copied into this project), against the installed `timm`
package: `python -P` keeps the checkout's own `timm/` folder off the import path, so both sides
build the same model code. Both sides train the same model, on the same images (the prepared
store's training images, written once as an ImageFolder of PNGs for timm), at the same image size,
batch, precision and layout (whatever the optimized recipe resolves to here: bf16 autocast and
channels_last on a CPU with AVX512-BF16), each in a fresh process, in turns: timm, cnnpipe, timm,
cnnpipe, ... (the VM's speed drifts within minutes; each round's ratio is taken between
neighbours). Each side's rate is the median of its per-step images/s after `--warmup` steps:
timm's from its log lines (`--log-interval 1`: `Time: 0.993s, 257.83/s`), cnnpipe's from the
engine's own `train_step`, timed per step. After each cnnpipe run, the same process counts one
step's FLOPs and measures this machine's bf16 matmul rate (`profile/peaks.py`), which gives the
share of the bf16 peak the recipe reaches. The last line, per size:

    cnnpipe/timm: R.RRx (IQR a-b); bf16 share: P%

Getting the peer (pinned: `PINNED_COMMIT`, timm's v1.0.28 tag; another commit runs with a warning
that names it):

    git clone https://github.com/huggingface/pytorch-image-models /tmp/timm-peer
    git -C /tmp/timm-peer checkout v1.0.28
    python bench/peer.py --timm-repo /tmp/timm-peer                     # 32 px, batch 256, 5 rounds
    python bench/peer.py --timm-repo /tmp/timm-peer --size 128 --batch 64
    python bench/peer.py --timm-repo /tmp/timm-peer --model resnet18 --batch 16 --steps 3 --warmup 1 \\
        --rounds 1 --images 64                                           # a smoke test, ~1 min

What differs by design: timm's augmentation is its own default (RandomResizedCrop, flip, colour
jitter, on PIL images in its loader workers, `-j`), cnnpipe's its fast batched crop and flip; the
optimizer (SGD with Nesterov momentum, cosine) and the loss (label smoothing 0.1) are set alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PINNED_COMMIT = "8ef73809f622e0031bd7f4940265734aef8b9978"
"""timm v1.0.28: the newest release tag in the mirror this was written against (installed: 1.0.31)."""
TIMM_RATE = re.compile(r"Train: \d+ \[\s*(\d+)/\d+.*?Time: [\d.]+s,\s+([\d.]+)/s")
"""A timm train.py log line: the update's index and its images/s (the update alone, not the average)."""


def timm_commit(repo: Path) -> str:
    """The checkout's commit, with a warning on stderr when it is not the pinned one."""
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    if commit != PINNED_COMMIT:
        print(f"peer: timm checkout at {commit}, not the pinned {PINNED_COMMIT} (v1.0.28); using it",
              file=sys.stderr)
    return commit


def timm_rates(log: str, warmup: int) -> list[float]:
    """Images/s of each update in timm's log after the first `warmup` updates."""
    return [float(rate) for index, rate in TIMM_RATE.findall(log) if int(index) >= warmup]


def write_image_folder(data: Path, out: Path, count: int) -> tuple[int, int]:
    """The first `count` training images of the prepared store as `out/train/<class>/<i>.png`
    (cycled when the split is smaller); returns (channels, stored size)."""
    from PIL import Image

    from cnnpipe.data.store.shards import open_split

    split = open_split(data, "train")
    for name in split.classes:
        (out / "train" / name).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        row = i % len(split)
        image = split.images[row]
        mode = "L" if image.shape[-1] == 1 else "RGB"
        Image.fromarray(image[..., 0] if mode == "L" else image, mode).save(
            out / "train" / split.classes[split.labels[row]] / f"{i:06d}.png")
    return split.channels, int(split.images[0].shape[0])


def optimized_config(args: argparse.Namespace):
    """The optimized recipe at this batch, size and model, its `auto` knobs as its profile tuned them."""
    import torch

    from cnnpipe.params import load_params, resolve
    from cnnpipe.train.tuning import read_tuned, resolve_auto

    params = copy.deepcopy(load_params(args.params))
    params["model"].update(name=args.model, pretrained=False)  # (the weights do not change the speed)
    params["data"]["image_size"] = args.size
    params["variants"]["optimized"].setdefault("train", {}).update(batch_size=args.batch, min_steps=None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tuned = read_tuned(args.tuned / "optimized_tuned.yaml")
    cfg = resolve_auto(resolve(params, "optimized"), device, tuned)
    return cfg.with_train(compile="off"), device  # timm's side runs eager too (no --torchcompile)


def cnnpipe_side(args: argparse.Namespace) -> dict:
    """One cnnpipe run (this script with `--side cnnpipe`): per-step images/s, then the step's share
    of the bf16 peak (one step's FLOPs and the matmul rate, both after the timed steps)."""
    import torch

    from cnnpipe.data.store.shards import open_split
    from cnnpipe.profile.measure import build_setup, train_step
    from cnnpipe.profile.peaks import count_step, matmul_gflops
    from cnnpipe.train.distributed import init_distributed
    from cnnpipe.train.engine import sync_device
    from cnnpipe.train.parts import set_threads

    cfg, device = optimized_config(args)
    info = init_distributed(device.type)
    set_threads(cfg, info)
    s = build_setup(cfg, info, open_split(args.data, "train"))
    rates = []
    for i in range(args.warmup + args.steps):
        sync_device(s.device)
        t0 = time.perf_counter()
        train_step(s)
        sync_device(s.device)
        if i >= args.warmup:
            rates.append(s.images_per_step / (time.perf_counter() - t0))
    count = count_step(s, per_image_s=0.0, share_s=None)
    bf16, _ = matmul_gflops(s.device, torch.bfloat16, seconds=1.0)
    achieved = sum(count.flops.values()) / s.images_per_step * statistics.median(rates) / 1e9
    return {"rates": rates, "amp": s.ctx.amp, "channels_last": cfg.train.channels_last, "in_chans": s.in_chans,
            "achieved_gflops": achieved, "bf16_gflops": bf16, "threads": torch.get_num_threads()}


def timm_command(args: argparse.Namespace, folder: Path, out: Path, side: dict) -> list[str]:
    """timm's train.py with this run's model, data, size, batch, precision and layout."""
    cmd = [sys.executable, "-P", str(args.timm_repo / "train.py"), "--data-dir", str(folder), "--train-split", "train",
           "--val-split", "", "--model", args.model, "--num-classes", str(args.classes),
           "--in-chans", str(side["in_chans"]), "--img-size", str(args.size), "-b", str(args.batch),
           "--epochs", "1", "--log-interval", "1", "-j", str(args.workers), "--opt", "sgd", "--momentum", "0.9",
           "--weight-decay", "5e-5", "--lr", "0.1", "--sched", "cosine", "--warmup-epochs", "0",
           "--smoothing", "0.1", "--output", str(out), "--checkpoint-hist", "1",
           "--device", "cuda" if args.cuda else "cpu", "--seed", "42"]
    if side["amp"] == "bf16":
        cmd += ["--amp", "--amp-dtype", "bfloat16"]
    elif side["amp"] == "fp16":
        cmd += ["--amp", "--amp-dtype", "float16"]
    if side["channels_last"]:
        cmd.append("--channels-last")
    if args.cuda:
        cmd.append("--synchronize-step")  # else its per-step time is the host's queueing time
    return cmd


def run_side(cmd: list[str], cwd: Path) -> tuple[str, str]:
    """Run one side in a fresh process: (stdout, stderr), or exit with the failure's tail."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"peer: {' '.join(cmd[:3])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, done.stderr


def run_cnnpipe(cmd: list[str]) -> dict:
    """One cnnpipe run: the JSON line it ends its stdout with."""
    return json.loads(run_side(cmd, Path.cwd())[0].strip().splitlines()[-1])


def quartiles(values: list[float]) -> tuple[float, float]:
    """The interquartile range's ends (both the value itself for one value)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def compare(args: argparse.Namespace) -> str:
    """Rounds of timm then cnnpipe at one size; the line `cnnpipe/timm: ...` for it."""
    me = [sys.executable, str(Path(__file__).resolve()), "--side", "cnnpipe", "--data", str(args.data),
          "--params", str(args.params), "--tuned", str(args.tuned), "--model", args.model, "--size", str(args.size),
          "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    ratios, shares = [], []
    with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
        folder = Path(tmp) / "images"
        count = args.images or (args.warmup + args.steps) * args.batch  # one epoch is the timed steps
        chans, stored = write_image_folder(args.data, folder, count)
        side: dict | None = None
        for r in range(args.rounds):
            if side is None:  # the first cnnpipe run tells timm the precision and layout it resolved to
                side = run_cnnpipe(me)
            log = "".join(run_side(timm_command(args, folder, Path(tmp) / f"out{r}", side), Path(tmp)))
            timm = timm_rates(log, args.warmup)
            if r:
                side = run_cnnpipe(me)
            if not timm:
                raise SystemExit(f"peer: no timm rates after {args.warmup} warm-up updates in its log:\n{log[-2000:]}")
            ratio = statistics.median(side["rates"]) / statistics.median(timm)
            ratios.append(ratio)
            shares.append(side["achieved_gflops"] / side["bf16_gflops"])
            print(f"  round {r + 1}: timm {statistics.median(timm):.1f} img/s ({len(timm)} steps), cnnpipe "
                  f"{statistics.median(side['rates']):.1f} img/s ({len(side['rates'])} steps): {ratio:.2f}x; "
                  f"{side['achieved_gflops']:.0f} GFLOP/s of a {side['bf16_gflops']:.0f} bf16 matmul", flush=True)
    low, high = quartiles(ratios)
    print(f"{args.model}, {args.size} px from {stored} px PNGs ({chans} channel(s)), batch {args.batch}, "
          f"amp={side['amp']}, channels_last={side['channels_last']}, {side['threads']} threads, "
          f"{args.rounds} rounds")
    return (f"cnnpipe/timm: {statistics.median(ratios):.2f}x (IQR {low:.2f}-{high:.2f}); "
            f"bf16 share: {statistics.median(shares):.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timm-repo", type=Path, help="a checkout of huggingface/pytorch-image-models")
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile"), help="holds optimized_tuned.yaml")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--size", type=int, nargs="+", default=[32], help="image sizes, each compared in turn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps of each run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2, help="timm's loader workers (-j)")
    parser.add_argument("--images", type=int, default=None, help="PNGs for timm (default: warm-up + timed steps)")
    parser.add_argument("--side", choices=["cnnpipe"], help=argparse.SUPPRESS)  # (one cnnpipe run, a JSON line)
    args = parser.parse_args()
    if args.side == "cnnpipe":
        args.size = args.size[0]
        print(json.dumps(cnnpipe_side(args)))
        return
    if args.timm_repo is None or not (args.timm_repo / "train.py").exists():
        parser.error("--timm-repo must point to a checkout of huggingface/pytorch-image-models (see --help)")
    import timm
    import torch

    from cnnpipe.data.store.shards import open_split

    args.cuda = torch.cuda.is_available()
    args.classes = open_split(args.data, "train").num_classes
    commit = timm_commit(args.timm_repo)
    print(f"peer: timm train.py at {commit[:12]} against timm {timm.__version__} (installed), "
          f"torch {torch.__version__}")
    for size in args.size:  # each size ends with its own `cnnpipe/timm:` line
        print(compare(argparse.Namespace(**{**vars(args), "size": size})), flush=True)


if __name__ == "__main__":
    main()
