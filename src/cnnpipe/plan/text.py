"""The plan as text: the lines `dvc repro` prints before training starts, and plan.md."""

from __future__ import annotations

from typing import Any

from cnnpipe.plan.plan import frac_text
from cnnpipe.train.budget import EVAL_BATCH


def to_text(plan: dict[str, Any]) -> str:
    """The plan as the lines `dvc repro` prints before training starts (and plan.md holds)."""
    budget = plan["budget_minutes"]
    lines = [f"# Time plan ({'budget ' + format(budget, 'g') + ' min' if budget else 'no budget'})", "",
             "| stage | predicted |", "| --- | ---: |"]
    measured = {**plan.get("spent_s", {}), **plan["profile_s"]}
    for name, seconds in {**measured, **plan["predicted_s"]}.items():
        kind = " (measured)" if name in measured else ""
        lines.append(f"| {name} | {seconds / 60:.1f} min{kind} |")
    bound = " (at most: early stop)" if plan.get("upper_bound") else ""
    lines += [f"| **whole run** | **{plan['predicted_total_s'] / 60:.1f} min**{bound} |", "",
              epochs_line(plan) + f" Training images per epoch: **{plan['images_per_epoch']}** of "
              f"{plan['train_images']} (fraction {frac_text(plan['fraction'])}): {plan['reason']}."]
    if plan.get("upper_bound"):
        lines.append("Early stop is on (train.patience: " + ", ".join(
            f"{v} {p}" for v, p in plan["early_stop"].items()) + "): a run that stops sooner takes less time, "
            "so the training times above are upper bounds.")
    if plan["fraction"] < 1.0:
        whole = "Without the budget" if plan.get("epochs_auto") is None else "On the whole split per epoch"
        lines.append(f"{whole} the run would take ~{plan['predicted_total_unbudgeted_s'] / 60:.0f} min. "
                     f"Under it, validation uses {plan['val_images']} images per epoch and the export check "
                     f"{plan['parity_images']} test images (fixed, class-balanced); test evaluation stays whole.")
    halved = [f"{r['variant']} {plan['batch'][r['variant']]} (train.batch_size {r['global_batch']})"
              for r in plan["recipes"] if plan["batch"][r["variant"]] != r["global_batch"]]
    if halved:
        lines.append("Global batch lowered so that the run takes at least train.min_steps optimizer steps: "
                     + "; ".join(halved) + ".")
    lines += ["", "Speeds measured by the profile stages: " + "; ".join(
        f"{r['variant']} {r['train_img_s']:.0f} img/s training, ~{r['eval_img_s']:.0f} img/s inference"
        f"{eval_batch_text(r)}" for r in plan["recipes"]) + ".", ""]
    scaled = [f"{r['variant']}: {r['scaling']}" for r in plan["recipes"] if r.get("scale", 1.0) != 1.0]
    if scaled:
        lines[-1:-1] = ["Training speed at the job's world size: " + "; ".join(scaled) + "."]
    slower = [f"{r['variant']} at batch {b}: {speed:.2f}x" for r in plan["recipes"]
              for b, speed in sorted(r.get("smaller_batch_speed", {}).items(), reverse=True)]
    if slower:
        lines[-1:-1] = ["Smaller batches, measured against the profiled one: " + "; ".join(slower) + "."]
    return "\n".join(lines)


def eval_batch_text(recipe: dict[str, Any]) -> str:
    """" at batch N" when the profile timed inference (and validation and evaluate run) below EVAL_BATCH."""
    batch = recipe.get("eval_batch", EVAL_BATCH)
    return "" if batch == EVAL_BATCH else f" at batch {batch} (validation and evaluate run at it)"


def epochs_line(plan: dict[str, Any]) -> str:
    """"Epochs: ..." for the plan's text: the chosen count of the `auto` variants, the others' own."""
    epochs, auto = plan.get("epochs", {}), plan.get("epochs_auto")
    if auto is None:
        counts = set(epochs.values())
        return (f"Epochs: {counts.pop()} (train.epochs)." if len(counts) == 1 else
                "Epochs (train.epochs): " + ", ".join(f"{v} {n}" for v, n in epochs.items()) + ".")
    low, high = plan["epochs_range"]
    fixed = [f"{v} {n} (train.epochs)" for v, n in epochs.items() if n != auto]
    return (f"Epochs: **{auto}** (train.epochs: auto, {low} to {high})" + (f"; {', '.join(fixed)}" if fixed else "")
            + ".")
