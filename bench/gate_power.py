"""The gate's operating characteristics: how often `judge` blesses, warns or refuses simulated weeks.

Each simulated week draws, per class, which test images the champion and the challenger get right
(a multinomial over the paired cells), builds both models' answers and runs the gate's own
`cnnpipe.release.gate.judge` at the release params' defaults. Champion recalls per class are drawn
once from U(0.60, 0.94); an equal challenger disagrees with it on `flips` of each class's images,
as many each way. Weeks:

  equal f%            an equal challenger, f% of the answers flipping (as many each way)
  N pt worse          6% flips, and N points of recall more lost in every class
  one class -N pt     6% flips, one class (of n/classes images) loses N points of recall
  new class           equal at 6% on the old classes, plus a new class of n/10 more images at 85%
                      recall, and 2% of the old classes' images now called the new class
  new class, 2 worse  the same week with the old classes 2 points worse

Printed per week, test size and class count, in % of the simulated weeks: judged (not too small),
blessed (with or without the too-small warning), blessed among the judged weeks, refused, and
refused by a per-class rule. Then the targets, each with its worst cell.

    python bench/gate_power.py                # 300 weeks per cell, ~10 min on one core
    python bench/gate_power.py --weeks 50     # a quick look
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import numpy as np

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.release.gate import GateRules, judge

SIZES = (200, 1_000, 5_000, 20_000)
CLASS_COUNTS = (10, 50, 200, 1_000)
BASE_FLIPS = 0.06


@dataclass(frozen=True)
class Week:
    name: str
    flips: float = BASE_FLIPS
    worse: float = 0.0  # recall lost in every class
    one_class: float = 0.0  # recall lost by class 0 alone
    new_class: bool = False


WEEKS = (Week("equal 3%", 0.03), Week("equal 6%"), Week("equal 10%", 0.10), Week("1 pt worse", worse=0.01),
         Week("2 pt worse", worse=0.02), Week("3 pt worse", worse=0.03), Week("one class -10 pt", one_class=0.10),
         Week("one class -20 pt", one_class=0.20), Week("new class", new_class=True),
         Week("new class, 2 worse", worse=0.02, new_class=True))


def simulate(week: Week, n: int, k: int, recall: np.ndarray, rules: GateRules, rng: np.random.Generator) -> dict:
    """One simulated week through `judge`: its verdict."""
    support = np.full(k, n // k)
    support[: n % k] += 1
    lost = np.full(k, week.worse)
    lost[0] += week.one_class
    negative, positive = week.flips / 2 + lost, np.full(k, week.flips / 2)
    cells = np.stack([recall - negative, negative, positive, 1 - recall - positive], axis=1)
    counts = rng.multinomial(support, np.clip(cells, 0, 1))
    label = np.repeat(np.repeat(np.arange(k), 4), counts.ravel())
    cell = np.repeat(np.tile(np.arange(4), k), counts.ravel())
    other = (label + 1) % k
    champion = np.where((cell == 0) | (cell == 1), label, other)
    challenger = np.where((cell == 0) | (cell == 2), label, other)
    classes = [f"c{i}" for i in range(k)]
    if not week.new_class:
        return judge(label, champion, challenger, classes, classes, rules)
    extra = n // 10  # the new class's test images: the champion never says it
    known = challenger.copy()
    pulled = rng.random(len(label)) < 0.02  # old images now called the new class by the unrestricted argmax
    challenger = np.where(pulled, k, challenger)
    label = np.concatenate([label, np.full(extra, k)])
    champion = np.concatenate([champion, rng.integers(0, k, extra)])
    challenger = np.concatenate([challenger, np.where(rng.random(extra) < 0.85, k, 0)])
    known = np.concatenate([known, np.zeros(extra, np.int64)])
    return judge(label, champion, challenger, classes + ["new"], classes, rules, challenger_pred_known=known)


def targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """The targets the defaults must meet, each with whether it holds and its worst cell."""
    def worst(name: str, cells: list[dict], key: str, low: bool) -> tuple[str, bool, str]:
        cell = (min if low else max)(cells, key=lambda r: r[key])
        ok = cell[key] >= 95 if key == "blessed_judged" else (cell[key] >= 90 if low else cell[key] <= 5)
        return name, ok, f"{cell[key]:.1f}% ({cell['week']}, {cell['n']:,} images, {cell['k']:,} classes)"
    equal = [r for r in rows if r["week"].startswith("equal")]
    judged = [r for r in equal if r["judged"] >= 50]  # where the gate judges: most weeks are not too small
    return [worst("an equal challenger blessed >= 95% wherever the gate judges", judged, "blessed_judged", True),
            worst("an equal challenger refused <= 5% (too small blessed with the warning)", equal, "refused", False),
            worst("2 points worse refused >= 90% at n >= 5,000",
                  [r for r in rows if r["week"] == "2 pt worse" and r["n"] >= 5000], "refused", True),
            worst("one class -20 points on >= 100 images refused >= 90%",
                  [r for r in rows if r["week"] == "one class -20 pt" and r["n"] // r["k"] >= 100], "refused", True),
            worst("the per-class rules refuse an equal challenger <= 5%", equal, "by_class", False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weeks", type=int, default=300, help="simulated weeks per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="test set sizes")
    parser.add_argument("--classes", type=int, nargs="+", default=list(CLASS_COUNTS), help="class counts")
    parser.add_argument("--only", nargs="+", metavar="WEEK", help="only these weeks (their names as printed)")
    args = parser.parse_args()
    cfg = ReleaseConfig()
    rules = GateRules.from_config(cfg)
    print(f"gate_power: {args.weeks} weeks per cell; release defaults: margin {cfg.margin}, min_support "
          f"{cfg.min_support}, max_class_drop {cfg.max_class_drop}, too_small {cfg.too_small}, confidence "
          f"{rules.confidence}, power {rules.power}")
    print("\n| Week | Test images | Classes | Images/class | Judged | Blessed | Blessed, of the judged | Refused "
          "| Refused by a class rule |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    t0, rows = time.perf_counter(), []
    for week, n, k in itertools.product(WEEKS, args.sizes, args.classes):
        if n < k or (args.only and week.name not in args.only):
            continue
        rng = np.random.default_rng([args.seed, n, k, WEEKS.index(week)])
        recall = np.random.default_rng([args.seed, k]).uniform(0.60, 0.94, k)
        judged = blessed = blessed_judged = refused = by_class = 0
        for _ in range(args.weeks):
            verdict = simulate(week, n, k, recall, rules, rng)
            small = verdict["too_small"] is not None
            judged += not small
            blessed += verdict["blessed"]
            blessed_judged += verdict["blessed"] and not small
            refused += not verdict["blessed"]
            by_class += bool(verdict["classes_failing"])
        row = {"week": week.name, "n": n, "k": k, "judged": 100 * judged / args.weeks,
               "blessed": 100 * blessed / args.weeks, "blessed_judged": 100 * blessed_judged / max(judged, 1),
               "refused": 100 * refused / args.weeks, "by_class": 100 * by_class / args.weeks}
        rows.append(row)
        print(f"| {week.name} | {n:,} | {k:,} | {n // k} | {row['judged']:.1f} | {row['blessed']:.1f} | "
              + (f"{row['blessed_judged']:.1f}" if judged else "") + f" | {row['refused']:.1f} | {row['by_class']:.1f} |",
              flush=True)
    print("\n| Target | Met | Worst cell |\n|---|---|---|")
    for name, ok, cell in targets(rows):
        print(f"| {name} | {'yes' if ok else 'NO'} | {cell} |")
    print(f"\ngate_power: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
