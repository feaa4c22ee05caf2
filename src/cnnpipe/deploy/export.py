"""Export the best checkpoint to TorchScript and ONNX, and check both against PyTorch on real images.

The exported graphs take what evaluation feeds the model: float32 NCHW at `image_size`, normalised
with the mean/std in `meta.json` (written beside them, with the class names and the whole input
recipe, `recipe`: a raw photo is decoded to the recipe's stored square, then resized and normalised,
exactly as predict does), and return logits divided by the model's fitted temperature: their
softmax is the calibrated probability predict gives.
The batch dimension is dynamic in both. Exports are fp32 on the CPU: the portable form; a runtime
may lower the precision itself.
"""

from __future__ import annotations

import importlib.metadata
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.splits.draw import balanced_subset
from cnnpipe.data.store.shards import open_split, read_index
from cnnpipe.files import write_json
from cnnpipe.malloc import keep_for_inference
from cnnpipe.uptime import process_seconds
from cnnpipe.train.budget import EVAL_BATCH
from cnnpipe.train.recipe import STORE_KEYS, recipe_differences, recipe_of, store_recipe
from cnnpipe.train.trained import Calibrated, load_trained, make_transform

OPSET = 18


def export_torchscript(model: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    """Trace `model` (inference only, no control flow in a timm CNN) and save it."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice; tracing still works
        traced = torch.jit.trace(model, example)
    traced.save(str(path))


def export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    """torch.export-based ONNX exporter, opset 18, dynamic batch, weights inside the one file."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (example,), dynamo=True, opset_version=OPSET, input_names=["images"],
                                    output_names=["logits"], dynamic_shapes=({0: batch},), verbose=False)
    program.save(str(path), external_data=False)


def onnx_runner(path: Path) -> tuple[Callable[[np.ndarray], np.ndarray] | None, str]:
    """A function running the ONNX file, and the name of what checks it.

    onnxruntime when it is installed (it runs the graph); else only onnx's structural checker,
    which proves the file is valid but computes nothing, so parity is then not measured.
    """
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    try:
        import onnxruntime as ort
    except ImportError:
        return None, f"onnx.checker {onnx.__version__} (onnxruntime not installed: no numerical parity)"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return (lambda x: session.run(None, {name: x})[0]), f"onnxruntime {ort.__version__}"


def check_dynamic_batch(scripted: torch.jit.ScriptModule, run_onnx: Callable[[np.ndarray], np.ndarray] | None,
                        meta: dict) -> None:
    """Run one image and an odd-sized batch through both files: the batch axis must really be dynamic."""
    for n in (1, 7):
        x = torch.randn(n, meta["in_chans"], meta["image_size"], meta["image_size"])
        outputs = {"TorchScript": scripted(x).shape}
        if run_onnx is not None:
            outputs["ONNX"] = run_onnx(x.numpy()).shape
        for name, shape in outputs.items():
            if tuple(shape) != (n, meta["num_classes"]):
                raise RuntimeError(f"the {name} export returned {tuple(shape)} for a batch of {n}: "
                                   "its batch dimension is not dynamic")


def _agreement(reference: torch.Tensor, other: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {
        "max_abs_diff": float((reference - other).abs().max()),
        "top1_agreement": float((reference.argmax(1) == other.argmax(1)).float().mean()),
        "top1": float((other.argmax(1) == labels).float().mean()),
    }


@torch.no_grad()
def parity(model: torch.nn.Module, scripted: torch.jit.ScriptModule,
           run_onnx: Callable[[np.ndarray], np.ndarray] | None, meta: dict,
           prepared_dir: Path, max_images: int | None, batch_size: int = EVAL_BATCH) -> dict[str, Any]:
    """PyTorch vs TorchScript vs ONNX logits on the test split, or a fixed class-balanced subset of
    `max_images` of it (the same fp32 inputs for all three), `batch_size` images at a time."""
    whole = open_split(prepared_dir, "test")
    split = balanced_subset(whole, max_images)
    transform = make_transform({**meta, "channels_last": False})
    ref, ts, ox, labels = [], [], [], []
    for images, y in build_eval_loader(split, batch_size=batch_size, pin_memory=False):
        x = transform(images)
        ref.append(model(x))
        ts.append(scripted(x))
        if run_onnx is not None:
            ox.append(torch.from_numpy(run_onnx(x.numpy())))
        labels.append(y)
    reference, labels_t = torch.cat(ref), torch.cat(labels)
    result = {"images": len(labels_t),
              "parity_on": "whole test split" if len(split) == len(whole) else
              f"fixed class-balanced subset of the test split ({len(split)} of {len(whole)})",
              "pytorch_top1": float((reference.argmax(1) == labels_t).float().mean()),
              "torchscript": _agreement(reference, torch.cat(ts), labels_t)}
    result["onnx"] = _agreement(reference, torch.cat(ox), labels_t) if ox else None
    return result


def export_model(model_dir: Path, prepared_dir: Path, out_dir: Path, metrics_path: Path,
                 max_images: int | None = None, batch_size: int = EVAL_BATCH) -> dict[str, Any]:
    """Write model.ts, model.onnx and meta.json to `out_dir`, and the parity report to `metrics_path`;
    the parity check runs at `batch_size` (the plan's `export_batch`: the batch the profile timed)."""
    cpu = torch.device("cpu")
    allocator = keep_for_inference()  # as warm as the process the profile timed fp32 inference in
    model, meta = load_trained(model_dir, cpu)
    other = recipe_differences(recipe_of(meta), store_recipe(read_index(prepared_dir)), STORE_KEYS)
    if other:
        raise ValueError(f"{model_dir}/best.pt was trained on another store than {prepared_dir} ({'; '.join(other)}): "
                         f"the parity check would run on pixels it never sees; rerun `dvc repro train@{model_dir.name}`")
    model = Calibrated(model.to(memory_format=torch.contiguous_format).float(), meta["temperature"]).eval()
    example = torch.zeros(2, meta["in_chans"], meta["image_size"], meta["image_size"])
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    export_torchscript(model, example, out_dir / "model.ts")
    t_ts = time.perf_counter() - t0
    export_onnx(model, example, out_dir / "model.onnx")
    t_onnx = time.perf_counter() - t0 - t_ts
    run_onnx, checker = onnx_runner(out_dir / "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation notice; loading works
        scripted = torch.jit.load(str(out_dir / "model.ts"), map_location=cpu)
    checks = parity(model, scripted, run_onnx, meta, prepared_dir, max_images, batch_size)
    check_dynamic_batch(scripted, run_onnx, meta)
    write_json(out_dir / "meta.json", {
        "classes": meta["classes"], "image_size": meta["image_size"], "in_chans": meta["in_chans"],
        "mean": meta["mean"], "std": meta["std"], "recipe": recipe_of(meta),
        "input": "float32 NCHW at image_size: a photo decoded to recipe.stored_size (short side, centre square), "
                 "recipe.channels, resized to image_size (bilinear, antialiased), (pixels/255 - mean) / std; "
                 "cnnpipe.train.recipe.photo_input and cnnpipe.train.trained.make_transform apply it",
        "output": "logits / temperature (softmax: calibrated probabilities)", "temperature": meta["temperature"],
        "weights": meta["weights"], "epoch": meta["epoch"], "onnx_opset": OPSET})
    result = {
        "weights": meta["weights"], "onnx_opset": OPSET, "onnx_checker": checker,
        "torch": torch.__version__, "onnx_version": importlib.metadata.version("onnx"),
        "export_time_s": {"torchscript": t_ts, "onnx": t_onnx},
        "size_mb": {f.suffix[1:]: f.stat().st_size / 2**20 for f in (out_dir / "model.ts", out_dir / "model.onnx")},
        **checks,
        "parity_batch": batch_size, "malloc": allocator,
        "stage_time_s": process_seconds(),
    }
    write_json(metrics_path, result)
    return result
