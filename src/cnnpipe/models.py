"""Model creation through timm, with honest pretrained-weight resolution.

Weights are looked for, in order: `model.weights_file`, the local Hugging Face cache, torch hub's
cache (where torchvision's `weights=` and timm's URL downloads keep files), then the hub (only when it
answers within seconds, so an offline machine never hangs). Every path counts what it loaded
(`weights.LoadReport`) and refuses a partial load; the count is recorded in `InitInfo` and ends up in
train.json: we never claim weights that were not loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

import timm
import torch

from cnnpipe.config import ModelConfig
from cnnpipe.files import file_sha256
from cnnpipe.weight_files import WeightsMismatch, resolve_weights_path, torch_hub_dir, torch_hub_file
from cnnpipe.weights import LoadReport, classifier_prefix, load_pretrained_counted, load_weights

log = logging.getLogger(__name__)

HUB_HOST = "huggingface.co"


class WeightsUnavailable(RuntimeError):
    """`model.pretrained: true` but no weights could be had, or `model.weights_file` does not fit."""


@dataclass(frozen=True)
class InitInfo:
    """Where the initial weights came from."""

    source: str  # "random", "file", "hub-cache", "torch-hub-cache", "hub" or "champion"
    location: str | None = None
    sha256: str | None = None
    mapping: str | None = None  # how a file's tensors were named onto the model's (`weights.LAYOUTS`)
    loaded: int | None = None  # backbone parameters and running statistics loaded: all of them, or the run stops
    backbone: int | None = None  # the model's backbone parameters and running statistics
    classifier: str | None = None  # "loaded" or "replaced" (new for the catalog's classes)
    counters_loaded: int | None = None  # BatchNorm num_batches_tracked from the file (the rest keep the model's 0)
    counters: int | None = None  # the model's num_batches_tracked counters
    entry: str | None = None  # the checkpoint entry the weights came from (`state_dict_ema`: EMA weights)

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)


def hub_address() -> tuple[str, int]:
    """Host and port huggingface_hub downloads from: `HF_ENDPOINT` (a mirror, a test's fake hub on
    127.0.0.1) or huggingface.co."""
    url = urlsplit(os.environ.get("HF_ENDPOINT") or f"https://{HUB_HOST}")
    return url.hostname or HUB_HOST, url.port or (443 if url.scheme == "https" else 80)


_REACHABLE: dict[tuple[str, int], bool] = {}
"""Answers of `hub_reachable` in this process: the profile builds a model for every trial, and one
probe per address is enough."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check, so `auto` never waits on a machine with no route to the hub; asked once per
    process and address."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    address = hub_address()
    if address not in _REACHABLE:
        try:
            with socket.create_connection(address, timeout=timeout):
                _REACHABLE[address] = True
        except OSError:
            _REACHABLE[address] = False
    return _REACHABLE[address]


@contextlib.contextmanager
def _hub_timeouts(etag_s: int = 10, download_s: int = 30) -> Iterator[None]:
    """Short hub timeouts for one download. huggingface_hub reads its HF_HUB_* variables once, at
    import, into `huggingface_hub.constants`, so setting the environment here would change nothing."""
    from huggingface_hub import constants

    old = constants.HF_HUB_ETAG_TIMEOUT, constants.HF_HUB_DOWNLOAD_TIMEOUT
    constants.HF_HUB_ETAG_TIMEOUT, constants.HF_HUB_DOWNLOAD_TIMEOUT = etag_s, download_s
    try:
        yield
    finally:
        constants.HF_HUB_ETAG_TIMEOUT, constants.HF_HUB_DOWNLOAD_TIMEOUT = old


def _hub_file(model_name: str) -> tuple[str, str] | None:
    """(repo id, cached weights path) when the hub cache holds this model's weights."""
    cfg = timm.models.get_pretrained_cfg(model_name)
    repo = getattr(cfg, "hf_hub_id", None) if cfg else None
    if not repo:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for filename in ("model.safetensors", "pytorch_model.bin"):
        found = try_to_load_from_cache(repo, filename)
        if isinstance(found, str):
            return repo, found
    return None


_SAID_RANDOM: set[str] = set()
"""Model names whose random-init warning this process already logged."""


def create_model(cfg: ModelConfig, num_classes: int, in_chans: int) -> tuple[torch.nn.Module, InitInfo]:
    """Build `cfg.name` for our classes; load pretrained weights per `cfg.pretrained`."""
    kwargs = dict(num_classes=num_classes, in_chans=in_chans)
    if cfg.drop_path:
        kwargs["drop_path_rate"] = cfg.drop_path
    if cfg.name not in timm.list_models(pretrained=False) and cfg.name.split(".")[0] not in timm.list_models():
        raise ValueError(f"model.name={cfg.name!r} is not a timm model; see timm.list_models()")
    if cfg.pretrained == "false":
        return timm.create_model(cfg.name, pretrained=False, **kwargs), InitInfo("random")

    attempts: list[str] = []
    if cfg.weights_file:
        try:
            path = resolve_weights_path(cfg.weights_file)
            model = timm.create_model(cfg.name, pretrained=False, **kwargs)
            report = load_weights(model, path)
        except (FileNotFoundError, WeightsMismatch) as exc:
            raise WeightsUnavailable(_named(f"model.weights_file={cfg.weights_file!r}", exc)) from exc
        print(f"model: {cfg.weights_file} -> {cfg.name}: {report.describe()}", flush=True)
        return model, _with_report(InitInfo("file", str(path), file_sha256(path)), report)

    cached = _hub_file(cfg.name)
    if cached:
        repo, path = cached
        # Straight from the cached file: huggingface_hub reads HF_HUB_OFFLINE once, at import, so
        # going through the hub client would still ask the hub for the file's metadata first.
        model, report = _timm_load(cfg.name, kwargs, num_classes, in_chans, f"the Hugging Face cache's {path}", path)
        print(f"model: {path} (Hugging Face cache) -> {cfg.name}: {report.describe()}", flush=True)
        return model, _with_report(InitInfo("hub-cache", repo, file_sha256(path)), report)
    attempts.append("no copy in the local Hugging Face cache")

    local = torch_hub_file(cfg.name)
    if local is not None:
        try:
            model = timm.create_model(cfg.name, pretrained=False, **kwargs)
            report = load_weights(model, local)
        except WeightsMismatch as exc:
            raise WeightsUnavailable(_named(f"model.pretrained={cfg.pretrained}: torch hub's cached {local.name}", exc)
                                     + f" Or move {local} out of {local.parent}.") from exc
        print(f"model: {local} (torch hub's cache) -> {cfg.name}: {report.describe()}", flush=True)
        return model, _with_report(InitInfo("torch-hub-cache", str(local), file_sha256(local)), report)
    attempts.append(f"no {cfg.name.partition('.')[0]} file in torch hub's cache {torch_hub_dir()}")

    if hub_reachable():
        try:
            with _hub_timeouts():
                model, report = _timm_load(cfg.name, kwargs, num_classes, in_chans, "the hub's file", None)
            found = _hub_file(cfg.name)
            info = InitInfo("hub", found[0] if found else cfg.name, file_sha256(found[1]) if found else None)
            print(f"model: {info.location} (hub) -> {cfg.name}: {report.describe()}", flush=True)
            return model, _with_report(info, report)
        except WeightsUnavailable:
            raise
        except Exception as exc:  # any hub/network failure: fall through to the remedy below
            attempts.append(f"hub download failed: {exc.__class__.__name__}: {exc}")
    else:
        host, port = hub_address()
        attempts.append(f"{host}:{port} is not reachable" if os.environ.get("HF_ENDPOINT")
                        else f"{host} is not reachable")

    reason = "; ".join(attempts)
    if cfg.pretrained == "true":
        raise WeightsUnavailable(
            f"model.pretrained=true but no weights for {cfg.name!r}: {reason}. Remedy: download them on a "
            f"connected machine (timm.create_model({cfg.name!r}, pretrained=True) fills the cache), copy the "
            f"file here and set model.weights_file, or set model.pretrained: auto|false."
        )
    if cfg.name not in _SAID_RANDOM:  # the profile builds a model per trial: say it once per process
        _SAID_RANDOM.add(cfg.name)
        log.warning("model.pretrained=auto: NO pretrained weights for %s (%s); training from RANDOM init",
                    cfg.name, reason)
    return timm.create_model(cfg.name, pretrained=False, **kwargs), InitInfo("random", None, None)


def _named(what: str, exc: Exception) -> str:
    """A refusal's one line: what was being loaded, then why."""
    return f"{what}: {exc}"


def _timm_load(name: str, kwargs: dict, num_classes: int, in_chans: int, what: str,
               file: str | None) -> tuple[torch.nn.Module, LoadReport]:
    """`name` built without weights, then loaded by timm's own loader from `file` (a cached copy) or
    the hub, counted (`weights.load_pretrained_counted`); a partial load is `WeightsUnavailable`."""
    model = timm.create_model(name, pretrained=False, **kwargs)
    cfg = dict(getattr(model, "pretrained_cfg", {}) or {})
    if file:
        cfg["file"] = file
    # The filter timm's model module applies to its own checkpoints (ViT's position embeddings...), when it has one.
    filter_fn = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    try:
        return model, load_pretrained_counted(model, cfg, num_classes, in_chans, filter_fn)
    except WeightsMismatch as exc:
        raise WeightsUnavailable(_named(f"{name} from {what}", exc) + ". Set model.pretrained: false, or point "
                                 "model.weights_file at weights of this model.name.") from exc


def _with_report(info: InitInfo, report: LoadReport) -> InitInfo:
    return dataclasses.replace(info, mapping=report.mapping, loaded=report.loaded, backbone=report.backbone,
                               classifier=report.classifier, counters_loaded=report.counters_loaded,
                               counters=report.counters, entry=report.entry)


def classifier_keys(model: torch.nn.Module) -> tuple[str, str]:
    """State-dict keys of the classifier's weight and bias (timm names the layer in its pretrained
    config: `fc` for a ResNet, `head.fc` for others)."""
    name = classifier_prefix(model)
    return f"{name}.weight", f"{name}.bias"


def warm_start(model: torch.nn.Module, weights: dict[str, torch.Tensor], old_classes: Sequence[str],
               classes: Sequence[str], renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Load a previous model's `weights` into `model` (built for `classes`), mapping the classifier's
    rows by class name: a class both know keeps its row wherever it moved (a class renamed
    {old: new} in `renamed` keeps the old name's row), a new class keeps the fresh row `model` was
    built with, a removed class's row is dropped. Returns what was mapped."""
    weight_key, bias_key = classifier_keys(model)
    own = model.state_dict()
    if weights.keys() != own.keys() or any(weights[k].shape != own[k].shape for k in own
                                           if k not in (weight_key, bias_key)):
        raise ValueError("the champion's weights do not fit this model (another model.name or input channels?): "
                         "set model.init: pretrained for this run")
    renamed = dict(renamed or {})
    row = {renamed.get(name, name): i for i, name in enumerate(old_classes)}
    mapped = dict(weights)
    for key in (weight_key, bias_key):
        fresh = own[key].clone()
        for i, name in enumerate(classes):
            if name in row:
                fresh[i] = weights[key][row[name]]
        mapped[key] = fresh
    model.load_state_dict(mapped)
    today = set(classes)
    return {"kept": [c for c in classes if c in row], "new": [c for c in classes if c not in row],
            "removed": [c for c in old_classes if renamed.get(c, c) not in today],
            "renamed": {old: new for old, new in renamed.items() if old in set(old_classes) and new in today}}


def model_mean_std(model: torch.nn.Module, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Normalisation the model's pretrained config expects, folded to `channels`."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    mean = tuple(cfg.get("mean", (0.485, 0.456, 0.406)))
    std = tuple(cfg.get("std", (0.229, 0.224, 0.225)))
    if channels != len(mean):
        mean = (sum(mean) / len(mean),) * channels
        std = (sum(std) / len(std),) * channels
    return mean, std
