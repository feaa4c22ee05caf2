"""Hooks for the processes the test suite starts; Python imports this module at their start-up.

tests/suite_plugin.py puts this folder first on PYTHONPATH for every process the tests start. Each
hook is off unless its environment variable is set, and costs nothing then (no import beyond `os`).

- Stage timing (CNNPIPE_STAGE_LOG): a DVC stage's command (DVC sets DVC_STAGE for it) appends one JSON
  line when it starts and one when it ends, with the test that ran it (pytest's PYTEST_CURRENT_TEST,
  inherited), so `scripts/slowest_tests.py` can pin a slow test to a stage. A stage killed by a test
  (SIGKILL) has a start and no end. Only the stage's first Python process logs: torchrun's agent and
  workers inherit CNNPIPE_STAGE_TIMED and stay quiet.
- A pause after the first checkpoint (CNNPIPE_TEST_PAUSE_AT_CHECKPOINT=<folder>): the first process to
  write a last.pt writes `<folder>/paused` (the checkpoint's epoch) once that epoch's checkpoints are
  written (last.pt, and best.pt with it), and waits until `<folder>/resume` exists. A test kills the run there: on any machine the kill lands after a
  checkpoint and before the run ends, placed by that event, not by a delay.
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


if os.environ.get("CNNPIPE_TEST_PAUSE_AT_CHECKPOINT"):
    import importlib.abc
    import importlib.util
    import sys

    _PAUSE = os.environ["CNNPIPE_TEST_PAUSE_AT_CHECKPOINT"]
    _wrote_last = []  # set by save_atomic when it wrote a last.pt; read after the epoch's checkpoints

    def _recording(save):
        def save_atomic(state, path, *args, **kwargs):
            save(state, path, *args, **kwargs)
            if os.path.basename(str(path)) == "last.pt":
                _wrote_last.append(state.get("epoch"))
        return save_atomic

    def _pausing(save_checkpoints):
        def save_checkpoints_then_pause(*args, **kwargs):
            save_checkpoints(*args, **kwargs)  # last.pt and, when validation improved, best.pt
            if not _wrote_last:
                return
            paused, resume = os.path.join(_PAUSE, "paused"), os.path.join(_PAUSE, "resume")
            try:  # the first last.pt of the whole run only, whichever process writes it
                os.close(os.open(paused + ".claim", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            with open(paused + ".tmp", "w") as fh:
                fh.write(str(_wrote_last[-1]))
            os.replace(paused + ".tmp", paused)
            import time

            while not os.path.exists(resume):
                time.sleep(0.05)

        return save_checkpoints_then_pause

    _PATCHES = {"cnnpipe.train.checkpoint": ("save_atomic", _recording),
                "cnnpipe.train.pacing": ("save_checkpoints", _pausing)}

    class _PatchCheckpoints(importlib.abc.MetaPathFinder):
        """Wraps the checkpoint writers as their modules are first imported (before any `from` import
        binds them)."""

        def find_spec(self, name, path=None, target=None):
            if name not in _PATCHES or getattr(self, "busy", False):
                return None
            self.busy = True
            try:
                spec = importlib.util.find_spec(name)
            finally:
                self.busy = False
            attribute, wrap = _PATCHES[name]
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                setattr(module, attribute, wrap(getattr(module, attribute)))

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchCheckpoints())
