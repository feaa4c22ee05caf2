"""No host sync in the training step: what would stall a GPU's host, counted on the CPU.

Every recipe runs 100 optimizer steps through the real `micro_step` under `HostSyncCounter`. The one
documented read is the NaN guard's (`checks_loss`: the last micro-batch of every 50th optimizer
step), so 100 steps read the loss twice, whatever the recipe, and nothing else syncs.
"""

from __future__ import annotations

import math

import pytest
import torch
from timm.data import Mixup
from timm.utils import ModelEmaV3
from torch.utils._python_dispatch import TorchDispatchMode

from cnnpipe.data.loaders.transforms import AugmentConfig, FastTransform, crop_params
from cnnpipe.train import engine
from cnnpipe.train.distributed import DistInfo
from cnnpipe.train.ema import ModelEma
from cnnpipe.train.engine import StepContext, micro_step
from cnnpipe.train.syncs import KINDS, HostSyncCounter

STEPS = 100
NAN_READS = 2  # steps 0 and 50
NONE = dict.fromkeys(KINDS, 0)
CPU = torch.device("cpu")


def tiny_net() -> torch.nn.Module:
    """Two convolutions with BatchNorm (float statistics and an integer step counter for the EMA)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, 10))


def batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random uint8 NHWC images (16 px, cropped to 12) and labels, as the fast loader yields them."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (8, 16, 16, 3), dtype=torch.uint8, generator=g),
             torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def train_transform() -> FastTransform:
    return FastTransform(AugmentConfig(12, scale=(0.35, 1.0)), (0.5,) * 3, (0.25,) * 3, train=True,
                         channels_last=True, seed=0)


def context(amp: str = "off", optimizer: str = "sgd", fused: bool = False, scaler: bool = False,
            ema: bool = False, grad_clip: float | None = None, mixup: bool = False, accum: int = 1) -> StepContext:
    """A step context built the way the trainer builds one, from the recipe's switches."""
    model = tiny_net()
    impl = {"fused": True} if fused else {"foreach": True}
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **impl) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3, **impl))
    return StepContext(model, opt, CPU, amp, scaler=torch.amp.GradScaler("cpu") if scaler else None,
                       grad_clip=grad_clip, lr_for_step=lambda step: 0.01,
                       ema=ModelEma(model, decay=0.99) if ema else None,
                       mixup=Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=10) if mixup else None,
                       accum_steps=accum)


def run_steps(ctx: StepContext, steps: int = STEPS, start: int = 0) -> HostSyncCounter:
    data, transform = batches(), train_transform()
    with HostSyncCounter() as syncs:
        for step in range(start, start + steps):
            for micro in range(ctx.accum_steps):
                images, labels = data[micro % len(data)]
                micro_step(ctx, images, labels, transform, step, micro == 0, micro == ctx.accum_steps - 1)
    return syncs


RECIPES = {
    "bf16": dict(amp="bf16"),
    "fp16_scaler_fused_sgd": dict(amp="fp16", scaler=True, fused=True),
    "fp16_scaler_fused_adamw": dict(amp="fp16", scaler=True, fused=True, optimizer="adamw"),
    "ema": dict(ema=True),
    "grad_clip": dict(grad_clip=1.0),
    "grad_clip_fp16_scaler": dict(amp="fp16", scaler=True, fused=True, grad_clip=1.0),
    "mixup_cutmix": dict(mixup=True),
    "accumulation": dict(accum=4),
    "everything": dict(amp="fp16", scaler=True, fused=True, ema=True, grad_clip=1.0, mixup=True, accum=4),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_training_step_reads_only_the_periodic_loss(recipe):
    syncs = run_steps(context(**RECIPES[recipe]))
    assert syncs.counts() == {**NONE, "item": NAN_READS}, syncs.report()
    assert all("_forward_backward" in s.where for s in syncs.syncs), syncs.report()


def test_a_scaler_with_a_foreach_optimizer_reads_found_inf_every_step():
    """Why training wants `fused=True` with fp16: the seam sees GradScaler's host read otherwise."""
    syncs = run_steps(context(amp="fp16", scaler=True, fused=False), steps=10)
    scaler_reads = [s for s in syncs.syncs if "grad_scaler" in s.where]
    assert len(scaler_reads) == 10 and syncs.counts()["item"] == 10 + 1, syncs.report()


def test_the_nan_guard_still_stops_on_a_checked_step():
    ctx = context(accum=2)
    with torch.no_grad():
        ctx.model[-1].bias.fill_(math.nan)
    run_steps(ctx, steps=49, start=1)  # unchecked steps: no read, no error
    with pytest.raises(engine.NonFiniteLoss, match="loss is nan at optimizer step 50"):
        run_steps(ctx, steps=1, start=50)


def test_an_epoch_reads_its_mean_loss_once_more():
    ctx, data = context(), batches()
    with HostSyncCounter() as syncs:
        stats = engine.train_one_epoch(ctx, data * (STEPS // len(data)), train_transform(), start_step=0)
    assert stats.steps == STEPS and math.isfinite(stats.loss)
    assert syncs.counts() == {**NONE, "item": NAN_READS + 1}, syncs.report()


def eval_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(5)


def eval_transform(images: torch.Tensor) -> torch.Tensor:
    return FastTransform(AugmentConfig(12), (0.5,) * 3, (0.25,) * 3, train=False, channels_last=False, seed=0)(images)


def test_evaluation_reads_once_at_the_end_and_matches_the_logits():
    model, info = tiny_net(), DistInfo(device=CPU)
    with HostSyncCounter() as syncs:
        result = engine.evaluate_top1(model, eval_batches(), eval_transform, info, "off")
    assert syncs.counts() == {**NONE, "to_host": 1}, syncs.report()
    with HostSyncCounter() as syncs:
        logits, labels = engine.predict(model, eval_batches(), eval_transform, CPU, "off")
    assert syncs.counts() == {**NONE, "to_host": 1}, syncs.report()
    assert logits.shape == (40, 10) and result["top1"] == engine.topk_correct(logits, labels, 1) / 40
    assert result["top5"] == engine.topk_correct(logits, labels, 5) / 40
    assert result["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)


def test_one_batch_generator_serves_evaluation_and_predict():
    """`eval_logits`, which both walk: float32 logits left on the device, the model in eval mode without
    autograd at the recipe's precision, and not one read to the host."""
    model = tiny_net().train()
    with HostSyncCounter() as syncs:
        out = list(engine.eval_logits(model, eval_batches(), eval_transform, CPU, "bf16"))
    assert syncs.counts() == NONE, syncs.report()
    assert not model.training and len(out) == 5
    assert all(logits.dtype == torch.float32 and not logits.requires_grad and logits.shape == (8, 10)
               for logits, _ in out)
    assert all(torch.equal(got, given) for (_, got), (_, given) in zip(out, eval_batches()))  # as the loader gave them
    logits, labels = engine.predict(model, eval_batches(), eval_transform, CPU, "bf16")
    assert torch.equal(logits, torch.cat([batch for batch, _ in out]))
    top1 = engine.evaluate_top1(model, eval_batches(), eval_transform, DistInfo(device=CPU), "bf16")["top1"]
    assert top1 == engine.topk_correct(logits, labels, 1) / 40


def test_the_crop_draws_once_per_batch_with_the_documented_distributions():
    ops, transform, images = _OpLog(), train_transform(), batches(1)[0][0]
    with ops:
        transform(images)
    random_ops = [op for op in ops.names if op.startswith(("aten.rand", "aten.uniform", "aten.bernoulli"))]
    assert random_ops == ["aten.rand.generator"]
    # Areas and ratios small enough that no crop is clamped: the draws show undistorted.
    aug = AugmentConfig(12, scale=(0.2, 0.7), ratio=(3 / 4, 4 / 3))
    x0, y0, w, h, flip = crop_params(20_000, aug, 16, 24, torch.Generator().manual_seed(0))
    area, log_ratio = (w / 24) * (h / 16), torch.log((w / 24) / (h / 16))
    assert 0.2 - 1e-5 <= area.min() and area.max() <= 0.7 + 1e-5 and abs(area.mean().item() - 0.45) < 0.01
    assert log_ratio.abs().max() <= math.log(4 / 3) + 1e-5 and abs(log_ratio.mean().item()) < 0.01
    assert abs((x0 / (24 - w)).mean().item() - 0.5) < 0.01 and abs((y0 / (16 - h)).mean().item() - 0.5) < 0.01
    assert abs(flip.float().mean().item() - 0.5) < 0.01


class _OpLog(TorchDispatchMode):
    """The aten ops run while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_ema_is_one_foreach_lerp_and_matches_timm():
    model = tiny_net()
    ours, timms = ModelEma(model, decay=0.9), ModelEmaV3(model, decay=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches()
    for step in range(6):
        model(train_transform()(data[step % 4][0])).logsumexp(1).mean().backward()
        opt.step()
        opt.zero_grad()
        ops = _OpLog()
        with ops:
            ours.update(model, step=step)
        assert ops.names == ["aten._foreach_lerp_.Scalar", "aten._foreach_copy_.default"]
        timms.update(model, step=step)
    ours_state, timm_state = ours.state_dict(), timms.state_dict()
    assert list(ours_state) == list(timm_state)
    for key in timm_state:
        assert torch.equal(ours_state[key], timm_state[key]), key
    restored = ModelEma(tiny_net(), decay=0.9)
    restored.load_state_dict(timm_state)  # a checkpoint written with timm's EMA resumes into ours
    assert torch.equal(restored.module[0].weight, timms.module[0].weight)


def test_the_seam_counts_each_kind_and_undoes_its_patches():
    t = torch.tensor([1.0, 2.0, 2.0])
    sync, own_cpu = torch.cuda.synchronize, torch.Tensor.__dict__.get("cpu")
    with HostSyncCounter() as syncs:
        t[0].item(), bool(t[1]), t[t > 1], t.unique(), t.tolist(), t.cpu()
        with pytest.raises(Exception):  # no GPU here: counted, then the real call fails
            torch.cuda.synchronize()
    assert syncs.counts() == {**NONE, "item": 2, "nonzero": 1, "unique": 1, "to_host": 2, "wait": 1}
    assert "test_host_syncs.py" in syncs.syncs[0].where
    assert torch.cuda.synchronize is sync and torch.Tensor.__dict__.get("cpu") is own_cpu
    with HostSyncCounter() as syncs:
        (t * 2).sum()
    assert syncs.counts() == NONE
