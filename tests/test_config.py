"""params.yaml validation: every bad value names its key, its value and what is allowed."""

import dataclasses

import pytest
import torch
import yaml

from cnnpipe.config import DataConfig, ModelConfig, ParamsError, ProfileConfig, RunConfig, TrainConfig
from cnnpipe.params import build_section, load_params, resolve
from cnnpipe.train.tuning import resolve_auto
from conftest import ROOT, base_params, write_params


@pytest.mark.parametrize("section, cls", [("run", RunConfig), ("data", DataConfig), ("model", ModelConfig),
                                          ("train", TrainConfig), ("profile", ProfileConfig)])
def test_dataclass_defaults_are_params_yaml(section, cls):
    """One source of defaults: each section's dataclass, built with no values, equals params.yaml's
    shared section, and params.yaml sets every key (so a reader sees them all in one place)."""
    shared = yaml.safe_load((ROOT / "params.yaml").read_text())[section]
    assert set(shared) == {f.name for f in dataclasses.fields(cls)}, f"params.yaml `{section}:` misses keys"
    assert build_section(cls, shared, section) == cls(), f"{cls.__name__} defaults differ from params.yaml"


def test_project_params_are_valid():
    raw = load_params(ROOT / "params.yaml")
    for variant in ("baseline", "optimized"):
        cfg = resolve(raw, variant)
        assert cfg.model.name == "resnet50"
    base = resolve(raw, "baseline")
    assert base.train.amp == "off" and base.train.loader == "baseline" and base.model.pretrained == "false"
    assert base.train.schedule == "constant" and base.train.num_workers == 0 and not base.train.pin_memory
    opt = resolve(raw, "optimized")
    assert opt.train.schedule == "cosine" and opt.train.label_smoothing > 0
    assert {opt.train.loader, opt.train.channels_last, opt.train.num_workers} == {"auto"}
    resolved = resolve_auto(opt, torch.device("cpu"))
    assert resolved.train.loader == "fast" and resolved.train.channels_last is True
    tuned = resolve_auto(opt, torch.device("cpu"), {"channels_last": False, "num_workers": 2, "amp": "off"})
    assert tuned.train.channels_last is False and tuned.train.num_workers == 2 and tuned.train.amp == "off"
    assert resolve_auto(base, torch.device("cpu"), {"amp": "bf16"}).train == base.train  # explicit values win
    assert base.train.epochs == opt.train.epochs  # same epochs, same data


@pytest.mark.parametrize(
    "section, key, value, fragment",
    [
        ("train", "epochs", "three", "`train.epochs` = 'three'"),
        ("train", "epochs", 0, "an integer >= 1"),
        ("train", "lr", -1, "`train.lr`"),
        ("train", "amp", "fp8", "off | bf16 | fp16 | auto"),
        ("train", "num_workers", "many", "an integer or auto"),
        ("train", "channels_last", "yes", "true | false"),
        ("train", "bogus", 1, "`train.bogus`"),
        ("data", "val_fraction", 0.9, "`data.val_fraction` = 0.9"),
        ("data", "image_size", "big", "an integer in [8, 1024] or `auto`"),
        ("data", "max_train_images", 3, "null (all) or an integer >= 10"),
        ("model", "pretrained", "maybe", "auto | true | false"),
        ("train", "rdzv_endpoint", "nohost", "host:port"),
    ],
)
def test_bad_values_name_the_key(tmp_path, section, key, value, fragment):
    params = base_params()
    params[section][key] = value
    with pytest.raises(ParamsError) as err:
        load_params(write_params(tmp_path / "params.yaml", params))
    assert fragment in str(err.value)


def test_variant_override_errors_name_the_variant_key(tmp_path):
    params = base_params()
    params["variants"]["optimized"]["train"]["batch_size"] = -4
    with pytest.raises(ParamsError, match=r"variants\.optimized\.train\.batch_size"):
        load_params(write_params(tmp_path / "params.yaml", params))
    params = base_params()
    params["variants"]["optimized"]["data"] = {"image_size": 16}
    with pytest.raises(ParamsError, match="only `model` and `train`"):
        load_params(write_params(tmp_path / "params.yaml", params))


def test_yaml_booleans_map_to_choice_strings(tmp_path):
    path = tmp_path / "params.yaml"
    text = yaml.safe_dump(base_params())
    text = text.replace("amp: auto", "amp: off").replace("pretrained: auto", "pretrained: true")
    path.write_text(text)
    cfg = resolve(load_params(path), "optimized")
    assert cfg.train.amp == "off" and cfg.model.pretrained == "true"


def test_unknown_variant_and_missing_file(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")
    with pytest.raises(ParamsError, match="variant 'fast'"):
        resolve(base_params(), "fast")
