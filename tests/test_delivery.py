"""The delivery check on stores `prepare` writes, against a champion whose answers are fixed by
construction: a linear probe of each photo's mean colour whose weights are the Bayes rule for the
colours below (per-photo colour offsets of known spread), so its softmax is calibrated by design and
it tells the colours apart. Nothing here is learned."""

import json
import shutil
from pathlib import Path

import numpy as np
from scipy.stats import betabinom
import pytest
import timm
import torch
from timm.models import register_model

from cnnpipe.config import DataConfig
from cnnpipe.data.loaders.transforms import normalize
from cnnpipe.data.prepare import prepare
from cnnpipe.params import ParamsError, release_config
from cnnpipe.release.delivery import check_delivery
from cnnpipe.release.flagging import OTHER_CLASSES, flag_pairs, grouped_holm, pooled_prior
from cnnpipe.release_config import DeliveryConfig, ReleaseConfig
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.recipe import input_recipe
from conftest import ROOT, base_params, meta_lines, save_image, tiny_params, write_params

COLOURS = {"blue": (40, 40, 210), "green": (40, 190, 40), "red": (210, 40, 40), "yellow": (210, 200, 40)}
CLASSES = sorted(COLOURS)
OFFSET = 18.0  # per-photo colour offset (sd, per channel): what the probe's Bayes rule assumes
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # in [0, 1] units, as timm gives them


class ColourProbe(torch.nn.Module):
    """Logits linear in the photo's mean normalised colour: with the weights `probe_checkpoint`
    sets, the log posterior of Gaussian colour classes of equal spread."""

    def __init__(self, num_classes: int, in_chans: int = 3) -> None:
        super().__init__()
        self.head = torch.nn.Linear(in_chans, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.float().mean((2, 3)))


@register_model
def colour_probe(pretrained: bool = False, num_classes: int = 4, in_chans: int = 3, **_: object) -> ColourProbe:
    return ColourProbe(num_classes, in_chans)


def probe_checkpoint(folder: Path, colours: dict[str, tuple[int, int, int]], stored_size: int,
                     offset: float = OFFSET, temperature: float = 1.0) -> Path:
    """best.pt of the Bayes rule for `colours` (classes sorted by name) with per-photo colour offsets
    of sd `offset`: a champion that is right and calibrated by construction."""
    classes = sorted(colours)
    centres = torch.stack([normalize(torch.tensor(colours[c], dtype=torch.float32).view(1, 3, 1, 1), MEAN, STD).view(3)
                           for c in classes])
    var = (offset / (255 * STD[0])) ** 2
    model = timm.create_model("colour_probe", num_classes=len(classes), in_chans=3)
    with torch.no_grad():
        model.head.weight.copy_(centres / var)
        model.head.bias.copy_(-(centres**2).sum(1) / (2 * var))
    data = DataConfig(source="catalog", stored_size=stored_size, image_size=stored_size)
    meta = {"model_name": "colour_probe", "num_classes": len(classes), "in_chans": 3, "classes": classes,
            "mean": list(MEAN), "std": list(STD), "image_size": stored_size, "amp": "off", "channels_last": False,
            "temperature": temperature, "temperature_for": "model", "serve": "model",
            "input": input_recipe(data, 3, MEAN, STD)}
    folder.mkdir(parents=True, exist_ok=True)
    ckpt.save_atomic({"model": model.state_dict(), "ema": None, "meta": meta, "epoch": 1}, folder / "best.pt")
    (folder / "champion.json").write_text(json.dumps({"artifact": "m", "stage": "prod", "version": "v1.0.0"}))
    return folder


def colour_photo(path: Path, colour: tuple[int, int, int], seed: int) -> None:
    """A 12 px photo of `colour` moved by a per-photo offset, with pixel noise."""
    rng = np.random.default_rng(seed)
    shade = np.array(colour) + rng.normal(0, OFFSET, 3)
    save_image(path, np.clip(shade + rng.normal(0, 10, (12, 12, 3)), 0, 255).astype(np.uint8))


def two_weeks(root: Path, week1: list[tuple[str, str, int]]) -> Path:
    """A catalog of 60 photos a colour prepared once, then `week1`'s (true colour, folder, count)
    photos added and prepared again: the second store marks those as new."""
    cfg = DataConfig(source=str(root / "catalog"), stored_size=8, image_size=8, prepare_workers=1,
                     val_fraction=0.1, test_fraction=0.3)
    for k, name in enumerate(CLASSES):
        for i in range(60):
            colour_photo(root / "catalog" / name / f"old-{i:03d}.png", COLOURS[name], 1000 * k + i)
    prepare(cfg, 0, root / "prepared", root / "report.json")
    for j, (true, folder, count) in enumerate(week1):
        for i in range(count):
            colour_photo(root / "catalog" / folder / f"new-{true}-{i:03d}.png", COLOURS[true], 10**5 * (j + 1) + i)
    prepare(cfg, 0, root / "prepared", root / "report.json")
    return root / "prepared"


@pytest.fixture(scope="module")
def swapped(tmp_path_factory) -> Path:
    """Week 1: 50 honest new photos a colour, plus 100 red photos filed as green and 100 green as red."""
    root = tmp_path_factory.mktemp("swapped")
    honest = [(c, c, 50) for c in CLASSES]
    return two_weeks(root, honest + [("red", "green", 100), ("green", "red", 100)])


@pytest.fixture(scope="module")
def champion(tmp_path_factory) -> Path:
    return probe_checkpoint(tmp_path_factory.mktemp("champion") / "champion", COLOURS, 8)


def test_a_swapped_delivery_is_flagged_both_ways_by_file(swapped, champion):
    report, files = check_delivery(swapped, champion, ReleaseConfig(), torch.device("cpu"))
    assert report["checked"] and report["flagged"] and report["new_images"] == 400
    pairs = {(r["given"], r["predicted"]): r for r in report["pairs"]}
    assert set(pairs) == {("green", "red"), ("red", "green")}  # both directions, nothing else
    assert pairs[("green", "red")]["of"] == 150 and pairs[("green", "red")]["images"] >= 90
    swapped_files = {f["source"] for f in files}
    planted = {f"green/new-red-{i:03d}.png" for i in range(100)} | {f"red/new-green-{i:03d}.png" for i in range(100)}
    listed = {s for s in swapped_files if any(s.endswith(p) for p in planted)}
    assert len(listed) == 200  # every swapped photo, the champion sure of it or not: the delivery is held whole
    assert {s.split("/")[0] for s in swapped_files} == {"red", "green"} and len(swapped_files) == 300  # and only
    # the flagged classes' new photos: their 50 honest ones each beside them
    assert len(report["files"]) == 100 and set(report["files"]) <= swapped_files
    assert {f["split"] for f in files} == {"train", "val", "test"}  # new photos of every split


def test_an_honest_week_is_not_flagged(tmp_path, champion):
    prepared = two_weeks(tmp_path, [(c, c, 100) for c in CLASSES])
    report, files = check_delivery(prepared, champion, ReleaseConfig(), torch.device("cpu"))
    assert report["checked"] and not report["flagged"] and files == [] and report["new_images"] == 400


def test_a_pair_the_champion_usually_confuses_is_not_flagged():
    """Built counts: the champion confidently calls 20% of the test's class 0 class 1; 22 of 100 new
    class-0 photos called class 1 is its usual rate, 60 of 100 is not."""
    cfg = DeliveryConfig()
    ref_given = np.zeros(200, np.int64)
    ref_pred = np.r_[np.ones(40), np.zeros(160)].astype(np.int64)
    ref_conf = np.full(200, 0.95)
    for k, expect in ((22, False), (60, True)):
        given = np.zeros(100, np.int64)
        pred = np.r_[np.ones(k), np.zeros(100 - k)].astype(np.int64)
        pairs, photos, _ = flag_pairs(given, pred, np.full(100, 0.95), ref_given, ref_pred, ref_conf, ["a", "b"],
                                      np.array([True, True]), cfg)
        assert pairs[0]["flagged"] is expect and photos.sum() == (100 if expect else 0)  # a flagged class held whole
        assert pairs[0]["expected"] == pytest.approx(41 / 202)


def test_unconfident_disagreements_and_tiny_pairs_are_not_flagged():
    cfg = DeliveryConfig(min_images=5)
    ref = (np.zeros(100, np.int64), np.zeros(100, np.int64), np.full(100, 0.99))
    given, pred = np.zeros(50, np.int64), np.r_[np.ones(30), np.zeros(20)].astype(np.int64)
    pairs, _, _ = flag_pairs(given, pred, np.full(50, 0.6), *ref, ["a", "b"], np.array([True, True]), cfg)
    assert pairs == []  # 0.6 < release.delivery.confidence: not a confident disagreement
    pairs, _, _ = flag_pairs(given[:4], pred[:4], np.full(4, 0.99), *ref, ["a", "b"], np.array([True, True]), cfg)
    assert not pairs[0]["flagged"]  # 4 of 4, far above 1%, but under min_images


def honest_answers(rng: np.random.Generator, classes: int, per_class: int) -> tuple[np.ndarray, ...]:
    """`per_class` photos of every class, filed right, and a champion's answers on them: right 90% of
    the time (sure of it 90% of those), else one of three look-alike classes (sure 30% of those).
    The same law for the old test photos and an honest delivery: (given, predicted, confidence)."""
    given = np.repeat(np.arange(classes), per_class)
    wrong = rng.random(len(given)) < 0.1
    look_alike = (given + rng.integers(1, 4, len(given))) % classes
    pred = np.where(wrong, look_alike, given)
    sure = rng.random(len(given)) < np.where(wrong, 0.3, 0.9)
    return given, pred, np.where(sure, 0.95, 0.5)


def check(new: tuple[np.ndarray, ...], test: tuple[np.ndarray, ...], classes: int,
          cfg: DeliveryConfig = DeliveryConfig()):
    names = [f"c{i:04d}" for i in range(classes)]
    return flag_pairs(*new, *test, names, np.ones(classes, bool), cfg)


def test_ten_photos_filed_wrong_among_1000_classes_are_flagged():
    """1,000 classes, 20 old test photos and 20 new photos each, but class 7's delivery is ten photos
    of class 8 filed under 7 (the champion sure they are 8): they are flagged, pair and files, and
    nothing else is. Holm over all 999,000 pairs (p about 2e-8 against 1e-8) could not flag them."""
    rng = np.random.default_rng(7)
    test = honest_answers(rng, 1000, 20)
    given, pred, conf = honest_answers(rng, 1000, 20)
    keep = given != 7
    given, pred, conf = (np.r_[x[keep], np.full(10, v)] for x, v in ((given, 7), (pred, 8), (conf, 0.97)))
    planted = np.arange(len(given) - 10, len(given))
    pairs, photos, classes = check((given, pred, conf), test, 1000)
    flagged = [(r["given"], r["predicted"]) for r in pairs if r["flagged"]]
    assert flagged == [("c0007", "c0008")] and [r["given"] for r in classes if r["flagged"]] == ["c0007"]
    assert set(np.flatnonzero(photos)) == set(planted)
    uniform = betabinom.sf(9, 10, pairs[0]["test_disagreements"] + 1, 20 - pairs[0]["test_disagreements"] + 1)
    assert pairs[0]["images"] == 10 and uniform * 999_000 > DeliveryConfig().alpha  # the old rule's miss


def test_photos_filed_wrong_towards_several_classes_flag_their_class():
    """Twelve photos filed under one class of 100, the champion sure they are four other classes (3
    each, under min_images per pair): the class is flagged, its photos listed, in one row."""
    rng = np.random.default_rng(3)
    test = honest_answers(rng, 100, 20)
    given, pred, conf = honest_answers(rng, 100, 20)
    planted = np.flatnonzero(given == 5)[:12]
    pred[planted], conf[planted] = np.repeat([50, 60, 70, 80], 3), 0.97
    pairs, photos, _ = check((given, pred, conf), test, 100)
    assert [(r["given"], r["predicted"]) for r in pairs if r["flagged"]] == [("c0005", OTHER_CLASSES)]
    assert set(np.flatnonzero(photos)) >= set(planted) and not photos[given != 5].any()


@pytest.mark.parametrize("classes", [10, 100, 1000])
def test_honest_weeks_are_rarely_flagged_at_any_class_count(classes):
    """Forty honest weeks (seeded) at each class count, the delivery and the test split drawn from
    the same champion: alpha is 1%, so one flagged week in forty is already unlikely, and a rule
    whose false flags grew with the class count would show it at 1,000."""
    rng = np.random.default_rng(classes)
    weeks = [check(honest_answers(rng, classes, 20), honest_answers(rng, classes, 20), classes) for _ in range(40)]
    assert sum(any(r["flagged"] for r in pairs) for pairs, _, _ in weeks) <= 1


def test_grouped_holm_is_holm_within_each_family():
    """Listed p-values only (the rest of each family at 1) give the same adjusted p as Holm on the
    whole family."""
    from cnnpipe.release.stats import holm

    rng = np.random.default_rng(0)
    families = [rng.random(12) ** 4 for _ in range(3)]
    listed = [np.flatnonzero(f < 0.3) for f in families]
    p = np.concatenate([f[i] for f, i in zip(families, listed)])
    group = np.concatenate([np.full(len(i), g) for g, i in enumerate(listed)])
    expected = np.concatenate([holm(f)[i] for f, i in zip(families, listed)])
    assert np.allclose(grouped_holm(p, group, np.full(3, 12)), expected)


def read_list(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def run_stage(tmp_path: Path, prepared: Path, champion: Path, policy: str, capsys) -> tuple[int, str, str, Path]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("delivery_stage", ROOT / "stages" / "delivery.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    params = base_params()
    params["release"]["delivery"]["policy"] = policy
    params["train"]["device"] = "cpu"
    tmp_path.mkdir(parents=True, exist_ok=True)
    out, listed = tmp_path / "metrics" / "delivery.json", tmp_path / "data" / "delivery" / "flagged.csv"
    rc = stage.main(["--params", str(write_params(tmp_path / "params.yaml", params)), "--data", str(prepared),
                     "--champion", str(champion), "--out", str(out), "--list", str(listed)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, listed


def test_the_stop_policy_fails_before_training_naming_the_list(tmp_path, swapped, champion, capsys):
    rc, out, err, listed = run_stage(tmp_path, swapped, champion, "stop", capsys)
    assert rc == 1 and f"{listed}" in err and "training does not start" in err
    assert len(read_list(listed)) >= 180  # the list is written before the stage fails
    assert "new 'red' photos look like 'green'" in out and "new 'green' photos look like 'red'" in out
    report = json.loads((tmp_path / "metrics" / "delivery.json").read_text())
    assert report["list"] == str(listed) and report["flagged_images"] >= 180
    rc, out, _, _ = run_stage(tmp_path / "report", swapped, champion, "report", capsys)
    assert rc == 0 and "flagged" in out  # report only: the same flags, training goes on


def test_no_champion_says_so_and_passes(tmp_path, swapped, capsys):
    shutil.rmtree(tmp_path / "champion", ignore_errors=True)
    (tmp_path / "champion").mkdir()
    (tmp_path / "champion" / "champion.json").write_text(json.dumps({"version": None, "reason": "none"}))
    rc, out, _, listed = run_stage(tmp_path, swapped, tmp_path / "champion", "stop", capsys)
    assert rc == 0 and "no champion yet" in out and read_list(listed) == []
    assert listed.read_text().startswith("source,sha256,split,")  # a header, never an empty file
    report = json.loads((tmp_path / "metrics" / "delivery.json").read_text())
    assert report["checked"] is False and report["flagged"] is False


def test_delivery_params_are_validated_and_default_to_params_yaml():
    assert release_config(base_params()).delivery == DeliveryConfig()
    for key, value, allowed in (("policy", "maybe", "report | hold_out | stop"), ("confidence", 0.0, "(0, 1]"),
                                ("min_images", 0, ">= 1"), ("colour", 1, "known keys")):
        with pytest.raises(ParamsError, match=rf"release\.delivery\.{key}.*{allowed}".replace("(", r"\(")
                           .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")):
            release_config({"release": {"delivery": {key: value}}})


def test_the_gate_repeats_the_flags(tmp_path, swapped, champion, capsys):
    """gate.json and gate.md carry the delivery check's pairs; the champion judged against itself."""
    from cnnpipe.release.verdict import run_gate

    run_stage(tmp_path, swapped, champion, "report", capsys)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text(json.dumps({"top1": 0.9}))
    verdict = run_gate(ReleaseConfig(artifact="m"), champion, champion, tmp_path / "eval", swapped, tmp_path / "gate",
                       torch.device("cpu"), delivery=tmp_path / "metrics" / "delivery.json")
    assert verdict["delivery"]["flagged"] and {(r["given"], r["predicted"]) for r in verdict["delivery"]["pairs"]} \
        == {("green", "red"), ("red", "green")}
    page = (tmp_path / "gate" / "gate.md").read_text()
    assert "## Delivery check: " in page
    assert "| green | red | 100 of 150 |" in page and "| red | green | 100 of 150 |" in page
    assert "flagged.csv" in page


def test_hold_out_keeps_the_flagged_photos_out_of_training_and_the_test(tmp_path, swapped, champion, capsys,
                                                                          monkeypatch):
    """Under `hold_out` the list marks its photos; training and validation (`fit`) and the gate's test
    split open without exactly those rows; the store and its split files are untouched."""
    from cnnpipe.data.splits.held_out import open_kept
    from cnnpipe.data.store.shards import open_split
    from cnnpipe.params import resolve
    from cnnpipe.release.verdict import run_gate
    from cnnpipe.train import trainer
    from cnnpipe.train.distributed import DistInfo

    rc, out, _, listed = run_stage(tmp_path, swapped, champion, "hold_out", capsys)
    rows = read_list(listed)
    assert rc == 0 and len(rows) >= 180 and all(r["held_out"] == "true" for r in rows)
    for split in ("train", "val", "test"):
        kept, index = open_kept(swapped, split, listed)
        whole = open_split(swapped, split)
        held = sum(r["split"] == split for r in rows)
        assert len(kept) == len(whole) - held and len(index) == len(kept)
        assert np.array_equal(np.asarray(kept.images), np.asarray(whole.images[index]))
    _, report_list = run_stage(tmp_path / "report", swapped, champion, "report", capsys)[2:]
    assert open_kept(swapped, "train", report_list)[1] is None  # `report` holds nothing out

    seen = {}

    def stop_at_training(cfg, info, split, champion):
        seen["train"] = len(split)
        raise RuntimeError("stop here")

    monkeypatch.setattr(trainer, "build_training", stop_at_training)
    cfg = resolve(tiny_params(), "optimized")
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.fit(cfg, DistInfo(), swapped, tmp_path / "m", tmp_path / "t.json", tmp_path / "live", held_out=listed)
    assert seen["train"] == len(open_split(swapped, "train")) - sum(r["split"] == "train" for r in rows)

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text(json.dumps({"top1": 0.9}))
    verdict = run_gate(ReleaseConfig(artifact="m"), champion, champion, tmp_path / "eval", swapped, tmp_path / "gate",
                       torch.device("cpu"), held_out=listed)
    held_test = sum(r["split"] == "test" for r in rows)
    assert held_test and verdict["challenger"]["test_images"] == len(open_split(swapped, "test")) - held_test


def test_hold_out_leaves_the_flagged_test_photos_out_of_evaluate(tmp_path, swapped, champion, capsys):
    """evaluate's test images and predictions.csv under `hold_out`: the kept photos, each by its own file."""
    import csv

    from cnnpipe.evaluate.evaluation import evaluate

    listed = run_stage(tmp_path, swapped, champion, "hold_out", capsys)[3]
    held = {r["source"] for r in read_list(listed) if r["split"] == "test"}
    result = evaluate(champion, swapped, tmp_path / "eval", torch.device("cpu"), held_out=listed)
    with open(tmp_path / "eval" / "predictions.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    sources = [meta["source"] for meta in meta_lines(swapped, "test")]
    assert held and result["images"] == len(sources) - len(held) == len(rows)
    assert [r["source"] for r in rows] == [s for s in sources if s not in held]
    assert all(r["actual"] == s.split("/")[0] for r, s in zip(rows, [s for s in sources if s not in held]))


def test_every_stage_that_reads_photos_for_the_model_runs_after_the_check():
    """`stop` keeps training from starting only if DVC runs the check first: training, evaluate and the
    gate list the delivery stage's list (what `hold_out` reads), and the gate its report."""
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    listed = next(iter(stages["delivery"]["outs"]))
    assert listed == "data/delivery/flagged.csv" and f"--list {listed}" in stages["delivery"]["cmd"]
    for name in ("train", "evaluate", "gate"):
        stage = stages[name].get("do", stages[name])
        assert listed in stage["deps"] and f"--held-out {listed}" in " ".join(stage["cmd"].split()), name
    assert "metrics/delivery.json" in stages["gate"]["deps"]


@pytest.mark.parametrize("classes", [10, 100, 1000])
def test_ten_photos_filed_wrong_among_twenty_honest_ones_are_flagged(classes):
    """Class 7's delivery: its twenty honest photos and ten of class 8 filed under 7, the champion sure
    they are 8; 20 old test photos a class. Against a uniform prior on class 7's own 20 test photos,
    ten confident disagreements among thirty never stood out at any class count; against the rate
    the other classes pin down (`pooled_prior`), the class is flagged, and held whole."""
    rng = np.random.default_rng(classes)
    test = honest_answers(rng, classes, 20)
    given, pred, conf = honest_answers(rng, classes, 20)
    given, pred, conf = (np.r_[x, np.full(10, v)] for x, v in ((given, 7), (pred, 8), (conf, 0.97)))
    pairs, photos, flagged = check((given, pred, conf), test, classes)
    assert [r["given"] for r in flagged if r["flagged"]] == ["c0007"], [r for r in flagged if r["flagged"]]
    assert set(np.flatnonzero(photos)) == set(np.flatnonzero(given == 7))  # all thirty held until a person looks


def test_the_pooled_prior_follows_the_classes_spread():
    """The same pooled rate, the strength by how much the classes differ beyond their binomial noise:
    alike classes pin it down (one observation per class at most), scattered ones leave each class
    near its own count."""
    n = np.full(100, 20)
    alike = np.full(100, 1)
    a0, b0 = pooled_prior(alike, n)
    assert a0 / (a0 + b0) == pytest.approx(0.05) and a0 + b0 == pytest.approx(100.0)
    scattered = np.r_[np.zeros(50, np.int64), np.full(50, 2)]  # the same mean, some look-alike classes
    scattered[:10] = 10
    a1, b1 = pooled_prior(scattered, n)
    assert a1 + b1 < 20 and pooled_prior(alike[:4], n[:4]) == (1.0, 1.0)  # too few classes: uniform
