"""The slowest tests of the last run, each with the `dvc repro` stages it ran and how long each took.

Reads what the suite wrote (tests/suite_plugin.py): test-reports/durations.json (every test's set-up +
call + tear-down) and test-reports/stages.jsonl (each stage's start and end, with the test that ran
it). Prints a Markdown table, the one docs/testing.md keeps:

    python scripts/slowest_tests.py            # the slowest 25
    python scripts/slowest_tests.py --top 10
    python scripts/slowest_tests.py --record   # also: tests/durations.json, the order of the next run

A stage that ran more than once in a test is summed, with its count; a stage killed by its test
(no end) is marked "killed". Stages built for a shared fixture are listed as `built_once <name>`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD_MIN_S = 5.0
"""Tests at least this slow go into tests/durations.json (the rest keep the random order)."""


def stage_times(log: Path) -> dict[str, dict[str, list[float | None]]]:
    """Test -> stage -> the seconds of each run of it (None: started, never ended)."""
    starts: dict[int, dict] = {}
    out: dict[str, dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    for line in log.read_text().splitlines() if log.exists() else []:
        record = json.loads(line)
        if record["event"] == "start":
            starts[record["pid"]] = record
        elif (start := starts.pop(record["pid"], None)) is not None:
            out[start["test"]][start["stage"]].append(record["t"] - start["t"])
    for start in starts.values():
        out[start["test"]][start["stage"]].append(None)
    return out


def breakdown(stages: dict[str, list[float | None]]) -> str:
    parts = []
    for stage, runs in sorted(stages.items(), key=lambda kv: -sum(r or 0 for r in kv[1])):
        done = [r for r in runs if r is not None]
        text = f"{stage} {sum(done):.0f}"
        if len(runs) > 1:
            text += f" ({len(runs)}x)"
        if len(done) < len(runs):
            text += " (killed)"
        parts.append(text)
    return ", ".join(parts)


def table(durations: dict[str, float], stages: dict[str, dict[str, list[float | None]]], top: int) -> str:
    rows = ["| Test | Seconds | Stages (s) |", "| --- | ---: | --- |"]
    for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1])[:top]:
        rows.append(f"| {nodeid.removeprefix('tests/')} | {seconds:.1f} | {breakdown(stages.get(nodeid, {}))} |")
    for name in sorted(k for k in stages if k.startswith("built_once ")):
        total = sum(r or 0 for runs in stages[name].values() for r in runs)
        rows.append(f"| ({name}: a shared fixture) | {total:.1f} | {breakdown(stages[name])} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=Path, default=ROOT / "test-reports")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--record", action="store_true", help="write tests/durations.json from this run")
    args = parser.parse_args(argv)
    found = args.reports / "durations.json"
    if not found.exists():
        print(f"slowest_tests: {found} not found: run the suite first (bash scripts/test.sh)", file=sys.stderr)
        return 1
    durations = json.loads(found.read_text())
    print(table(durations, stage_times(args.reports / "stages.jsonl"), args.top))
    if args.record:
        kept = {k: v for k, v in durations.items() if v >= RECORD_MIN_S}
        (ROOT / "tests" / "durations.json").write_text(json.dumps(kept, indent=1) + "\n")
        print(f"\nrecorded {len(kept)} tests of {RECORD_MIN_S:.0f} s or more in tests/durations.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
