"""metrics/profile/report.md and breakdown.png from the per-variant profile JSON files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cnnpipe.profile.format import REGIONS, all_trials
from cnnpipe.profile.roofline import markdown as roofline_markdown


def load_profiles(profile_dir: Path, variants: list[str]) -> dict[str, dict[str, Any]]:
    """The profile JSON of each variant."""
    out = {}
    for v in variants:
        path = profile_dir / f"{v}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: run `dvc repro profile@{v}` first")
        out[v] = json.loads(path.read_text())
    return out


def seconds_per_1000_images(profile: dict[str, Any]) -> float:
    """Median training time per 1,000 images: comparable across recipes that step at different batches."""
    return profile["step_time_median_s"] / profile["batch_size"] * 1000


def bar_chart(profiles: dict[str, dict[str, Any]], path: Path) -> None:
    """Stacked horizontal bars: seconds per 1,000 training images spent in each region, per variant,
    each labelled with its batch and throughput (a per-step bar would make the larger batch look slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(profiles)
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.55 * len(names)))
    left = [0.0] * len(names)
    for region in REGIONS:
        widths = [profiles[n]["fractions"].get(region, 0.0) * seconds_per_1000_images(profiles[n]) for n in names]
        ax.barh(names, widths, left=left, label=region, height=0.6)
        left = [a + b for a, b in zip(left, widths)]
    for y, name in enumerate(names):
        p = profiles[name]
        ax.text(left[y], y, f"  batch {p['batch_size']}, {p['throughput_img_s']:,.0f} img/s", va="center", fontsize=9)
    ax.set_xlim(0, max(left) * 1.35)
    ax.set_xlabel("seconds per 1,000 training images (median step time / batch size)")
    ax.legend(ncol=len(REGIONS), fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False,
              handlelength=1.2, columnspacing=1.0)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def to_markdown(profiles: dict[str, dict[str, Any]], chart_name: str) -> str:
    """The report: breakdown table, bottleneck, recommendations with evidence, trials, how to open traces."""
    lines = ["# Profile report", "", f"![time per 1,000 training images, by region]({chart_name})", "",
             "| Region | " + " | ".join(profiles) + " |", "| --- |" + " ---: |" * len(profiles)]
    for region in REGIONS:
        shares = [p["fractions"].get(region, 0.0) for p in profiles.values()]
        cells = [f"{share:.1%} ({share * p['step_time_median_s'] * 1000:.0f} ms)"
                 for share, p in zip(shares, profiles.values())]
        lines.append(f"| {region} | " + " | ".join(cells) + " |")
    lines.append("| **step (median ± IQR)** | " + " | ".join(
        f"{p['step_time_median_s'] * 1000:.0f} ± {p['step_time_iqr_s'] * 1000:.0f} ms"
        for p in profiles.values()) + " |")
    lines.append("| **throughput** | "
                 + " | ".join(f"{p['throughput_img_s']:.0f} img/s" for p in profiles.values()) + " |")
    for name, p in profiles.items():
        lines += ["", f"## {name}: bottleneck `{p['bottleneck']}`", "",
                  f"{p['device']}, {p['threads']} threads, {_image_size(p)}amp={p['amp']}, {_batch(p)}, "
                  f"CPU utilisation {p['cpu_util']:.0%}, peak memory {p['peak_mem_mb']:.0f} MB, "
                  f"{_syncs(p)}{_faults(p)}{_gpu_facts(p)}.{_stage_time(p)}", ""]
        if p.get("roofline"):  # (profiles from before it was measured have none)
            lines += roofline_markdown(p["roofline"]) + [""]
        if not p["recommendations"]:
            compute = sum(p["fractions"].get(k, 0.0) for k in ("forward", "backward", "optimizer"))
            lines.append(f"No rule fired: forward + backward + optimizer are {compute:.1%} of the step, with "
                         f"amp={p['amp']}; what remains is the model's arithmetic (the trials below try the rest).")
        for rec in p["recommendations"]:
            measured = rec.get("measured")
            lines.append(f"- **{rec['action']}** — evidence: `{json.dumps(rec['evidence'])}`"
                         + (f"; expected: {rec['expected_gain']}" if rec["expected_gain"] else "")
                         + (f"; measured: {measured['before_img_s']:.0f} → {measured['after_img_s']:.0f} img/s "
                            f"({measured['speedup']:.2f}x)" if measured else ""))
        trials = all_trials(p)
        if trials:
            lines += ["", f"Trials: blocks of the current and the candidate setting alternate "
                          f"(median of {p.get('trial_rounds', '?')} rounds, range in brackets); a candidate "
                          f"wins when it is ≥{p['min_gain']:.0%} faster at the median and faster in every round.",
                      "", "| Candidate | Current → candidate | Speed-up | Wins | Note |",
                      "| --- | ---: | ---: | :---: | --- |"]
            for t in trials:
                change = ", ".join(f"{k}={v}" for k, v in t["change"].items())
                if t["knob"] in ("combined", "confirm", "recommended"):
                    change = f"**{t['knob']}**: {change}"
                low, high = t["speedup_range"]
                speed = (f"{t['before_img_s']:.0f} → {t['after_img_s']:.0f} img/s" if t["speedup"] else "—")
                ratio = f"{t['speedup']:.2f}x ({low:.2f}–{high:.2f})" if t["speedup"] else "—"
                lines.append(f"| {change} | {speed} | {ratio} | {'yes' if t['win'] else 'no'} | {t['note']} |")
        if p.get("tuned"):
            lines += ["", "Values for the params left at `auto`: `" + json.dumps(p["tuned"]) + "`."]
    lines += ["", "## Opening the traces", "",
              "```", "tensorboard --logdir logs/profile   # PyTorch Profiler tab (torch-tb-profiler)", "```", "",
              "Or load a `logs/profile/<variant>/*.pt.trace.json` file in https://ui.perfetto.dev.",
              "The figures above come from an un-profiled timed run (the profiler's overhead is not in them).", ""]
    return "\n".join(lines)


def _image_size(p: dict[str, Any]) -> str:
    """The model's input size, and why when `data.image_size: auto` chose it for a GPU."""
    if p.get("image_size") is None:  # profiles from before it was recorded
        return ""
    why = " (`data.image_size: auto` on a GPU: at the store's size it would be launch-bound)" \
        if p.get("image_size_auto") and p["device"] == "cuda" else ""
    return f"{p['image_size']} px{why}, "


def _batch(p: dict[str, Any]) -> str:
    """The batch measured, and the recipe's when the time box made the profile measure a smaller one."""
    recipe = p.get("recipe_batch_size", p["batch_size"])
    if recipe == p["batch_size"]:
        return f"batch {p['batch_size']}"
    return (f"batch {p['batch_size']} (the recipe's {recipe} does not fit the time box: its speed is taken "
            f"per image)")


def _stage_time(p: dict[str, Any]) -> str:
    """How long the stage ran, against its time box (profile.budget_share of run.budget_minutes, at
    most a fifth of the training it informs)."""
    if p.get("stage_time_s") is None:
        return ""
    box = ""
    if p.get("time_box_s"):
        box = f" (time box: {p['time_box_s']:.0f} s"
        if p.get("trial_window_s") is not None:
            box += (f"; whole-split training predicted at {p['training_estimate_s']:.0f} s; "
                    f"trials had {p['trial_window_s']:.0f} s after the first measurement, "
                    f"in blocks of {p.get('trial_block_steps', 2)} steps")
        box += ")"
        if p.get("box_too_small"):
            box += f"; the box is too small for this recipe: it would need {p['box_needed_s']:.0f} s"
    return f" The stage took {p['stage_time_s']:.0f} s{box}."


def _syncs(p: dict[str, Any]) -> str:
    n = p["host_syncs_per_step"]
    if p["device"] == "cuda":
        return f"{n:.0f} host syncs per step"
    return f"{n:.0f} scalar reads to Python per step (`.item()`; ~1 µs each on the CPU, where nothing waits)"


def _faults(p: dict[str, Any]) -> str:
    """The allocator and what the kernel took of the step (profiles from before it was measured: nothing)."""
    if p.get("kernel_frac") is None:
        return ""
    return (f", malloc={p['malloc']}: {p['page_faults_per_step']:,.0f} page faults a step, "
            f"{p['kernel_frac']:.0%} of the CPU time in the kernel")


def _gpu_facts(p: dict[str, Any]) -> str:
    """CUDA-only readings, when the profile has them."""
    parts = []
    if p.get("gpu_busy_frac") is not None:
        parts.append(f"GPU busy {p['gpu_busy_frac']:.0%}")
    if p.get("tensor_core_frac") is not None:
        parts.append(f"{p['tensor_core_frac']:.0%} of matrix-kernel time on Tensor Cores")
    if p.get("memory_frac") is not None:
        parts.append(f"memory {p['memory_frac']:.0%} of the device")
    return (", " + ", ".join(parts)) if parts else ""


def write_report(profile_dir: Path, variants: list[str]) -> Path:
    """Write report.md and breakdown.png next to the profile JSON files."""
    profiles = load_profiles(profile_dir, variants)
    bar_chart(profiles, profile_dir / "breakdown.png")
    path = profile_dir / "report.md"
    path.write_text(to_markdown(profiles, "breakdown.png"))
    return path
