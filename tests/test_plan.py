"""The time plan and budget (pure), the per-epoch subset it relies on, and the CPU report."""

import os
import re
from dataclasses import replace

import numpy as np
import pytest

from cnnpipe import hardware
from cnnpipe.data.loaders.sampling import ShardSampler
from cnnpipe.params import ParamsError, load_params, resolve, run_config
from cnnpipe.plan.plan import (
    CHECKPOINT_SHARE,
    DVC_STAGE_S,
    KEEP_BAND,
    LADDER,
    LAST_AND_BEST,
    OTHER_STAGES,
    PARITY_UNDER_BUDGET,
    STARTUP_S,
    VAL_UNDER_BUDGET,
    Recipe,
    at_epochs,
    budget_values,
    make_plan,
    predict_total,
    recipe_from_profile,
    stage_seconds,
)
from cnnpipe.plan.text import to_text
from cnnpipe.train import pacing
from cnnpipe.train.budget import EVAL_BATCH, apply_budget, eval_batch, export_batch
from cnnpipe.train.schedule import (
    MIN_BATCH,
    SMALLEST_BATCH,
    batch_for_split,
    batch_for_steps,
    choose_batch,
    steps_per_run,
)
from conftest import ROOT, tiny_params, write_params

# Fashion-MNIST's split sizes and this machine's measured speeds (dvc.lock run, img/s).
N_TRAIN, N_VAL, N_TEST = 54_000, 6_000, 10_000


def recipes(slowdown: float = 1.0, auto: tuple[int, int] | None = None) -> list[Recipe]:
    """Baseline and optimized as the profile measured them here, `slowdown` times slower; `auto`:
    (train.min_epochs, train.max_epochs) of `train.epochs: auto` (None: 4 epochs)."""
    return [Recipe("baseline", 4, 64, 300 / slowdown, 1400 / slowdown, 35 * slowdown, auto_epochs=auto),
            Recipe("optimized", 4, 256, 445 / slowdown, 2500 / slowdown, 63 * slowdown, auto_epochs=auto)]


def test_a_run_that_fits_keeps_the_whole_split():
    plan = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes=60)
    assert plan["fraction"] == 1.0 and plan["images_per_epoch"] == N_TRAIN and plan["fits"]
    usual = {"baseline": EVAL_BATCH, "optimized": EVAL_BATCH}
    assert budget_values(plan) == {"fraction": 1.0, "images_per_epoch": None, "val_images": None,
                                   "parity_images": None,  # training sees no cap
                                   "eval_batch": usual, "export_batch": usual}


@pytest.mark.parametrize("slowdown", [1.0, 2.0, 4.0])  # machines of this kind differ by 4x
def test_over_budget_shrinks_every_variant_alike_until_it_fits(slowdown):
    plan = make_plan(recipes(slowdown), N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
    assert plan["predicted_total_s"] <= 20 * 60 < plan["predicted_total_unbudgeted_s"]
    assert plan["fraction"] in LADDER and plan["fraction"] < 1.0
    assert plan["images_per_epoch"] % 256 == 0  # whole batches of the largest global batch
    # The largest fitting step: the next larger one would not fit.
    larger = LADDER[LADDER.index(plan["fraction"]) - 1]
    assert predict_total(recipes(slowdown), larger, N_TRAIN, N_VAL, N_TEST)[2] > 20 * 60
    # Slower machines get less data per epoch, never more.
    if slowdown > 1:
        faster = make_plan(recipes(slowdown / 2), N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
        assert plan["fraction"] <= faster["fraction"]


def test_the_prediction_adds_up_stage_by_stage():
    images, stages, total = predict_total(recipes(), 0.5, N_TRAIN, N_VAL, N_TEST)
    assert images == 26_880  # 0.5 * 54,000 = 27,000 → 105 whole batches of 256
    assert set(stages) == {"train@baseline", "train@optimized", "evaluate@baseline", "evaluate@optimized",
                           "export@baseline", "export@optimized", "compare", "other stages", "DVC's own work"}
    assert total == pytest.approx(sum(stages.values()) + 35 + 63)
    train_only = 4 * images / 300
    assert stages["train@baseline"] > train_only  # validation and start-up are on top
    # the six other stages at a start-up each, DVC's work for every stage the run has (16)
    assert stages["other stages"] == pytest.approx(len(OTHER_STAGES) * STARTUP_S)
    assert stages["DVC's own work"] == pytest.approx(16 * DVC_STAGE_S)
    # what ran before the plan (prepare, measured) counts whole
    assert predict_total(recipes(), 0.5, N_TRAIN, N_VAL, N_TEST, spent_s=42.0)[2] == pytest.approx(total + 42)


def test_training_pays_its_warm_up_checkpoints_and_calibration():
    """A train stage is its epochs plus: the first step's warm-up, last.pt writes as paced (at most
    train/pacing.py's share of training) with the final last.pt and best.pt, and the temperature fit
    over the whole validation split."""
    assert CHECKPOINT_SHARE == pacing.CHECKPOINT_SHARE
    plain = Recipe("optimized", 10, 256, 400.0, 2000.0, 60.0, startup_s=5.0)
    images = 25_600
    base = stage_seconds(plain, images, 1000, 10_000, 10_000)["train@optimized"]
    assert base == pytest.approx(10 * (images / 400 + 1000 / 2000) + 5.0)
    fast_disk = replace(plain, warmup_s=3.0, checkpoint_s=1.0)
    got = stage_seconds(fast_disk, images, 1000, 10_000, 10_000, n_calibration=6000)["train@optimized"]
    assert got == pytest.approx(base + 3.0 + 9 * 1.0 + LAST_AND_BEST * 1.0 + 6000 / 2000)
    slow_disk = replace(plain, checkpoint_s=100.0)  # pacing skips writes beyond its share
    epochs_s = 10 * (images / 400 + 1000 / 2000)
    got = stage_seconds(slow_disk, images, 1000, 10_000, 10_000)["train@optimized"]
    assert got == pytest.approx(base + CHECKPOINT_SHARE * epochs_s + LAST_AND_BEST * 100.0)


def test_the_plan_counts_prepare_and_says_so():
    plan = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes=60, spent={"prepare": 30.0})
    without = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes=60)
    assert plan["spent_s"] == {"prepare": 30.0}
    assert plan["predicted_total_s"] == pytest.approx(without["predicted_total_s"] + 30.0)
    assert re.search(r"\| prepare \| 0\.5 min \(measured\) \|", to_text(plan))
    assert "| DVC's own work |" in to_text(plan)


def test_the_zen3_profile_fits_the_default_budget():
    """The speeds and profile times an AMD EPYC Zen 3 (2 cores, fp32: no bf16 instructions) measured
    on 2026-12-03 (metrics/plan/plan.json); its fresh-clone `bash scripts/repro.sh` took 18 min 46 s."""
    zen3 = [Recipe("baseline", 4, 64, 66.6, 270.5, 161.5, batch_size=64),
            Recipe("optimized", 4, 256, 125.3, 506.7, 346.1, batch_size=256, min_steps=300,
                   smaller_batch_speed={128: 0.877, 64: 0.817})]
    plan = make_plan(zen3, N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
    # Validation and the export check on 1,000 images each, the start-ups as measured, the other stages
    # and DVC's own work counted: twice the training images that the whole-split checks left (1/32 then).
    assert plan["fits"] and plan["fraction"] == 1 / 16 and plan["images_per_epoch"] == 3328
    assert plan["batch"] == {"baseline": 64, "optimized": 64}  # 304 steps at 64
    assert plan["predicted_total_unbudgeted_s"] > 90 * 60  # issue 9: 102 min without a budget


def test_hysteresis_keeps_the_previous_choice_near_a_boundary():
    """A budget that fits a larger ladder step, where the previous run's smaller step is predicted at
    80% of it (inside 75%..110%): the previous choice stays; far below the band it is dropped."""
    total = {f: predict_total(recipes(), f, N_TRAIN, N_VAL, N_TEST)[2] for f in LADDER}
    small = next(s for b, s in zip(LADDER, LADDER[1:]) if total[b] <= total[s] / 0.8)
    budget_minutes = total[small] / 0.8 / 60
    fresh = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes)
    assert fresh["fraction"] > small  # without a previous run, the larger step that fits
    kept = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes, previous={"fraction": small})
    assert kept["fraction"] == small and kept["reason"].startswith("kept the previous fraction")
    tiny = LADDER[-1]
    assert total[tiny] < 0.75 * budget_minutes * 60  # below the band: a fresh choice
    again = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes, previous={"fraction": tiny})
    assert again["fraction"] == fresh["fraction"]


def test_no_budget_and_hopeless_budgets_are_said_plainly():
    assert make_plan(recipes(8), N_TRAIN, N_VAL, N_TEST, budget_minutes=None)["fraction"] == 1.0
    hopeless = make_plan(recipes(50), N_TRAIN, N_VAL, N_TEST, budget_minutes=1)
    assert hopeless["fraction"] == LADDER[-1] and not hopeless["fits"] and "OVER budget" in hopeless["reason"]
    assert "OVER budget" in to_text(hopeless)


def test_the_plan_text_names_every_stage_and_the_choice():
    text = to_text(make_plan(recipes(4), N_TRAIN, N_VAL, N_TEST, budget_minutes=20))
    for name in ("profile@baseline", "train@baseline", "train@optimized", "evaluate@optimized", "whole run",
                 "Training images per epoch"):
        assert name in text


def test_the_budget_only_ever_lowers_images_per_epoch(tmp_path):
    cfg = resolve(load_params(write_params(tmp_path / "p.yaml", tiny_params())), "optimized")
    assert apply_budget(cfg, {}).train.images_per_epoch is None
    assert apply_budget(cfg, {"images_per_epoch": 512}).train.images_per_epoch == 512
    asked = cfg.with_train(images_per_epoch=256)
    assert apply_budget(asked, {"images_per_epoch": 512}).train.images_per_epoch == 256


def test_recipe_uses_the_tuned_speed_and_the_forward_share(tmp_path):
    cfg = resolve(load_params(write_params(tmp_path / "p.yaml", tiny_params())), "optimized")
    profile = {"throughput_img_s": 400.0, "tuned_speedup": 1.25, "fractions": {"forward": 0.2},
               "stage_time_s": 30.0}
    recipe = recipe_from_profile(cfg, profile)
    assert recipe.train_img_s == 500.0 and recipe.eval_img_s == pytest.approx(2500.0)
    assert recipe.global_batch == cfg.train.batch_size and recipe.profile_s == 30.0


def test_budget_param_is_validated(tmp_path):
    params = tiny_params()
    params["run"] = {"budget_minutes": 0}
    with pytest.raises(ParamsError, match=r"`run.budget_minutes` = 0"):
        load_params(write_params(tmp_path / "p.yaml", params))
    params["run"] = {"budget_minutes": None}
    assert run_config(load_params(write_params(tmp_path / "p.yaml", params))).budget_minutes is None
    params["train"]["images_per_epoch"] = 0
    with pytest.raises(ParamsError, match="train.images_per_epoch"):
        load_params(write_params(tmp_path / "p.yaml", params))


def test_the_shipped_params_have_a_budget():
    assert run_config(load_params(ROOT / "params.yaml")).budget_minutes == 20


def test_per_epoch_subset_is_fresh_each_epoch_and_sharded_exactly():
    sampler = ShardSampler(1000, 32, shuffle=True, drop_last=True, seed=3, per_epoch=256)
    assert len(sampler) == 8
    first = np.concatenate([b for b in sampler])
    sampler.set_epoch(1)
    second = np.concatenate([b for b in sampler])
    assert len(first) == len(set(first)) == 256 and len(second) == 256
    assert set(first) != set(second)  # a different random subset each epoch
    ranks = [ShardSampler(1000, 32, shuffle=True, drop_last=True, seed=3, rank=r, world_size=2, per_epoch=256)
             for r in range(2)]
    assert sorted(np.concatenate([np.concatenate(list(r)) for r in ranks])) == sorted(first)
    assert len(ShardSampler(1000, 32, shuffle=True, drop_last=True, per_epoch=5000)) == 1000 // 32


def test_cpu_report_matches_proc_cpuinfo():
    report = hardware.cpu_report()
    assert 1 <= report["usable_cores"] <= (os.cpu_count() or 1)
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    assert set(report["features"]) == flags & set(hardware.FEATURES)
    assert report["fast_bf16"] == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_min_steps_halves_the_batch_down_to_the_floor():
    # 4 epochs of 4,864 images: batch 256 gives 76 steps, 128 gives 152, 64 gives 304.
    assert steps_per_run(4864, 4, 256) == 76
    assert batch_for_steps(256, None, 4864, 4) == 256  # null: the batch is the params'
    assert batch_for_steps(256, 150, 4864, 4) == 128
    assert batch_for_steps(256, 300, 4864, 4) == 64
    assert batch_for_steps(256, 10_000, 4864, 4) == MIN_BATCH  # never below the floor
    assert batch_for_steps(32, 10_000, 4864, 4) == 32  # nor above the params' batch
    assert batch_for_steps(256, 300, 54_000, 4) == 256  # a long run keeps its batch
    # Processes and accumulation multiply the global batch: fewer steps, so halved further.
    assert batch_for_steps(256, 150, 4864, 4, world_size=2) == 64
    assert steps_per_run(4864, 4, 64, world_size=2, accum_steps=2) == 4 * (2432 // 64 // 2)


def test_a_split_smaller_than_one_batch_halves_it_only_until_an_epoch_fills_one_step():
    # 45 training photos (a small folder): batch 64, the floor of min_steps, takes no step at all.
    assert steps_per_run(45, 4, MIN_BATCH) == 0
    assert batch_for_split(256, 45) == batch_for_steps(256, 300, 45, 4) == 32  # one step an epoch, not more
    assert batch_for_steps(64, None, 45, 4) == 32  # the baseline's fixed batch too: else no step
    assert steps_per_run(45, 4, batch_for_steps(256, 300, 45, 4)) == 4
    assert batch_for_split(256, 45, world_size=2) == 16  # 22 images per process
    assert batch_for_split(256, 45, accum_steps=2) == 16  # a step of two micro-batches
    assert batch_for_split(256, 5) == SMALLEST_BATCH  # the floor: the loader names the batch that does not fit
    assert batch_for_split(256, 300) == 256 and batch_for_split(64, 64) == 64  # an epoch of one step or more: kept
    assert batch_for_steps(256, None, 300, 4) == 256 and batch_for_steps(256, 300, 100, 4) == MIN_BATCH


def test_a_halved_batch_names_the_rule_that_halved_it():
    """train.json's `batch_note` comes from the choice itself: the small epoch where it alone halves the
    batch that far (with min_steps set or not), min_steps where the batch went lower than the split asks."""
    assert choose_batch(256, 300, 54_000, 4) == (256, "")
    assert choose_batch(256, 300, 4864, 4) == (64, "train.batch_size 256 halved to reach train.min_steps=300")
    small_epoch = "train.batch_size 256 halved to 128: an epoch holds fewer images than one batch"
    assert choose_batch(256, 4, 200, 4) == (128, small_epoch)  # 4 steps at 128 meet min_steps: the epoch halved it
    assert choose_batch(256, None, 200, 4) == (128, small_epoch)
    assert choose_batch(256, 300, 200, 4)[0] == 64 and "min_steps=300" in choose_batch(256, 300, 200, 4)[1]
    assert choose_batch(256, 300, 45, 4) == (32, small_epoch.replace("128", "32"))


def test_the_plan_predicts_the_smaller_batch_at_its_measured_speed():
    slow = Recipe("optimized", 4, 256, 200.0, 1000.0, 60.0, batch_size=256, min_steps=300,
                  smaller_batch_speed={128: 0.9, 64: 0.75})
    assert slow.batch_for(54_000) == 256 and slow.train_speed(54_000) == 200.0
    assert slow.batch_for(4864) == 64 and slow.train_speed(4864) == 150.0
    plain = Recipe("optimized", 4, 256, 200.0, 1000.0, 60.0, batch_size=256)
    base = Recipe("baseline", 4, 64, 150.0, 800.0, 30.0, batch_size=64)
    full = make_plan([base, slow], N_TRAIN, N_VAL, N_TEST, budget_minutes=None)
    assert full["batch"] == {"baseline": 64, "optimized": 256}
    tight = make_plan([base, slow], N_TRAIN, N_VAL, N_TEST, budget_minutes=8)
    assert tight["batch"]["optimized"] < 256 and tight["batch"]["baseline"] == 64
    # The slower small batch costs time the plan accounts for.
    same = predict_total([base, plain], tight["fraction"], N_TRAIN, N_VAL, N_TEST)[2]
    assert tight["predicted_total_s"] > same
    assert "train.min_steps" in to_text(tight) and "at batch 64: 0.75x" in to_text(tight)


def test_recipe_reads_the_smaller_batch_speeds_from_the_profile(tmp_path):
    params = tiny_params()
    params["train"]["min_steps"] = 100
    cfg = resolve(load_params(write_params(tmp_path / "p.yaml", params)), "optimized")
    profile = {"throughput_img_s": 400.0, "fractions": {"forward": 0.2}, "stage_time_s": 30.0,
               "smaller_batches": [{"change": {"batch_size": 64}, "speedup": 0.8, "speed_vs_tuned": 0.7}]}
    recipe = recipe_from_profile(cfg, profile)
    assert recipe.min_steps == 100 and recipe.smaller_batch_speed == {64: 0.7}  # vs the tuned recipe
    params["train"]["min_steps"] = 0
    with pytest.raises(ParamsError, match="train.min_steps"):
        load_params(write_params(tmp_path / "p.yaml", params))


def test_a_binding_budget_also_shrinks_validation_and_the_export_check():
    plan = make_plan(recipes(2.0), N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
    values = budget_values(plan)
    assert values["val_images"] == VAL_UNDER_BUDGET and values["parity_images"] == PARITY_UNDER_BUDGET
    whole = stage_seconds(recipes(2.0)[1], 6_656, N_VAL, N_TEST, N_TEST)
    cut = stage_seconds(recipes(2.0)[1], 6_656, VAL_UNDER_BUDGET, N_TEST, PARITY_UNDER_BUDGET)
    assert cut["train@optimized"] < whole["train@optimized"] and cut["export@optimized"] < whole["export@optimized"]
    assert cut["evaluate@optimized"] == whole["evaluate@optimized"]  # the test split stays whole
    cfg = resolve(load_params(ROOT / "params.yaml"), "optimized")
    capped = apply_budget(cfg, values)
    assert capped.train.val_images == VAL_UNDER_BUDGET and capped.train.images_per_epoch == values["images_per_epoch"]
    assert apply_budget(cfg.with_train(val_images=500), values).train.val_images == 500  # never raised


def test_the_profile_s_measured_inference_speed_is_what_the_plan_uses():
    cfg = resolve(load_params(ROOT / "params.yaml"), "optimized")
    profile = {"throughput_img_s": 100.0, "tuned_speedup": 1.2, "fractions": {"forward": 0.3}}
    assert recipe_from_profile(cfg, profile).eval_img_s == pytest.approx(120.0 / 0.3)  # estimated
    measured = recipe_from_profile(cfg, {**profile, "inference_img_s": 500.0})
    assert measured.eval_img_s == pytest.approx(600.0) and measured.train_img_s == pytest.approx(120.0)


def test_validation_and_evaluate_run_at_the_batch_the_profile_timed_inference_at():
    """A box with room for batch 16 only: the plan predicts evaluate's six timed passes at 16, budget.yaml
    carries it per variant, and train and evaluate read it from there (256 where no plan names one)."""
    cfg = resolve(load_params(ROOT / "params.yaml"), "optimized")
    profile = {"throughput_img_s": 100.0, "inference_img_s": 50.0, "inference_batch": 16}
    small = recipe_from_profile(cfg, profile)
    assert small.eval_batch == 16 and recipe_from_profile(cfg, {"throughput_img_s": 100.0}).eval_batch == EVAL_BATCH
    at_256 = replace(small, eval_batch=EVAL_BATCH)
    seconds = stage_seconds(small, 1000, 200, 300, 300)["evaluate@optimized"]
    assert seconds == pytest.approx(stage_seconds(at_256, 1000, 200, 300, 300)["evaluate@optimized"]
                                    - 6 * (EVAL_BATCH - 16) / 50.0)
    plan = make_plan([replace(recipes()[0], eval_batch=32), small], N_TRAIN, N_VAL, N_TEST, budget_minutes=60)
    assert budget_values(plan)["eval_batch"] == {"baseline": 32, "optimized": 16}
    assert budget_values(plan)["export_batch"] == {"baseline": EVAL_BATCH, "optimized": EVAL_BATCH}
    timed_export = recipe_from_profile(cfg, {**profile, "export_img_s": 20.0, "export_batch": 64})
    assert export_batch(budget_values(make_plan([timed_export], N_TRAIN, N_VAL, N_TEST, 60)), "optimized") == 64
    assert "optimized 100 img/s training, ~50 img/s inference at batch 16" in to_text(plan)
    assert eval_batch(budget_values(plan), "optimized") == 16 and eval_batch({}, "optimized") == EVAL_BATCH
    with pytest.raises(ValueError, match=r"budget.yaml: `eval_batch.optimized` = 0 .*rerun `dvc repro plan`"):
        eval_batch({"eval_batch": {"optimized": 0}}, "optimized")
    with pytest.raises(ValueError, match=r"`eval_batch` = \[16\] is not a mapping"):
        eval_batch({"eval_batch": [16]}, "optimized")
    with pytest.raises(ValueError, match=r"`export_batch.optimized` = True is not a batch size"):
        export_batch({"export_batch": {"optimized": True}}, "optimized")


def test_the_batches_change_with_the_plan_s_choice_not_with_every_re_measured_profile():
    """A profile re-measured in a larger box (a new profile.budget_share) times inference at 256 where it
    timed 32: while the plan keeps its fraction and epochs, budget.yaml keeps 32, so nothing retrains;
    a new choice (it retrains anyway) takes the profile's batch."""
    first = make_plan([replace(r, eval_batch=32, export_batch=64) for r in recipes()], N_TRAIN, N_VAL, N_TEST, 20)
    again = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes=20, previous=budget_values(first))
    assert again["fraction"] == first["fraction"] and budget_values(again) == budget_values(first)
    assert again["recipes"][0]["eval_batch"] == 32  # what runs is what evaluate's bench is predicted at
    longer = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes=60, previous=budget_values(first))
    assert longer["fraction"] != first["fraction"]
    assert budget_values(longer)["eval_batch"] == budget_values(longer)["export_batch"] == {
        "baseline": EVAL_BATCH, "optimized": EVAL_BATCH}


def test_the_plan_trains_at_the_speed_the_trials_measured_throughout_the_profile():
    """The first timed window can catch a fast minute; the trials' current-setting blocks span the profile."""
    cfg = resolve(load_params(ROOT / "params.yaml"), "optimized")
    profile = {"throughput_img_s": 331.0, "inference_img_s": 1400.0, "tuned_speedup": 1.0,
               "trials": [{"before_img_s": v} for v in (269.0, 300.0, 278.0, 236.0, 257.0, 0.0)],
               "combined_trial": None, "smaller_batches": [{"before_img_s": 248.0}, {"before_img_s": 246.0}]}
    assert recipe_from_profile(cfg, profile).train_img_s == pytest.approx(257.0)
    # Trials at a halved batch time that batch, not the base's: the smaller batches' blocks of the base count.
    at_half = {**profile, "batch_size": 64, "trial_batch": 32}
    assert recipe_from_profile(cfg, at_half).train_img_s == pytest.approx(247.0)
    assert recipe_from_profile(cfg, {**at_half, "smaller_batches": []}).train_img_s == pytest.approx(331.0)


# --------------------------------------------------------------------------- train.epochs: auto
def photo_recipes(auto: tuple[int, int] = (4, 100), patience: int | None = None) -> list[Recipe]:
    """Both recipes on 64 px photos on a slow 2-core CPU: ~3x slower per image than at 32 px (the
    ResNet-50 speeds bench/throughput.py measured at 64 px, taken lower), profiles of 1-2 minutes."""
    return [Recipe("baseline", 4, 64, 80.0, 400.0, 70.0, batch_size=64, auto_epochs=auto, patience=patience),
            Recipe("optimized", 4, 256, 120.0, 600.0, 90.0, batch_size=256, min_steps=300,
                   smaller_batch_speed={128: 0.9, 64: 0.8}, auto_epochs=auto, patience=patience)]


SMALL = (212, 24, 32)  # a two-class photo set: training, validation and test images


@pytest.mark.parametrize("ceiling", [100, 1000])
def test_auto_gives_a_small_catalog_its_budget_s_worth_of_epochs(ceiling):
    """212 training photos and 20 minutes: 4 epochs would train for seconds. `auto` trains the most
    epochs whose whole run is predicted within the budget (or the ceiling), both recipes alike."""
    plan = make_plan(photo_recipes((4, ceiling)), *SMALL, budget_minutes=20)
    epochs = plan["epochs_auto"]
    assert epochs > 4 and plan["epochs"] == {"baseline": epochs, "optimized": epochs}
    assert plan["fraction"] == 1.0 and plan["images_per_epoch"] == 212 and plan["fits"]
    assert plan["predicted_total_s"] <= 20 * 60
    four = make_plan([replace(r, auto_epochs=None) for r in photo_recipes()], *SMALL, budget_minutes=20)
    assert four["epochs"] == {"baseline": 4, "optimized": 4} and four["predicted_total_s"] < 6 * 60
    assert plan["predicted_s"]["train@optimized"] > 10 * four["predicted_s"]["train@optimized"]
    if epochs < ceiling:  # the budget binds: one more epoch would not fit
        assert predict_total(at_epochs(photo_recipes((4, ceiling)), epochs + 1), 1.0, *SMALL)[2] > 20 * 60
        assert "the most epochs of the whole split that fit the budget" in plan["reason"]
    else:
        assert ceiling == 100 and "train.max_epochs (100)" in plan["reason"]
    # The batch follows the run's length: 212 images are one step at batch 128 (three at 64), so 128
    # would need 300 epochs for train.min_steps; the plan predicts each count at its own batch.
    assert plan["batch"] == {"baseline": 64, "optimized": 64}
    assert budget_values(plan)["epochs"] == epochs
    assert f"Epochs: **{epochs}** (train.epochs: auto, 4 to {ceiling})" in to_text(plan)


@pytest.mark.parametrize("slowdown", [1.0, 2.0, 4.0])
def test_auto_on_the_default_split_trains_the_floor_and_shrinks_images_as_before(slowdown):
    """Fashion-MNIST's 54,000 images on 2 cores: even the floor (4 epochs) of the whole split is over
    20 minutes, so `auto` trains 4 epochs on the same share of the split a fixed 4 gets."""
    fixed = make_plan(recipes(slowdown), N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
    auto = make_plan(recipes(slowdown, auto=(4, 100)), N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
    assert auto["epochs_auto"] == 4 and auto["epochs"] == {"baseline": 4, "optimized": 4}
    for key in ("fraction", "images_per_epoch", "predicted_total_s", "batch", "val_images", "parity_images"):
        assert auto[key] == fixed[key], key
    assert auto["fraction"] < 1.0 and auto["reason"].startswith("train.min_epochs (4), the floor of `auto`")
    assert budget_values(auto) == {**budget_values(fixed), "epochs": 4}


def test_auto_on_the_zen3_profile_picks_the_floor_and_the_same_fraction():
    """The slowest measured machine (test_the_zen3_profile_fits_the_default_budget) under `auto`."""
    zen3 = [Recipe("baseline", 4, 64, 66.6, 270.5, 161.5, batch_size=64, auto_epochs=(4, 100)),
            Recipe("optimized", 4, 256, 125.3, 506.7, 346.1, batch_size=256, min_steps=300,
                   smaller_batch_speed={128: 0.877, 64: 0.817}, auto_epochs=(4, 100))]
    plan = make_plan(zen3, N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
    assert plan["epochs_auto"] == 4 and plan["fraction"] == 1 / 16 and plan["images_per_epoch"] == 3328
    assert plan["fits"] and plan["batch"] == {"baseline": 64, "optimized": 64}


def test_auto_keeps_the_previous_count_while_it_still_fits():
    """Speeds drift ~10%: a re-measured plan keeps last run's epochs (and so its unfinished run's
    resume) while their prediction stays within 75%..110% of the budget; outside it, a fresh choice."""
    first = make_plan(photo_recipes((4, 1000)), *SMALL, budget_minutes=20)
    slower = [replace(r, train_img_s=r.train_img_s * 0.93) for r in photo_recipes((4, 1000))]
    fresh = make_plan(slower, *SMALL, budget_minutes=20)
    assert fresh["epochs_auto"] < first["epochs_auto"]  # without the previous choice: fewer epochs fit
    kept = make_plan(slower, *SMALL, budget_minutes=20, previous=budget_values(first))
    assert kept["epochs_auto"] == first["epochs_auto"] and kept["reason"].startswith("kept the previous choice")
    assert 20 * 60 < kept["predicted_total_s"] <= KEEP_BAND[1] * 20 * 60 and kept["fits"]
    much_slower = [replace(r, train_img_s=r.train_img_s * 0.7) for r in photo_recipes((4, 1000))]
    dropped = make_plan(much_slower, *SMALL, budget_minutes=20, previous=budget_values(first))
    assert dropped["epochs_auto"] < first["epochs_auto"] and dropped["predicted_total_s"] <= 20 * 60
    outside = make_plan(slower, *SMALL, budget_minutes=20, previous={**budget_values(first), "epochs": 2000})
    assert outside["epochs_auto"] == fresh["epochs_auto"]  # a count beyond train.max_epochs is not kept


def test_a_catalog_smaller_than_a_batch_is_never_planned_more_images_than_it_has():
    hopeless = make_plan(photo_recipes(), *SMALL, budget_minutes=1)
    assert hopeless["epochs_auto"] == 4 and not hopeless["fits"] and hopeless["images_per_epoch"] == 212


def test_auto_without_a_budget_and_beside_a_fixed_count():
    plan = make_plan(photo_recipes((4, 30)), *SMALL, budget_minutes=None)
    assert plan["epochs_auto"] == 30 and plan["fraction"] == 1.0 and "train.max_epochs (30)" in plan["reason"]
    # A variant with a number keeps it; the `auto` ones share one count, fitted around it.
    mixed = [replace(photo_recipes()[0], epochs=8, auto_epochs=None), photo_recipes((4, 1000))[1]]
    plan = make_plan(mixed, *SMALL, budget_minutes=20)
    assert plan["epochs"]["baseline"] == 8 and plan["epochs"]["optimized"] == plan["epochs_auto"] > 8
    assert "baseline 8 (train.epochs)" in to_text(plan)
    with pytest.raises(ValueError, match="train.min_epochs and train.max_epochs"):
        make_plan([replace(photo_recipes()[0], auto_epochs=(10, 20)), photo_recipes((4, 8))[1]], *SMALL, 20)
    fixed = make_plan(recipes(), N_TRAIN, N_VAL, N_TEST, budget_minutes=20)
    assert "epochs" not in budget_values(fixed) and fixed["epochs_auto"] is None  # budget.yaml as before
    assert "Epochs: 4 (train.epochs)." in to_text(fixed)


def test_with_early_stop_the_prediction_is_an_upper_bound():
    plan = make_plan(photo_recipes(patience=5), *SMALL, budget_minutes=20)
    assert plan["upper_bound"] and plan["early_stop"] == {"baseline": 5, "optimized": 5}
    text = to_text(plan)
    assert "(at most: early stop)" in text and "upper bounds" in text and "optimized 5" in text
    assert not make_plan(photo_recipes(), *SMALL, budget_minutes=20)["upper_bound"]


def test_the_budget_sets_the_epochs_of_auto_only(tmp_path):
    params = tiny_params(epochs="auto", min_epochs=2, max_epochs=50, patience=3)
    cfg = resolve(load_params(write_params(tmp_path / "p.yaml", params)), "optimized")
    assert cfg.train.epochs == "auto" and cfg.train.epoch_count == 2 and cfg.train.patience == 3
    assert apply_budget(cfg, {"epochs": 17, "fraction": 1.0}).train.epochs == 17
    assert apply_budget(cfg, {"fraction": 1.0}).train.epochs == "auto"  # fit then trains the floor
    fixed = cfg.with_train(epochs=6)
    assert apply_budget(fixed, {"epochs": 17}).train.epochs == 6  # a number in the params is kept
    with pytest.raises(ValueError, match="budget.yaml: `epochs`"):
        apply_budget(cfg, {"epochs": "many"})
    recipe = recipe_from_profile(cfg, {"throughput_img_s": 400.0, "inference_img_s": 900.0})
    assert recipe.epochs == 2 and recipe.auto_epochs == (2, 50) and recipe.patience == 3


@pytest.mark.parametrize("key, value, fragment", [
    ("epochs", 0, "an integer >= 1 or `auto`"),
    ("epochs", "some", "an integer or auto"),
    ("max_epochs", 3, "`train.max_epochs` = 3 is invalid; allowed: an integer >= train.min_epochs (4)"),
    ("min_epochs", 0, "`train.min_epochs` = 0"),
    ("patience", 0, "`train.patience` = 0"),
])
def test_epoch_params_are_validated(tmp_path, key, value, fragment):
    params = tiny_params()
    params["train"].update({"min_epochs": 4, key: value})
    with pytest.raises(ParamsError, match=re.escape(fragment)):
        load_params(write_params(tmp_path / "p.yaml", params))


def test_the_shipped_params_train_auto_epochs_with_a_floor_of_four():
    """The default run trains the floor on Fashion-MNIST (test_auto_on_the_default_split_...), own
    photos and the weekly loop get the epochs their budget holds."""
    for variant in ("baseline", "optimized"):
        t = resolve(load_params(ROOT / "params.yaml"), variant).train
        assert (t.epochs, t.min_epochs, t.patience) == ("auto", 4, None)
