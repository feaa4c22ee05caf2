"""The misclassification gallery: the test images the model got wrong with the most confidence."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

Mistake = tuple[int, int, int, float]
"""(test index, actual class, predicted class, predicted probability)."""


def most_confident_mistakes(logits: torch.Tensor, labels: torch.Tensor, count: int) -> list[Mistake]:
    """The `count` wrong predictions with the highest softmax probability, most confident first.

    Ties are broken by test index, so the gallery is deterministic.
    """
    if len(labels) == 0 or count <= 0:
        return []
    probs = torch.softmax(logits.float(), dim=1)
    confidence, predicted = probs.max(dim=1)
    wrong = torch.nonzero(predicted != labels).flatten()
    # Stable sort on negated confidence: equal confidences keep index order.
    order = wrong[torch.sort(-confidence[wrong], stable=True).indices][:count]
    return [(int(i), int(labels[i]), int(predicted[i]), float(confidence[i])) for i in order]


def save_gallery(path: Path, images: np.ndarray, mistakes: Sequence[Mistake], classes: Sequence[str],
                 title: str, columns: int = 4) -> None:
    """A PNG grid of `mistakes`: each tile shows the image, its true and its predicted class."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    rows = max(1, math.ceil(len(mistakes) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(2.4 * columns, 2.7 * rows + 0.4), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (index, actual, predicted, prob) in zip(axes.flat, mistakes):
        pixels = np.asarray(images[index])
        grey = pixels.shape[-1] == 1
        ax.imshow(pixels[..., 0] if grey else pixels, cmap="gray" if grey else None, vmin=0, vmax=255,
                  interpolation="nearest")
        ax.set_title(f"true: {classes[actual]}\npred: {classes[predicted]} ({prob:.0%})", fontsize=9)
    if not mistakes:
        axes.flat[0].text(0.5, 0.5, "no mistakes", ha="center", va="center")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(path)
