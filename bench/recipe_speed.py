"""Benchmark: the two recipes' training speed at the same batch, in interleaved blocks.

On a shared VM the speed drifts by tens of percent within minutes, so two runs timed one after the
other (or two short epochs) cannot tell a 10% edge from noise. This builds the baseline recipe and
the optimized one (the profile's tuned values applied, `at_batch` included, as `fit` would) at one
batch in one process, and times blocks of steps of each in turn with the pipeline's own
`train_step`; the ratio is taken per round, so drift cancels. `--flip` adds the optimized recipe
with a knob changed, e.g. to see what channels_last or bf16 is worth at that batch.

    python bench/recipe_speed.py --batch 64                        # ~2.5 min: the short-run batch
    python bench/recipe_speed.py --batch 64 --flip channels_last=false amp=off --seconds 300

Run it under `LD_PRELOAD=...libjemalloc.so.2` (or tcmalloc) and without, alternately, to compare
allocators: they cannot be switched inside one process.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import yaml

from cnnpipe.config import VariantConfig
from cnnpipe.data.store.shards import open_split
from cnnpipe.hardware import cpu_report
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.measure import Setup, build_setup, train_step
from cnnpipe.train.distributed import init_distributed
from cnnpipe.train.parts import set_threads
from cnnpipe.train.tuning import read_tuned, resolve_auto


def recipes(raw: dict, batch: int | None, tuned_dir: Path, flips: list[str], device) -> dict[str, VariantConfig]:
    """Baseline and optimized at `batch` (None: each variant's own), their auto knobs resolved from the
    tuned files as `fit` resolves them, without `train.min_steps`' halving; plus each flip."""
    runs = {"baseline": ("baseline", {}), "optimized": ("optimized", {})}
    for flip in flips:
        key, _, text = flip.partition("=")
        runs[f"optimized {key}={text}"] = ("optimized", {key: yaml.safe_load(text)})
    out = {}
    for name, (variant, change) in runs.items():
        params = copy.deepcopy(raw)  # a flip goes through params validation, as `dvc exp run -S` would
        train = params["variants"][variant].setdefault("train", {})
        train.update(change, min_steps=None, **({} if batch is None else {"batch_size": batch}))
        tuned = read_tuned(tuned_dir / f"{variant}_tuned.yaml")
        out[name] = resolve_auto(resolve(params, variant), device, tuned)
    return out


def interleave(setups: dict[str, Setup], seconds: float, steps: int) -> dict[str, list[float]]:
    """Images/s of each setup per round: `steps` steps of each in turn until `seconds` have passed."""
    for s in setups.values():
        for _ in range(2):  # warm-up: allocation and kernel selection
            train_step(s)
    speeds: dict[str, list[float]] = {name: [] for name in setups}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for name, s in setups.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(s)
            speeds[name].append(steps * s.images_per_step / (time.perf_counter() - t0))
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--data", type=Path, default=Path("data/prepared"))
    parser.add_argument("--tuned", type=Path, default=Path("metrics/profile"), help="holds <variant>_tuned.yaml")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--steps", type=int, default=4, help="steps per block")
    parser.add_argument("--flip", nargs="*", default=[], metavar="KEY=VALUE",
                        help="also time the optimized recipe with train.KEY=VALUE")
    args = parser.parse_args()
    raw = load_params(args.params)
    info = init_distributed("auto")
    configs = recipes(raw, args.batch, args.tuned, args.flip, info.device)
    set_threads(configs["optimized"], info)
    train = open_split(args.data, "train")
    speeds = interleave({name: build_setup(cfg, info, train) for name, cfg in configs.items()},
                        args.seconds, args.steps)
    cpu = cpu_report()
    print(f"\n{cpu['model']}, {info.device}, batch {args.batch}, {len(speeds['baseline'])} rounds of "
          f"{args.steps} steps each")
    print(f"{'recipe':32s} {'img/s (median)':>15s}  vs baseline, per round: median [min-max]")
    for name, values in speeds.items():
        ratios = [a / b for a, b in zip(values, speeds["baseline"])]
        t = configs[name].train
        print(f"{name:32s} {statistics.median(values):15.1f}  {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]   amp={t.amp} channels_last={t.channels_last} loader={t.loader}")


if __name__ == "__main__":
    main()
