"""Shared fixtures: tiny real data sets written by the tests themselves.

The suite never touches the network: the hub is offline for this process and every child it starts
(set here, before timm or huggingface_hub is imported, so a test file run alone is hermetic too).
tests/test_hub.py serves its own hub on 127.0.0.1 to test the download path.

Under pytest-xdist (`scripts/test.sh` runs two workers) an expensive read-only fixture is built once
for the whole run, not once per worker: `built_once` keys it by name in the run's shared temp folder.
How the run itself is arranged (threads, stage timings, longest first, background builds, the temp
folder check) is tests/suite_plugin.py, whose hooks are imported here.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["DVC_NO_ANALYTICS"] = "1"

import numpy as np
import pytest
import yaml
from filelock import FileLock
from PIL import Image

from cnnpipe.data.sources import idx
from cnnpipe.data.prepare import prepare_fashion_mnist
from cnnpipe.params import resolve
from suite_plugin import (  # noqa: F401  (pytest finds hooks by name in a conftest)
    BACKGROUND,
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
)

ROOT = Path(__file__).resolve().parents[1]


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images whose class is learnable: a bright square whose position depends on the label."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 10
    rng.shuffle(labels)
    images = rng.integers(0, 40, size=(n, 28, 28), dtype=np.uint8)
    for i, label in enumerate(labels):
        r, c = divmod(int(label), 5)
        images[i, 2 + r * 12 : 10 + r * 12, 1 + c * 5 : 6 + c * 5] = 220
    return images, labels.astype(np.uint8)


def write_fake_fmnist(out: Path) -> Path:
    """The four Fashion-MNIST IDX files (synthetic, 600 train / 200 test) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 600, 0), ("test", 200, 1)):
        idx.write_split(out, split, *_blobs(n, seed))
    return out


@pytest.fixture(scope="session")
def fake_fmnist(tmp_path_factory) -> Path:
    """A directory with the four Fashion-MNIST IDX files (synthetic, 600 train / 200 test)."""
    return write_fake_fmnist(tmp_path_factory.mktemp("fmnist"))


_THREAD_LOCKS: dict[str, threading.Lock] = {}


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], Any]) -> tuple[Path, Any]:
    """`build(folder)` run once per test run, whichever worker asks first; every worker then gets
    (folder, what `build` returned, as JSON). Callers must treat the folder as read-only.

    Alone (no xdist) this is a plain session cache. Under xdist the workers share the parent of their
    temp folders, so the first one builds under a file lock while the others wait for it: a fixture
    that takes a minute (a reproduced project) costs a minute per run, not per worker.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / f"built-{name}", shared / f"built-{name}.json"
    # A thread of this process may be building it (tests/suite_plugin.py): the file lock is for other
    # processes; threads of this one wait on a lock of its own first.
    with _THREAD_LOCKS.setdefault(name, threading.Lock()), FileLock(str(shared / f"built-{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that raised left behind
            folder.mkdir()
            result = build(folder)
            done.write_text(json.dumps(result))  # last: a build that raised is redone by the next caller
    return folder, json.loads(done.read_text())


@pytest.fixture
def one_thread():
    """Step times and their shares depend on torch's thread count, which other tests change: one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def prepared(fake_fmnist, tmp_path_factory) -> Path:
    """The synthetic Fashion-MNIST prepared as `tiny_params()` says (read-only: copy it to change it)."""
    def build(out: Path) -> None:
        prepare_fashion_mnist(resolve(tiny_params(), "optimized").data, 0, out, search_dirs=(fake_fmnist,))

    return built_once(tmp_path_factory, "prepared", build)[0]


def base_params() -> dict:
    """The project's params.yaml as a dict."""
    return yaml.safe_load((ROOT / "params.yaml").read_text())


PROJECT_FILES = ("dvc.yaml", "stages", "src", ".dvc/config", ".dvc/plots", ".dvcignore", "pyproject.toml",
                 "data/raw/README.md", "weights/README.md", ".gitignore", "data/delivery/cleared.csv")
"""What a user's checkout of the project holds, for the tests that run real `dvc` in a copy of it."""


def copy_project(root: Path) -> Path:
    """A copy of the project's files (no venv, data or outputs) at `root`."""
    for name in PROJECT_FILES:
        src, dst = ROOT / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dst)
    return root


def tiny_params(**train_overrides) -> dict:
    """params.yaml shrunk for CPU tests: a tiny timm model, 2 epochs, small batches."""
    params = base_params()
    params["data"].update(image_size=28, stored_size=28, max_train_images=None, max_eval_images=None)
    params["model"].update(name="test_resnet", pretrained="false")
    # checkpoint_every 1: resume tests need last.pt after every epoch (`auto` skips some of a tiny run's)
    params["train"].update({"epochs": 2, "batch_size": 32, "lr": 0.2, "threads": 1, "checkpoint_every": 1,
                            **train_overrides})
    params["profile"].update(wait=0, warmup=1, active=2, trial_steps=1, trial_rounds=2)
    params["variants"]["baseline"]["train"]["batch_size"] = 32
    # The shipped `compile: auto` would compile the tiny model in every profile with no time box:
    # test_compile_is_judged_over_the_whole_run times it once.
    params["variants"]["optimized"]["train"].pop("compile", None)
    return params


SMALLEST_PROFILE = 0.001
"""`profile.budget_share` for the end-to-end tests that check what the pipeline does with a profile, not
what the profile measures: a time box of a second or less at any budget, less than the stage's start-up,
so each profile measures the least it can (a probe, two steps at the recipe's batch or at 64, the
smallest training runs at, a two-step trace, one inference call) and times no trial (each is noted
as out of time). A profile with its trials took ~18 s of every such `dvc repro` here, two per repro. What the profile measures is tested in test_profile.py,
test_profile_box.py and test_gpu_ready.py, and its trials through `dvc repro` in test_pipeline.py's
test_profile_params_retrain_only_when_the_tuned_values_change."""


def write_params(path: Path, params: dict) -> Path:
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def save_image(path: Path, array: np.ndarray, mode: str | None = None, **kwargs) -> Path:
    """Write an image file with PIL (format from the extension)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
    img.save(path, **kwargs)
    return path


def colour_image(seed: int, size: tuple[int, int] = (40, 30)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)


def _run_for_build(cmd: list[str], cwd: Path, name: str) -> str:
    """`cmd` for a `built_once` build (maybe in a background thread): its stages are logged under
    `built_once <name>`, not under whichever test the worker runs meanwhile."""
    import subprocess
    import sys

    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTEST_CURRENT_TEST=f"built_once {name}")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def build_reproduced(root: Path) -> str:
    """A git + DVC copy of the project whose Fashion-MNIST is the synthetic one (DVC-tracked in
    data/raw), after one `dvc repro`; returns that run's output. For `reproduced` (tests/test_pipeline.py),
    started in the background at collection (tests/suite_plugin.py)."""
    def run(*cmd: str) -> str:
        return _run_for_build(list(cmd), root, "reproduced")

    copy_project(root)
    write_fake_fmnist(root / "data" / "raw" / "fashion-mnist")  # the "copy under data/raw" route
    params = tiny_params()
    params["data"]["stored_size"] = 32  # resized from 28 by prepare, cropped to 28 for the model
    params["profile"]["budget_share"] = SMALLEST_PROFILE  # the tests that change the profiles' params set their own
    write_params(root / "params.yaml", params)
    run("git", "init", "-q")
    run("dvc", "add", "-q", "data/raw/fashion-mnist")  # the raw data travels through DVC too
    run("git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return run("dvc", "repro")


BACKGROUND["reproduced"] = build_reproduced


def eval_loader_batches(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> list[int]:
    """The batch sizes each call to `build_eval_loader` in `modules` asks for, in call order (the loaders
    are the real ones): how a test sees which batch the plan's `eval_batch`/`export_batch` reached."""
    batches: list[int] = []
    for module in modules:
        def recording(split: Any, batch_size: int, real: Callable = module.build_eval_loader, **kw: Any) -> Any:
            batches.append(batch_size)
            return real(split, batch_size=batch_size, **kw)
        monkeypatch.setattr(module, "build_eval_loader", recording)
    return batches


class Ran(NamedTuple):
    """What a stage run by `stage` left: its exit code and what it printed."""

    code: int
    err: str
    out: str


Stage = Callable[..., Ran]


@pytest.fixture
def stage(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Stage:
    """`stage(cwd, script, *args)`: stages/<script> run as `python stages/<script> *args` from `cwd`, in
    this process (a fresh interpreter spends ~5 s importing torch and timm). An exception the stage does
    not turn into an exit code fails the test, as its traceback would fail the subprocess. What a stage
    changes in the process is put back: the working folder, argv, the environment, warning filters and
    torch's thread count."""
    import torch

    def run(cwd: Path, script: str, *args: str) -> Ran:
        path = ROOT / "stages" / script
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [str(path), *args])
        environ, threads = dict(os.environ), torch.get_num_threads()
        capsys.readouterr()
        try:
            with warnings.catch_warnings():
                runpy.run_path(str(path), run_name="__main__")
            code = 0
        except SystemExit as exc:  # sys.exit's own rule: None is 0, an int itself, anything else 1
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        finally:
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
        printed = capsys.readouterr()
        return Ran(code, printed.err, printed.out)
    return run


def meta_lines(store: Path, split: str) -> list[dict]:
    """The meta dict (source, sha256, ...) of each image of a prepared split, in the split's order."""
    from cnnpipe.data.store.meta import in_folder, split_meta

    return list(split_meta(in_folder(store), split))
