"""Swapping finished folders in for the old ones (the store and its split ledger), crash-safe.

A prepare builds `<final>.new` beside each output and swaps it in by renames, so no file of the old
store is rewritten and a failed run leaves it as it was. A crash (a kill, a power cut) at any step of
the swap must lose neither the old pair nor the finished new one, and must never leave a store from
one run beside a ledger from another. So:

1. every file and folder of each `.new` is fsynced (renames are durable only after their data is);
2. a marker `<first final>.swap` is written and fsynced: from here on the new folders are complete;
3. each old folder is renamed to `<final>.old` and each new one to `<final>`, the parent fsynced;
4. the marker is removed, then the `.old` folders.

`recover`, run first by every prepare, finishes a swap that has its marker (every `.new` is complete)
and undoes one that has not (a `.new` may be half written): either way the outputs are one run's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

Pairs = Sequence[tuple[Path, Path]]  # (staged folder, final folder)


def _reached(step: str) -> None:
    """Called after each durable step; tests replace it to kill the process there."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder below `folder` (files with nothing new to write cost a syscall)."""
    for parent, _, files in os.walk(folder):
        for name in files:
            _fsync(Path(parent) / name)
        _fsync(Path(parent))


def staged(final: Path) -> Path:
    return final.with_name(final.name + ".new")


def _old(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def _marker(pairs: Pairs) -> Path:
    final = pairs[0][1]
    return final.with_name(final.name + ".swap")


def swap_in(pairs: Pairs) -> None:
    """Replace each final folder by its staged one, all of them or (after a crash) none."""
    for new, _ in pairs:
        fsync_tree(new)
    parents = {final.parent for _, final in pairs}
    _reached("staged")
    marker = _marker(pairs)
    with open(marker, "w", encoding="utf-8") as fh:
        json.dump([[str(new), str(final)] for new, final in pairs], fh)
        fh.flush()
        os.fsync(fh.fileno())
    for parent in parents:
        _fsync(parent)
    _reached("marked")
    _roll_forward(pairs, marker)


def _roll_forward(pairs: Pairs, marker: Path) -> None:
    for new, final in pairs:
        if new.exists():
            if final.exists():
                if _old(final).exists():  # left by an earlier run's clean-up: nobody's data
                    shutil.rmtree(_old(final))
                os.rename(final, _old(final))
                _fsync(final.parent)
                _reached(f"{final.name} set aside")
            os.rename(new, final)
            _fsync(final.parent)
            _reached(f"{final.name} swapped in")
    marker.unlink()
    _fsync(marker.parent)
    _reached("unmarked")
    for _, final in pairs:
        shutil.rmtree(_old(final), ignore_errors=True)  # unlinks only: open maps of the old files stay valid


def recover(finals: Sequence[Path]) -> str | None:
    """Finish or undo a swap a crash left halfway; returns what it did (None: nothing to do)."""
    pairs = [(staged(final), final) for final in finals]
    marker = _marker(pairs)
    if marker.exists():
        _roll_forward(pairs, marker)
        return "finished the swap an interrupted prepare had started (its new store was complete)"
    undone = False
    for new, final in pairs:
        if new.exists():
            shutil.rmtree(new)
            undone = True
        if not final.exists() and _old(final).exists():  # only a swap without its marker could leave this
            os.rename(_old(final), final)
            undone = True
        shutil.rmtree(_old(final), ignore_errors=True)
    return "removed the unfinished store an interrupted prepare left" if undone else None
