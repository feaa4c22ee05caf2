"""What a user sees when something is missing or wrong: each stage's CLI exits with code 2 and a
message that names the file or the params key and what to do (never a traceback).

The stages run in this process (conftest's `stage`): the same script, arguments, working folder and
`sys.exit(main())` as dvc.yaml's command line, without a fresh interpreter's ~5 s of importing torch
and timm per case. The process boundary itself is tested where it matters: test_weights.py runs the
profile and train stages as subprocesses on bad weights, and every `dvc repro` test runs them all.
"""

from __future__ import annotations

import json

import pytest

from cnnpipe.params import resolve
from cnnpipe.train import engine
from conftest import Stage, tiny_params, write_params

pytestmark = pytest.mark.slow


def usage_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in err, err[-3000:]


@pytest.mark.parametrize("script, args", [
    ("prepare.py", ()), ("profiler.py", ("optimized",)), ("plan.py", ()), ("train.py", ("optimized",)),
    ("evaluate.py", ("optimized",)),
])
def test_an_unknown_params_section_stops_every_stage_naming_it(tmp_path, script, args, stage: Stage):
    params = tiny_params()
    params["trian"] = {"lr": 0.1}  # a typo of `train`
    write_params(tmp_path / "params.yaml", params)
    code, err, _ = stage(tmp_path, script, *args)
    usage_error(code, err, "`trian`", "one of the top-level sections")


def test_an_unknown_model_name_is_named_with_its_key(tmp_path, prepared, stage: Stage):
    params = tiny_params()
    params["model"]["name"] = "resnet5O"
    write_params(tmp_path / "params.yaml", params)
    code, err, _ = stage(tmp_path, "train.py", "optimized", "--data", str(prepared))
    usage_error(code, err, "model.name='resnet5O' is not a timm model")


def test_a_missing_weights_file_is_named(tmp_path, prepared, stage: Stage):
    params = tiny_params()
    params["model"].update(pretrained="auto", weights_file=str(tmp_path / "nowhere.safetensors"))
    write_params(tmp_path / "params.yaml", params)
    code, err, _ = stage(tmp_path, "train.py", "optimized", "--data", str(prepared))
    usage_error(code, err, "model.weights_file=", "nowhere.safetensors", "does not exist")


@pytest.mark.parametrize("script, args", [("train.py", ("optimized",)), ("profiler.py", ("optimized",)),
                                          ("plan.py", ())])
def test_missing_prepared_data_says_to_run_prepare(tmp_path, script, args, stage: Stage):
    write_params(tmp_path / "params.yaml", tiny_params())
    (tmp_path / "metrics" / "profile").mkdir(parents=True)  # the plan reads the profiles first
    for v in ("baseline", "optimized"):
        (tmp_path / "metrics" / "profile" / f"{v}.json").write_text(json.dumps(
            {"throughput_img_s": 100.0, "inference_img_s": 300.0, "device": "cpu"}))
    code, err, _ = stage(tmp_path, script, *args)
    usage_error(code, err, "data/prepared", "dvc repro prepare")


def test_a_plan_without_a_profile_names_the_stage_to_run(tmp_path, prepared, stage: Stage):
    write_params(tmp_path / "params.yaml", tiny_params())
    code, err, _ = stage(tmp_path, "plan.py", "--data", str(prepared))
    usage_error(code, err, "metrics/profile/baseline.json not found", "dvc repro profile@baseline")


def test_a_profile_report_without_profiles_names_the_stage_to_run(tmp_path, stage: Stage):
    write_params(tmp_path / "params.yaml", tiny_params())
    code, err, _ = stage(tmp_path, "profile_report.py")
    usage_error(code, err, "baseline.json not found", "dvc repro profile@baseline")


def test_compare_without_predictions_names_the_file(tmp_path, stage: Stage):
    for v in ("baseline", "optimized"):
        (tmp_path / "metrics" / v).mkdir(parents=True)
        (tmp_path / "metrics" / v / "train.json").write_text(json.dumps({"history": []}))
        (tmp_path / "metrics" / v / "eval.json").write_text(json.dumps({"top1": 0.5, "images": 10}))
    code, err, _ = stage(tmp_path, "compare.py")
    usage_error(code, err, "predictions.csv")


def test_evaluate_and_export_without_a_model_say_to_train(tmp_path, prepared, stage: Stage):
    write_params(tmp_path / "params.yaml", tiny_params())
    code, err, _ = stage(tmp_path, "evaluate.py", "optimized", "--data", str(prepared))
    usage_error(code, err, "models/optimized")
    code, err, _ = stage(tmp_path, "export.py", "optimized", "--data", str(prepared))
    usage_error(code, err, "models/optimized")


def test_a_budget_file_that_is_not_a_mapping_says_to_rerun_the_plan(tmp_path, prepared, stage: Stage):
    write_params(tmp_path / "params.yaml", tiny_params())
    (tmp_path / "budget.yaml").write_text("- just\n- a list\n")
    code, err, _ = stage(tmp_path, "train.py", "optimized", "--data", str(prepared), "--budget", "budget.yaml")
    usage_error(code, err, "budget.yaml", "dvc repro plan")
    (tmp_path / "budget.yaml").write_text("eval_batch: {optimized: half}\n")  # read before any model is
    code, err, _ = stage(tmp_path, "evaluate.py", "optimized", "--data", str(prepared), "--budget", "budget.yaml")
    usage_error(code, err, "`eval_batch.optimized` = 'half'", "dvc repro plan")


def test_more_accumulation_steps_than_batches_is_named(tmp_path, prepared, stage: Stage):
    """An optimizer step of more images than an epoch holds: the batch halves until one step fits
    (`schedule.batch_for_split`, down to 8); where not even batch 8 gives the step its micro-batches
    (67 batches of 8 an epoch here, for 128 accumulation steps) the error names the key."""
    write_params(tmp_path / "params.yaml", tiny_params(accum_steps=128, batch_size=32))
    code, err, _ = stage(tmp_path, "train.py", "optimized", "--data", str(prepared))
    usage_error(code, err, "train.accum_steps=128 exceeds the 67 batches per epoch")


def test_a_nan_loss_under_mixup_stops_with_the_step(tmp_path, prepared, monkeypatch):
    """The soft-target loss (mixup/cutmix) has its own NaN guard path."""
    from cnnpipe.params import load_params
    from cnnpipe.train import trainer
    from cnnpipe.train.distributed import DistInfo

    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params(mixup_alpha=0.2))), "optimized")
    original = engine._soft_target_ce.forward

    def poisoned(x, target):
        return original(x, target) * float("nan")

    monkeypatch.setattr(engine._soft_target_ce, "forward", poisoned)
    monkeypatch.setattr(engine.F, "cross_entropy", lambda *a, **k: pytest.fail("hard-label loss used under mixup"))
    with pytest.raises(engine.NonFiniteLoss, match="loss is nan at optimizer step 0"):
        trainer.fit(cfg, DistInfo(), prepared, tmp_path / "models", tmp_path / "train.json", tmp_path / "live")
    assert not (tmp_path / "models" / "last.pt").exists()
