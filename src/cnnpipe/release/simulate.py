"""Simulated weeks for the gate's operating characteristics (bench/gate_power.py and the tests).

A model is known by which test images it gets right. The first one gets an image of class c right
with probability `recall[c]`; each next model is trained from the champion and changes its answer on
`flips` of the images, `(flips + loss) / 2` from right to wrong and `(flips - loss) / 2` from wrong to
right, so it is `loss` worse in every class and disagrees with the champion on `flips` of the images.
A wrong answer is the next class. Every run is seeded; `uniforms` shared between cells (common random
numbers) make neighbouring cells of a grid differ only by what the cell changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cnnpipe.release.gate import GateRules, judge


def answers(labels: np.ndarray, right: np.ndarray, k: int) -> np.ndarray:
    """A model's answers from which images it gets right: the label, else the next class."""
    return np.where(right, labels, (labels + 1) % k)


def next_model(right: np.ndarray, accuracy: np.ndarray, flips: float, loss: float, uniforms: np.ndarray) -> np.ndarray:
    """The images a challenger trained from the model that gets `right` right gets right: `accuracy` is
    that model's expected recall per image (its class's), `uniforms` one U(0, 1) draw per image."""
    if not 0 <= loss <= flips:
        raise ValueError(f"a loss of {loss} needs at least as many flips, not {flips}")
    to_wrong = np.minimum(1.0, (flips + loss) / 2 / np.maximum(accuracy, 1e-9))
    to_right = np.minimum(1.0, (flips - loss) / 2 / np.maximum(1 - accuracy, 1e-9))
    return np.where(right, uniforms >= to_wrong, uniforms < to_right)


def one_week(n: int, k: int, recall: np.ndarray, flips: float, loss: float, uniforms: np.ndarray,
             rules: GateRules) -> dict:
    """One week through `judge`: a champion of `recall` per class and a challenger `loss` worse that
    disagrees with it on `flips` of `n` test images (uniforms: two U(0, 1) rows of at least n)."""
    labels = np.arange(n) % k
    accuracy = recall[labels]
    champion = uniforms[0, :n] < accuracy
    challenger = next_model(champion, accuracy, flips, loss, uniforms[1, :n])
    classes = [f"c{i}" for i in range(k)]
    return judge(labels, answers(labels, champion, k), answers(labels, challenger, k), classes, classes, rules)


@dataclass(frozen=True)
class Run:
    """A run of weeks: which were blessed, and the true top-1 lost against the first model when shipped."""

    blessed: list[bool]
    too_small: list[bool]  # the weeks too small to judge the margin
    shipped_loss: list[float]  # after each week, the loss of the model in production against week 0's
    anchors: int  # how many times the anchor moved

    @property
    def first_refusal(self) -> int | None:
        """The first refused week (1-based), or None."""
        return next((i + 1 for i, b in enumerate(self.blessed) if not b), None)


def run_weeks(n: int, growth: int, k: int, recall: np.ndarray, flips: float, loss: float, weeks: int,
              rules: GateRules, rng: np.random.Generator, stop_at_refusal: bool = True) -> Run:
    """`weeks` in a row: each week's challenger is trained from the champion, `loss` worse and
    disagreeing on `flips`; the test set starts at `n` images and grows by `growth` a week. The champion
    changes when a challenger is blessed, the anchor when the verdict says it becomes one."""
    size = n + growth * weeks
    labels = np.arange(size) % k
    classes = [f"c{i}" for i in range(k)]
    champion = rng.random(size) < recall[labels]
    champion_accuracy = recall[labels].astype(np.float64)
    anchor, lost, anchors = champion, 0.0, 0
    blessed, small, shipped = [], [], []
    for week in range(weeks):
        m = n + growth * week
        challenger = next_model(champion, champion_accuracy, flips, loss, rng.random(size))
        verdict = judge(labels[:m], answers(labels[:m], champion[:m], k), answers(labels[:m], challenger[:m], k),
                        classes, classes, rules, anchor_pred=answers(labels[:m], anchor[:m], k),
                        anchor_classes=classes, anchor_name="simulated")
        blessed.append(bool(verdict["blessed"]))
        small.append(verdict["too_small"] is not None)
        if verdict["blessed"]:
            champion, champion_accuracy, lost = challenger, champion_accuracy - loss, lost + loss
            if verdict["drift"]["new_anchor"]:
                anchor, anchors = challenger, anchors + 1
        shipped.append(lost)
        if stop_at_refusal and not verdict["blessed"]:
            break
    return Run(blessed, small, shipped, anchors)
