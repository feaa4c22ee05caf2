"""Pins: a reader's hard links to the store it opened, so an update swapped in mid-run (or a
`dvc repro` that removes the store first) unlinks names, never the files a running job reads."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any, Callable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _remove_stale_pins(readers: Path) -> None:
    """Pins of this machine's processes that are gone (killed before their clean-up ran)."""
    host = socket.gethostname()
    for pin in readers.glob(f"{host}-*") if readers.is_dir() else []:
        pid = pin.name[len(host) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(pin, ignore_errors=True)


_PINS: dict[tuple[str, int, int], Path] = {}


def pin_store(prepared_dir: Path, files: Callable[[dict[str, Any]], list[str]]) -> Path:
    """A folder of hard links to every file a reader needs of the store as it is now, kept until this
    process exits: a prepare that swaps in an update (or a `dvc repro` that removes the store first)
    unlinks names, never the files this run reads, so a run keeps reading the store it started with.
    `files(index)` names them, relative to the store. Returns the store itself where links are
    impossible (a read-only or foreign filesystem)."""
    prepared_dir = Path(prepared_dir).resolve()
    index_path = prepared_dir / "index.json"
    readers = prepared_dir.with_name(prepared_dir.name + ".readers")
    for _ in range(5):  # an update swapped in while we linked: start again
        st = index_path.stat()
        key = (str(prepared_dir), st.st_ino, st.st_mtime_ns)
        if key in _PINS and _PINS[key].is_dir():
            return _PINS[key]
        pin = readers / f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            _remove_stale_pins(readers)
            pin.mkdir(parents=True)
            os.link(index_path, pin / "index.json")
            names = files(json.loads((pin / "index.json").read_text(encoding="utf-8")))
            for folder in {(pin / name).parent for name in names}:
                folder.mkdir(parents=True, exist_ok=True)
            for name in names:
                os.link(prepared_dir / name, pin / name)
        except OSError:
            shutil.rmtree(pin, ignore_errors=True)
            if os.path.samestat(st, index_path.stat()):
                return prepared_dir  # links are not possible here: read the store in place
            continue
        if os.path.samestat(os.stat(pin / "index.json"), index_path.stat()):
            atexit.register(shutil.rmtree, pin, True)
            _PINS[key] = pin
            return pin
        shutil.rmtree(pin, ignore_errors=True)
    return prepared_dir
