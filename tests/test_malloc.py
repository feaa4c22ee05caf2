"""`train.malloc`: whether a step's freed memory stays in the process.

The allocator's state is the process's, so the mechanism is tested in fresh interpreters: a step's
worth of large blocks freed and allocated again faults its pages in again under glibc's defaults,
and not under `keep`. Page faults are counted, never timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cnnpipe import malloc
from cnnpipe.params import ParamsError, load_params, resolve
from cnnpipe.train import checkpoint as ckpt
from cnnpipe.train.tuning import default_for, resolve_auto
from conftest import tiny_params, write_params

pytestmark = pytest.mark.skipif(not malloc.available(), reason="glibc's mallopt: Linux with glibc only")

STEP = """
import json, statistics, sys, torch
from cnnpipe import malloc
for mode in sys.argv[1:]:
    malloc.use_malloc(mode)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 40, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(40, 40, 3, padding=1))
x = torch.randn(16, 3, 128, 128)  # activations of 40 MiB, over glibc's own threshold at its cap
faults = []
for _ in range(6):
    start = malloc.usage()
    net(x).square().mean().backward()
    faults.append(malloc.KernelTime.since(start).faults)
print(json.dumps({"faults": statistics.median(faults[2:]), "current": malloc.current()}))
"""
"""A training step whose activations are 40 MiB each; its median page faults after two warm-up steps.
Counted in pages, which may be huge pages (transparent huge pages `always`): the tests compare counts."""


def step_faults(*modes: str) -> dict:
    """Page faults of one step in a fresh interpreter whose allocator was set to `modes` in turn."""
    out = subprocess.run([sys.executable, "-c", STEP, *modes], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_keep_stops_each_step_faulting_its_freed_memory_in_again():
    system = step_faults()
    kept = step_faults("keep")
    assert system["current"] == "system" and system["faults"] > 0  # glibc's defaults: every step, again
    # none on a quiet machine; a few thousand when the step's threads land elsewhere (a busy one)
    assert kept["current"] == "keep" and kept["faults"] <= system["faults"] / 10


def test_system_after_keep_faults_again_as_glibc_does():
    """The profile's A/B blocks switch back and forth in one process: `system` must be glibc's again."""
    fresh, again = step_faults(), step_faults("keep", "system")
    assert again["current"] == "system" and again["faults"] == pytest.approx(fresh["faults"], rel=0.5)


class RefusingLibc:
    """glibc before 2.35: mallopt refuses an mmap threshold over half its 64 MiB arena heap."""

    def __init__(self) -> None:
        self.set: dict[int, int] = {}

    def mallopt(self, param: int, value) -> int:
        if param == malloc.M_MMAP_THRESHOLD and value.value > 32 << 20:
            return 0
        self.set[param] = value.value
        return 1


def test_an_older_glibc_keeps_what_its_mallopt_takes(monkeypatch):
    libc = RefusingLibc()
    monkeypatch.setattr(malloc, "_libc", lambda: libc)
    monkeypatch.setattr(malloc, "_current", None)
    malloc.use_malloc("keep")
    assert libc.set == {malloc.M_MMAP_THRESHOLD: 32 << 20, malloc.M_TRIM_THRESHOLD: 2**31 - 1}
    assert malloc.current() == "keep"


def test_a_glibc_that_refuses_keep_is_an_error_for_training_and_not_for_evaluate(monkeypatch):
    monkeypatch.setattr(malloc, "_libc", lambda: type("Refuses", (), {"mallopt": lambda self, p, v: 0})())
    monkeypatch.setattr(malloc, "_current", None)
    with pytest.raises(malloc.MallocUnavailable, match="set train.malloc: system"):
        malloc.use_malloc("keep")
    assert malloc.keep_for_inference() == "system"  # evaluate and export run at glibc's defaults instead


def test_an_unknown_allocator_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ParamsError, match="train.malloc"):
        resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params(malloc="jemalloc"))), "optimized")
    with pytest.raises(ValueError, match="train.malloc"):
        malloc.use_malloc("auto")  # resolved before it is used


def test_without_glibc_auto_means_system_and_keep_is_an_error_naming_the_key(monkeypatch, tmp_path):
    monkeypatch.setattr(malloc, "available", lambda: False)
    monkeypatch.setattr(malloc, "_current", None)
    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params())), "optimized")
    assert cfg.train.malloc == "auto" and default_for("malloc", torch.device("cpu")) == "system"
    assert resolve_auto(cfg, torch.device("cpu")).train.malloc == "system"
    tuned_elsewhere = {"malloc": "keep"}  # a committed profile from a glibc machine
    assert resolve_auto(cfg, torch.device("cpu"), tuned_elsewhere).train.malloc == "system"
    malloc.use_malloc("system")  # glibc's defaults: nothing to set, so nothing to refuse
    with pytest.raises(malloc.MallocUnavailable, match="train.malloc: keep needs glibc"):
        malloc.use_malloc("keep")
    assert malloc.keep_for_inference() == "system"


def test_the_allocator_does_not_change_what_training_computes(tmp_path):
    """A resume (or another node) with another allocator continues the same run."""
    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params())), "optimized")
    assert ckpt.computed_settings(cfg.with_train(malloc="keep")) == ckpt.computed_settings(
        cfg.with_train(malloc="system"))
