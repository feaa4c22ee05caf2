"""Temperature scaling: confidences a product owner can put a threshold on.

Label smoothing, mixup and EMA leave a model under-confident (the optimized recipe's top-class
probability runs ~10 points below its accuracy), so "auto-accept above 90%" would mean nothing. One
scalar T, fitted after training on the validation split by minimising the negative log-likelihood
of softmax(logits / T) (Guo et al. 2017, "On Calibration of Modern Neural Networks"), fixes the
scale without moving any prediction: argmax is unchanged. T is stored in best.pt's meta and applied
by evaluate, predict and the exported graphs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.splits.draw import balanced_subset
from cnnpipe.data.store.shards import PreparedSplit
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.budget import EVAL_BATCH
from cnnpipe.train.engine import predict
from cnnpipe.train.trained import load_trained, make_transform

T_RANGE = (0.05, 20.0)
# The most validation images T is fitted on: the logits are held in memory for L-BFGS's passes
# (50,000 x 1,000 classes is 200 MB), and beyond that T's estimate no longer moves.
MAX_FIT_IMAGES = 50_000


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The T in `T_RANGE` minimising the NLL of softmax(logits / T), by L-BFGS on log T."""
    if len(labels) == 0:
        return 1.0
    logits, labels = logits.float(), labels.long()
    log_t = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=0.1, max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(log_t.detach().exp().clamp(*T_RANGE))


def calibrate_best(model_dir: Path, val: PreparedSplit, device: torch.device,
                   recipe: dict[str, Any] | None = None, data_generation: int | None = None,
                   batch_size: int = EVAL_BATCH) -> dict[str, Any]:
    """Fit T for the weights best.pt serves (raw or EMA, as `load_trained` picks) on `val`, and write it
    into best.pt's meta with the model's input `recipe` (`trained.input_recipe`) and the generation of
    the store it was trained on (index.json's: the delivery check's photos are those that came later).
    Returns T and the validation NLL before and after.

    `val` is the whole validation split (at most MAX_FIT_IMAGES of it, class-balanced), not the
    budget's per-epoch subset: that subset only picks the best epoch, and a T fitted on 1,000 images
    of a 10-class set carries their sampling error into every threshold a user sets."""
    model, meta = load_trained(model_dir, device)
    val = balanced_subset(val, MAX_FIT_IMAGES) if len(val) > MAX_FIT_IMAGES else val
    logits, labels = predict(model, build_eval_loader(val, batch_size=batch_size), make_transform(meta), device,
                             meta["amp"])
    temperature = fit_temperature(logits, labels)
    path = model_dir / "best.pt"
    state = ckpt.load(path)
    state["meta"] = {**state["meta"], "temperature": temperature, "temperature_for": meta["weights"],
                     "serve": meta["weights"], **({"input": recipe} if recipe is not None else {}),
                     **({"data_generation": data_generation} if data_generation is not None else {})}
    ckpt.save_atomic(state, path)
    return {"temperature": temperature, "val_images": len(labels),
            "val_nll_before": float(F.cross_entropy(logits, labels)),
            "val_nll_after": float(F.cross_entropy(logits / temperature, labels))}
