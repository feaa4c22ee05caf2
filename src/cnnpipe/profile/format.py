"""The profile JSON's shared vocabulary, for the stage that writes it and the report that reads it."""

from __future__ import annotations

from typing import Any

REGIONS = ("data_wait", "copy", "augment", "forward", "backward", "optimizer", "sync")
"""The step's phases, in order; each is a region timer and a profiler label."""


def all_trials(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The one-knob trials, then the combined (or "recommended") one when there was one."""
    return result["trials"] + ([result["combined_trial"]] if result.get("combined_trial") else [])
