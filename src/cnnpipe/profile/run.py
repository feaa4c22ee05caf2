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

from cnnpipe.config import VariantConfig
from cnnpipe.files import write_json, write_text
from cnnpipe.monitor import peak_mem_mb, process_seconds, reset_peak_memory
from cnnpipe.profile.clock import TrialClock, block_steps, trial_window
from cnnpipe.profile.decision import best_batch, confirm_winners, tuned_settings, tuned_speedup
from cnnpipe.profile.diagnosis import Facts, Recommendation, diagnose
from cnnpipe.profile.format import all_trials
from cnnpipe.profile.measure import (
    INFERENCE_BATCH,
    build_setup,
    cpu_fp32_inference,
    fractions,
    inference_times,
    iqr,
    memory_frac,
    timed_steps,
    trace_window,
)
from cnnpipe.profile.trials import Trial, recommended_together, run_trials, smaller_batch_trials, smaller_batches
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.precision import math_mode
from cnnpipe.train.tuning import auto_knobs, resolve_auto


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
                    with_trials: bool, time_box_s: float | None = None) -> dict[str, Any]:
    """Everything metrics/profile/<variant>.json holds (`tuned`: values for the `auto` knobs).

    `time_box_s` is the stage's share of the budget (seconds since the process started; None: no
    budget). The trials get the window `clock.trial_window` gives, counted from the end of the base
    measurement, with the smaller batches' speeds and the inference timing (which the plan needs,
    and which always run) set aside; a trial that no longer fits is noted, not timed.
    """
    cfg = resolve_auto(requested, info.device)  # profile the defaults; the trials test the alternatives
    p, t = cfg.profile, cfg.train
    reset_peak_memory(info.device)
    t0 = time.perf_counter()
    base = build_setup(cfg, info, prepared_dir)
    setup_s = time.perf_counter() - t0
    startup_s = process_seconds()  # imports, data and model: what each later stage pays before its first step
    times, totals, cpu_util = timed_steps(base, warmup=1, steps=max(p.active, p.trial_steps * p.trial_rounds))
    step_s = statistics.median(times)
    traced = trace_window(base, trace_dir, worker=f"{cfg.variant}_rank{info.rank}")
    peak_mb, mem_frac = peak_mem_mb(info.device), memory_frac(info.device)  # the recipe's own, before any trial
    t0 = time.perf_counter()
    inference_s = inference_times(base)  # timed again at the end: the VM's speed drifts within minutes
    export_img_s = cpu_fp32_inference(base)
    tail_s = time.perf_counter() - t0
    training_s = t.epochs * base.steps_per_epoch * step_s  # the whole split: what the plan may shrink
    block = block_steps(step_s, p.trial_steps)
    trial_s = setup_s + 2 * p.trial_rounds * (block + 1) * step_s  # a full trial at the base's speed
    must_follow = len(smaller_batches(cfg)) * trial_s + tail_s if with_trials else 0.0
    box_left = None if time_box_s is None else time_box_s - process_seconds() - must_follow
    clock = TrialClock(trial_window(box_left, training_s), block, trial_s)
    facts = Facts(fractions=fractions(totals), device=info.device.type, amp=base.ctx.amp,
                  channels_last=t.channels_last, loader=t.loader, num_workers=t.num_workers, batch_size=t.batch_size,
                  utilization=cpu_util if info.device.type == "cpu" else traced["gpu_busy_frac"],
                  memory_frac=mem_frac, host_syncs_per_step=traced["host_syncs_per_step"],
                  tensor_core_frac=traced["tensor_core_frac"])
    results: list[Trial] = []
    tuned = {k: getattr(t, k) for k in auto_knobs(requested)}
    combined, smaller, gain = None, [], 1.0
    if with_trials:
        recommended = [r.knob for r in diagnose(facts)[1] if r.knob]  # bottleneck first
        results = run_trials(cfg, requested, info, prepared_dir, base, recommended, clock)
        best = best_batch(results)
        facts = dataclasses.replace(facts, batch_gain=best.speedup if best else None,
                                    best_batch=best.change["batch_size"] if best else None)
        tuned, combined = confirm_winners(requested, cfg, info, prepared_dir, base, results,
                                           tuned_settings(requested, cfg, results), clock)
        gain = tuned_speedup(cfg, tuned, results, combined)
        smaller = smaller_batch_trials(requested, cfg, info, prepared_dir, base, tuned, gain, clock)
    at_batch = {e["change"]["batch_size"]: e["at_batch"] for e in smaller if e["at_batch"]}
    label, recs = diagnose(facts)
    if with_trials and combined is None and not clock.out_of_time():  # (`gain` cannot be this mix's)
        combined = recommended_together(cfg, info, prepared_dir, base, results,
                                        [r.knob for r in recs if r.knob and r.knob != "batch_size"], clock.block)
    inference_s += inference_times(base)
    return {
        "variant": cfg.variant,
        "device": info.device.type,
        "threads": torch.get_num_threads(),
        "image_size": cfg.data.image_size,
        "image_size_auto": requested.data.image_size == "auto",
        "amp": base.ctx.amp,
        "math": math_mode(base.ctx.amp, info.device),
        "batch_size": t.batch_size,
        "step_time_median_s": step_s,
        "step_time_iqr_s": iqr(times),
        "steps_timed": len(times),
        "throughput_img_s": base.images_per_step / step_s,
        "inference_img_s": INFERENCE_BATCH / statistics.median(inference_s),
        "export_img_s": export_img_s,
        "startup_s": startup_s,
        "fractions": facts.fractions,
        "cpu_util": cpu_util,
        **traced,
        "peak_mem_mb": peak_mb,
        "memory_frac": mem_frac,
        "bottleneck": label,
        "recommendations": [_with_measurement(rec, results) for rec in recs],
        "trials": [r.to_dict() for r in results],
        "combined_trial": combined.to_dict() if combined else None,
        "min_gain": p.min_gain,
        "trial_rounds": p.trial_rounds,
        "time_box_s": time_box_s,
        "training_estimate_s": training_s,
        "trial_window_s": clock.window_s,
        "trial_block_steps": block,
        # `at_batch`: values that differ at a batch `train.min_steps` may pick (training applies them there).
        "tuned": {**tuned, "at_batch": at_batch} if at_batch else tuned,
        "tuned_speedup": gain,
        "smaller_batches": smaller,
        "trace_dir": str(trace_dir),
    }


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
             f"{result['throughput_img_s']:.0f} img/s; {shares}; bottleneck: {result['bottleneck']}"]
    lines += [f"  - {rec['action']}  (evidence: {rec['evidence']})" for rec in result["recommendations"]]
    for trial in all_trials(result):
        low, high = trial["speedup_range"]
        lines.append(f"  trial {trial['change']}: {trial['speedup']:.2f}x ({low:.2f}-{high:.2f})"
                     f"{' WIN' if trial['win'] else ''} {trial['note']}".rstrip())
    for entry in result.get("smaller_batches", []):
        retuned = "".join(f"; {t['knob']}={t['change'][t['knob']]} there ({t['speedup']:.2f}x)"
                          for t in entry["knob_trials"] if t["win"])
        lines.append(f"  batch {entry['change']['batch_size']} (for train.min_steps): {entry['speedup']:.2f}x "
                     f"the speed of batch {result['batch_size']}{retuned}")
    if result["tuned"]:
        lines.append(f"  tuned (for the `auto` params): {result['tuned']}")
    return "\n".join(lines)
