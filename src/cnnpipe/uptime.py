"""How long this process has run: what a stage costs the run, imports included (torch-free, so a
stage that never loads torch, like prepare, can time itself)."""

from __future__ import annotations

import time

import psutil


def process_seconds() -> float:
    """Wall seconds since this process started, imports included: what a stage costs the run."""
    return time.time() - psutil.Process().create_time()
