"""How the suite runs, as pytest hooks that tests/conftest.py imports (the fixtures stay there).

- **Child processes**: one thread each (OMP/MKL), DVC analytics off, and tests/child_hooks/ first on
  PYTHONPATH, so every stage of every `dvc repro` a test runs appends its start and end to the stage
  log (`CNNPIPE_STAGE_LOG`, default test-reports/stages.jsonl; `scripts/slowest_tests.py` reads it).
- **Longest first**: the tests that took longest in a recorded run (tests/durations.json, written by
  `python scripts/slowest_tests.py --record`) start first, spread over the xdist workers' first
  shares, after pytest-randomly's shuffle (which still orders everything else).
- **Every test's time**: set-up + call + tear-down of every test, to test-reports/durations.json.
- **Built in the background**: a fixture named in `BACKGROUND` (the reproduced project) starts
  building in a thread as soon as collection shows a test needs it, through `built_once`'s lock, so
  the tests that need it find it built or being built, and the tests ordered first run meanwhile.
- **Temp folder**: what the run leaves in the system temp folder (outside pytest's own) is listed at
  the end, and fails the run under CI when its name is one the tests' programs use (`OURS`).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = Path(__file__).with_name("durations.json")
SLOW_DEFAULT_S = 60.0
"""What a `slow`-marked test not yet in tests/durations.json is expected to take."""
HEAD_MIN_S = 20.0
"""Tests expected to take at least this long are ordered first; the rest keep pytest-randomly's order."""

_IS_WORKER = "PYTEST_XDIST_WORKER" in os.environ
REPORTS = Path(os.environ.setdefault("CNNPIPE_TEST_REPORTS", str(ROOT / "test-reports")))


def _child_environment() -> None:
    """What every process a test starts inherits (set at import: before xdist starts its workers)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # two workers on two cores: not 2 x cores threads
        os.environ.setdefault(var, "1")
    os.environ["DVC_NO_ANALYTICS"] = "1"  # else every dvc command leaves a report file in the temp folder
    # torch.compile's cache, kept between runs, but not in the system temp folder (its default)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".pytest_cache" / "torchinductor"))
    # DVC's per-repository state (/var/tmp/dvc/repo/<hash> by default): the tests' projects are gone
    # when the run ends, so is theirs.
    os.environ.setdefault("DVC_SITE_CACHE_DIR", str(ROOT / ".pytest_cache" / "dvc-site"))
    child_hooks = str(Path(__file__).with_name("child_hooks"))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != child_hooks]
    os.environ["PYTHONPATH"] = os.pathsep.join([child_hooks, *paths])
    if not _IS_WORKER:  # the controller (or the only process) starts a fresh log
        log = Path(os.environ.setdefault("CNNPIPE_STAGE_LOG", str(REPORTS / "stages.jsonl")))
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")


_child_environment()


# --------------------------------------------------------------------------- longest first
def recorded_durations() -> dict[str, float]:
    """Node id -> seconds, from the recorded run (empty where none is recorded)."""
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except FileNotFoundError:
        return {}


def expected_s(item: pytest.Item, recorded: dict[str, float]) -> float:
    if item.nodeid in recorded:
        return recorded[item.nodeid]
    return SLOW_DEFAULT_S if item.get_closest_marker("slow") else 0.0


def waits_on_background(item: pytest.Item) -> bool:
    return any(name in BACKGROUND for name in getattr(item, "fixturenames", ()))


def longest_first(items: list[pytest.Item], workers: int, recorded: dict[str, float]) -> list[pytest.Item]:
    """`items` with the long tests first. With several workers, xdist's worksteal hands out the list
    in `workers` consecutive shares (then steals from their ends): the long tests are dealt to the
    heads of the shares, the longest to the least loaded, so every worker starts with its long tests
    and no long test starts last. Long tests that need a background-built fixture come after the
    ones that do not, which run while it builds. Ties and the rest keep their (random) order."""
    long = [i for i in items if expected_s(i, recorded) >= HEAD_MIN_S]
    long.sort(key=lambda i: (waits_on_background(i), -expected_s(i, recorded)))
    ids = {id(i) for i in long}
    rest = [i for i in items if id(i) not in ids]
    if workers <= 1:
        return long + rest
    sizes, left = [], len(items)
    for k in range(workers):  # worksteal's first round: len(pending) // nodes_remaining each
        sizes.append(left // (workers - k))
        left -= sizes[-1]
    shares: list[list[pytest.Item]] = [[] for _ in sizes]
    load = [0.0] * workers
    for item in long:
        open_ = [k for k in range(workers) if len(shares[k]) < sizes[k]]
        k = min(open_, key=lambda k: load[k])
        shares[k].append(item)
        load[k] += expected_s(item, recorded)
    for item in rest:
        k = next(k for k in range(workers) if len(shares[k]) < sizes[k])
        shares[k].append(item)
    return [item for share in shares for item in share]


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, which runs first in its wrapper
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = longest_first(items, workers, recorded_durations())


# --------------------------------------------------------------------------- built in the background
BACKGROUND: dict[str, Callable[[Path], Any]] = {}
"""Fixture name -> the `build(folder)` its fixture passes to `built_once` under the same name."""

_builders: list[threading.Thread] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start each background build a collected test needs. Every worker starts its own thread; the
    first to take `built_once`'s lock builds, the others find it built."""
    from conftest import built_once  # noqa: PLC0415  (conftest imports this module)

    if session.config.option.collectonly:
        return
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ()) if name in BACKGROUND}
    factory = session.config._tmp_path_factory  # the factory the tests' own fixtures get
    if needed:
        factory.getbasetemp()  # made (a given --basetemp emptied) here, not by two threads at once
    for name in sorted(needed):
        def build(name: str = name) -> None:
            try:
                built_once(factory, name, BACKGROUND[name])
            except BaseException:  # noqa: BLE001  the test that needs it builds it again and reports the error
                pass
        thread = threading.Thread(target=build, name=f"built_once-{name}", daemon=True)
        thread.start()
        _builders.append(thread)


# --------------------------------------------------------------------------- every test's time
_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Set-up, call and tear-down of each test, summed (xdist sends the workers' reports here too)."""
    if not _IS_WORKER:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def _write_durations() -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    ranked = dict(sorted(((k, round(v, 2)) for k, v in _seconds.items()), key=lambda kv: -kv[1]))
    (REPORTS / "durations.json").write_text(json.dumps(ranked, indent=1) + "\n")


# --------------------------------------------------------------------------- the temp folder
_temp_before: set[str] = set()


def _temp_listing() -> set[str]:
    """The system temp folder's entries, less pytest's own (pytest-of-<user>, or a --basetemp there)."""
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if not p.name.startswith("pytest-of-")}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _IS_WORKER:
        _temp_before.update(_temp_listing())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _IS_WORKER:
        return
    if _seconds:
        _write_durations()
    left = set(_temp_listing() - _temp_before)
    if session.config.option.basetemp:
        left.discard(Path(session.config.option.basetemp).resolve().name)
    left = sorted(left)
    session.config.stash[_LEFT] = left
    if any(name.startswith(OURS) for name in left) and os.environ.get("CI") and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


OURS = ("cnnpipe-", "torchelastic_", ".tensorboard-info")
"""The temp files the project's launcher, torchrun and TensorBoard make: such a leftover fails CI. Any
other new name is listed: `tmp*` names are anyone's (a process outside the suite writing there
meanwhile would fail a run it had nothing to do with)."""


_LEFT = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left = config.stash.get(_LEFT, [])
    tmp = tempfile.gettempdir()
    if left:
        ours = any(name.startswith(OURS) for name in left)
        verdict = "FAILED (CI)" if os.environ.get("CI") and ours else "warning"
        terminalreporter.write_sep("=", f"temp folder {tmp}: {len(left)} new entries ({verdict})", red=True)
        for name in left[:50]:
            terminalreporter.write_line(f"  {tmp}/{name}")
        terminalreporter.write_line("Each test and launcher must remove what it makes there "
                                    "(or make it under tmp_path).")
    if not _IS_WORKER:
        terminalreporter.write_line(f"stage timings of every dvc repro: {os.environ.get('CNNPIPE_STAGE_LOG')} "
                                    "(python scripts/slowest_tests.py)")
