"""End to end: the real `dvc repro` on a copy of the project with a shrunken config."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from cnnpipe.plan.plan import KEEP_BAND
from cnnpipe.profile.diagnosis import BOTTLENECKS
from cnnpipe.train.precision import cpu_has_fast_bf16
from conftest import (ROOT, base_params, build_reproduced, built_once, save_image, tiny_params,
                      write_params)

pytestmark = pytest.mark.slow



def run(cmd: list[str], cwd: Path, extra_env: dict[str, str] | None = None) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **(extra_env or {}))
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def stages_run(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory) -> tuple[Path, str]:
    """A git + DVC copy of the project whose Fashion-MNIST is the synthetic one (DVC-tracked in
    data/raw), after one `dvc repro`; with that run's output (`build_reproduced` in conftest). Built
    once per test run (`built_once`), started in the background as the run starts, and never changed:
    each test gets a copy."""
    return built_once(tmp_path_factory, "reproduced", build_reproduced)


@pytest.fixture()
def project(reproduced, tmp_path) -> Path:
    """This test's own copy of the reproduced project (git, DVC cache, outputs and all): what one
    test edits, no other test sees, so the tests pass in any order."""
    copy = tmp_path / "project"
    shutil.copytree(reproduced[0], copy, symlinks=True)
    return copy


def test_repro_produces_every_output_and_metric(reproduced):
    project, out = reproduced
    ran = stages_run(out)
    assert set(ran) == {"machine", "prepare", "profile@baseline", "profile@optimized", "profile_report", "plan",
                        "train@baseline", "train@optimized", "evaluate@baseline", "evaluate@optimized",
                        "export@baseline", "export@optimized", "compare", "champion", "delivery", "gate"}
    # The plan is printed, and the delivery checked (no champion yet: it says so), before any training starts.
    assert max(ran.index("plan"), ran.index("delivery")) < min(ran.index("train@baseline"), ran.index("train@optimized"))
    assert "delivery: not checked: no champion yet" in out
    assert out.index("# Time plan (budget 20 min)") < out.index("Running stage 'train@")
    plan = json.loads((project / "metrics" / "plan" / "plan.json").read_text())
    assert plan["fraction"] == 1.0  # a tiny run trains in seconds
    assert plan["fits"] == (plan["predicted_total_s"] <= 20 * 60 * KEEP_BAND[1])
    # prepare's own seconds, as its report measured them, count in the budget
    prepared = json.loads((project / "metrics" / "data_report.json").read_text())["stage_time_s"]
    assert plan["spent_s"] == {"prepare": prepared} and prepared > 0
    # validation and evaluate run at the batch each profile timed inference at, through budget.yaml
    profiles = {v: json.loads((project / "metrics" / "profile" / f"{v}.json").read_text())
                for v in ("baseline", "optimized")}
    timed = {v: p["inference_batch"] for v, p in profiles.items()}
    assert yaml.safe_load((project / "metrics" / "plan" / "budget.yaml").read_text()) == {
        "fraction": 1.0, "images_per_epoch": None, "val_images": None, "parity_images": None, "eval_batch": timed,
        "export_batch": {v: p["export_batch"] for v, p in profiles.items()}}
    assert (project / "metrics" / "profile" / "report.md").exists()
    assert yaml.safe_load((project / "metrics" / "profile" / "baseline_tuned.yaml").read_text()) == {}
    tuned = yaml.safe_load((project / "metrics" / "profile" / "optimized_tuned.yaml").read_text())
    assert set(tuned) == {"channels_last", "loader", "num_workers", "amp", "decode", "malloc"}
    for variant in ("baseline", "optimized"):
        train = json.loads((project / "metrics" / variant / "train.json").read_text())
        for key in ("epochs", "epoch_time_s", "throughput_img_s", "data_wait_frac", "peak_mem_mb", "device",
                    "world_size", "init"):
            assert key in train, (variant, key)
        assert train["cpu"]["usable_cores"] >= 1 and "fast_bf16" in train["cpu"]
        evaluation = json.loads((project / "metrics" / variant / "eval.json").read_text())
        assert {"top1", "top5", "loss"} <= set(evaluation)
        assert train["eval_batch"] == evaluation["eval_batch"] == timed[variant]
        assert (project / "metrics" / variant / "mistakes.png").read_bytes()[:4] == b"\x89PNG"
        exported = json.loads((project / "metrics" / variant / "export.json").read_text())
        assert exported["onnx"]["top1_agreement"] == 1.0 and exported["torchscript"]["top1_agreement"] == 1.0
        assert exported["parity_batch"] == profiles[variant]["export_batch"]
        assert (project / "exports" / variant / "model.onnx").exists()
        assert 0.0 <= evaluation["top1"] <= evaluation["top5"] <= 1.0
        profile = json.loads((project / "metrics" / "profile" / f"{variant}.json").read_text())
        assert sum(profile["fractions"].values()) == pytest.approx(1.0)
        assert profile["bottleneck"] in BOTTLENECKS
        assert list((project / "logs" / "profile" / variant).glob("*.pt.trace.json*"))
        assert (project / "models" / variant / "best.pt").exists()
    compare = json.loads((project / "metrics" / "compare.json").read_text())
    assert {"speedup_throughput", "speedup_epoch_time", "top1_delta"} <= set(compare)
    compare_md = (project / "metrics" / "compare.md").read_text()
    assert "| Top-1 (test) |" in compare_md and "(optimized/mistakes.png)" in compare_md
    assert "| train@baseline |" in compare_md and compare["plan"]["stages"]["train@optimized"]["actual_s"] > 0
    assert "| export@optimized |" in compare_md and 0 < compare["plan"]["training_share"] < 1
    assert "McNemar" in compare_md and "95% Wilson" in compare_md
    shown = run(["dvc", "metrics", "show", "--json"], project)
    assert "top1" in shown and "speedup_throughput" in shown


def _stale(project: Path) -> set[str]:
    status = json.loads(run(["dvc", "status", "--json"], project).strip().splitlines()[-1])
    return set(status) - {"machine", "champion"}  # always changed by design


def test_another_node_gets_data_models_and_results_from_a_dvc_remote(project, tmp_path):
    """docs/distributed.md's recipe for node k: the same commit, `dvc pull` from the remote, and
    nothing left to run but the machine stage (which always runs) before training or predicting."""
    run(["dvc", "repro"], project)
    remote = tmp_path / "remote"
    run(["dvc", "remote", "add", "-f", "-d", "shared", str(remote)], project)
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results", "--allow-empty"], project)
    run(["dvc", "push"], project)
    node = tmp_path / "node1"
    run(["git", "clone", "-q", str(project), str(node)], tmp_path)
    run(["dvc", "pull"], node)
    status = run(["dvc", "status"], node)
    assert sorted(stages_changed(status)) == ["champion", "machine"], status
    assert (node / "data" / "prepared" / "index.json").exists()
    assert (node / "models" / "optimized" / "best.pt").exists()
    image = save_image(tmp_path / "shoe.png", np.full((28, 28), 200, np.uint8))
    out = run([sys.executable, "-m", "cnnpipe.predict", str(image)], node)
    assert "1 classified" in out


def stages_changed(status: str) -> list[str]:
    """Stage names `dvc status` lists (lines `name:` at the start), in order."""
    return [line[:-1] for line in status.splitlines() if line.endswith(":") and not line.startswith((" ", "\t"))]


@pytest.mark.parametrize("key, value, stale", [
    # the optimiser's numbers: training reruns, no profile, no plan
    ("lr", 0.15, {"train@baseline", "train@optimized"}),
    ("label_smoothing", 0.05, {"train@baseline", "train@optimized"}),
    # the batch changes step speed: both profiles and the plan are stale too
    ("batch_size", 16, {"profile@baseline", "profile@optimized", "plan", "train@baseline", "train@optimized"}),
    # epochs: auto's bounds reach training only through the plan's budget.yaml; early stop also the plan's text
    ("max_epochs", 7, {"plan"}),
    ("min_epochs", 3, {"profile@baseline", "profile@optimized", "plan"}),
    ("patience", 3, {"plan", "train@baseline", "train@optimized"}),
])
def test_only_what_a_key_changes_is_stale(project, key, value, stale):
    params_file = project / "params.yaml"
    original = params_file.read_text()
    params = yaml.safe_load(original)
    params["train"][key] = value
    write_params(params_file, params)
    assert _stale(project) == stale
    params_file.write_text(original)
    assert _stale(project) == set()


def test_another_machine_reruns_the_profiles_and_the_plan(project):
    """A new fingerprint (here a label; in real life a new CPU or GPU) re-measures before training."""
    tuned = {v: (project / "metrics" / "profile" / f"{v}_tuned.yaml").read_text() for v in ("baseline", "optimized")}
    budget = (project / "metrics" / "plan" / "budget.yaml").read_text()
    env = {"CNNPIPE_MACHINE_LABEL": "another box"}
    out = run(["dvc", "repro"], project, env)
    ran = set(stages_run(out))
    assert {"machine", "profile@baseline", "profile@optimized", "plan"} <= ran
    assert json.loads((project / "metrics" / "machine.json").read_text())["label"] == "another box"
    for variant in ("baseline", "optimized"):
        same = tuned[variant] == (project / "metrics" / "profile" / f"{variant}_tuned.yaml").read_text()
        same = same and budget == (project / "metrics" / "plan" / "budget.yaml").read_text()
        assert (f"train@{variant}" in ran) == (not same), (variant, ran)
    assert sorted(stages_run(run(["dvc", "repro"], project, env))) == ["champion", "machine"]


def test_changing_optimized_params_reruns_only_optimized_stages(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["variants"]["optimized"]["train"]["lr"] = 0.1
    write_params(project / "params.yaml", params)
    diff = run(["dvc", "params", "diff"], project)
    assert "variants.optimized.train.lr" in diff
    out = run(["dvc", "repro"], project)
    assert set(stages_run(out)) == {"machine", "champion", "profile@optimized", "profile_report", "plan",
                                    "train@optimized", "evaluate@optimized", "export@optimized", "gate", "compare"}


def test_profile_params_retrain_only_when_the_tuned_values_change(project):
    tuned_file = project / "metrics" / "profile" / "optimized_tuned.yaml"
    before = yaml.safe_load(tuned_file.read_text())
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["profile"]["min_gain"] = 0.9  # no candidate can win: every `auto` knob gets its default
    # The shipped time box, not the reproduced project's smallest (conftest.SMALLEST_PROFILE): the trials run.
    params["profile"]["budget_share"] = base_params()["profile"]["budget_share"]
    write_params(project / "params.yaml", params)
    out = run(["dvc", "repro"], project)
    after = yaml.safe_load(tuned_file.read_text())
    trials = json.loads((project / "metrics" / "profile" / "optimized.json").read_text())["trials"]
    assert any(t["speedup"] > 0 for t in trials), trials  # measured, and none won
    ran = set(stages_run(out))
    assert {"profile@baseline", "profile@optimized"} <= ran and "train@baseline" not in ran
    assert ("train@optimized" in ran) == (after != before)
    assert after == {"amp": "bf16" if cpu_has_fast_bf16() else "off", "channels_last": True, "loader": "fast",
                     "num_workers": 0, "decode": "cpu", "malloc": "system"}


def test_killed_repro_resumes_without_repeating_epochs(project, tmp_path):
    """SIGKILL the whole `dvc repro` mid-training; the next `dvc repro` resumes from last.pt. The kill
    lands right after the first checkpoint, where the run waits for it (tests/child_hooks), so it is
    mid-training on any machine, however fast or loaded."""
    import signal
    import time

    # The reproduced project's params (2 epochs): only train@optimized is stale, the profiles stand.
    shutil.rmtree(project / "models" / "optimized")  # the reproduced run's finished checkpoint
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               CNNPIPE_TEST_PAUSE_AT_CHECKPOINT=str(tmp_path), TMPDIR=str(tmp_path))  # killed: it cannot clean up
    proc = subprocess.Popen(["dvc", "repro", "train@optimized"], cwd=project, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # a hang guard, not a speed check
    while not (tmp_path / "paused").exists():
        assert proc.poll() is None, "training ended without pausing at its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.05)
    killed_after = int((tmp_path / "paused").read_text())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert killed_after == 1
    out = run(["dvc", "repro", "train@optimized"], project)
    assert "resuming from" in out and set(stages_run(out)) - {"machine", "champion"} == {"train@optimized"}
    summary = json.loads((project / "metrics" / "optimized" / "train.json").read_text())
    epochs = [h["epoch"] for h in summary["history"]]
    assert epochs == [1, 2]  # every epoch once: none repeated, none lost
    assert summary["resumed_from_epoch"] == killed_after


def test_a_new_local_weights_file_reruns_training(project):
    (project / "weights" / "mine.safetensors").write_bytes(b"not really weights")
    try:
        status = json.loads(run(["dvc", "status", "--json"], project).strip().splitlines()[-1])
    finally:
        (project / "weights" / "mine.safetensors").unlink()
    for stage in ("train@baseline", "train@optimized"):
        assert any("weights" in json.dumps(entry) for entry in status.get(stage, [])), status.get(stage)


def test_a_tight_budget_shrinks_every_variant_alike(project):
    """run.budget_minutes below what the plan predicts: fewer images per epoch, the same for both.

    40 epochs of the tiny split with the stages around them take over the 1-minute floor of
    run.budget_minutes; how far the plan shrinks them depends on this machine's measured speeds (the
    plan's own rules, OVER budget included, are tested on fixed numbers in test_plan.py). It runs up to
    the two train stages, where the budget is applied: evaluate and export would only read their caps
    from the budget.yaml checked here (export's cap: tests/test_use_model.py).
    """
    from cnnpipe.plan.plan import LADDER

    params = tiny_params(epochs=40)
    params["data"]["stored_size"] = 32
    params["run"] = {"budget_minutes": 1}
    write_params(project / "params.yaml", params)
    out = run(["dvc", "repro", "train@baseline", "train@optimized"], project)
    assert {"plan", "train@baseline", "train@optimized"} <= set(stages_run(out))
    plan = json.loads((project / "metrics" / "plan" / "plan.json").read_text())
    budget = yaml.safe_load((project / "metrics" / "plan" / "budget.yaml").read_text())
    assert plan["fraction"] < 1.0
    assert ("OVER budget" in out) == (plan["fraction"] == LADDER[-1] and plan["predicted_total_s"] > 60)
    images = plan["images_per_epoch"]
    assert budget["images_per_epoch"] == images < plan["train_images"] and images % 32 == 0  # whole batches
    assert budget["val_images"] == plan["val_images"] and budget["parity_images"] == plan["parity_images"]
    for variant in ("baseline", "optimized"):
        train = json.loads((project / "metrics" / variant / "train.json").read_text())
        assert train["images_per_epoch"] == images
        assert all(h["epoch_time_s"] > 0 for h in train["history"])
    diff = run(["dvc", "metrics", "diff", "--json"], project)
    assert "images_per_epoch" in diff
