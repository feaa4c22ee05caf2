"""Serve what was judged: a model's input recipe travels in best.pt and every path applies it (predict,
the gate, the warm start's check). Models here have set weights (a seeded tiny timm net), never
trained ones: the tests compare paths, not what a model learned."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

from cnnpipe.config import DataConfig, ModelConfig, TrainConfig, VariantConfig
from cnnpipe.release_config import ReleaseConfig
from cnnpipe.data.prepare import prepare
from cnnpipe.data.store import shards as prepared_store
from cnnpipe.data.store.shards import open_split
from cnnpipe.deploy import predict
from cnnpipe.evaluate.metrics import calibration_bins, expected_calibration_error
from cnnpipe.models import model_mean_std, warm_start
from cnnpipe.release.verdict import run_gate
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.recipe import input_recipe, recipe_of
from cnnpipe.train.temperature import fit_temperature
from cnnpipe.train.trained import load_trained, make_transform
from cnnpipe.train.warm_start import from_champion
from conftest import save_image

CLASSES = ["blue", "green", "red"]  # as the store sorts them
COLOURS = {"red": (200, 40, 40), "green": (40, 180, 40), "blue": (40, 40, 200)}


def make_model(folder: Path, classes: list[str], data: DataConfig, seed: int, temperature: float = 1.0) -> Path:
    """best.pt of a tiny timm net with seeded weights, trained on nothing, with the meta training writes."""
    torch.manual_seed(seed)
    model = timm.create_model("test_resnet", num_classes=len(classes), in_chans=3)
    mean, std = model_mean_std(model, 3)
    meta = {"model_name": "test_resnet", "num_classes": len(classes), "in_chans": 3, "classes": classes,
            "mean": list(mean), "std": list(std), "image_size": data.image_size, "amp": "off", "channels_last": False,
            "temperature": temperature, "temperature_for": "model", "serve": "model",
            "input": input_recipe(data, 3, mean, std)}
    folder.mkdir(parents=True, exist_ok=True)
    ckpt.save_atomic({"model": model.state_dict(), "ema": None, "meta": meta, "epoch": 1}, folder / "best.pt")
    return folder


def catalog(root: Path, per_class: int = 12) -> Path:
    """Colour photos of odd shapes (the decode resizes and crops each), in class folders."""
    rng = np.random.default_rng(0)
    for name, colour in COLOURS.items():
        for i in range(per_class):
            w, h = int(rng.integers(30, 70)), int(rng.integers(30, 70))
            pixels = np.clip(np.array(colour) + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            save_image(root / name / f"{name}-{i}.png", pixels)
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store at 16 px for a model that sees 24 px: stored_size != image_size."""
    root = tmp_path_factory.mktemp("recipe")
    data = DataConfig(source=str(catalog(root / "photos")), stored_size=16, image_size=24, prepare_workers=1,
                      val_fraction=0.2, test_fraction=0.4)
    prepare(data, 0, root / "prepared", root / "report.json")
    return root, data


def through_the_store(model_dir: Path, prepared: Path) -> torch.Tensor:
    model, meta = load_trained(model_dir, torch.device("cpu"))
    split = open_split(prepared, "test")
    with torch.no_grad():
        logits = model(make_transform(meta)(torch.from_numpy(np.asarray(split.images))))
    return torch.softmax(logits / meta["temperature"], 1)


def test_a_photo_predicted_from_its_file_is_predicted_as_through_the_store(store):
    """The test photos as files, through predict (given no prepared folder: the recipe in best.pt alone),
    get the probabilities the same model gives them from the prepared store, where the gate judged it.
    Decoding the photo straight to the input size, as predict did, gives others."""
    root, data = store
    model_dir = make_model(root / "model", CLASSES, data, seed=1, temperature=1.7)
    expected = through_the_store(model_dir, root / "prepared")
    files = [Path(data.source) / source for source in prepared_store.test_sources(root / "prepared")]
    assert len(files) >= 9
    predictor = predict.Predictor.load(model_dir, None, torch.device("cpu"))
    assert predictor.stored_size == 16 and predictor.meta["image_size"] == 24
    served = predictor.probabilities(np.stack([predictor.decode(f) for f in files]))
    torch.testing.assert_close(served, expected, atol=1e-5, rtol=1e-4)
    results = list(predictor.predict(files, topk=3))
    assert [r.topk[0][1] for r in results] == pytest.approx(expected.max(1).values.tolist(), abs=1e-5)
    sharp = predict.Predictor(predictor.model, predictor.meta, CLASSES, {**predictor.recipe, "stored_size": 24},
                              torch.device("cpu"))
    assert not torch.allclose(sharp.probabilities(np.stack([sharp.decode(f) for f in files])), expected, atol=1e-3)


def gate_verdict(champion: Path, challenger: Path, root: Path, tmp_path: Path) -> dict:
    """The gate's verdict on `challenger` against `champion` on the store's test images, without floors
    (the challenger's evaluation reads a top-1 of 0.9)."""
    metrics = tmp_path / "metrics"
    metrics.mkdir(exist_ok=True)
    (metrics / "eval.json").write_text(json.dumps({"top1": 0.9}))
    return run_gate(ReleaseConfig(floors={}), champion, challenger, metrics, root / "prepared", tmp_path / "out",
                    torch.device("cpu"))


def test_the_gate_judges_each_model_by_its_recipe_and_like_for_like(store, tmp_path):
    """The champion knows red and green only; the challenger also blue. Both run on the same stored test
    images; the comparison covers the red and green ones, with the challenger's answer among red and
    green. A champion stored at another size cannot be judged on these pixels: refused, saying why."""
    root, data = store
    champion = make_model(tmp_path / "champion", ["green", "red"], data, seed=2)
    (champion / "champion.json").write_text(json.dumps({"version": "v0.1.0", "commit": "a" * 40}))
    challenger = make_model(tmp_path / "challenger", CLASSES, data, seed=3)
    verdict = gate_verdict(champion, challenger, root, tmp_path)
    split = open_split(root / "prepared", "test")
    assert split.classes == CLASSES
    old = np.isin(split.labels, [CLASSES.index("red"), CLASSES.index("green")])
    assert verdict["paired"]["images"] == int(old.sum()) < len(split)
    assert verdict["challenger"]["input"]["stored_size"] == 16 and verdict["champion"]["version"] == "v0.1.0"
    assert (tmp_path / "out" / "gate.md").read_text().startswith("# Gate: ")
    elsewhere = make_model(tmp_path / "other", ["green", "red"], DataConfig(stored_size=32, image_size=24), seed=2)
    (elsewhere / "champion.json").write_text(json.dumps({"version": "v0.1.0", "commit": "a" * 40}))
    refused = gate_verdict(elsewhere, challenger, root, tmp_path)
    assert not refused["blessed"] and any("stored_size: 32 != 16" in r for r in refused["reasons"])


def test_the_gate_measures_the_drift_from_the_anchor_the_champion_stage_fetched(store, tmp_path):
    """The champion stage puts the drift budget's anchor, when it is another model, in the champion's
    `anchor/` folder: the gate runs it on today's test images, names it, and records what the weeks after
    this one are measured against (`anchor_next`). Without a champion the first model is its own anchor."""
    root, data = store
    champion = make_model(tmp_path / "champion", CLASSES, data, seed=2)
    make_model(champion / "anchor", CLASSES, data, seed=4)
    anchor = {"commit": "b" * 40, "version": "v0.1.0", "path": "models/optimized/best.pt", "sha256": "c" * 64,
              "same_as_champion": False, "why": "v0.1.0, the last model shown within the margin"}
    (champion / "champion.json").write_text(json.dumps({"version": "v0.2.0", "commit": "a" * 40, "anchor": anchor}))
    challenger = make_model(tmp_path / "challenger", CLASSES, data, seed=3)
    verdict = gate_verdict(champion, challenger, root, tmp_path)
    split = open_split(root / "prepared", "test")
    theirs = through_the_store(champion / "anchor", root / "prepared").argmax(1).numpy()
    ours = through_the_store(challenger, root / "prepared").argmax(1).numpy()
    right = (theirs == split.labels).mean(), (ours == split.labels).mean()
    assert verdict["drift"]["anchor"] == anchor["why"] and verdict["drift"]["images"] == len(split)
    assert (verdict["drift"]["anchor_top1"], verdict["drift"]["challenger_top1"]) == pytest.approx(right)
    expected = {"self": True} if verdict["drift"]["new_anchor"] else {k: anchor[k] for k in ("commit", "version",
                                                                                              "path", "sha256")}
    assert verdict["anchor_next"] == expected
    assert "Drift from the anchor" in (tmp_path / "out" / "gate.md").read_text()
    first = gate_verdict(tmp_path / "nobody", challenger, root, tmp_path)
    assert first["first_model"] and first["anchor_next"] == {"self": True}


def test_a_recorded_anchor_whose_file_is_missing_is_an_error_not_the_champion(store, tmp_path):
    """champion.json records another model as the drift budget's anchor, but anchor/best.pt is gone (a
    partial checkout, a deleted folder): the gate refuses to run, naming the file and how to fetch it,
    rather than measure the drift from the champion. With no anchor recorded, the champion is the anchor."""
    root, data = store
    champion = make_model(tmp_path / "champion", CLASSES, data, seed=2)
    challenger = make_model(tmp_path / "challenger", CLASSES, data, seed=3)
    (champion / "champion.json").write_text(json.dumps({"version": "v0.1.0", "commit": "a" * 40}))
    unrecorded = gate_verdict(champion, challenger, root, tmp_path)
    assert unrecorded["drift"]["anchor"] == "the champion v0.1.0: no anchor recorded"
    anchor = {"commit": "b" * 40, "version": "v0.0.9", "path": "models/optimized/best.pt", "sha256": "c" * 64,
              "same_as_champion": False, "why": "v0.0.9, the last model shown within the margin"}
    (champion / "champion.json").write_text(json.dumps({"version": "v0.1.0", "commit": "a" * 40, "anchor": anchor}))
    with pytest.raises(FileNotFoundError, match=r"anchor v0\.0\.9 .*anchor/best\.pt is missing.*dvc repro champion"):
        gate_verdict(champion, challenger, root, tmp_path)


def test_the_gate_counts_its_looks_at_the_anchor_in_the_committed_verdicts(store, tmp_path):
    """The gate stage reads which look at the anchor this is from the verdicts git holds (`looks`): one
    committed verdict against the same anchor with another challenger makes this look 2, named in
    the verdict; the champion's own sha256 is the anchor when none other is recorded."""
    root, data = store
    champion = make_model(tmp_path / "champion", CLASSES, data, seed=2)
    challenger = make_model(tmp_path / "challenger", CLASSES, data, seed=3)
    about = {"version": "v0.1.0", "commit": "a" * 40, "sha256": "c" * 64,
             "anchor": {"sha256": "c" * 64, "same_as_champion": True, "why": "the champion"}}
    (champion / "champion.json").write_text(json.dumps(about))
    identity = {"GIT_AUTHOR_NAME": "po", "GIT_AUTHOR_EMAIL": "po@x", "GIT_COMMITTER_NAME": "po", "GIT_COMMITTER_EMAIL": "po@x"}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gate.json").write_text(json.dumps({"drift": {}, "champion": about,
                                                            "challenger": {"sha256": "e" * 64}}))
    for args in (["init", "-q"], ["add", "out/gate.json"], ["commit", "-qm", "last week's refused challenger"]):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, env={**os.environ, **identity})
    verdict = gate_verdict(champion, challenger, root, tmp_path)
    assert verdict["drift"]["look"] == 2 and verdict["drift"]["looks_counted"]["earlier_challengers"] == ["e" * 64]
    assert "look 2 at this anchor" in " ".join(verdict["reasons"])


def variant(data: DataConfig) -> VariantConfig:
    return VariantConfig("optimized", 0, data, ModelConfig(name="test_resnet", init="champion"), TrainConfig())


def test_a_warm_start_across_input_recipes_is_refused_unless_allowed(tmp_path):
    data = DataConfig(stored_size=32, image_size=32)
    champion = make_model(tmp_path / "champion", CLASSES, DataConfig(stored_size=16, image_size=32), seed=4)
    with pytest.raises(ValueError, match=r"other inputs than this run \(stored_size: 16 != 32\).*"
                                         "release.warm_start_across_recipes: true"):
        from_champion(variant(data), CLASSES, 3, champion)
    (champion / "champion.json").write_text(json.dumps({"version": "v0.1.0", "commit": "b" * 40,
                                                        "warm_start": {"renamed": {}, "across_recipes": True}}))
    _, init = from_champion(variant(data), CLASSES, 3, champion)
    assert init.source == "champion" and "across input recipes (stored_size: 16 != 32)" in init.location
    same = make_model(tmp_path / "same", CLASSES, data, seed=4)
    assert from_champion(variant(data), CLASSES, 3, same)[1].source == "champion"


def test_the_warm_start_maps_the_classifier_by_class_name_and_rename():
    torch.manual_seed(0)
    old = timm.create_model("test_resnet", num_classes=3, in_chans=1)
    new = timm.create_model("test_resnet", num_classes=3, in_chans=1)
    fresh = new.state_dict()["fc.weight"].clone()
    report = warm_start(new, old.state_dict(), ["coat", "bag", "tshirt"], ["t-shirt", "coat", "hat"],
                        renamed={"tshirt": "t-shirt"})
    assert report == {"kept": ["t-shirt", "coat"], "new": ["hat"], "removed": ["bag"], "renamed": {"tshirt": "t-shirt"}}
    weights, old_weights = new.state_dict()["fc.weight"], old.state_dict()["fc.weight"]
    assert torch.equal(weights[0], old_weights[2]) and torch.equal(weights[1], old_weights[0])  # renamed, reordered
    assert torch.equal(weights[2], fresh[2])  # the new class keeps its fresh row
    assert torch.equal(new.state_dict()["fc.bias"][0], old.state_dict()["fc.bias"][2])
    body = [k for k in old.state_dict() if not k.startswith("fc.")]
    assert all(torch.equal(new.state_dict()[k], old.state_dict()[k]) for k in body)
    without = timm.create_model("test_resnet", num_classes=3, in_chans=1)
    assert warm_start(without, old.state_dict(), ["coat", "bag", "tshirt"], ["t-shirt", "coat", "hat"])["new"] == [
        "t-shirt", "hat"]  # without the rename its row is thrown away
    with pytest.raises(ValueError, match="do not fit this model"):
        warm_start(timm.create_model("test_resnet", num_classes=3, in_chans=3), old.state_dict(), ["a"] * 3, ["a"] * 3)


def test_a_fitted_temperature_calibrates_an_under_confident_model():
    """Labels drawn from softmax(z): z is calibrated. The model reports z / 4 (under-confident, like
    label smoothing makes it); the fitted temperature is about 1/4 and brings the ECE down."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(20_000, 10, generator=gen) * 3
    labels = torch.multinomial(torch.softmax(z, 1), 1, generator=gen).squeeze(1)
    shown = z / 4
    t = fit_temperature(shown, labels)
    assert t == pytest.approx(0.25, rel=0.1)
    before = expected_calibration_error(calibration_bins(torch.softmax(shown, 1), labels))
    after = expected_calibration_error(calibration_bins(torch.softmax(shown / t, 1), labels))
    assert before > 0.15 and after < 0.02
    assert torch.equal((shown / t).argmax(1), shown.argmax(1))  # no prediction moves


def test_an_old_checkpoint_without_a_recipe_is_read_from_its_meta():
    meta = {"in_chans": 1, "image_size": 28, "mean": [0.5], "std": [0.25]}
    assert recipe_of(meta) == {"decode": None, "stored_size": None, "channels": 1, "resize": "bilinear-antialias",
                               "image_size": 28, "mean": [0.5], "std": [0.25]}


def test_calibration_fits_on_the_whole_validation_split_and_records_the_recipe(store, tmp_path, monkeypatch):
    from cnnpipe.train import temperature

    root, data = store
    model_dir = make_model(tmp_path / "model", CLASSES, data, seed=5)
    recipe = ckpt.load(model_dir / "best.pt")["meta"]["input"]
    state = ckpt.load(model_dir / "best.pt")
    state["meta"] = {k: v for k, v in state["meta"].items() if k != "input"}
    ckpt.save_atomic(state, model_dir / "best.pt")
    val = open_split(root / "prepared", "val")
    fitted = temperature.calibrate_best(model_dir, val, torch.device("cpu"), recipe)
    assert fitted["val_images"] == len(val) >= 6
    assert ckpt.load(model_dir / "best.pt")["meta"]["input"] == recipe
    monkeypatch.setattr(temperature, "MAX_FIT_IMAGES", 3)  # a huge split: a class-balanced part of it
    assert temperature.calibrate_best(model_dir, val, torch.device("cpu"))["val_images"] == 3
