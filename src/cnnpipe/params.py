"""Reading ``params.yaml``: types checked at the door, variants applied, every section validated.

A wrong type, range or unknown key raises :class:`ParamsError` naming the exact key, the value and
what is allowed, before any work starts. The sections themselves are `cnnpipe.config`.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from cnnpipe.config import (
    DataConfig,
    ModelConfig,
    ParamsError,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    VariantConfig,
    reject,
)
from cnnpipe.release_config import ReleaseConfig

__all__ = ["ParamsError", "build_section", "data_config", "load_params", "release_config", "resolve", "run_config"]


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Validate `value` against a dataclass field type; return it (ints widen to floats)."""
    origin = get_origin(hint)
    if origin is Literal:
        allowed = get_args(hint)
        # YAML reads `off`/`true` as booleans; accept them for string choices.
        if isinstance(value, bool):
            for spelling in ("true", "on") if value else ("false", "off"):
                if spelling in allowed:
                    return spelling
        if value not in allowed:
            reject(key, value, " | ".join(map(str, allowed)))
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for inner in (a for a in args if a is not type(None)):
            try:
                return _check_type(key, value, inner)
            except ParamsError as exc:
                errors.append(str(exc).split("allowed: ", 1)[1])
        reject(key, value, " or ".join(errors) + (" or null" if type(None) in args else ""))
    if hint is bool:
        if not isinstance(value, bool):
            reject(key, value, "true | false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            reject(key, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            reject(key, value, "a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            reject(key, value, "a string")
        return value
    if dataclasses.is_dataclass(hint):  # a subsection (release.delivery)
        return build_section(hint, value, key)
    if origin is dict:  # a mapping of names to values (release.floors)
        if not isinstance(value, dict):
            reject(key, value, "a mapping")
        key_type, value_type = get_args(hint)
        return {_check_type(f"{key}.{k}", k, key_type): _check_type(f"{key}.{k}", v, value_type)
                for k, v in value.items()}
    raise TypeError(f"unsupported field type {hint!r} for {key}")


def build_section(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a raw mapping, naming `prefix.key` in every error."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        reject(prefix, raw, "a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        reject(f"{prefix}.{unknown[0]}", raw[unknown[0]], f"one of the known keys: {', '.join(sorted(names))}")
    values = {k: _check_type(f"{prefix}.{k}", v, hints[k]) for k, v in raw.items()}
    try:
        return cls(**values)
    except ParamsError as exc:
        # Range checks name the bare section (`train.lr`); inside a variant, name the full key.
        section = prefix.rsplit(".", 1)[-1]
        if prefix == section:
            raise
        raise ParamsError(str(exc).replace(f"`{section}.", f"`{prefix}.")) from None


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    """Read params.yaml and validate every section and every variant; return the raw mapping."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path} not found: run from the project root (where dvc.yaml is)")
    with path.open() as fh:
        raw = yaml.safe_load(fh) or {}
    known = {"seed", "run", "data", "model", "train", "profile", "release", "variants"}
    unknown = sorted(set(raw) - known)
    if unknown:
        reject(unknown[0], raw[unknown[0]], f"one of the top-level sections: {', '.join(sorted(known))}")
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict):
        reject("variants", variants, "a mapping of variant name to overrides")
    for name in variants:
        resolve(raw, name)  # validate each variant up front
    data_config(raw)
    run_config(raw)
    release_config(raw)
    return raw


def run_config(raw: dict[str, Any]) -> RunConfig:
    """The `run` section."""
    return build_section(RunConfig, raw.get("run"), "run")


def release_config(raw: dict[str, Any]) -> ReleaseConfig:
    """The `release` section: the champion's GTO stage and the gate's rules."""
    return build_section(ReleaseConfig, raw.get("release"), "release")


def data_config(raw: dict[str, Any]) -> DataConfig:
    """The shared `data` section."""
    return build_section(DataConfig, raw.get("data"), "data")


def resolve(raw: dict[str, Any], variant: str) -> VariantConfig:
    """Shared sections with `variants.<variant>` overrides applied, validated."""
    variants = raw.get("variants") or {}
    if variant not in variants:
        raise ParamsError(
            f"params.yaml: variant {variant!r} not under `variants`; defined: {', '.join(variants) or 'none'}"
        )
    override = variants[variant] or {}
    if not isinstance(override, dict):
        reject(f"variants.{variant}", override, "a mapping with `model` and/or `train` overrides")
    bad = sorted(set(override) - {"model", "train"})
    if bad:
        reject(f"variants.{variant}.{bad[0]}", override[bad[0]], "only `model` and `train` can be overridden")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        reject("seed", seed, "an integer")
    prefix = f"variants.{variant}"

    def section(cls: type, name: str) -> Any:
        shared = raw.get(name) or {}
        build_section(cls, shared, name)  # errors in the shared part name the shared key
        return build_section(cls, _merge(shared, override.get(name) or {}), f"{prefix}.{name}")

    return VariantConfig(
        variant=variant,
        seed=seed,
        data=data_config(raw),
        model=section(ModelConfig, "model"),
        train=section(TrainConfig, "train"),
        profile=build_section(ProfileConfig, raw.get("profile"), "profile"),
    )
