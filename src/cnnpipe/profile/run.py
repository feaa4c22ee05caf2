"""The profile stage: step-time breakdown, a TensorBoard trace, a diagnosis and measured trials.

`measure` times a setup and writes the trace, `trials` measures candidate settings against it,
`decision` turns the trials into tuned values; this module runs them in order and writes the results.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from cnnpipe import malloc
from cnnpipe.config import VariantConfig
from cnnpipe.data.store.shards import open_split
from cnnpipe.files import write_json, write_text
from cnnpipe.monitor import peak_mem_mb, reset_peak_memory
from cnnpipe.profile.box import PROBE_IMAGES, ROOFLINE_SHARE, TAIL_SHARE, BoxPlan, TimeBox, inference_s
from cnnpipe.profile.decision import best_batch, confirm_winners, tuned_settings, tuned_speedup
from cnnpipe.profile.diagnosis import Facts, Recommendation, diagnose
from cnnpipe.profile.format import all_trials
from cnnpipe.profile.measure import (
    build_setup,
    checkpoint_write_s,
    cpu_fp32_inference,
    cpu_fp32_timing,
    first_step_s,
    fractions,
    inference_times,
    iqr,
    memory_frac,
    probe_per_image,
    timed_steps,
    trace_window,
)
from cnnpipe.profile.peaks import count_step, measure_peaks
from cnnpipe.profile.roofline import attribute_self_time, headline, markdown, summarize
from cnnpipe.profile.smaller import smaller_batch_trials, smaller_batches
from cnnpipe.profile.trials import Trial, TrialContext, recommended_together, run_trials
from cnnpipe.train.budget import EVAL_BATCH, fit_batch_to_split
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.precision import math_mode
from cnnpipe.train.tuning import auto_knobs, resolve_auto
from cnnpipe.uptime import process_seconds


def _with_measurement(rec: Recommendation, results: list[Trial]) -> dict[str, Any]:
    """The recommendation, plus before/after numbers from the same run when a trial measured its knob."""
    entry = rec.to_dict()
    measured = [r for r in results if r.knob == rec.knob and r.speedup]
    if measured:
        best = max(measured, key=lambda r: r.speedup)
        entry["measured"] = {"before_img_s": best.before_img_s, "after_img_s": best.after_img_s,
                             "speedup": best.speedup, "change": best.change, "win": best.win}
    return entry


def profile_variant(requested: VariantConfig, info: DistInfo, prepared_dir: Path, trace_dir: Path,
                    with_trials: bool, time_box_s: float | None = None, box: TimeBox | None = None) -> dict[str, Any]:
    """Everything metrics/profile/<variant>.json holds (`tuned`: values for the `auto` knobs).

    `time_box_s` is the stage's share of the budget, counted from the process start (None: no
    budget); `box` overrides that deadline (tests). One probe step sizes every part to a share of
    what the box has left (`box`): the base measurement (at a smaller batch when the recipe's is too
    slow for the box), the trace, the trials, the smaller batches' speeds and, last, the inference timing.
    """
    # A catalog smaller than the batch: measure the batch training will halve to (it cannot step at this one).
    train = open_split(prepared_dir, "train")  # once: every setup and trial reads this one
    requested = fit_batch_to_split(requested, len(train), info.world_size)
    cfg = resolve_auto(requested, info.device)  # profile the defaults; the trials test the alternatives
    t = cfg.train
    box = box or TimeBox.from_process_start(time_box_s, process_seconds())
    reset_peak_memory(info.device)
    t0 = time.perf_counter()
    setup = build_setup(cfg, info, train)
    setup_s = time.perf_counter() - t0
    startup_s = process_seconds()  # imports, data and model: what each later stage pays before its first step
    probe_s = probe_per_image(setup, PROBE_IMAGES) * t.accum_steps  # per image of train.batch_size (x accum)
    plan = BoxPlan.after_probe(box, cfg.profile, t.batch_size, t.accum_steps, probe_s, setup_s)
    batch = plan.batch
    measured = cfg.with_train(batch_size=batch)
    if batch == t.batch_size:
        base = setup
    else:
        del setup  # (its model and optimizer state: the base builds its own)
        base = build_setup(measured, info, train)
    first_s = first_step_s(base)  # the recipe's batch: its first step at that shape (the warm-up)
    times, totals, cpu_util, kernel = timed_steps(base, warmup=0, steps=plan.base_steps())
    step_s = statistics.median(times)
    warmup_s = max(0.0, first_s - step_s)
    per_image_s = step_s / base.images_per_step
    trace = plan.trace(step_s)
    traced = trace_window(base, trace_dir, f"{cfg.variant}_rank{info.rank}", trace, step_s)
    peak_mb, mem_frac = peak_mem_mb(info.device), memory_frac(info.device)  # the recipe's own, before any trial
    # The roofline: after the peak memory is read (its count steps a copy of the model), outside every timed window.
    roofline_s = plan.share(ROOFLINE_SHARE)
    count = count_step(base, per_image_s, None if roofline_s is None else roofline_s / 2)
    peaks = measure_peaks(info.device, None if roofline_s is None else roofline_s / 2)
    op_us = attribute_self_time(traced.pop("op_events"), count.ops)
    # on CUDA the ops' shares are of kernel time: the GPU idles between kernels, a step's wall time overstates theirs
    op_step_s = step_s if info.device.type == "cpu" else sum(op_us.values()) / traced["recorded_steps"] / 1e6
    roofline = summarize(peaks, base.ctx.amp, step_s, count.flops, count.bytes, op_us, count.basis, op_step_s)
    if info.rank == 0:
        write_roofline_summary(trace_dir, roofline)
    trace_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_s = checkpoint_write_s(base, trace_dir) if info.rank == 0 else 0.0
    training_s = t.epoch_count * base.steps_per_epoch * step_s  # the whole split: what the plan may shrink
    batches = smaller_batches(cfg) if with_trials else []
    inference = plan.inference(per_image_s, EVAL_BATCH)
    export = cpu_fp32_timing(base, plan.share(TAIL_SHARE))  # sized now (its fp32 copy made), timed after the trials
    trials = plan.trials(step_s, per_image_s, batches, training_s, inference_s(inference, per_image_s) + export.seconds)
    ctx = TrialContext(measured, requested, info, train, base, trials.clock, measured_step_s=step_s)
    if with_trials and trials.batch != batch:  # not one full trial fits at the measured batch: a smaller one
        ctx = ctx.at(build_setup(measured.with_train(batch_size=trials.batch), info, train))
    facts = Facts(fractions=fractions(totals), device=info.device.type, amp=base.ctx.amp,
                  channels_last=t.channels_last, loader=t.loader, num_workers=t.num_workers, batch_size=batch,
                  utilization=cpu_util if info.device.type == "cpu" else traced["gpu_busy_frac"],
                  memory_frac=mem_frac, host_syncs_per_step=traced["host_syncs_per_step"],
                  tensor_core_frac=traced["tensor_core_frac"], malloc=t.malloc,
                  page_faults_per_step=kernel.faults / len(times),
                  kernel_frac=kernel.kernel_frac if malloc.available() else None)  # (advice only where it applies)
    results: list[Trial] = []
    tuned = {k: getattr(t, k) for k in auto_knobs(requested)}
    combined, smaller, gain = None, [], 1.0
    if with_trials:
        recommended = [r.knob for r in diagnose(facts)[1] if r.knob]  # bottleneck first
        results = run_trials(ctx, recommended, grow_batch=trials.batch == t.batch_size)
        best = best_batch(results)
        facts = dataclasses.replace(facts, batch_gain=best.speedup if best else None,
                                    best_batch=best.change["batch_size"] if best else None)
        tuned, combined = confirm_winners(ctx, results, tuned_settings(requested, ctx.cfg, results))
        gain = tuned_speedup(ctx.cfg, tuned, results, combined)
        # the smaller batches are measured against the base, at its batch
        smaller = smaller_batch_trials(ctx.at(base), batches, tuned, gain, trials.rounds_for)
    at_batch = {e["change"]["batch_size"]: e["at_batch"] for e in smaller if e["at_batch"]}
    label, recs = diagnose(facts)
    if with_trials and combined is None and not trials.clock.out_of_time():  # (`gain` cannot be this mix's)
        combined = recommended_together(ctx, results, [r.knob for r in recs if r.knob and r.knob != "batch_size"])
    # Last: the inference timings run at `keep`, as evaluate and export do, and once set, glibc's own
    # thresholds are gone for the rest of the process (`cnnpipe.malloc`): every trial is done by now.
    del ctx  # (a trial batch's setup: not held through the timings)
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
    inference_times_s = inference_times(base, inference.batch, inference.calls)
    export_img_s = cpu_fp32_inference(base, export)
    needed = plan.needed_s(time_box_s)
    return {
        "variant": cfg.variant,
        "device": info.device.type,
        "threads": torch.get_num_threads(),
        "image_size": cfg.data.image_size,
        "image_size_auto": requested.data.image_size == "auto",
        "amp": base.ctx.amp,
        "math": math_mode(base.ctx.amp, info.device),
        "batch_size": batch,
        "recipe_batch_size": t.batch_size,
        "step_time_median_s": step_s,
        "step_time_iqr_s": iqr(times),
        "steps_timed": len(times),
        "throughput_img_s": base.images_per_step / step_s,
        "probe_s_per_image": probe_s,
        "inference_img_s": inference.batch / statistics.median(inference_times_s),
        "inference_batch": inference.batch,
        "export_img_s": export_img_s,
        "export_batch": export.batch,
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "checkpoint_s": checkpoint_s,
        "fractions": facts.fractions,
        "cpu_util": cpu_util,
        "malloc": t.malloc,
        "kernel_frac": kernel.kernel_frac,
        "page_faults_per_step": kernel.faults / len(times),
        **traced,
        "trace_steps": dataclasses.asdict(trace),
        "roofline": roofline,
        "peak_mem_mb": peak_mb,
        "memory_frac": mem_frac,
        "bottleneck": label,
        "recommendations": [_with_measurement(rec, results) for rec in recs],
        "trials": [r.to_dict() for r in results],
        "combined_trial": combined.to_dict() if combined else None,
        "min_gain": cfg.profile.min_gain,
        "trial_rounds": cfg.profile.trial_rounds,
        "time_box_s": time_box_s,
        "box_left_after_probe_s": plan.left,
        "box_too_small": needed is not None,
        "box_needed_s": needed,
        "training_estimate_s": training_s,
        "trial_window_s": trials.clock.window_s,
        "trial_batch": trials.batch,
        "trial_block_steps": trials.block,
        # `at_batch`: values that differ at a batch `train.min_steps` may pick (training applies them there).
        "tuned": {**tuned, "at_batch": at_batch} if at_batch else tuned,
        "tuned_speedup": gain,
        "smaller_batches": smaller,
        "trace_dir": str(trace_dir),
    }


def write_roofline_summary(trace_dir: Path, roofline: dict[str, Any]) -> None:
    """The roofline beside the trace, for TensorBoard: its headline and op table as text, the step's
    achieved GFLOP/s and shares of the peaks as scalars (the old event files go first: one run per
    variant, like the trace)."""
    from torch.utils.tensorboard import SummaryWriter  # (loads tensorboard: only when writing)

    for stale in trace_dir.glob("events.out.tfevents.*"):
        stale.unlink()
    with SummaryWriter(str(trace_dir)) as writer:
        writer.add_text("roofline", "\n".join(markdown(roofline)))
        for name in ("achieved_gflops", "bf16_share", "math_share", "bandwidth_share"):
            if roofline[name] is not None:
                writer.add_scalar(f"roofline/{name}", roofline[name])
        for name in ("bf16_gflops", "fp32_gflops", "copy_gbs"):
            writer.add_scalar(f"roofline/peak_{name}", roofline["peaks"][name])


def save_profile(result: dict[str, Any], out_dir: Path) -> None:
    """`<variant>.json` and `<variant>_tuned.yaml` (only the `auto` knobs, so explicit recipes get
    an empty, stable file that training can depend on)."""
    variant = result["variant"]
    write_json(Path(out_dir) / f"{variant}.json", result)
    write_text(Path(out_dir) / f"{variant}_tuned.yaml", yaml.safe_dump(result["tuned"], sort_keys=True))


def summary(result: dict[str, Any]) -> str:
    """The lines the stage prints: breakdown, bottleneck, advice, trials and tuned values."""
    shares = ", ".join(f"{k} {v:.0%}" for k, v in result["fractions"].items() if v >= 0.01)
    lines = [f"profile[{result['variant']}] at {result.get('image_size')} px: "
             f"{result['step_time_median_s'] * 1000:.0f} ms/step, "
             f"{result['throughput_img_s']:.0f} img/s at batch {result['batch_size']}; {shares}; "
             f"bottleneck: {result['bottleneck']}"]
    if result.get("roofline"):
        lines.append(f"  roofline: {headline(result['roofline'])}")
    recipe_batch = result.get("recipe_batch_size", result["batch_size"])
    if recipe_batch != result["batch_size"]:
        lines.append(f"  measured at batch {result['batch_size']}, not the recipe's {recipe_batch}: three steps there "
                     f"do not fit the time box; its speed is taken per image (a step's time in proportion to its batch)")
    if result.get("trial_batch", result["batch_size"]) != result["batch_size"]:
        lines.append(f"  trials at batch {result['trial_batch']}: not one full trial fits the trial window at batch "
                     f"{result['batch_size']}; the values they measure are taken for the recipe's batch")
    if result.get("box_too_small"):
        lines.append(f"  the time box ({result['time_box_s'] or 0:.0f} s) is too small to profile this recipe at any batch: "
                     f"it would need {result['box_needed_s']:.0f} s (raise run.budget_minutes or "
                     f"profile.budget_share); the plan counts the time this stage really took")
    lines += [f"  - {rec['action']}  (evidence: {rec['evidence']})" for rec in result["recommendations"]]
    for trial in all_trials(result):
        low, high = trial["speedup_range"]
        lines.append(f"  trial {trial['change']}: {trial['speedup']:.2f}x ({low:.2f}-{high:.2f})"
                     f"{' WIN' if trial['win'] else ''} {trial['note']}".rstrip())
    for entry in result.get("smaller_batches", []):
        retuned = "".join(f"; {t['knob']}={t['change'][t['knob']]} there ({t['speedup']:.2f}x)"
                          for t in entry["knob_trials"] if t["win"])
        how = " (predicted: no room to measure it)" if entry.get("predicted") else ""
        lines.append(f"  batch {entry['change']['batch_size']} (for train.min_steps): {entry['speedup']:.2f}x "
                     f"the speed of batch {result['batch_size']}{retuned}{how}")
    if result["tuned"]:
        lines.append(f"  tuned (for the `auto` params): {result['tuned']}")
    return "\n".join(lines)
