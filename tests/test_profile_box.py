"""The profile's time box holds at any step time: every part sized by a measured step, nothing by counts."""

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

import cnnpipe.profile.measure as measure
import cnnpipe.profile.run as run
from cnnpipe.malloc import KernelTime
from cnnpipe.params import load_params, resolve
from cnnpipe.profile.box import (
    BASE_SHARE,
    MIN_BASE_BATCH,
    MIN_MEASURE_BATCH,
    TRACE_SHARE,
    BoxPlan,
    TimeBox,
    full_trial_s,
    inference_plan,
    inference_s,
    measure_batch,
    smaller_rounds,
    steps_within,
    trace_steps,
    trial_batch,
)
from cnnpipe.profile.measure import Fp32Timing
from cnnpipe.profile.peaks import StepCount
from cnnpipe.profile.roofline import Peaks
from cnnpipe.profile.run import profile_variant, summary
from cnnpipe.profile.trials import Trial, TrialContext
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.schedule import MIN_BATCH
from conftest import tiny_params, write_params

SLEEP_PER_IMAGE = 0.008
"""A step that sleeps this long per image: 2 s at batch 256, like ResNet-50 at 128 px on two cores."""


pytestmark = pytest.mark.usefixtures("one_thread")


class FakeClock:
    """A clock that only the fake steps move (plus a microsecond a read, so every timed span is
    positive): the profile's box is judged on it, whatever the CPU's speed or load."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        self.t += 1e-6
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    """`time.perf_counter` and `time.monotonic`, what the profile times its steps and its box with,
    on a `FakeClock` for this test."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock.now)
    monkeypatch.setattr(time, "monotonic", clock.now)
    return clock


@pytest.fixture
def slow_steps(monkeypatch, fake_clock):
    """Every training step and forward pass the profile runs takes time in proportion to its
    images, on the fake clock."""
    step, forward = measure.micro_step, measure.forward_times

    def slow_step(ctx, images, labels, *args, **kwargs):
        fake_clock.sleep(SLEEP_PER_IMAGE * len(labels))
        return step(ctx, images, labels, *args, **kwargs)

    def slow_forward(model, in_chans, image_size, channels_last, amp, device, batch=256, calls=5):
        times = forward(model, in_chans, image_size, channels_last, amp, device, batch=batch, calls=calls)
        fake_clock.sleep(SLEEP_PER_IMAGE / 3 * batch * (calls + 1))
        return [t + SLEEP_PER_IMAGE / 3 * batch for t in times]

    monkeypatch.setattr(measure, "micro_step", slow_step)
    monkeypatch.setattr(measure, "forward_times", slow_forward)
    return fake_clock


def config(tmp_path, **train):
    params = tiny_params(**train)
    params["profile"].update(wait=1, warmup=2, active=4, trial_steps=2, trial_rounds=3)  # the shipped counts
    return resolve(load_params(write_params(tmp_path / "params.yaml", params)), "optimized")


@pytest.mark.parametrize("box_s", [25.0, 60.0])
def test_a_slow_step_keeps_the_profile_inside_its_box(tmp_path, prepared, slow_steps, box_s):
    """A 2 s step at the recipe's batch: the shipped counts alone (7 base steps, 7 traced, three
    rounds for each smaller batch) would take minutes. Every part is still there, measured at a
    batch that fits or marked predicted, and the stage ends inside its box (on the fake clock that
    only the slow steps move: the real model's steps take no time on it)."""
    cfg = config(tmp_path, batch_size=256, min_steps=100_000, channels_last="auto", amp="auto")
    t0 = slow_steps.now()
    result = profile_variant(cfg, DistInfo(), prepared, tmp_path / "logs", True, box_s,
                             box=TimeBox(t0 + box_s, now=slow_steps.now))
    took = slow_steps.now() - t0
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
    # Never below the smallest batch training runs at (`train.min_steps` halves to 64), even where
    # three steps there overrun the box: the plan predicts training from this batch's images/s.
    assert measure_batch(per_image, 256, 1.0) == MIN_BASE_BATCH == MIN_BATCH
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


def test_the_plan_sizes_each_part_from_what_the_box_has_left_when_it_is_reached(tmp_path):
    """`BoxPlan` on a fake clock: 10 ms an image, a 100 s box, 1 s to build a setup."""
    p = config(tmp_path).profile  # the shipped counts: 4 traced steps, 3 rounds of 2 steps
    now = [40.0]
    box = TimeBox(100.0, now=lambda: now[0])
    plan = BoxPlan.after_probe(box, p, 256, 1, probe_s=0.01, setup_s=1.0)
    # 60 s left: three 2.56 s steps fit the base's 9 s share at the recipe's batch
    assert (plan.left, plan.batch, plan.too_small) == (60.0, 256, False)
    assert plan.share(TRACE_SHARE) == pytest.approx(7.2) and plan.trace(2.56).total == 2
    assert plan.base_steps() == 2  # 9 s less the warm-up step's 2.56 s: two steps, not the counts' six
    now[0] += 3.0  # (a rebuild's 3 s come off the base's share: still the two it never goes under)
    assert plan.base_steps() == 2
    # 8% of 60 s (4.8 s): three timed calls at 256 and the untimed one take 3.4 s
    inference = plan.inference(0.01, 256)
    assert (inference.batch, inference.calls) == (256, 3) and inference_s(inference, 0.01) == pytest.approx(3.41, 0.01)
    assert plan.inference(0.02, 256).calls == 1  # (twice as slow: 6.8 s, 5.1 s with two calls, 3.4 s with one)
    now[0] = 60.0  # the base, the trace and the roofline took 20 s: 40 s left
    tail_s = inference_s(inference, 0.01) + 4.0  # and the export's fp32 timing, sized by a call of its own
    trials = plan.trials(step_s=2.56, per_image_s=0.01, batches=[128, 64], training_s=1000.0, tail_s=tail_s)
    # The smaller batches' 15 s hold no round (11.5 s against 128 and 9.6 s against 64, after a 1 s
    # build): predicted, nothing reserved. The window: 40 s less the inference timings that follow
    # the trials (3.4 s and 4 s) and the 6 s margin. One full trial at 256 takes 47 s: the trials
    # run at 128 (24 s).
    assert trials.rounds_for == {128: 0, 64: 0}
    assert trials.clock.window_s == pytest.approx(40.0 - 4 * 256 * 0.01 / 3 - 4.0 - 6.0)
    assert trials.batch == 128 and trials.clock.trial_s == pytest.approx(1.0 + 3 * 3 * 2 * 1.28)
    assert trials.block == 2 and plan.needed_s(100.0) is None
    # Without a box: the recipe's batch and the `profile:` counts, no window.
    free = BoxPlan.after_probe(TimeBox(None), p, 256, 1, probe_s=0.01, setup_s=1.0)
    assert (free.batch, free.base_steps(), free.trace(2.56).total) == (256, 6, 7)
    assert free.trials(2.56, 0.01, [128], 1000.0, 0.0).clock.window_s is None


def test_a_box_too_small_at_any_batch_says_the_box_it_would_need(tmp_path):
    p = config(tmp_path).profile
    plan = BoxPlan.after_probe(TimeBox(100.0, now=lambda: 99.0), p, 256, 1, probe_s=0.01, setup_s=1.0)
    # 1 s left: three steps at the floor of 64 (1.92 s) exceed the base's 0.15 s share
    assert plan.batch == MIN_BASE_BATCH and plan.too_small
    assert plan.needed_s(100.0) == pytest.approx(99.0 + 3 * 0.01 * 64 / BASE_SHARE)
    assert plan.needed_s(None) is None


def test_the_trials_and_the_smaller_batches_each_run_against_their_own_base(tmp_path, monkeypatch):
    """profile_variant's wiring, every measurement faked on a fake clock (12 ms an image, a 60 s box):
    the base is measured at 128, the trials at 64 against a base built there (`ctx.at`), the
    smaller batches against the measured base at 128, and the inference timed after them all."""
    cfg = config(tmp_path, batch_size=256, min_steps=100_000, channels_last="auto")
    now, seen = [0.0], {}

    def fake_setup(c, info, prepared):
        now[0] += 1.0
        return SimpleNamespace(cfg=c, ctx=SimpleNamespace(amp=c.train.amp), images_per_step=c.train.batch_size,
                               steps_per_epoch=600 // c.train.batch_size)

    def timed(s, warmup, steps):
        now[0] += (warmup + steps) * 0.012 * s.images_per_step
        return [0.012 * s.images_per_step] * steps, {"forward": 1.0}, 1.0, KernelTime(0, 0.0, 1.0)

    def first_step(s):
        now[0] += 0.012 * s.images_per_step
        return 0.012 * s.images_per_step

    def trials(ctx, recommended, grow_batch):
        seen.setdefault("order", []).append("trials")
        seen["trials"] = (ctx.cfg.train.batch_size, ctx.base.cfg.train.batch_size, grow_batch)
        seen["measured"] = (ctx.measured.cfg.train.batch_size, ctx.measured_step_s)
        return [Trial("channels_last", {"channels_last": False}, 1.0)]

    def smaller(ctx, batches, tuned, gain, rounds_for):
        seen["order"].append("smaller")
        seen["smaller"] = (ctx.cfg.train.batch_size, ctx.base.cfg.train.batch_size, batches, ctx.clock)
        return []

    fakes = {"build_setup": fake_setup, "probe_per_image": lambda s, images: 0.012, "timed_steps": timed,
             "first_step_s": first_step, "checkpoint_write_s": lambda s, folder: 0.5,
             "trace_window": lambda *a: {"host_syncs_per_step": 0.0, "gpu_busy_frac": None, "tensor_core_frac": None,
                                         "recorded_steps": 1, "op_events": []},
             "count_step": lambda s, per_image_s, share_s: StepCount({}, {}, "faked"),
             "measure_peaks": lambda device, share_s: Peaks(1.0, 1.0, 1.0, 256, 256, 1, 0.0),
             "write_roofline_summary": lambda trace_dir, roofline: None,
             "inference_times": lambda s, batch, calls: seen.setdefault("order", []).append("inference")
             or [0.004 * batch] * calls,
             "cpu_fp32_timing": lambda s, share: Fp32Timing(torch.nn.Identity(), 64, 2, 0.5),
             "cpu_fp32_inference": lambda s, timing: seen["order"].append("export") or 100.0,
             "process_seconds": lambda: 0.0,
             "run_trials": trials, "smaller_batch_trials": smaller,
             "confirm_winners": lambda ctx, results, tuned: seen["order"].append("confirm") or (tuned, None),
             "recommended_together": lambda *a: seen["order"].append("together"),
             "open_split": lambda prepared, split: range(600)}  # a training split of 600 images
    for name, fake in fakes.items():
        monkeypatch.setattr(run, name, fake)
    monkeypatch.setattr(run, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    result = profile_variant(cfg, DistInfo(), tmp_path, tmp_path / "logs", True, 60.0,
                             box=TimeBox(60.0, now=lambda: now[0]))
    assert result["batch_size"] == 128 and result["trial_batch"] == 64
    assert seen["trials"] == (64, 64, False)  # a smaller measured batch is not grown
    assert seen["measured"] == (128, pytest.approx(0.012 * 128))  # where the allocator is tried
    assert seen["smaller"][:3] == (128, 128, [128, 64])
    assert result["trial_window_s"] == seen["smaller"][3].window_s  # one clock for both
    # the inference timings (at `keep`, as evaluate and export run) after every trial: glibc's own
    # thresholds stay for the trials' blocks
    assert seen["order"] == ["trials", "confirm", "smaller", "together", "inference", "export"]
    assert result["export_batch"] == 64


def test_a_trial_context_at_another_base_keeps_everything_else():
    clock = object()
    ctx = TrialContext(cfg="cfg@64", requested="asked", info="info", split="train", base=None, clock=clock)
    base = SimpleNamespace(cfg="cfg@128")
    at = ctx.at(base)
    assert (at.cfg, at.base, at.requested, at.info, at.split, at.clock) == (
        "cfg@128", base, "asked", "info", "train", clock)
    assert ctx.cfg == "cfg@64" and ctx.base is None  # a new context: the trials' own is unchanged
    measured = SimpleNamespace(cfg="cfg@256")
    smaller = dataclasses.replace(ctx, base=measured).at(base)
    assert smaller.measured is measured and smaller.at(measured).measured is measured  # (down and back up)


def test_exports_fp32_timing_copies_the_model_once_and_times_that_copy(monkeypatch):
    """The sizing call before the trials makes the fp32 CPU copy; the timing after them steps that very
    copy (no second deep copy of the model), in fp32 and contiguous whatever the setup trains in."""
    model = torch.nn.Conv2d(2, 4, 3).to(torch.bfloat16).to(memory_format=torch.channels_last)
    assert not model.weight.is_contiguous()
    s = SimpleNamespace(ctx=SimpleNamespace(model=model), in_chans=2,
                        cfg=SimpleNamespace(data=SimpleNamespace(image_size=8)))
    copies, timed = [], []
    real_deepcopy = measure.copy.deepcopy
    monkeypatch.setattr(measure.copy, "deepcopy", lambda m: copies.append(m) or real_deepcopy(m))
    monkeypatch.setattr(measure, "keep_for_inference", lambda: None)
    monkeypatch.setattr(measure, "forward_times",
                        lambda m, *a, batch, calls: timed.append((m, batch)) or [0.001 * batch] * calls)
    timing = measure.cpu_fp32_timing(s, share_s=0.05)  # 1 ms an image: 3 calls of 16 fit, of 32 do not
    assert timing.batch == 16 and timing.model is not model and timing.model.weight.dtype == torch.float32
    assert timing.model.weight.is_contiguous()
    assert measure.cpu_fp32_inference(s, timing) == pytest.approx(1000.0)
    assert len(copies) == 1 and [m for m, _ in timed] == [timing.model, timing.model]
    assert [b for _, b in timed] == [8, 16]  # the sizing call at 8, then the timing at the batch it chose
