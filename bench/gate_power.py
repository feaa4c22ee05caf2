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
  drain 30%, drain 24% equal on the old classes like for like, but as served 30% (24%) of their images
                      now called the new class (the issue's drains of small classes: 10 x 15, 50 x 19)

Printed per week, test size and class count, in % of the simulated weeks: judged (not too small),
blessed (with or without the too-small warning), blessed among the judged weeks, refused, and
refused by a per-class rule.

Then three tables of `cnnpipe.release.simulate`'s weeks (a challenger `loss` worse in every class that
disagrees with the champion on `flips` of the images, a wrong answer being the next class):

  Disagreement   one week, 2,000 test images in 20 classes, the bless rate by true loss and by
                 disagreement, the same draws for every disagreement (common random numbers)
  Weeks in a row 12 weeks, each challenger trained from the champion, `loss` worse and disagreeing
                 on 6%; the test set starts at n images and grows by n/10 a week; the champion
                 changes when a challenger is blessed, the anchor when one is shown within the margin
                 of the anchor. A refused week is retried: next week's challenger comes from the
                 same champion. Per cell: the weeks too small to judge, the weeks refused, the runs
                 whose shipped loss never passed the drift budget in 12 weeks, and the loss shipped
                 after 12 weeks (mean and the worst run)
  Drift promise  the same loop at 200, 1,000 and 5,000 test images: the runs within the budget at
                 0.5, 1 and 2 points a week, beside the weeks an equal challenger is blessed and the
                 images the drift bound needs to pass an equal challenger 95% of the time

Then the targets, each with its worst cell.

    python bench/gate_power.py                # 300 weeks per cell
    python bench/gate_power.py --weeks 50     # a quick look
    python bench/gate_power.py --weeks 60 --runs 100 --sizes 200 1000 5000   # docs/weekly-loop.md's tables
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import numpy as np

from cnnpipe.release_config import ReleaseConfig
from cnnpipe.release.gate import GateRules, judge
from cnnpipe.release.simulate import one_week, run_weeks
from cnnpipe.release.stats import images_needed

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
    drain: float = 0.02  # the old classes' images the challenger now calls the new class (as served)


WEEKS = (Week("equal 3%", 0.03), Week("equal 6%"), Week("equal 10%", 0.10), Week("1 pt worse", worse=0.01),
         Week("2 pt worse", worse=0.02), Week("3 pt worse", worse=0.03), Week("one class -10 pt", one_class=0.10),
         Week("one class -20 pt", one_class=0.20), Week("new class", new_class=True),
         Week("new class, 2 worse", worse=0.02, new_class=True), Week("drain 30%", new_class=True, drain=0.30),
         Week("drain 24%", new_class=True, drain=0.24))


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
    pulled = rng.random(len(label)) < week.drain  # old images now called the new class by the unrestricted argmax
    challenger = np.where(pulled, k, challenger)
    label = np.concatenate([label, np.full(extra, k)])
    champion = np.concatenate([champion, rng.integers(0, k, extra)])
    challenger = np.concatenate([challenger, np.where(rng.random(extra) < 0.85, k, 0)])
    known = np.concatenate([known, np.zeros(extra, np.int64)])
    return judge(label, champion, challenger, classes + ["new"], classes, rules, challenger_pred_known=known)


DISAGREEMENT = (0.02, 0.04, 0.08, 0.12, 0.16)
LOSSES = (0.0, 0.01, 0.015, 0.02, 0.03, 0.04)
RUN_SIZES = (200, 1_000, 5_000, 20_000)
RUN_LOSSES = (0.0, 0.005, 0.01, 0.02)
RUN_WEEKS = 12


def disagreement_table(weeks: int, seed: int, rules: GateRules, which: str) -> list[dict]:
    """The bless rate by true loss and disagreement at 2,000 test images in 20 classes."""
    n, k = 2_000, 20
    recall = np.random.default_rng([seed, k]).uniform(0.60, 0.94, k)
    print(f"\n### Disagreement: one week, {n:,} test images in {k} classes, {which}; % of {weeks} weeks blessed\n")
    print("| True loss | " + " | ".join(f"{f:.0%} disagree" for f in DISAGREEMENT) + " | Largest rise |")
    print("|---:|" + "---:|" * (len(DISAGREEMENT) + 1))
    rows = []
    for loss in LOSSES:
        rates = []
        for flips in DISAGREEMENT:
            rng = np.random.default_rng([seed, n, k, 99])  # the same draws for every disagreement
            blessed = sum(one_week(n, k, recall, flips, loss, rng.random((2, n)), rules)["blessed"]
                          for _ in range(weeks)) if flips >= loss else None
            rates.append(None if blessed is None else 100 * blessed / weeks)
        seen = [r for r in rates if r is not None]
        rise = max([b - a for a, b in zip(seen, seen[1:])] + [0.0])
        rows.append({"loss": loss, "rates": rates, "rise": rise})
        print(f"| {loss * 100:.1f} pt | " + " | ".join("" if r is None else f"{r:.1f}" for r in rates)
              + f" | {rise:+.1f} |", flush=True)
    return rows


def runs_table(runs: int, seed: int, rules: GateRules, classes: int = 10) -> list[dict]:
    """Weeks in a row: the drift they ship, by test size and loss a week."""
    recall = np.random.default_rng([seed, classes]).uniform(0.60, 0.94, classes)
    print(f"\n### Weeks in a row: {RUN_WEEKS} weeks, {classes} classes, 6% disagreement a week, the test set growing "
          f"by a tenth of its first size a week; {runs} runs a cell\n")
    print("| Test images (week 1) | Loss a week | Weeks too small | Weeks refused | Runs that never shipped more than "
          "the budget | First refusal before the sum passed it | Loss shipped after 12 weeks (mean) | (worst run) | Anchor moves (mean) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for n, loss in itertools.product(RUN_SIZES, RUN_LOSSES):
        small = refused = weeks_run = caught = first = 0
        shipped, moves = [], []
        for r in range(runs):
            run = run_weeks(n, n // 10, classes, recall, 0.06, loss, RUN_WEEKS, rules,
                            np.random.default_rng([seed, n, int(loss * 1e4), r]), stop_at_refusal=False)
            small += sum(run.too_small)
            weeks_run += len(run.blessed)
            refused += sum(not b for b in run.blessed)
            caught += run.shipped_loss[-1] <= rules.drift_budget + 1e-9  # never shipped beyond the budget
            stop = run.first_refusal  # the view: the first refusal comes before the sum passes the budget
            first += stop is not None and loss * (stop - 1) <= rules.drift_budget + 1e-9
            shipped.append(run.shipped_loss[-1])
            moves.append(run.anchors)
        row = {"n": n, "loss": loss, "small": 100 * small / weeks_run, "refused": 100 * refused / weeks_run,
               "caught": 100 * caught / runs, "first": 100 * first / runs, "mean": float(np.mean(shipped)), "worst": float(np.max(shipped)),
               "moves": float(np.mean(moves))}
        rows.append(row)
        print(f"| {n:,} | {loss * 100:.1f} pt | {row['small']:.1f} | {row['refused']:.1f} | "
              + ("" if loss == 0 else f"{row['caught']:.1f} | {row['first']:.1f}") + (" | " if loss == 0 else "")
              + f" | {row['mean'] * 100:.2f} pt | "
              f"{row['worst'] * 100:.1f} pt | {row['moves']:.1f} |", flush=True)
    return rows


PROMISE_SIZES = (200, 1_000, 5_000)
PROMISE_LOSSES = (0.005, 0.01, 0.02)


def promise_table(runs: int, seed: int, rules: GateRules, classes: int = 10) -> list[dict]:
    """The drift promise with retries at the sizes the docs name: within the budget per loss a week,
    and an equal challenger's bless rate in the same loop, with the size the drift bound needs."""
    recall = np.random.default_rng([seed, classes]).uniform(0.60, 0.94, classes)
    print(f"\n### Drift promise: a loop that retries every refused week, {RUN_WEEKS} weeks, {classes} classes, 6% "
          f"disagreement, the test set growing by a tenth of its first size a week; drift bound "
          f"{rules.drift_look_confidence:.2%} a week ({rules.drift_error:.0%} spent over {rules.drift_weeks} weeks); "
          f"{runs} runs a cell\n")
    print("| Test images (week 1) | " + " | ".join(f"Within budget, {x * 100:.1f} pt a week" for x in PROMISE_LOSSES)
          + " | Equal challenger blessed (% of weeks) | Images the drift bound needs (an equal challenger passing 95%, "
          "disagreeing on the error rate) |")
    print("|---:|" + "---:|" * (len(PROMISE_LOSSES) + 2))
    rows = []
    accuracy = float(recall.mean())
    for n in PROMISE_SIZES:
        within = []
        for loss in PROMISE_LOSSES:
            ok = sum(max(run_weeks(n, n // 10, classes, recall, 0.06, loss, RUN_WEEKS, rules,
                                   np.random.default_rng([seed, n, int(loss * 1e4), r, 1]),
                                   stop_at_refusal=False).shipped_loss) <= rules.drift_budget + 1e-9
                     for r in range(runs))
            within.append(100 * ok / runs)
        equal = [run_weeks(n, n // 10, classes, recall, 0.06, 0.0, RUN_WEEKS, rules,
                           np.random.default_rng([seed, n, 0, r, 2]), stop_at_refusal=False) for r in range(runs)]
        blessed = 100 * float(np.mean([b for run in equal for b in run.blessed]))
        needed = images_needed(accuracy, 1 - accuracy, rules.drift_budget, rules.drift_look_confidence, rules.power)
        rows.append({"n": n, "within": within, "equal": blessed, "needed": needed})
        print(f"| {n:,} | " + " | ".join(f"{w:.1f}" for w in within) + f" | {blessed:.1f} | {needed:,} |", flush=True)
    return rows


def targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """The targets the defaults must meet, each with whether it holds and its worst cell."""
    def worst(name: str, cells: list[dict], key: str, low: bool) -> tuple[str, bool, str]:
        if not cells:
            return name, True, "not run"
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


def drift_targets(disagreement: list[dict], runs: list[dict], rules: GateRules, promise: list[dict],
                  rows: list[dict]) -> list[tuple[str, bool, str]]:
    """The targets of the disagreement and weeks-in-a-row tables."""
    within = [r for r in disagreement if r["loss"] < rules.drift_budget]
    rise = max(within, key=lambda r: r["rise"])
    beyond = max((x for r in disagreement if r["loss"] > rules.drift_budget for x in r["rates"] if x is not None),
                 default=0.0)
    point = [r for r in runs if r["loss"] == 0.01 and r["n"] == 1_000]
    caught = min(runs, key=lambda r: r["caught"] if r["loss"] else 101)
    drains = [r for r in rows if r["week"].startswith("drain")]
    return [("top-1 rules: more disagreement never raises the bless rate within the budget (rise <= 5 points)",
             rise["rise"] <= 5, f"{rise['rise']:+.1f} points ({rise['loss'] * 100:.1f} pt loss)"),
            (f"beyond the budget, blessed <= {100 * (1 - rules.drift_confidence):.0f}% at any disagreement",
             beyond <= 100 * (1 - rules.drift_confidence), f"{beyond:.1f}%"),
            ("weeks 1 point worse at 1,000 images: the first refusal before their sum passes 3 points >= 90%",
             bool(point) and point[0]["first"] >= 90, f"{point[0]['first']:.1f}%" if point else "not run"),
            ("runs of losing weeks never ship more than the budget in 12 weeks >= 90%", caught["caught"] >= 90,
             f"{caught['caught']:.1f}% ({caught['n']:,} images, {caught['loss'] * 100:.1f} pt a week)"),
            ("retrying 12 weeks, 0.5-2 pt a week, 200-5,000 images: within the budget >= 90%",
             bool(promise) and min(w for r in promise for w in r["within"]) >= 90,
             min((f"{w:.1f}% ({r['n']:,} images, {x * 100:.1f} pt a week)" for r in promise
                  for x, w in zip(PROMISE_LOSSES, r["within"])), key=lambda t: float(t.split("%")[0]))
             if promise else "not run"),
            ("a drain of 24-30% into a new class refused >= 90%, every class size",
             bool(drains) and min(r["refused"] for r in drains) >= 90,
             (lambda c: f"{c['refused']:.1f}% ({c['week']}, {c['n']:,} images, {c['k']:,} classes)")(
                 min(drains, key=lambda r: r["refused"])) if drains else "not run")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weeks", type=int, default=300, help="simulated weeks per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="test set sizes")
    parser.add_argument("--classes", type=int, nargs="+", default=list(CLASS_COUNTS), help="class counts")
    parser.add_argument("--only", nargs="+", metavar="WEEK", help="only these weeks (their names as printed)")
    parser.add_argument("--runs", type=int, default=None, help="runs a weeks-in-a-row cell (default weeks / 3)")
    args = parser.parse_args()
    cfg = ReleaseConfig()
    rules = GateRules.from_config(cfg)
    print(f"gate_power: {args.weeks} weeks per cell; release defaults: margin {cfg.margin}, min_support "
          f"{cfg.min_support}, max_class_drop {cfg.max_class_drop}, too_small {cfg.too_small}, drift_budget "
          f"{cfg.drift_budget}, drift_confidence {cfg.drift_confidence}, drift_weeks {cfg.drift_weeks}, drift_error "
          f"{cfg.drift_error}, confidence {rules.confidence}, power {rules.power}")
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
    top1 = GateRules(**{**vars(rules), "min_support": 10**9})  # no class judged: the top-1 rules alone
    disagreement = disagreement_table(args.weeks, args.seed, top1, "the top-1 rules alone (no class judged)")
    disagreement_table(args.weeks, args.seed, rules, "every rule (the per-class rule too)")
    runs_a_cell = args.runs or max(args.weeks // 3, 10)
    runs = runs_table(runs_a_cell, args.seed, rules)
    promise = promise_table(runs_a_cell, args.seed, rules)
    print("\n| Target | Met | Worst cell |\n|---|---|---|")
    for name, ok, cell in targets(rows) + drift_targets(disagreement, runs, rules, promise, rows):
        print(f"| {name} | {'yes' if ok else 'NO'} | {cell} |")
    print(f"\ngate_power: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
