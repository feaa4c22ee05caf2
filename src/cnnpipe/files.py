"""Atomic writes: a crash never leaves a half-written result file behind."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text(path: Path, text: str) -> None:
    """Write to a temp file beside `path`, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Indented UTF-8 JSON, written atomically."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
