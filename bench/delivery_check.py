"""The delivery check's operating characteristics: precision and recall of the flagged files for two
classes swapped (a share of each one's new photos filed under the other), and how often an honest
delivery of the same size is flagged.

Synthetic colour-class photos like tests/test_delivery.py's (a per-photo colour offset and pixel
noise), ten classes, two of them close (teal and cyan: the champion confuses them on its own), and
the tests' champion: the Bayes rule for those colours, calibrated by construction. The champion runs
once over a pool of photos through the library's `calibrated_answers`; each simulated week draws its
old test photos and its delivery from that pool and runs the library's `flag_pairs`.

Then the class count (`--scale`): at 10, 100 and 1,000 classes, a champion's answers drawn directly
(right 90% of the time and sure of it 90% of those, else one of three look-alike classes, sure 30%
of those; the same law for the old test photos and an honest delivery), `--scale-per-class` old test
photos and new photos a class. How often an honest week is flagged, and how often a week whose one
class's delivery is ten photos of another class filed wrong (alone, or beside 10 or 20 honest ones) is
flagged (that class and pair),
by the two-stage rule and by Holm over every (given, predicted) pair.

    python bench/delivery_check.py --weeks 400 --new-per-class 200 --test-per-class 100
    python bench/delivery_check.py --scale --weeks 1000
    python bench/delivery_check.py --scale --spread --weeks 1000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import betabinom

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from cnnpipe.data.store.shards import PreparedSplit  # noqa: E402
from cnnpipe.release.delivery import calibrated_answers  # noqa: E402
from cnnpipe.release.flagging import OTHER_CLASSES, flag_pairs, grouped_holm  # noqa: E402
from cnnpipe.release_config import DeliveryConfig  # noqa: E402
from cnnpipe.train.trained import load_trained  # noqa: E402
from test_delivery import OFFSET, probe_checkpoint  # noqa: E402  (registers the probe with timm)

COLOURS = {"black": (30, 30, 30), "blue": (40, 40, 210), "cyan": (40, 190, 190), "green": (40, 190, 40),
           "grey": (128, 128, 128), "magenta": (200, 40, 200), "orange": (230, 130, 30), "red": (210, 40, 40),
           "teal": (40, 160, 160), "yellow": (210, 200, 40)}
CLASSES = sorted(COLOURS)
PAIRS = {"distinct (red, orange)": ("red", "orange"), "close (teal, cyan)": ("teal", "cyan")}


def pool(per_class: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`per_class` photos of every colour: (N, size, size, 3) uint8 and their true classes."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(CLASSES)), per_class)
    centre = np.array([COLOURS[c] for c in CLASSES], np.float32)[labels]
    shade = centre + rng.normal(0, OFFSET, centre.shape)
    pixels = shade[:, None, None, :] + rng.normal(0, 10, (len(labels), size, size, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8), labels


def week(rng: np.random.Generator, by_class: list[np.ndarray], new: int, test: int, pair: tuple[int, int] | None,
         fraction: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pool indices of the old test photos and of the delivery, the delivery's given labels, and
    which of its photos are filed under the other class of `pair` (a share `fraction` of each)."""
    test_rows, new_rows, given, swapped = [], [], [], []
    for c, rows in enumerate(by_class):
        drawn = rng.choice(rows, test + new, replace=False)
        test_rows.append(drawn[:test])
        new_rows.append(drawn[test:])
    for a, b in ([pair, pair[::-1]] if pair else []):
        k = round(fraction * new)
        new_rows[a][:k] = rng.choice(np.setdiff1d(by_class[b], np.r_[test_rows[b], new_rows[b]]), k, replace=False)
    for c, rows in enumerate(new_rows):
        given.append(np.full(len(rows), c))
        swapped.append(np.arange(len(rows)) < (round(fraction * new) if pair and c in pair else 0))
    return np.concatenate(test_rows), np.concatenate(new_rows), np.concatenate(given), np.concatenate(swapped)


def honest_answers(rng: np.random.Generator, classes: int, per_class: int,
                   rates: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """(given, predicted, confidence) of `per_class` photos a class, filed right (tests/test_delivery.py's law;
    `rates`: each class's own share of wrong answers instead of 10% for all)."""
    given = np.repeat(np.arange(classes), per_class)
    wrong = rng.random(len(given)) < (0.1 if rates is None else rates[given])
    pred = np.where(wrong, (given + rng.integers(1, 4, len(given))) % classes, given)
    sure = rng.random(len(given)) < np.where(wrong, 0.3, 0.9)
    return given, pred, np.where(sure, 0.95, 0.5)


def every_pair_flags(pairs: list[dict], classes: int, cfg: DeliveryConfig) -> set[tuple[str, str]]:
    """The pairs the one-stage rule flags: Holm over all C(C - 1) pairs, with the same floors, each
    pair's rate under the uniform prior on its own test photos (the rule before the pooled priors)."""
    rows = [r for r in pairs if r["predicted"] != OTHER_CLASSES]
    p = [betabinom.sf(r["images"] - 1, r["of"], r["test_disagreements"] + 1,
                      r["test_images"] - r["test_disagreements"] + 1) for r in rows]
    adjusted = grouped_holm(np.array(p), np.zeros(len(rows), np.int64), np.array([classes * (classes - 1)]))
    return {(r["given"], r["predicted"]) for r, h in zip(rows, adjusted)
            if h <= cfg.alpha and r["images"] >= cfg.min_images and r["share"] >= cfg.min_share}


def planted(rng: np.random.Generator, classes: int, per_class: int, honest_left: int,
            rates: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """An honest delivery in which class 0's photos are `honest_left` of its own and ten of class 1
    filed under 0, the champion sure they are 1."""
    given, pred, conf = honest_answers(rng, classes, per_class, rates)
    keep = (given != 0) | (np.cumsum(given == 0) <= honest_left)
    return tuple(np.r_[x[keep], np.full(10, v)] for x, v in ((given, 0), (pred, 1), (conf, 0.97)))


def scale(weeks: int, per_class: int, seed: int, spread: bool = False) -> None:
    """Honest weeks and weeks with ten photos filed wrong in one class, at 10, 100 and 1,000 classes, both
    rules. `spread`: each class its own share of wrong answers, drawn each week from Beta(0.5, 4.5)
    (mean 10%, a tenth of the classes above 25%: look-alike classes), for the champion's test answers
    and the delivery alike."""
    cfg = DeliveryConfig()
    rng = np.random.default_rng(seed)
    print(f"\n{weeks} weeks a row; {per_class} old test photos and {per_class} new photos a class, except class 0 in "
          "the weeks with photos filed wrong: ten of class 1 under its label, with 0, 10 or 20 of its own\n")
    print("| Classes | Week | Flagged: the class, two-stage | Flagged: the pair, two-stage | "
          "Flagged: the pair, Holm over every pair |")
    print("|---:|---|---:|---:|---:|")
    for c in (10, 100, 1000):
        names = [f"c{i}" for i in range(c)]
        everyone = np.ones(c, bool)
        counts = np.zeros((4, 3), np.int64)
        for _ in range(weeks):
            rates = rng.beta(0.5, 4.5, c) if spread else None
            test = honest_answers(rng, c, per_class, rates)
            for row, new in enumerate((honest_answers(rng, c, per_class, rates), planted(rng, c, per_class, 0, rates),
                                       planted(rng, c, per_class, 10, rates), planted(rng, c, per_class, 20, rates))):
                pairs, _, classes = flag_pairs(*new, *test, names, everyone, cfg)
                if row == 0:  # honest: any flag at all is a false one
                    counts[row] += (any(r["flagged"] for r in classes), any(r["flagged"] for r in pairs),
                                    bool(every_pair_flags(pairs, c, cfg)))
                else:
                    counts[row] += (any(r["given"] == "c0" and r["flagged"] for r in classes),
                                    any((r["given"], r["predicted"]) == ("c0", "c1") and r["flagged"] for r in pairs),
                                    ("c0", "c1") in every_pair_flags(pairs, c, cfg))
        for row, week in enumerate(("honest (any flag)", "10 of 10 filed wrong", "10 of 20 filed wrong",
                                    "10 of 30 filed wrong")):
            print(f"| {c:,} | {week} | " + " | ".join(f"{x / weeks:.1%}" for x in counts[row]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weeks", type=int, default=400, help="simulated deliveries per row")
    parser.add_argument("--new-per-class", type=int, default=200, help="new photos filed under each class")
    parser.add_argument("--test-per-class", type=int, default=100, help="old test photos of each class")
    parser.add_argument("--pool-per-class", type=int, default=3000)
    parser.add_argument("--size", type=int, default=16, help="stored size of the photos")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", action="store_true", help="only the 10/100/1,000-class table")
    parser.add_argument("--scale-per-class", type=int, default=20, help="old test and new photos a class (--scale)")
    parser.add_argument("--spread", action="store_true", help="--scale with each class its own error rate")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(1)
    if args.scale:
        scale(args.weeks, args.scale_per_class, args.seed, args.spread)
        print(f"({time.perf_counter() - start:.0f} s)")
        return
    cfg = DeliveryConfig()
    images, truth = pool(args.pool_per_class, args.size, args.seed)
    with tempfile.TemporaryDirectory() as temp:
        model, meta = load_trained(probe_checkpoint(Path(temp) / "champion", COLOURS, args.size), torch.device("cpu"))
        pred, conf = calibrated_answers(model, meta, PreparedSplit(images, truth, CLASSES), torch.device("cpu"))
    del images
    print(f"champion on the pool: top-1 {np.mean(pred == truth):.2%}, "
          f"confident (>= {cfg.confidence}) {np.mean(conf >= cfg.confidence):.1%} of photos; "
          f"rules: alpha {cfg.alpha}, min_images {cfg.min_images}, min_share {cfg.min_share}")
    by_class = [np.flatnonzero(truth == c) for c in range(len(CLASSES))]
    everyone = np.ones(len(CLASSES), bool)
    rng = np.random.default_rng(args.seed + 1)
    print(f"\n{args.weeks} weeks a row; a delivery of {args.new_per_class} new photos under each of {len(CLASSES)} "
          f"classes; {args.test_per_class} old test photos a class\n")
    print("| Swapped pair | Share of each class's new photos | Swapped photos (both ways) | Weeks flagged (both ways) "
          "| Precision of flagged files | Recall of flagged files |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (a, b) in PAIRS.items():
        pair = (CLASSES.index(a), CLASSES.index(b))
        for fraction in (0.05, 0.10, 0.20, 0.30, 0.50):
            tp = listed = planted = both = 0
            for _ in range(args.weeks):
                test, new, given, swapped = week(rng, by_class, args.new_per_class, args.test_per_class, pair, fraction)
                pairs, photos, _ = flag_pairs(given, pred[new], conf[new], truth[test], pred[test], conf[test],
                                              CLASSES, everyone, cfg)
                tp += int((photos & swapped).sum())
                listed, planted = listed + int(photos.sum()), planted + int(swapped.sum())
                named = {(r["given"], r["predicted"]) for r in pairs if r["flagged"]}
                both += {(a, b), (b, a)} <= named
            precision = f"{tp / listed:.1%}" if listed else "none flagged"
            print(f"| {name} | {fraction:.0%} | {planted // args.weeks} | {both / args.weeks:.1%} | {precision} | "
                  f"{tp / planted:.1%} |")
    flagged_weeks = files = 0
    for _ in range(args.weeks):
        test, new, given, _ = week(rng, by_class, args.new_per_class, args.test_per_class, None, 0.0)
        pairs, photos, _ = flag_pairs(given, pred[new], conf[new], truth[test], pred[test], conf[test], CLASSES,
                                      everyone, cfg)
        flagged_weeks += any(r["flagged"] for r in pairs)
        files += int(photos.sum())
    print(f"\nHonest deliveries of the same size: {flagged_weeks} of {args.weeks} weeks flagged "
          f"({flagged_weeks / args.weeks:.1%}), {files / args.weeks:.2f} files flagged a week on average")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
