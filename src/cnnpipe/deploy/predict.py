"""Classify new image files with a trained model: `python -m cnnpipe.predict IMAGE_OR_FOLDER ...`.

Every file goes through the input recipe the model was trained and judged with, recorded in its
best.pt (`train.recipe`): `prepare`'s decode (EXIF orientation, any mode to RGB, transparency onto
white, short side to the recipe's stored size, centre square), greyscale when the model was trained
on one channel, then evaluation's resize to the input size and normalisation. A model trained at
`image_size: auto` on a GPU (stored at 32 px, upsampled to 224) gets a 224 px input upsampled from a
32 px square, as in training and in the gate, never a sharp 224 px photo. Probabilities are
calibrated (the model's fitted temperature), so `--min-confidence 0.9` means what it says: an image
below it is marked uncertain, with its best guess, instead of forced into a class. A file that cannot be read as an image gets a row with an error, never a crash.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from cnnpipe.data.sources.catalog import is_hidden
from cnnpipe.data.store.shards import read_index
from cnnpipe.train.distributed import resolve_device
from cnnpipe.train.precision import autocast
from cnnpipe.train.recipe import LUMA, photo_input, recipe_of, to_channels
from cnnpipe.train.trained import load_trained, make_transform

__all__ = ["LUMA", "Prediction", "Predictor", "list_all", "list_inputs", "main", "to_channels", "write_predictions"]

DEFAULT_MAX_PIXELS = 89_478_485  # data.max_pixels' default: PIL's own decompression-bomb limit


@dataclass
class Prediction:
    """One file's result: the top-k (class, probability) pairs, or the reason it has none."""

    path: str
    topk: list[tuple[str, float]] = field(default_factory=list)
    error: str | None = None
    uncertain: bool = False  # the top probability is below --min-confidence: no label

    @property
    def label(self) -> str | None:
        return self.topk[0][0] if self.topk and not self.uncertain else None

    @property
    def probability(self) -> float | None:
        return self.topk[0][1] if self.topk else None

    def to_dict(self) -> dict:
        return {"path": self.path, "label": self.label, "probability": self.probability, "uncertain": self.uncertain,
                "topk": [{"label": c, "probability": p} for c, p in self.topk], "error": self.error}


def list_inputs(target: Path) -> list[Path]:
    """`target` itself, or every non-hidden file below the folder, sorted (deterministic output)."""
    if not target.exists():
        raise FileNotFoundError(f"{target} does not exist")
    if target.is_file():
        return [target]
    return sorted(p for p in target.rglob("*") if p.is_file() and not is_hidden(p, target))


def list_all(targets: Sequence[Path]) -> list[Path]:
    """Every file of every target (files and folders, a shell glob's expansion), each once, in order."""
    seen: dict[Path, None] = {}
    for target in targets:
        seen.update(dict.fromkeys(list_inputs(target)))
    return list(seen)


@dataclass
class Predictor:
    """A trained model with its input contract, ready to classify decoded images."""

    model: torch.nn.Module
    meta: dict
    classes: list[str]
    recipe: dict
    device: torch.device
    max_pixels: int = DEFAULT_MAX_PIXELS

    @property
    def stored_size(self) -> int:
        return int(self.recipe["stored_size"])

    @classmethod
    def load(cls, model_path: Path, prepared_dir: Path | None, device: torch.device) -> Predictor:
        """The model in `model_path` (a best.pt or its folder) with the class names and the input recipe
        it was trained with (they travel in best.pt: a champion from an older catalog keeps its own). A
        checkpoint older than input recipes takes its stored size from the prepared index when there is
        one, else its input size."""
        # A folder (models/optimized) or its best.pt, whether or not it exists yet: the error names it.
        model_dir = model_path.parent if model_path.suffix == ".pt" else model_path
        if model_path.is_file() and model_path.name != "best.pt":
            raise ValueError(f"{model_path}: expected a cnnpipe best.pt checkpoint or the folder holding it")
        model, meta = load_trained(model_dir, device)
        recipe = recipe_of(meta)
        if recipe["stored_size"] is None:
            index = prepared_dir is not None and (prepared_dir / "index.json").exists()
            recipe["stored_size"] = int(read_index(prepared_dir)["size"]) if index else meta["image_size"]
            print(f"predict: {model_dir / 'best.pt'} predates input recipes: decoding to {recipe['stored_size']} px "
                  f"({'the prepared index' if index else 'its input size'})", file=sys.stderr)
        return cls(model, meta, list(meta["classes"]), recipe, device)

    def decode(self, path: Path) -> np.ndarray | str:
        """The stored square the recipe makes of `path`, or the reason it cannot be used."""
        return photo_input(self.recipe, path, self.max_pixels)

    @torch.no_grad()
    def probabilities(self, images: np.ndarray) -> torch.Tensor:
        """Softmax over classes for a (N, S, S, C) uint8 batch, with evaluation's transform and precision."""
        x = make_transform(self.meta)(torch.from_numpy(images).to(self.device))
        with autocast(self.meta["amp"], self.device):
            logits = self.model(x)
        return torch.softmax(logits.float() / self.meta["temperature"], dim=1).cpu()

    def predict(self, paths: Sequence[Path], topk: int = 3, batch_size: int = 64,
                progress: bool = False, min_confidence: float = 0.0) -> Iterator[Prediction]:
        """Predictions for `paths` in order, decoded and classified `batch_size` at a time; those whose
        top probability is below `min_confidence` are marked uncertain."""
        k = max(1, min(topk, len(self.classes)))
        bar = tqdm(total=len(paths), unit="img", desc="predict", disable=None if progress else True)
        for start in range(0, len(paths), batch_size):
            chunk = paths[start : start + batch_size]
            decoded = [self.decode(p) for p in chunk]
            good = [i for i, d in enumerate(decoded) if isinstance(d, np.ndarray)]
            results = [Prediction(str(p), error=d if isinstance(d, str) else None) for p, d in zip(chunk, decoded)]
            if good:
                probs = self.probabilities(np.stack([decoded[i] for i in good]))
                values, indices = probs.topk(k, dim=1)
                for row, i in enumerate(good):
                    results[i].topk = [(self.classes[c], round(float(v), 6))
                                       for v, c in zip(values[row].tolist(), indices[row].tolist())]
                    results[i].uncertain = results[i].topk[0][1] < min_confidence
            bar.update(len(chunk))
            yield from results
        bar.close()


def write_predictions(predictions: list[Prediction], out: Path) -> None:
    """`.json`: a list of objects; `.csv`: one row per file with the top-k as `name:probability;...`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".json":
        out.write_text(json.dumps([p.to_dict() for p in predictions], indent=2, ensure_ascii=False) + "\n")
        return
    with open(out, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label", "probability", "uncertain", "topk", "error"])
        for p in predictions:
            topk = ";".join(f"{c}:{v:.4f}" for c, v in p.topk)
            writer.writerow([p.path, p.label or "", "" if p.probability is None else f"{p.probability:.4f}",
                             "yes" if p.uncertain else "", topk, p.error or ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cnnpipe.predict", description=__doc__.split("\n")[0])
    parser.add_argument("targets", type=Path, nargs="+", metavar="target",
                        help="image files and folders (searched recursively); a shell glob works")
    parser.add_argument("--variant", default="optimized", help="use models/<variant>/best.pt (default optimized)")
    parser.add_argument("--model", type=Path, help="a best.pt checkpoint or its folder (overrides --variant)")
    parser.add_argument("--data", type=Path, default=Path("data/prepared"),
                        help="for a checkpoint older than input recipes: the prepared folder whose index.json gives "
                             "the stored size (a newer best.pt carries its own)")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", type=Path, help="write .csv or .json here (default: a table on stdout)")
    parser.add_argument("--min-confidence", type=float, default=0.0, metavar="P",
                        help="mark images whose top (calibrated) probability is below P as uncertain, with no "
                             "label (default 0: always a label)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.min_confidence <= 1.0:
        parser.error(f"--min-confidence {args.min_confidence}: a probability in [0, 1]")
    if args.out is not None and args.out.suffix.lower() not in (".csv", ".json"):
        parser.error(f"--out {args.out}: use a .csv or .json file name")
    if args.topk < 1 or args.batch_size < 1:
        parser.error("--topk and --batch-size must be >= 1")
    try:
        paths = list_all(args.targets)
        predictor = Predictor.load(args.model or Path("models") / args.variant, args.data,
                                   resolve_device(args.device))
        predictions = list(predictor.predict(paths, args.topk, args.batch_size, progress=len(paths) > 20,
                                             min_confidence=args.min_confidence))
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"predict: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        write_predictions(predictions, args.out)
    else:
        for p in predictions:
            shown = p.error if p.error else ", ".join(f"{c} {v:.1%}" for c, v in p.topk)
            flag = "ERROR " if p.error else "UNCERTAIN " if p.uncertain else ""
            print(f"{p.path}\t{flag}{shown}")
    failed = sum(p.error is not None for p in predictions)
    unsure = sum(p.uncertain for p in predictions)
    print(f"predict: {len(predictions) - failed - unsure} classified, "
          + (f"{unsure} uncertain (below {args.min_confidence:.0%}), " if args.min_confidence > 0 else "")
          + f"{failed} could not be read"
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
