"""The model's exponential moving average, as one foreach lerp per step.

Follows timm's `ModelEmaV3` (same decay rule, same `update(model, step=...)`, `.module`, state-dict
keys), whose update rebuilds both models' state dicts every step: two Python walks over every
module, a host cost that grows with the model's depth and that a GPU step cannot hide. Here the
tensor pairs are collected once and each update is one `torch._foreach_lerp_` over the floating
ones (parameters and BatchNorm statistics) plus one `torch._foreach_copy_` of the rest (the
BatchNorm step counters), with the same numbers as timm's for fp32 weights.
"""

from __future__ import annotations

import copy
import weakref

import torch

RUN_HORIZONS = 5
"""The fewest EMA horizons (1 / (1 - decay) steps) a run spans: the weights it starts from then weigh
at most exp(-5) < 1% in the final average. A fixed decay would not follow the run's length: 0.998
averages over ~500 steps, longer than a 100-step run, whose average would stay mostly its start."""


def decay_for_run(decay: float, total_steps: int) -> float:
    """`decay` (train.ema_decay), lowered when needed so the run's `total_steps` span `RUN_HORIZONS`
    horizons: the average follows the epoch count the run trains, whatever chose it."""
    return min(decay, max(0.0, 1.0 - RUN_HORIZONS / max(1, total_steps)))


class ModelEma(torch.nn.Module):
    """timm ModelEmaV3's average without warm-up: the model's weights copied on steps 0 and 1, then
    `ema = decay * ema + (1 - decay) * model` each step; non-float buffers copied.

    The EMA's tensors are bound to the model's on the first `update`, so the model's tensors must be
    updated in place afterwards (as optimizers and `load_state_dict` do); updating from another model
    object binds again.
    """

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        self._source: weakref.ref | None = None
        self._ema_float: list[torch.Tensor] = []
        self._model_float: list[torch.Tensor] = []
        self._ema_other: list[torch.Tensor] = []
        self._model_other: list[torch.Tensor] = []

    def get_decay(self, step: int | None = None) -> float:
        """timm's rule: `decay`, except 0 (a plain copy) on steps 0 and 1."""
        if step is None:
            return self.decay
        return self.decay if step > 1 else 0.0

    def _bind(self, model: torch.nn.Module) -> None:
        """Pair the EMA's state-dict tensors with the model's, once, as timm pairs them every step."""
        ema_state, model_state = self.module.state_dict(keep_vars=True), model.state_dict(keep_vars=True)
        if list(ema_state) != list(model_state):
            raise ValueError("ModelEma.update: the model's state-dict keys differ from the averaged copy's "
                             "(pass the unwrapped model, not its DDP or compiled wrapper)")
        pairs = list(zip(ema_state.values(), model_state.values()))
        low = sorted({str(e.dtype) for e, _ in pairs if e.dtype in (torch.float16, torch.bfloat16)})
        if low:
            raise ValueError(f"ModelEma keeps no {'/'.join(low)} average: (1 - decay) * (model - ema) is below "
                             f"their resolution; train with fp32 weights (autocast keeps them so)")
        floating = [(e, m) for e, m in pairs if e.is_floating_point()]
        other = [(e, m) for e, m in pairs if not e.is_floating_point()]
        self._ema_float, self._model_float = [e for e, _ in floating], [m for _, m in floating]
        self._ema_other, self._model_other = [e for e, _ in other], [m for _, m in other]
        self._source = weakref.ref(model)

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int | None = None) -> None:
        """Move the average towards `model` (the unwrapped training model) after optimizer step `step`."""
        if self._source is None or self._source() is not model:
            self._bind(model)
        if self._ema_float:
            torch._foreach_lerp_(self._ema_float, self._model_float, 1.0 - self.get_decay(step))
        if self._ema_other:
            torch._foreach_copy_(self._ema_other, self._model_other)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
