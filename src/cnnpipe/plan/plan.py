"""The time plan: predict every later stage's wall time from measured speeds, and fit a budget.

The profile stages measure each recipe's training speed on this machine. From those speeds and the
data set's size the plan predicts how long training, evaluation and export will take, and fits
`run.budget_minutes` by one rule for every variant, so the baseline/optimized comparison stays fair.

With `train.epochs: auto` it first fits epochs: the most (up to `train.max_epochs`) whose whole run,
on the whole training split, is predicted within the budget, one count for every variant that asks
for `auto`. A small catalog gets its budget's worth of training instead of four epochs of seconds.
When even `train.min_epochs` (the floor) of the whole split does not fit, the run trains the floor
and the images per epoch shrink, as with a fixed count:

- the fraction of the training split drawn per epoch comes from a fixed ladder (1, 3/4, 1/2, 3/8,
  ...): the largest step whose predicted total fits the budget;
- the count is rounded down to a multiple of the largest global batch, so every variant's epoch is
  whole batches of the same images;
- the other per-run costs shrink with it: validation runs on a fixed class-balanced subset
  (`VAL_UNDER_BUDGET`) and the export parity check on one of the test split (`PARITY_UNDER_BUDGET`);
  test evaluation always covers the whole test split;
- validation and evaluation run at the batch each profile timed inference at (`eval_batch`, at most
  evaluation's 256: smaller where the profile's box had no room for it), and export's parity check
  at the one it timed fp32 inference at (`export_batch`), so what is predicted runs;
- hysteresis: the previous run's choice (fraction, and epochs under `auto`) is kept while its
  prediction stays within 75%..110% of the budget. Speed measurements drift by ~10% on shared
  machines; without this a run near a ladder step (or an epoch) would flip between two recipes
  from one `dvc repro` to the next, and an unfinished `auto` run would lose its resume.

Everything here is pure: numbers in, numbers out. `budget.py` applies the choice to training.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any, Sequence

from cnnpipe.config import VariantConfig
from cnnpipe.plan.scaling import world_scaling
from cnnpipe.train.budget import EVAL_BATCH
from cnnpipe.train.schedule import batch_for_steps

LADDER = (1.0, 3 / 4, 1 / 2, 3 / 8, 1 / 4, 3 / 16, 1 / 8, 3 / 32, 1 / 16, 1 / 32, 1 / 64)
KEEP_BAND = (0.75, 1.10)
STARTUP_S = 7.0
"""A stage's process start (imports, data and model; measured 7-8 s on a 2-core VM), for profiles
that predate measuring their own (`Recipe.startup_s`)."""
EXPORT_S = 8.0
"""Tracing, the torch.export-based ONNX export of ResNet-50 and the ONNX Runtime session: CPU work on
any machine, measured on a 2-core VM (a bigger host only finishes sooner)."""
FP32_EXPORT_SLOWDOWN = 1.3
"""For profiles without `export_img_s`: export parity runs in fp32, slower than autocast inference."""
VAL_UNDER_BUDGET = 1000
"""Validation images per epoch when the budget binds: top-1 to about +-1.5 points, enough to pick the
best epoch, for a sixth of the cost of Fashion-MNIST's 6,000."""
PARITY_UNDER_BUDGET = 1000
"""Test images the export parity check covers when the budget binds (the whole split otherwise)."""
CHECKPOINT_SHARE = 0.05
"""The most of training time last.pt writes may take (train/pacing.py's pace, which skips a due write
beyond it); tests/test_plan.py checks the two agree."""
LAST_AND_BEST = 4 / 3
"""The final writes against one last.pt: last.pt, and best.pt (the weights alone, a third of it)."""
OTHER_STAGES = ("machine", "profile_report", "plan", "champion", "delivery", "gate")
"""The stages outside the profiles, training, evaluation and export: each costs about a stage's
start-up (imports, data, model) on the first run of a project (no champion yet to judge against)."""
DVC_STAGE_S = 1.7
"""DVC's own work per stage it runs (hashing the outputs, caching them, writing dvc.lock), besides the
stage's command: 24 s over 14 stages, measured between the commands' ends and starts of a whole
`dvc repro` on the 2-core AMD EPYC (`python bench/own_images.py --budget 8 --per-class 450 --until compare`)."""


@dataclass(frozen=True)
class Recipe:
    """One variant as the plan sees it: its measured speeds and how much work an epoch is."""

    variant: str
    epochs: int
    global_batch: int
    train_img_s: float
    """Training images/s of the recipe training will run (the profile's tuned values)."""
    eval_img_s: float
    """Inference images/s at `eval_batch`, as the profile measured it (older profiles: estimated
    from the forward share of the training step)."""
    profile_s: float
    """What the profile stage already spent."""
    batch_size: int | None = None
    """Per-process batch the profile measured (train.batch_size); None: the global batch, one process."""
    world_size: int = 1
    accum_steps: int = 1
    min_steps: int | None = None
    smaller_batch_speed: dict[int, float] = field(default_factory=dict)
    """Measured speed of each batch `min_steps` may halve to, relative to `batch_size` (profile)."""
    val_images: int | None = None
    """train.val_images: validation images per epoch asked for (None: the whole val split)."""
    amp: str = "off"
    """The precision training runs in (the export check always runs fp32)."""
    scale: float = 1.0
    """Training speed of the whole job over the profiled single process (`world_scaling`)."""
    scaling: str = "one process"
    startup_s: float = 0.0
    """A stage's start-up on this machine (imports, data, model), as the profile measured its own;
    0: not measured (older profiles), `STARTUP_S` applies."""
    export_img_s: float | None = None
    """fp32 images/s on the CPU, where export checks its files (profile); None: older profiles."""
    auto_epochs: tuple[int, int] | None = None
    """(train.min_epochs, train.max_epochs) when train.epochs is `auto`: the plan sets `epochs` in
    that range; None: `epochs` is the params' count."""
    patience: int | None = None
    """train.patience: with early stop the predicted training time is an upper bound."""
    warmup_s: float = 0.0
    """The first step's cost beyond a steady one (kernel selection, allocation), as the profile measured it."""
    checkpoint_s: float = 0.0
    """One last.pt write on this machine's disk, as the profile measured it (0: not measured)."""
    eval_batch: int = EVAL_BATCH
    """The batch the profile timed inference at: validation and evaluation run at it (budget.yaml)."""
    export_batch: int = EVAL_BATCH
    """The batch the profile timed fp32 CPU inference at: export's parity check runs at it (budget.yaml)."""

    def batch_for(self, images_per_epoch: int) -> int:
        """The per-process batch training will use when each epoch draws `images_per_epoch` images
        (`train.min_steps` halves it for a run of few steps, whatever share of the split an epoch draws)."""
        batch = self.global_batch if self.batch_size is None else self.batch_size
        return batch_for_steps(batch, self.min_steps, images_per_epoch, self.epochs, self.world_size,
                               self.accum_steps)

    def train_speed(self, images_per_epoch: int) -> float:
        """Training images/s at the batch that run will use."""
        return self.train_img_s * self.smaller_batch_speed.get(self.batch_for(images_per_epoch), 1.0) * self.scale


def steady_speed(profile: dict[str, Any]) -> float:
    """The profiled setup's training speed: the median of every trial's blocks of the current
    setting, which span the whole profile (minutes), rather than its first timed window (seconds).
    These VMs drift by tens of percent within minutes: the first window read 331 img/s where training
    then ran 256, and the trials' median 257. Trials run at a halved batch (`trial_batch`, a box too
    small for one at the base's) time another batch's speed: then only the smaller batches' paired
    blocks of the base count."""
    at_base = profile.get("trial_batch", profile.get("batch_size")) == profile.get("batch_size")
    trials = profile.get("trials", []) + [profile.get("combined_trial") or {}] if at_base else []
    trials += profile.get("smaller_batches", [])
    blocks = [t["before_img_s"] for t in trials if t.get("before_img_s")]
    return statistics.median(blocks) if blocks else profile["throughput_img_s"]


def recipe_from_profile(cfg: VariantConfig, profile: dict[str, Any]) -> Recipe:
    """A `Recipe` from metrics/profile/<variant>.json and the variant's resolved config."""
    train_img_s = steady_speed(profile) * profile.get("tuned_speedup", 1.0)
    if profile.get("inference_img_s"):  # measured at the eval batch; the tuned values change it as they do training
        eval_img_s = profile["inference_img_s"] * profile.get("tuned_speedup", 1.0)
    else:  # a profile without that block: the forward pass's share of a training step (cautious)
        eval_img_s = train_img_s / max(profile.get("fractions", {}).get("forward") or 0.25, 0.05)
    t = cfg.train
    world = t.nproc * t.nnodes
    smaller = {int(e["change"]["batch_size"]): float(e["speed_vs_tuned"])
               for e in profile.get("smaller_batches", []) if e.get("speed_vs_tuned")}
    amp = profile.get("tuned", {}).get("amp", profile.get("amp", "off"))
    scale, scaling = world_scaling(profile.get("device", "cpu"), t.nproc, t.nnodes)
    return Recipe(cfg.variant, t.epoch_count, t.batch_size * world * t.accum_steps, train_img_s, eval_img_s,
                  float(profile.get("stage_time_s", 0.0)), t.batch_size, world, t.accum_steps, t.min_steps, smaller,
                  t.val_images, amp, scale, scaling, startup_s=float(profile.get("startup_s") or 0.0),
                  export_img_s=profile.get("export_img_s"),
                  auto_epochs=(t.min_epochs, t.max_epochs) if t.epochs == "auto" else None, patience=t.patience,
                  warmup_s=float(profile.get("warmup_s") or 0.0),
                  checkpoint_s=float(profile.get("checkpoint_s") or 0.0),
                  eval_batch=int(profile.get("inference_batch") or EVAL_BATCH),
                  export_batch=int(profile.get("export_batch") or EVAL_BATCH))


def checked_images(fraction: float, n_val: int, n_test: int, val_images: int | None) -> tuple[int, int]:
    """(validation images per epoch, export parity images) at `fraction`: all of them unless the
    budget binds (fraction < 1)."""
    val = n_val if val_images is None else min(n_val, val_images)
    if fraction >= 1.0:
        return val, n_test
    return min(val, VAL_UNDER_BUDGET), min(n_test, PARITY_UNDER_BUDGET)


def stage_seconds(r: Recipe, images_per_epoch: int, n_val: int, n_test: int, n_parity: int,
                  n_calibration: int = 0) -> dict[str, float]:
    """Predicted wall time of train, evaluate and export for one recipe (`n_val`: validation images
    per epoch; `n_parity`: test images the export check covers; `n_calibration`: the validation split
    the temperature is fitted on after training)."""
    # Validation is sharded over the ranks like training; evaluate and export run as one process.
    startup = r.startup_s or STARTUP_S
    val_s = n_val / (r.eval_img_s * r.scale)
    epochs = r.epochs * (images_per_epoch / r.train_speed(images_per_epoch) + val_s)
    # last.pt as paced (at most CHECKPOINT_SHARE of training), then the final last.pt and best.pt
    checkpoints = min(CHECKPOINT_SHARE * epochs, max(0, r.epochs - 1) * r.checkpoint_s) + LAST_AND_BEST * r.checkpoint_s
    train = epochs + checkpoints + r.warmup_s + n_calibration / r.eval_img_s + startup
    bench = 6 * r.eval_batch / r.eval_img_s  # evaluate's model-only throughput: 6 forward passes
    evaluate = n_test / r.eval_img_s + bench + startup
    if r.export_img_s:  # measured: fp32 on the CPU, where export runs whatever trained the model
        parity_img_s = r.export_img_s
    else:
        parity_img_s = r.eval_img_s / (1.0 if r.amp == "off" else FP32_EXPORT_SLOWDOWN)
    export = 3 * n_parity / parity_img_s + EXPORT_S + startup  # PyTorch, TorchScript, ONNX Runtime
    return {f"train@{r.variant}": train, f"evaluate@{r.variant}": evaluate, f"export@{r.variant}": export}


def images_for(fraction: float, full: int, multiple: int) -> int:
    """`fraction` of `full`, rounded down to whole global batches (at least one, never more than `full`:
    a catalog smaller than one batch trains whole, at the batch `train.min_steps` halves to)."""
    if fraction >= 1.0:
        return full
    return min(full, max(multiple, int(fraction * full) // multiple * multiple))


def predict_total(recipes: Sequence[Recipe], fraction: float, full: int, n_val: int,
                  n_test: int, spent_s: float = 0.0) -> tuple[int, dict[str, float], float]:
    """(images per epoch, seconds per later stage, whole-run seconds) at `fraction`: the profiles' and
    `spent_s` (what else ran before the plan, measured: prepare), the predicted stages, the other
    stages' start-ups and DVC's own work between them."""
    multiple = max(r.global_batch for r in recipes)
    images = images_for(fraction, full, multiple)
    stages: dict[str, float] = {}
    for r in recipes:
        val, parity = checked_images(fraction, n_val, n_test, r.val_images)
        stages.update(stage_seconds(r, images, val, n_test, parity, n_val))
    startup = recipes[0].startup_s or STARTUP_S
    stages["compare"] = startup / 2
    commands = len(recipes) + len(stages) + len(OTHER_STAGES) + 1  # the profiles, the stages above, the rest, prepare
    stages["other stages"] = len(OTHER_STAGES) * startup
    stages["DVC's own work"] = commands * DVC_STAGE_S
    spent = sum(r.profile_s for r in recipes) + spent_s
    return images, stages, spent + sum(stages.values())


def choose_fraction(recipes: Sequence[Recipe], full: int, n_val: int, n_test: int, budget_s: float | None,
                    previous: float | None = None, spent_s: float = 0.0) -> tuple[float, str]:
    """The ladder fraction for this budget, and why it was chosen."""
    if budget_s is None:
        return 1.0, "no budget (run.budget_minutes: null)"
    totals = {f: predict_total(recipes, f, full, n_val, n_test, spent_s)[2] for f in LADDER}
    if previous in totals and KEEP_BAND[0] * budget_s <= totals[previous] <= KEEP_BAND[1] * budget_s:
        return previous, (f"kept the previous fraction: its prediction ({totals[previous] / 60:.1f} min) is within "
                          f"{KEEP_BAND[0]:.0%}..{KEEP_BAND[1]:.0%} of the budget")
    fitting = [f for f in LADDER if totals[f] <= budget_s]
    if not fitting:
        return LADDER[-1], (f"even {LADDER[-1]:.4g} of the images per epoch is predicted at "
                            f"{totals[LADDER[-1]] / 60:.1f} min: OVER budget; lower train.epochs (under auto: "
                            "train.min_epochs) or raise run.budget_minutes")
    chosen = fitting[0]
    if chosen == 1.0:
        return 1.0, "the whole training split fits the budget"
    return chosen, (f"the whole split is predicted at {totals[1.0] / 60:.1f} min; {frac_text(chosen)} of it per epoch "
                    f"is the largest ladder step that fits")


def epoch_range(recipes: Sequence[Recipe]) -> tuple[int, int] | None:
    """(fewest, most) epochs the plan may give the variants with `train.epochs: auto`; None: none asks."""
    spans = [r.auto_epochs for r in recipes if r.auto_epochs]
    if not spans:
        return None
    low, high = max(s[0] for s in spans), min(s[1] for s in spans)
    if high < low:
        raise ValueError(f"the variants' train.min_epochs and train.max_epochs leave no count they all allow "
                         f"({low} > {high}): the plan gives every `auto` variant the same epochs")
    return low, high


def at_epochs(recipes: Sequence[Recipe], epochs: int) -> list[Recipe]:
    """`recipes` with those whose train.epochs is `auto` at `epochs`."""
    return [replace(r, epochs=epochs) if r.auto_epochs else r for r in recipes]


def choose(recipes: Sequence[Recipe], full: int, n_val: int, n_test: int, budget_s: float | None,
           previous: dict[str, Any] | None = None, spent_s: float = 0.0) -> tuple[int | None, float, str]:
    """(epochs of the `auto` variants, None when none asks; the ladder fraction; why) for this budget.

    `previous` is the last run's budget.yaml: its choice is kept while its prediction stays in
    `KEEP_BAND`, so that speed drift neither flips the recipe nor restarts an unfinished run.
    """
    previous = previous or {}
    prev_fraction, prev_epochs = previous.get("fraction"), previous.get("epochs")
    span = epoch_range(recipes)
    if span is None:
        return None, *choose_fraction(recipes, full, n_val, n_test, budget_s, prev_fraction, spent_s)
    low, high = span
    if budget_s is None:
        return high, 1.0, f"no budget (run.budget_minutes: null): train.max_epochs ({high}) of the whole split"

    def total(epochs: int, fraction: float) -> float:
        return predict_total(at_epochs(recipes, epochs), fraction, full, n_val, n_test, spent_s)[2]

    if isinstance(prev_epochs, int) and low <= prev_epochs <= high and prev_fraction in LADDER:
        kept = total(prev_epochs, prev_fraction)
        if KEEP_BAND[0] * budget_s <= kept <= KEEP_BAND[1] * budget_s:
            return prev_epochs, prev_fraction, (
                f"kept the previous choice ({prev_epochs} epochs of {frac_text(prev_fraction)} of the split): its "
                f"prediction ({kept / 60:.1f} min) is within {KEEP_BAND[0]:.0%}..{KEEP_BAND[1]:.0%} of the budget")
    # Scanned down from the ceiling, not bisected: more epochs can mean more steps and so a larger,
    # faster batch (train.min_steps), so the total does not always grow with the count.
    for epochs in range(high, low - 1, -1):
        if (fitted := total(epochs, 1.0)) <= budget_s:
            if epochs == high:
                return epochs, 1.0, (f"train.max_epochs ({high}) of the whole split fit the budget "
                                     f"({fitted / 60:.1f} min predicted)")
            return epochs, 1.0, (f"the most epochs of the whole split that fit the budget ({fitted / 60:.2f} min "
                                 f"predicted; {epochs + 1} epochs: {total(epochs + 1, 1.0) / 60:.2f} min)")
    keep = prev_fraction if prev_epochs in (None, low) else None  # a fraction chosen at this same count
    fraction, reason = choose_fraction(at_epochs(recipes, low), full, n_val, n_test, budget_s, keep, spent_s)
    return low, fraction, f"train.min_epochs ({low}), the floor of `auto`: {reason}"


def frac_text(f: float) -> str:
    """A ladder fraction as a short fraction: 3/32."""
    return str(Fraction(f).limit_denominator(64))


def make_plan(recipes: Sequence[Recipe], n_train: int, n_val: int, n_test: int, budget_minutes: float | None,
              requested_images: int | None = None, previous: dict[str, Any] | None = None,
              spent: dict[str, float] | None = None) -> dict[str, Any]:
    """The plan: per-stage predictions, the chosen epochs and images per epoch, and the reasons.

    `previous`: the last run's budget.yaml (`budget_values`), for the hysteresis; `spent`: seconds the
    stages before the profiles took (prepare, as its report measured it), counted in the budget."""
    spent = spent or {}
    spent_s = sum(spent.values())
    full = n_train if requested_images is None else min(n_train, requested_images)
    budget_s = None if budget_minutes is None else budget_minutes * 60.0
    epochs, fraction, reason = choose(recipes, full, n_val, n_test, budget_s, previous, spent_s)
    recipes = recipes if epochs is None else at_epochs(recipes, epochs)
    recipes = kept_batches(recipes, previous, epochs, fraction)
    images, stages, total = predict_total(recipes, fraction, full, n_val, n_test, spent_s)
    _, _, unbudgeted = predict_total(recipes, 1.0, full, n_val, n_test, spent_s)
    val_cap, parity_cap = checked_images(fraction, n_val, n_test, None) if fraction < 1.0 else (None, None)
    return {
        "budget_minutes": budget_minutes,
        "fraction": fraction,
        "images_per_epoch": images,
        "val_images": val_cap,
        "parity_images": parity_cap,
        "train_images": n_train,
        "predicted_s": stages,
        "profile_s": {f"profile@{r.variant}": r.profile_s for r in recipes},
        "spent_s": dict(spent),
        "predicted_total_s": total,
        "predicted_total_unbudgeted_s": unbudgeted,
        "batch": {r.variant: r.batch_for(images) * r.world_size * r.accum_steps for r in recipes},
        "eval_batch": {r.variant: r.eval_batch for r in recipes},
        "export_batch": {r.variant: r.export_batch for r in recipes},
        "epochs": {r.variant: r.epochs for r in recipes},
        "epochs_auto": epochs,
        "epochs_range": epoch_range(recipes),
        "early_stop": {r.variant: r.patience for r in recipes if r.patience},
        "upper_bound": any(r.patience for r in recipes),
        "fits": budget_s is None or total <= budget_s * KEEP_BAND[1],
        "reason": reason,
        "recipes": [asdict(r) for r in recipes],
    }


def kept_batches(recipes: Sequence[Recipe], previous: dict[str, Any] | None, epochs: int | None,
                 fraction: float) -> list[Recipe]:
    """`recipes` with the previous run's `eval_batch` and `export_batch` where the plan keeps its previous
    choice (the same fraction and epochs), else with the batches their profiles timed.

    Training depends on budget.yaml, so a batch that followed every re-measured profile would retrain
    both variants whenever a profile's box (a new `profile.budget_share`, a slower hour) holds another
    halving of 256. The batches change with the training choice instead, when training reruns anyway;
    while they are kept, the plan predicts them at the speed timed at the profile's batch."""
    previous = previous or {}
    if previous.get("fraction") != fraction or previous.get("epochs") != epochs:
        return list(recipes)
    out = []
    for r in recipes:
        kept = {key: batches[r.variant] for key in ("eval_batch", "export_batch")
                if isinstance(batches := previous.get(key), dict) and isinstance(batches.get(r.variant), int)}
        out.append(replace(r, **kept))
    return out


def budget_values(plan: dict[str, Any]) -> dict[str, Any]:
    """What training depends on: only the chosen values, so a re-measured plan that chooses the same
    recipe retrains nothing. `epochs` only when a variant asks for `auto`; the batches change with the
    choice (`kept_batches`)."""
    whole = plan["fraction"] >= 1.0
    values = {"fraction": plan["fraction"], "images_per_epoch": None if whole else plan["images_per_epoch"],
              "val_images": plan.get("val_images"), "parity_images": plan.get("parity_images")}
    values.update({k: plan[k] for k in ("eval_batch", "export_batch") if k in plan})
    if plan.get("epochs_auto") is not None:
        values["epochs"] = plan["epochs_auto"]
    return values
