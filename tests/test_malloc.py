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
import json, sys, torch
from cnnpipe import malloc
for mode in sys.argv[1:]:
    malloc.use_malloc(mode)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3, padding=1))
x = torch.randn(16, 3, 128, 128)  # activations of 32 MiB, the cap of glibc's own threshold
faults = []
for _ in range(6):
    start = malloc.usage()
    net(x).square().mean().backward()
    faults.append(malloc.KernelTime.since(start).faults)
print(json.dumps({"faults": sorted(faults[2:])[1], "current": malloc.current()}))
"""
"""A training step whose activations are 32 MiB each; its median page faults after two warm-up steps."""

ACTIVATION_PAGES = (16 * 32 * 128 * 128 * 4) // 4096


def step_faults(*modes: str) -> dict:
    """Page faults of one step in a fresh interpreter whose allocator was set to `modes` in turn."""
    out = subprocess.run([sys.executable, "-c", STEP, *modes], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_keep_stops_each_step_faulting_its_freed_memory_in_again():
    system = step_faults()
    kept = step_faults("keep")
    assert system["current"] == "system" and system["faults"] >= ACTIVATION_PAGES  # glibc's defaults
    assert kept == {"faults": pytest.approx(0, abs=system["faults"] / 100), "current": "keep"}


def test_system_after_keep_faults_again_as_glibc_does():
    """The profile's A/B blocks switch back and forth in one process: `system` must be glibc's again."""
    again = step_faults("keep", "system")
    assert again["current"] == "system" and again["faults"] >= ACTIVATION_PAGES


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
    malloc.use_malloc("system")  # glibc's defaults: nothing to set, so nothing to refuse
    with pytest.raises(malloc.MallocUnavailable, match="train.malloc: keep needs glibc"):
        malloc.use_malloc("keep")
    assert malloc.keep_for_inference() == "system"


def test_the_allocator_does_not_change_what_training_computes(tmp_path):
    """A resume (or another node) with another allocator continues the same run."""
    cfg = resolve(load_params(write_params(tmp_path / "params.yaml", tiny_params())), "optimized")
    assert ckpt.computed_settings(cfg.with_train(malloc="keep")) == ckpt.computed_settings(
        cfg.with_train(malloc="system"))
