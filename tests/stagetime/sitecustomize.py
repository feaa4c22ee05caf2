"""Stage timing for the test suite: when a `dvc repro` that a test runs starts and ends each stage.

tests/conftest.py puts this folder first on PYTHONPATH for every process the tests start, so Python
imports this module at start-up. It does nothing unless the process is a DVC stage's command (DVC sets
DVC_STAGE for it) and the suite asked for a log (CNNPIPE_STAGE_LOG). Then it appends one JSON line
when the stage starts and one when it ends, with the test that ran it (pytest's PYTEST_CURRENT_TEST,
inherited), so `scripts/test_report.py` can pin a slow test to a stage. A stage killed by a test
(SIGKILL) has a start and no end. Only the stage's first Python process logs: torchrun's agent and
workers inherit CNNPIPE_STAGE_TIMED and stay quiet.
"""

import os

if os.environ.get("DVC_STAGE") and os.environ.get("CNNPIPE_STAGE_LOG") and not os.environ.get("CNNPIPE_STAGE_TIMED"):
    import atexit
    import json
    import time

    os.environ["CNNPIPE_STAGE_TIMED"] = "1"

    def _log(event: str) -> None:
        record = {"event": event, "t": round(time.time(), 3), "stage": os.environ["DVC_STAGE"],
                  "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "pid": os.getpid()}
        try:  # one short O_APPEND write: lines from parallel stages never interleave
            fd = os.open(os.environ["CNNPIPE_STAGE_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # a timing log must never fail the stage it times

    _log("start")
    atexit.register(_log, "end")
