"""How the suite runs: the order it starts tests in, the stage timings it keeps, the temp folder it
leaves, and the start-up cost of the stage the tests start most (prepare)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import suite_plugin
from conftest import ROOT
from suite_plugin import longest_first

sys.path.insert(0, str(ROOT / "scripts"))
import slowest_tests  # noqa: E402  (scripts/ is not a package)


def item(nodeid: str, *fixtures: str, slow: bool = False) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                           get_closest_marker=lambda name: object() if slow and name == "slow" else None)


def test_the_long_tests_head_each_workers_share_and_those_waiting_on_a_background_build_come_later():
    recorded = {"loop": 300.0, "recipe": 250.0, "kill": 100.0, "budget": 90.0}
    items = [item(f"t{i}") for i in range(6)] + [item("recipe", "reproduced"), item("budget", "reproduced"),
                                                 item("loop"), item("kill"), item("new", slow=True)]
    ordered = longest_first(items, 2, recorded)
    assert sorted(i.nodeid for i in ordered) == sorted(i.nodeid for i in items)  # nothing lost, nothing twice
    first, second = ordered[:5], ordered[5:]  # worksteal's first round: 11 // 2 = 5, then the other 6
    heads = [[i.nodeid for i in share if i.nodeid in recorded or i.nodeid == "new"] for share in (first, second)]
    # longest first, each to the less loaded share; in a share, those waiting on `reproduced` go last
    assert heads == [["loop", "budget"], ["kill", "new", "recipe"]]
    assert [i.nodeid for i in first[:2]] == heads[0] and [i.nodeid for i in second[:3]] == heads[1]
    assert [i.nodeid for i in first[2:] + second[3:]] == [f"t{i}" for i in range(6)]  # the rest keep their order


def test_alone_the_long_tests_simply_come_first():
    items = [item("a"), item("b", slow=True), item("c")]
    assert [i.nodeid for i in longest_first(items, 1, {"c": 90.0})] == ["c", "b", "a"]


def test_the_stage_log_gives_each_tests_stages_and_marks_a_killed_one(tmp_path):
    log = tmp_path / "stages.jsonl"
    records = [("start", 10.0, "prepare", "t::a", 1), ("end", 14.5, "prepare", "t::a", 1),
               ("start", 15.0, "train@optimized", "t::a", 2), ("start", 20.0, "prepare", "t::a", 3),
               ("end", 21.0, "prepare", "t::a", 3)]
    log.write_text("".join(json.dumps(dict(zip(("event", "t", "stage", "test", "pid"), r))) + "\n" for r in records))
    stages = slowest_tests.stage_times(log)
    assert stages["t::a"]["prepare"] == [4.5, 1.0] and stages["t::a"]["train@optimized"] == [None]
    assert slowest_tests.breakdown(stages["t::a"]) == "prepare 6 (2x), train@optimized 0 (killed)"


def test_a_stage_run_by_dvc_logs_its_start_and_end_with_the_test_that_ran_it(tmp_path):
    """The child hook as DVC would meet it: a stage's command (DVC_STAGE set) in a child of a test."""
    log = tmp_path / "stages.jsonl"
    env = dict(os.environ, DVC_STAGE="prepare", CNNPIPE_STAGE_LOG=str(log), PYTEST_CURRENT_TEST="t::x (call)")
    env.pop("CNNPIPE_STAGE_TIMED", None)
    subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', ''])"],
                   env=env, check=True)  # a stage that starts another Python: only the stage itself logs
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["event"], r["stage"], r["test"]) for r in lines] == [("start", "prepare", "t::x"),
                                                                     ("end", "prepare", "t::x")]


def test_prepare_starts_without_torch():
    """The stage the tests start most imports no torch: a second of start-up each time, and for users."""
    code = "import runpy, sys; sys.argv = ['prepare.py', '--help']\ntry:\n    runpy.run_path(sys.argv[0])\n" \
           "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'prepare imported torch'"
    subprocess.run([sys.executable, "-c", code.replace("sys.argv[0]", repr(str(ROOT / "stages" / "prepare.py")))],
                   check=True, capture_output=True)


def test_the_children_get_one_thread_and_dvc_without_analytics():
    assert os.environ["DVC_NO_ANALYTICS"] == "1" and os.environ["OMP_NUM_THREADS"]
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "tests" / "child_hooks")


def test_new_entries_in_the_temp_folder_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / "pytest-of-someone").mkdir()
    before = suite_plugin._temp_listing()
    (tmp_path / "cnnpipe-launch-x").mkdir()
    assert suite_plugin._temp_listing() - before == {"cnnpipe-launch-x"}
