"""Count, on the CPU, what would stall the host on CUDA: the seam that proves a training step sync-free.

On a GPU the host queues kernels and runs ahead of them. An operation whose result the host must see
stops it until the GPU has drained its queue: a scalar read (`.item()`, `if tensor:`, `float(t)`), an
output whose shape depends on the data (`nonzero`, boolean-mask indexing, `masked_select`, `unique`),
a copy to host memory (`.cpu()`, `.tolist()`, `.numpy()`), pinning host memory, and an explicit wait
(`synchronize`). The same Python runs these on the CPU, where they cost nothing, so a test can count
them there. On CUDA itself PyTorch's own `torch.cuda.set_sync_debug_mode("warn")` is the mechanism;
this seam is its stand-in for CPU-only CI.

Seen: every aten op the Python frontend dispatches (through a `TorchDispatchMode`, the mechanism of
PyTorch's debug modes) and, patched while active, the host-copy methods and the CUDA waits, which
never reach the dispatcher on a CPU tensor. Not seen: `.to("cpu")` (on the CPU it looks like any
other `.to`) and syncs inside a CUDA kernel's own implementation.
"""

from __future__ import annotations

import collections
import functools
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("item", "nonzero", "masked_select", "unique", "pin_memory", "wait", "to_host")
"""What is counted. `nonzero` includes boolean-mask indexing (`x[mask]`, `x[mask] = v`), which runs it."""

_aten = torch.ops.aten
_OP_KIND = {
    _aten._local_scalar_dense.default: "item",  # .item(), bool(), float(), int() of a tensor
    _aten.equal.default: "item",  # returns a Python bool
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.unique_dim_consecutive.default: "unique",
    _aten._pin_memory.default: "pin_memory",
    _aten.pin_memory.default: "pin_memory",
}
_MASK_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                  _aten._index_put_impl_.default}
_HOST_COPIES = ("cpu", "tolist", "numpy")


@dataclass(frozen=True)
class HostSync:
    """One operation that would make the host wait for the GPU."""

    kind: str
    op: str
    where: str
    """The innermost frame, then the innermost frame of our own code when that is another one."""


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__ and not _is_machinery(f.filename)]
    if not frames:
        return "?"

    def short(f: traceback.FrameSummary) -> str:
        return f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}"

    ours = [f for f in frames if "site-packages" not in f.filename and "/torch/" not in f.filename]
    inner = short(frames[-1])
    return inner if not ours or ours[-1] is frames[-1] else f"{inner} <- {short(ours[-1])}"


def _is_machinery(filename: str) -> bool:
    """The dispatch mode's own frames (dynamo wraps `__torch_dispatch__`): never the place to fix."""
    return "/torch/_dynamo/" in filename or filename.endswith(("/torch/_compile.py", "_python_dispatch.py"))


def _is_mask_indexing(func: Any, args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return func in _MASK_INDEXING and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class HostSyncCounter(TorchDispatchMode):
    """While active (`with HostSyncCounter() as syncs:`), records every would-be host sync in `syncs.syncs`.

    Runs everything unchanged; only the counting costs time, so use it in tests and benches, not in
    training.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[HostSync] = []
        self._restore: list[Callable[[], None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _OP_KIND.get(func)
        if kind is None and _is_mask_indexing(func, args):
            kind = "nonzero"
        if kind is None and kwargs.get("pin_memory"):  # torch.empty(..., pin_memory=True)
            kind = "pin_memory"
        if kind is not None:
            self.syncs.append(HostSync(kind, str(func), _where()))
        return func(*args, **kwargs)

    def record(self, kind: str, op: str) -> None:
        """Count one sync that does not pass the dispatcher (a host copy, an explicit wait)."""
        self.syncs.append(HostSync(kind, op, _where()))

    def counts(self) -> dict[str, int]:
        """Syncs per kind, every kind listed (zero included)."""
        seen = collections.Counter(s.kind for s in self.syncs)
        return {kind: seen[kind] for kind in KINDS}

    def report(self) -> str:
        """One line per (kind, op, place), most frequent first: what to fix, and where."""
        lines = collections.Counter((s.kind, s.op, s.where) for s in self.syncs)
        return "\n".join(f"{n:5d} x {kind:13s} {op:32s} {where}" for (kind, op, where), n in lines.most_common())

    def __enter__(self) -> HostSyncCounter:
        self._patch(torch.Tensor, _HOST_COPIES, "to_host")
        self._patch(torch.cuda, ("synchronize",), "wait")
        self._patch(torch.cuda.Event, ("synchronize",), "wait")
        self._patch(torch.cuda.Stream, ("synchronize",), "wait")
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
            self._patch(torch.accelerator, ("synchronize",), "wait")
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        while self._restore:
            self._restore.pop()()

    def _patch(self, owner: Any, names: tuple[str, ...], kind: str) -> None:
        """Wrap `owner.name` to record `kind` and then run the original; undone on exit."""
        for name in names:
            original = getattr(owner, name)
            own = owner.__dict__.get(name, _MISSING)  # a class may only inherit it (torch.Tensor.cpu)

            @functools.wraps(original)
            def counted(*args: Any, _original: Callable = original, _op: str = name, **kwargs: Any) -> Any:
                self.record(kind, f"{getattr(owner, '__name__', owner)}.{_op}")
                return _original(*args, **kwargs)

            setattr(owner, name, counted)
            self._restore.append(functools.partial(_unpatch, owner, name, own))


_MISSING = object()


def _unpatch(owner: Any, name: str, own: Any) -> None:
    if own is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, own)
