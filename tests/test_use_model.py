"""Using the trained model: predict on image files, export to TorchScript/ONNX, the mistakes gallery."""

import csv
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cnnpipe import malloc
from cnnpipe.data.loaders.host import build_eval_loader
from cnnpipe.data.prepare import prepare_fashion_mnist
from cnnpipe.data.store.shards import open_split
from cnnpipe.deploy import export, predict
from cnnpipe.evaluate import evaluation
from cnnpipe.evaluate.evaluation import evaluate
from cnnpipe.evaluate.gallery import most_confident_mistakes
from cnnpipe.params import load_params, resolve
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train import trainer
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.engine import predict as engine_predict
from cnnpipe.train.precision import autocast
from cnnpipe.train.trained import load_trained, make_transform
from conftest import built_once, eval_loader_batches, save_image, tiny_params, write_fake_fmnist, write_params

KEPT = "keep" if malloc.available() else "system"
"""The allocator evaluate and export run at: freed memory kept wherever glibc's mallopt is."""


def train_tiny_model(root: Path) -> None:
    """A prepared split (stored at the native 28 px) in `root`/prepared and a tiny model trained on it
    in `root`/models."""
    cfg = resolve(load_params(write_params(root / "params.yaml", tiny_params(epochs=3))), "optimized")
    prepared = root / "prepared"
    prepared.mkdir()
    prepare_fashion_mnist(cfg.data, 0, prepared, search_dirs=(write_fake_fmnist(root / "fmnist"),))
    trainer.fit(cfg, DistInfo(), prepared, root / "models", root / "train.json", root / "live")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`train_tiny_model`'s folder, prepared split and models: built once per run (`built_once`),
    read-only (a test that changes a checkpoint copies it first)."""
    root = built_once(tmp_path_factory, "use_model.trained", train_tiny_model)[0]
    return root, root / "prepared", root / "models"


def model_predictions(models, prepared, n):
    """Class probabilities of the first `n` test images through evaluation's own path."""
    model, meta = load_trained(models, torch.device("cpu"))
    split = open_split(prepared, "test", limit=n)
    logits, labels = engine_predict(model, build_eval_loader(split, batch_size=64), make_transform(meta),
                                    torch.device("cpu"), meta["amp"])
    return torch.softmax(logits / meta["temperature"], 1), labels, split


def test_predicting_image_files_gives_what_evaluation_gives(trained, tmp_path):
    _, prepared, models = trained
    probs, _, split = model_predictions(models, prepared, 40)
    for i in range(40):  # the test images as the PNG files a user would have
        save_image(tmp_path / "photos" / f"{i:03d}.png", np.asarray(split.images[i])[..., 0])
    predictor = predict.Predictor.load(models, prepared, torch.device("cpu"))
    results = list(predictor.predict(predict.list_inputs(tmp_path / "photos"), topk=3, batch_size=16))
    assert [r.error for r in results] == [None] * 40
    classes = open_split(prepared, "test").classes
    assert [r.label for r in results] == [classes[i] for i in probs.argmax(1).tolist()]
    np.testing.assert_allclose([r.probability for r in results], probs.max(1).values.numpy(), atol=1e-5)
    assert all(len(r.topk) == 3 and r.topk[0][1] >= r.topk[1][1] >= r.topk[2][1] for r in results)


def test_broken_and_foreign_files_get_error_rows_never_a_crash(trained, tmp_path, capsys):
    _, prepared, models = trained
    photos = tmp_path / "photos"
    rng = np.random.default_rng(0)
    save_image(photos / "shoe.jpg", rng.integers(0, 255, (60, 80, 3), dtype=np.uint8))
    rgba = rng.integers(0, 255, (30, 30, 4), dtype=np.uint8)
    save_image(photos / "nested" / "bag.webp", rgba)
    save_image(photos / "nested" / "icon.png", rgba)
    (photos / "truncated.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    (photos / "empty.png").write_bytes(b"")
    (photos / "notes.txt").write_text("not an image")
    (photos / ".hidden.png").write_bytes(b"")  # hidden files are skipped, as in prepare
    out = tmp_path / "preds.csv"
    rc = predict.main([str(photos), "--model", str(models / "best.pt"), "--data", str(prepared),
                       "--topk", "2", "--out", str(out)])
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["path"].rsplit("/", 1)[1] for r in rows] == ["empty.png", "bag.webp", "icon.png", "notes.txt",
                                                           "shoe.jpg", "truncated.jpg"]
    errors = {r["path"].rsplit("/", 1)[1]: r["error"] for r in rows}
    assert errors["empty.png"] == "empty file (0 bytes)" and "not an image" in errors["notes.txt"]
    assert "truncated" in errors["truncated.jpg"] or "corrupt" in errors["truncated.jpg"]
    assert all(errors[name] == "" for name in ("shoe.jpg", "bag.webp", "icon.png"))
    assert all(len(r["topk"].split(";")) == 2 for r in rows if not r["error"])
    assert "predict: 3 classified, 3 could not be read" in capsys.readouterr().err
    json_out = tmp_path / "preds.json"
    assert predict.main([str(photos / "shoe.jpg"), "--model", str(models), "--data", str(prepared),
                         "--out", str(json_out)]) == 0
    (only,) = json.loads(json_out.read_text())
    assert only["error"] is None and only["label"] in open_split(prepared, "test").classes


def test_training_fits_a_temperature_and_predict_and_both_exports_apply_it(trained, tmp_path):
    _, prepared, models = trained
    meta = ckpt.load(models / "best.pt")["meta"]
    assert meta["temperature"] > 0 and meta["temperature_for"] == meta["serve"] == "model"
    copy = tmp_path / "models"  # a temperature far from 1, so that forgetting it anywhere shows
    shutil.copytree(models, copy)
    state = ckpt.load(copy / "best.pt")
    state["meta"]["temperature"] = 2.5
    ckpt.save_atomic(state, copy / "best.pt")
    model, loaded = load_trained(copy, torch.device("cpu"))
    split = open_split(prepared, "test", limit=24)
    x = make_transform({**loaded, "channels_last": False})(torch.from_numpy(np.asarray(split.images)))
    expected = torch.softmax(model(x).float() / 2.5, 1)
    with autocast(loaded["amp"], torch.device("cpu")):  # predict runs in the model's precision (bf16 here)
        in_precision = torch.softmax(model(make_transform(loaded)(torch.from_numpy(np.asarray(split.images)))).float()
                                     / 2.5, 1)
    served = predict.Predictor.load(copy, prepared, torch.device("cpu")).probabilities(np.asarray(split.images))
    torch.testing.assert_close(served, in_precision, atol=1e-5, rtol=1e-4)
    export.export_model(copy, prepared, tmp_path / "exports", tmp_path / "export.json", max_images=24)
    scripted = torch.jit.load(str(tmp_path / "exports" / "model.ts"))
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "exports" / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_logits = torch.from_numpy(session.run(None, {"images": x.contiguous().numpy()})[0])
    for name, probs in (("torchscript", torch.softmax(scripted(x), 1)), ("onnx", torch.softmax(onnx_logits, 1))):
        torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4, msg=name)
    assert json.loads((tmp_path / "exports" / "meta.json").read_text())["temperature"] == 2.5


def test_several_targets_and_a_confidence_threshold(trained, tmp_path, capsys):
    """A shell glob gives several files and folders; below --min-confidence an image has no label."""
    _, prepared, models = trained
    split = open_split(prepared, "test", limit=6)
    for i in range(6):
        save_image(tmp_path / ("a" if i < 3 else "b") / f"{i}.png", np.asarray(split.images[i])[..., 0])
    out = tmp_path / "preds.json"
    args = [str(tmp_path / "a" / "0.png"), str(tmp_path / "b"), str(tmp_path / "a"), "--model", str(models),
            "--data", str(prepared), "--out", str(out)]
    assert predict.main(args) == 0
    rows = json.loads(out.read_text())
    assert [r["path"].rsplit("/", 1)[1] for r in rows] == ["0.png", "3.png", "4.png", "5.png", "1.png", "2.png"]
    assert not any(r["uncertain"] for r in rows) and all(r["label"] for r in rows)
    threshold = sorted(r["probability"] for r in rows)[3]
    assert predict.main([*args, "--min-confidence", str(threshold)]) == 0
    again = json.loads(out.read_text())
    assert [r["uncertain"] for r in again] == [r["probability"] < threshold for r in rows]
    assert all((r["label"] is None) == r["uncertain"] and r["topk"] for r in again)
    unsure = sum(r["probability"] < threshold for r in rows)
    assert f"{6 - unsure} classified, {unsure} uncertain" in capsys.readouterr().err


def test_cli_refuses_what_it_cannot_do(trained, tmp_path, capsys):
    _, prepared, models = trained
    assert predict.main([str(tmp_path / "missing"), "--model", str(models)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert predict.main([str(tmp_path), "--model", str(tmp_path)]) == 2
    assert "best.pt not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        predict.main([str(tmp_path), "--out", "preds.xlsx"])


def test_colour_photos_become_the_greyscale_the_model_was_trained_on():
    red, white = np.full((2, 2, 3), (255, 0, 0), np.uint8), np.full((2, 2, 3), 255, np.uint8)
    assert predict.to_channels(red, 1)[0, 0, 0] == 76  # ITU-R 601 luma, as PIL's convert("L")
    assert predict.to_channels(white, 1).shape == (2, 2, 1) and predict.to_channels(white, 1).max() == 255
    assert predict.to_channels(red, 3) is red


def test_exports_match_pytorch_on_the_test_split(trained, tmp_path):
    _, prepared, models = trained
    result = export.export_model(models, prepared, tmp_path / "exports", tmp_path / "export.json")
    assert (tmp_path / "exports" / "model.ts").stat().st_size > 0
    assert (tmp_path / "exports" / "model.onnx").stat().st_size > 0
    assert result["onnx_checker"].startswith("onnxruntime") and result["onnx_opset"] >= 17
    assert result["images"] == len(open_split(prepared, "test")) and result["parity_on"] == "whole test split"
    assert result["stage_time_s"] > 0
    for name in ("torchscript", "onnx"):
        assert result[name]["top1_agreement"] == 1.0, name
        assert result[name]["max_abs_diff"] < 1e-3, name
        assert result[name]["top1"] == pytest.approx(result["pytorch_top1"])
    meta = json.loads((tmp_path / "exports" / "meta.json").read_text())
    assert meta["classes"] == open_split(prepared, "test").classes and meta["weights"] == "model"
    assert json.loads((tmp_path / "export.json").read_text())["onnx"]["top1_agreement"] == 1.0
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "exports" / "model.onnx"), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"images": np.zeros((3, 1, 28, 28), np.float32)})
    assert out.shape == (3, 10)  # a batch size never seen at export time


def test_without_onnxruntime_export_says_only_the_checker_ran(trained, tmp_path, monkeypatch):
    _, prepared, models = trained
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if it never installed
    batches = eval_loader_batches(monkeypatch, export)
    result = export.export_model(models, prepared, tmp_path / "exports", tmp_path / "export.json", max_images=20,
                                 batch_size=8)  # the plan's export_batch: the one the profile timed
    assert batches == [8] and result["parity_batch"] == 8 and result["malloc"] == KEPT
    assert result["onnx"] is None and result["onnx_checker"].startswith("onnx.checker")
    assert 15 <= result["images"] <= 25 and result["parity_on"].startswith("fixed class-balanced subset")
    assert "no numerical parity" in result["onnx_checker"]
    assert result["torchscript"]["top1_agreement"] == 1.0


def test_most_confident_mistakes_are_wrong_sorted_and_deterministic():
    logits = torch.tensor([[5.0, 0.0], [0.0, 9.0], [0.0, 2.0], [0.0, 2.0], [3.0, 0.0]])
    labels = torch.tensor([0, 0, 0, 0, 1])
    mistakes = most_confident_mistakes(logits, labels, 3)
    assert [m[0] for m in mistakes] == [1, 4, 2]  # 9.0 > 3.0 > 2.0 (tie with 3: the lower index)
    assert all(actual != predicted for _, actual, predicted, _ in mistakes)
    assert mistakes[0][3] == pytest.approx(torch.softmax(torch.tensor([0.0, 9.0]), 0)[1].item())
    assert most_confident_mistakes(logits[:1], labels[:1], 5) == []


def always_answers(models, out, answer: int):
    """A copy of the trained checkpoint whose classifier ignores the image and always says `answer`
    (zero weights, one raised bias), in both its weight sets: which test images it gets wrong, and
    how sure it is of each, are known before it runs, whatever the tiny model had learned."""
    out.mkdir()
    state = ckpt.load(models / "best.pt")
    for weights in filter(None, (state["model"], state.get("ema"))):
        weights["fc.weight"].zero_()
        weights["fc.bias"].copy_(4.0 * (torch.arange(len(weights["fc.bias"])) == answer))
    ckpt.save_atomic(state, out / "best.pt")
    return out


@pytest.mark.parametrize("answer", [0, 7])
def test_evaluate_writes_the_gallery_of_known_mistakes(trained, tmp_path, answer):
    _, prepared, models = trained
    labels = np.asarray(open_split(prepared, "test").labels)
    wrong = np.flatnonzero(labels != answer)  # every image of another class; equally sure, so in index order
    assert len(wrong) > 8  # the synthetic test split has 20 images of each of 10 classes
    result = evaluate(always_answers(models, tmp_path / "fixed", answer), prepared, tmp_path, torch.device("cpu"),
                      gallery_size=8)
    assert result["top1"] == pytest.approx(np.mean(labels == answer))
    png = (tmp_path / "mistakes.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    listed = json.loads((tmp_path / "classes.json").read_text())["most_confident_mistakes"]
    classes = open_split(prepared, "test").classes
    assert [m["test_index"] for m in listed] == wrong[:8].tolist()
    assert [(m["actual"], m["predicted"]) for m in listed] == [(classes[labels[i]], classes[answer]) for i in wrong[:8]]
    expected = torch.softmax(4.0 * (torch.arange(10) == answer) / result["temperature"], 0)[answer].item()
    assert [m["probability"] for m in listed] == pytest.approx([expected] * 8, rel=1e-2)  # bf16 logits


def test_evaluate_runs_the_test_split_at_the_plan_s_batch(trained, tmp_path, monkeypatch):
    """The batch the profile timed inference at (budget.yaml `eval_batch`) is the one evaluate's loader
    gets; the answers do not depend on it."""
    _, prepared, models = trained
    batches = eval_loader_batches(monkeypatch, evaluation)
    small = evaluate(models, prepared, tmp_path / "at8", torch.device("cpu"), batch_size=8)
    usual = evaluate(models, prepared, tmp_path / "usual", torch.device("cpu"))
    assert batches == [8, 256] and (small["eval_batch"], usual["eval_batch"]) == (8, 256)
    assert small["malloc"] == KEPT  # as warm as the process the profile timed inference in (cnnpipe.malloc)
    read = [list(csv.DictReader((tmp_path / d / "predictions.csv").open())) for d in ("at8", "usual")]
    assert [r["predicted"] for r in read[0]] == [r["predicted"] for r in read[1]] and small["top1"] == usual["top1"]


@pytest.mark.parametrize("ema_better", [True, False])
def test_ema_weights_are_used_when_they_validated_better(trained, tmp_path, ema_better):
    _, _, models = trained
    best = ckpt.load(models / "best.pt")
    best["meta"] = {k: v for k, v in best["meta"].items() if k not in ("serve", "temperature_for")}  # no choice saved
    ema = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in best["model"].items()}
    ckpt.save_atomic({**best, "ema": ema, "epoch": 1}, tmp_path / "best.pt")
    record = {"val_top1": 0.5, "val_top1_ema": 0.6 if ema_better else 0.4}
    ckpt.save_atomic({"history": [record]}, tmp_path / "last.pt")
    model, meta = load_trained(tmp_path, torch.device("cpu"))
    assert meta["weights"] == ("ema" if ema_better else "model")
    name = next(k for k, v in best["model"].items() if v.is_floating_point())
    expected = ema[name] if ema_better else best["model"][name]
    assert torch.equal(model.state_dict()[name], expected)
