"""An override's record: `python -m cnnpipe.promote --override WHY` writes it into both tags, and
`python -m cnnpipe.release.verify` accepts a refused model only on a record it can check.

The record is one line of the tag's message, `cnnpipe-override: {json}`: who overrode (git's
`user.name`), why, and what was refused, by the md5s the commit's dvc.lock records for the verdict
(`metrics/gate.json`, the gate stage's output) and for the model it judged (`models/optimized`,
train@optimized's output: the folder `fetch` serves from). `verify` accepts it only when both are the
md5s of the commit the tag names: a hand-written "OVERRIDE by ..." tag carries no record, and a
record copied onto another commit names another verdict and model. It is a consistency check, not a
signature: whoever can push tags can write any record; sign the tags (`git tag -s`) where that matters.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

MARK = "cnnpipe-override: "
MADE_BY = "python -m cnnpipe.promote --override"
GATE = "metrics/gate.json"
MODEL_DIR = "models/optimized"
MODEL_STAGE = "train@optimized"
FIELDS = ("by", "why", "gate_md5", "model_md5", "made_by")


def _lock_md5(entries: list[dict[str, Any]] | None, path: str) -> str | None:
    return next((e.get("md5") for e in entries or [] if e.get("path") == path), None)


def judged_ids(lock_text: str) -> dict[str, str | None]:
    """The md5s dvc.lock (its text) records for the gate's verdict and for the model train@optimized made."""
    stages = (yaml.safe_load(lock_text) or {}).get("stages") or {}
    return {"gate_md5": _lock_md5((stages.get("gate") or {}).get("outs"), GATE),
            "model_md5": _lock_md5((stages.get(MODEL_STAGE) or {}).get("outs"), MODEL_DIR)}


def record_line(who: str, why: str, lock_text: str) -> str:
    """The record promote puts in the tags of an override of the verdict and model `lock_text` records."""
    ids = judged_ids(lock_text)
    missing = [k for k, v in ids.items() if not v]
    if missing:
        raise ValueError(f"dvc.lock records no {' or '.join(missing)} (the gate's {GATE}, {MODEL_STAGE}'s "
                         f"{MODEL_DIR}): an override must name the verdict and model it overrides; run `dvc repro gate` "
                         "and commit")
    return MARK + json.dumps({"by": who, "why": why, **ids, "made_by": MADE_BY}, sort_keys=True)


def read_record(message: str) -> dict[str, Any] | None:
    """The override record in a tag's message, or None when it has none (or one that is not JSON)."""
    for line in message.splitlines():
        if line.startswith(MARK):
            try:
                found = json.loads(line[len(MARK):])
            except json.JSONDecodeError:
                return None
            return found if isinstance(found, dict) else None
    return None


def claims_override(message: str) -> bool:
    """Whether a tag's message says it overrides the gate (promote's words, or a record)."""
    return message.startswith("OVERRIDE") or MARK in message


def check_override(tag: str, message: str, lock_text: str) -> str | None:
    """Why the override in `tag`'s message does not hold for the commit whose dvc.lock is `lock_text`
    (None: it does): no record of promote's, a field missing, or other md5s than that commit's."""
    found = read_record(message)
    if found is None:
        return (f"{tag} says OVERRIDE but carries no override record ({MARK.strip()} ...): only `{MADE_BY} WHY` "
                "makes an override verify accepts; run it on this commit")
    missing = [k for k in FIELDS if not found.get(k)]
    if missing or found.get("made_by") != MADE_BY:
        return f"{tag}'s override record is not promote's (missing or wrong: {', '.join(missing) or 'made_by'})"
    ids = judged_ids(lock_text)
    other = [f"{k} {found[k]} where this commit's dvc.lock records {ids[k]}" for k in ("gate_md5", "model_md5")
             if found[k] != ids[k]]
    if other:
        return (f"{tag}'s override was made for another verdict or model ({'; '.join(other)}): an override holds only "
                f"for the model it was made for; run `{MADE_BY} WHY` on this commit")
    return None


def describe(message: str) -> str:
    """An override record in words: who, why, and the md5s of what was overridden."""
    found = read_record(message) or {}
    return (f"by {found.get('by')}: {found.get('why')} (verdict md5 {found.get('gate_md5')}, "
            f"model md5 {found.get('model_md5')})")
