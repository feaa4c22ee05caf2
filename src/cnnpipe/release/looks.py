"""How many times the drift bound has looked at one anchor: the error `release.drift_error` is spent
over `release.drift_weeks` looks per anchor, retries included, so the gate must know which look this is.

A look is a challenger judged against the anchor. The looks are read from the verdicts git holds:
every version of the gate's verdict (`metrics/gate.json`) on any ref (branches, tags, and the
`refs/exps` commits `dvc exp run` makes), those whose anchor has this anchor's sha256 (a verdict's
`champion.anchor.sha256`, else the champion's own when it was its own anchor). Distinct challengers
count (by sha256): the same model judged again is the same look. A verdict nobody commits is a look
this count cannot see; commit each week's verdict, refused or not. Another anchor's verdicts do not
count: a new anchor starts at look 1.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def anchor_sha256(about: dict[str, Any]) -> str | None:
    """The sha256 of the drift anchor the champion stage's champion.json (`about`) names: its recorded
    anchor, else the champion itself (its own anchor)."""
    return (about.get("anchor") or {}).get("sha256") or about.get("sha256")


def anchor_of(verdict: dict[str, Any]) -> str | None:
    """The sha256 of the anchor a verdict measured the drift from (None: it judged no drift)."""
    return anchor_sha256(verdict.get("champion") or {}) if "drift" in verdict else None


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)


def committed_verdicts(verdict_path: Path) -> tuple[list[dict[str, Any]], str]:
    """Every version of the verdict at `verdict_path` that git holds on any ref, and where they came
    from in words. Outside a git repository: none, and the words say so."""
    folder = verdict_path.resolve().parent
    while not folder.is_dir():  # the gate writes its folder after counting
        folder = folder.parent
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        return [], f"{verdict_path.parent} is in no git repository: no earlier verdict is known"
    root = Path(top.stdout.strip())
    rel = verdict_path.resolve().relative_to(root).as_posix()
    commits = _git(root, "log", "--all", "--format=%H", "--", rel).stdout.split()
    if not commits:
        return [], f"no commit on any ref holds {rel} yet"
    listed = subprocess.run(["git", "-C", str(root), "cat-file", "--batch"], capture_output=True, check=False,
                            input="".join(f"{c}:{rel}\n" for c in commits).encode()).stdout
    verdicts, at = [], 0
    while at < len(listed):  # "<oid> blob <size>\n<content>\n" per commit, "<name> missing\n" where deleted
        line_end = listed.index(b"\n", at)
        header = listed[at:line_end].split()
        at = line_end + 1
        if len(header) != 3:
            continue
        body, at = listed[at : at + int(header[2])], at + int(header[2]) + 1
        try:
            verdicts.append(json.loads(body))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # not a verdict (a file of another kind at that path once): no look of the gate's
    return verdicts, f"{len(commits)} commit(s) on any ref holding {rel}"


def look_at_anchor(verdict_path: Path, anchor_sha256: str, challenger_sha256: str) -> dict[str, Any]:
    """Which look at the anchor `anchor_sha256` judging `challenger_sha256` is (1 for the first), with
    the challengers judged against it before and where they were read from."""
    verdicts, source = committed_verdicts(verdict_path)
    earlier = sorted({(v.get("challenger") or {}).get("sha256") for v in verdicts
                      if anchor_of(v) == anchor_sha256} - {None, challenger_sha256})
    return {"look": len(earlier) + 1, "earlier_challengers": earlier, "counted_from": source}
