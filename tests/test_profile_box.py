"""The profile's time box holds at any step time: every part sized by a measured step, nothing by counts."""

import time

import pytest

import cnnpipe.profile.measure as measure
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.box import (
    BASE_SHARE,
    MIN_MEASURE_BATCH,
    TimeBox,
    full_trial_s,
    inference_plan,
    measure_batch,
    smaller_rounds,
    steps_within,
    trace_steps,
    trial_batch,
)
from cnnpipe.profile.run import profile_variant, summary
from cnnpipe.train.distributed import DistInfo
from conftest import tiny_params, write_params

SLEEP_PER_IMAGE = 0.008
"""A step that sleeps this long per image: 2 s at batch 256, like ResNet-50 at 128 px on two cores."""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def slow_steps(monkeypatch):
    """Every training step and forward pass the profile runs sleeps in proportion to its images."""
    step, forward = measure.micro_step, measure.forward_times

    def slow_step(ctx, images, labels, *args, **kwargs):
        time.sleep(SLEEP_PER_IMAGE * len(labels))
        return step(ctx, images, labels, *args, **kwargs)

    def slow_forward(model, in_chans, image_size, channels_last, amp, device, batch=256, calls=5):
        times = forward(model, in_chans, image_size, channels_last, amp, device, batch=batch, calls=calls)
        time.sleep(SLEEP_PER_IMAGE / 3 * batch * (calls + 1))
        return [t + SLEEP_PER_IMAGE / 3 * batch for t in times]

    monkeypatch.setattr(measure, "micro_step", slow_step)
    monkeypatch.setattr(measure, "forward_times", slow_forward)


def config(tmp_path, **train):
    params = tiny_params(**train)
    params["profile"].update(wait=1, warmup=2, active=4, trial_steps=2, trial_rounds=3)  # the shipped counts
    return resolve(load_params(write_params(tmp_path / "params.yaml", params)), "optimized")


@pytest.mark.parametrize("box_s", [25.0, 60.0])
def test_a_slow_step_keeps_the_profile_inside_its_box(tmp_path, prepared, slow_steps, box_s):
    """A 2 s step at the recipe's batch: the shipped counts alone (7 base steps, 7 traced, three
    rounds for each smaller batch) would take minutes. Every part is still there, measured at a
    batch that fits or marked predicted, and the stage ends inside its box."""
    cfg = config(tmp_path, batch_size=256, min_steps=100_000, channels_last="auto", amp="auto")
    t0 = time.monotonic()
    result = profile_variant(cfg, DistInfo(), prepared, tmp_path / "logs", True, box_s,
                             box=TimeBox(t0 + box_s))
    took = time.monotonic() - t0
    print(f"box {box_s:.0f} s: took {took:.1f} s at batch {result['batch_size']}")
    assert took <= box_s * 1.05, f"the profile took {took:.1f} s of a {box_s:.0f} s box"
    assert result["recipe_batch_size"] == 256
    if box_s < 30:  # three 2 s steps are more than the base's share: measured at a batch where they fit
        assert result["batch_size"] < 256 and "measured at batch" in summary(result)
    assert result["steps_timed"] >= 2 and result["step_time_median_s"] > SLEEP_PER_IMAGE * result["batch_size"]
    assert result["trace_steps"]["active"] >= 1 and list((tmp_path / "logs").glob("*.pt.trace.json*"))
    assert result["inference_img_s"] > 0 and result["export_img_s"] > 0 and result["inference_batch"] <= 256
    sizes = [e["change"]["batch_size"] for e in result["smaller_batches"]]
    assert sizes == [128, 64]  # every batch min_steps may pick: measured, or predicted and marked
    for entry in result["smaller_batches"]:
        measured_here = entry["change"]["batch_size"] == result["batch_size"]  # the base itself
        assert entry["speed_vs_tuned"] > 0 and (entry["predicted"] or measured_here or entry["before_img_s"] > 0)


def test_the_box_picks_the_largest_batch_whose_base_fits():
    per_image = 0.01  # 2.56 s a step at 256
    assert measure_batch(per_image, 256, None) == 256  # no box: the recipe's batch
    assert measure_batch(per_image, 256, 1000.0) == 256  # 7.7 s of a 150 s share
    assert measure_batch(per_image, 256, 60.0) == 256  # 3 steps: 7.7 s of a 9 s share
    assert measure_batch(per_image, 256, 30.0) == 128  # ... of a 4.5 s share: 3.8 s at 128
    assert 3 * per_image * measure_batch(per_image, 256, 30.0) <= BASE_SHARE * 30.0
    assert measure_batch(per_image, 256, 1.0) == MIN_MEASURE_BATCH  # never below the floor
    assert measure_batch(per_image, 8, 1.0) == 8  # nor above the recipe's own
    assert steps_within(None, 1.0, 6, 2) == 6 and steps_within(3.0, 1.0, 6, 2) == 3
    assert steps_within(0.5, 1.0, 6, 2) == 2


def test_smaller_batches_get_the_rounds_their_share_holds_and_only_those_are_reserved():
    # batch 256 measured at 10 ms an image: a round against 128 is 3 x (2.56 + 1.28) = 11.5 s
    plan, cost = smaller_rounds([128, 64], 256, 60.0, 2, 0.01, 1.0, 3)
    assert plan == {128: 2, 64: 3} and cost == pytest.approx(2 * 1.0 + 2 * 11.52 + 3 * 9.6)
    plan, cost = smaller_rounds([128, 64], 256, 10.0, 2, 0.01, 1.0, 3)
    assert plan == {128: 0, 64: 0} and cost == 0.0  # predicted: nothing to reserve for them
    plan, _ = smaller_rounds([128, 64], 64, 60.0, 2, 0.01, 1.0, 3)
    assert plan == {128: 3}  # the measured batch is the base itself
    assert smaller_rounds([128, 64], 256, None, 2, 0.01, 1.0, 3) == ({128: 3, 64: 3}, 0.0)


def test_trials_run_at_a_smaller_batch_only_where_not_one_fits_at_the_measured_one():
    # 30 ms an image (ResNet-50 at 128 px on two cores), 2 s to build a setup, three rounds
    assert trial_batch(0.03, 128, None, 2.0, 3, 2) == 128  # no box: the measured batch
    assert trial_batch(0.03, 128, 100.0, 2.0, 3, 2) == 128  # one full trial (71 s) fits
    assert trial_batch(0.03, 128, 30.0, 2.0, 3, 2) == 32  # 71 s at 128, 37 s at 64, 19 s at 32
    assert full_trial_s(0.03, 32, 2.0, 3, 2) <= 30.0 < full_trial_s(0.03, 64, 2.0, 3, 2)
    assert trial_batch(0.03, 128, 1.0, 2.0, 3, 2) == MIN_MEASURE_BATCH  # never below the floor


def test_the_trace_and_inference_shrink_with_their_share(tmp_path):
    p = config(tmp_path).profile
    assert trace_steps(p, 1.0, None) == trace_steps(p, 0.01, 100.0)  # the `profile:` schedule when it fits
    short = trace_steps(p, 1.0, 3.0)
    assert short.active >= 1 and short.warmup >= 1 and short.total * 1.0 <= 3.0
    assert trace_steps(p, 10.0, 1.0).total == 2  # one warm-up and one recorded step at the least
    assert inference_plan(0.001, None) == inference_plan(0.0001, 100.0)
    small = inference_plan(0.03, 2.0)
    assert small.batch < 256 and small.calls >= 1
