"""The project's code and params copied next to a bench's data: the benches that run `dvc repro` or
the stages on a project of their own start from this copy of the checkout."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("dvc.yaml", "params.yaml", "stages", "src", ".dvcignore", "pyproject.toml", ".gitignore",
                 "weights/README.md", "data/raw/README.md", "data/delivery/cleared.csv")
"""What a copy needs to run the pipeline: the code, the params and the files git and DVC expect."""


def copy_project(dst: Path, items: Iterable[str] = PROJECT_FILES) -> Path:
    """A fresh copy of `items` (paths relative to the checkout) at `dst`, caches and build files left out."""
    shutil.rmtree(dst, ignore_errors=True)
    for item in items:
        src, out = ROOT / item, dst / item
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, out)
    return dst
