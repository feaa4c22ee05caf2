"""The journal of an interrupted prepare: what it decoded, kept in `<store>.work/` until the swap.

A killed `prepare`, or one whose worker the OOM killer took, continues from the journal on the next
run; after a power cut, a line whose pixels did not reach the disk is dropped and that image decoded
again, never read back as black. Files that could not be used are journalled too (with their
reason), so a rerun does not read them again: a file that kills its decoder is tried twice in all,
never once per run.
"""

from __future__ import annotations

import array
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from cnnpipe.data.keys import digest_at
from cnnpipe.data.previous import RECIPE_FILE, read_frame

CHUNK = 16              # lines written per fsync at most once SYNC_EVERY_S has passed
SYNC_EVERY_S = 0.2      # the journal's fsyncs, at most this often


class Journal:
    """Decoded pixels and one JSON line per finished file, appended as they come: the resume point.

    Pixels are appended at once; their lines wait until the pixels are fsynced (`sync`: after `CHUNK`
    files once `SYNC_EVERY_S` has passed, so at most a few fsyncs a second even on NFS, where one can
    take 20 ms), so a line on disk has its pixels on disk even after a power cut, which may keep a
    file's length but not its last blocks. A kill loses at most that much decoding.
    A reopened journal still drops any line whose pixels are not there (and everything after it)
    and cuts off pixels past the last line. What it holds is looked up in sorted arrays (`lookup`),
    48 bytes a file.
    """

    def __init__(self, work: Path, wanted: dict[str, Any]) -> None:
        self.work, self.frame = work, wanted["size"] * wanted["size"] * wanted["channels"]
        self.shape = (wanted["size"], wanted["size"], wanted["channels"])
        recipe_path = work / RECIPE_FILE
        if work.exists() and (not recipe_path.exists() or json.loads(recipe_path.read_text()) != wanted):
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        recipe_path.write_text(json.dumps(wanted))
        lines_path, pixels_path = work / "journal.jsonl", work / "decoded.u8"
        keys, digests, rows = array.array("Q"), bytearray(), array.array("q")
        reasons: dict[int, str] = {}  # line number -> why the file is unusable (a few)
        whole = 0  # bytes of the lines file up to the last complete line
        on_disk = pixels_path.stat().st_size // self.frame if pixels_path.exists() else 0  # whole frames
        if lines_path.exists():
            with open(lines_path, "rb") as fh:
                for line in fh:
                    try:
                        item = json.loads(line) if line.endswith(b"\n") else None
                    except json.JSONDecodeError:
                        item = None
                    if item is None:  # the last line of a killed run may be cut short
                        break
                    if item["row"] >= on_disk:  # its pixels were lost (a power cut): decode it again
                        break
                    whole += len(line)
                    if item["reason"] is not None:
                        reasons[len(keys)] = item["reason"]
                    keys.append(item["key"])
                    digests += bytes.fromhex(item["sha256"])
                    rows.append(item["row"])
        all_keys = np.frombuffer(keys, dtype=np.uint64)
        # A file journalled twice (its copy source vanished, so it was read again) counts as its last line.
        order = np.argsort(all_keys, kind="stable")
        last = np.ones(len(order), dtype=bool)
        last[:-1] = all_keys[order][1:] != all_keys[order][:-1]
        self._lines_of = order[last]
        self._keys = all_keys[self._lines_of]
        self._digests = np.frombuffer(bytes(digests), dtype="S32")
        self._rows = np.frombuffer(rows, dtype=np.int64)
        self._reasons = reasons
        self.rows = int(self._rows.max()) + 1 if len(self._rows) else 0
        # Cut a torn last line off (so new lines do not follow half of one) and the pixels past the
        # last line; truncating costs nothing at 10M lines, where rewriting the file would not.
        with open(lines_path, "ab") as fh:
            fh.truncate(whole)
        with open(pixels_path, "ab") as fh:
            fh.truncate(self.rows * self.frame)
        self._lines = open(lines_path, "a", encoding="utf-8")
        self._pixels = open(pixels_path, "ab")
        self._reader: int | None = None
        self._pending: list[str] = []  # lines whose pixels are not yet fsynced
        self._synced_at = time.monotonic()

    def __len__(self) -> int:
        """Files the journal held when it was opened."""
        return len(self._keys)

    def lookup(self, key: int) -> tuple[bytes, int, str | None] | None:
        """(sha256, pixel row or -1, reason when unusable) journalled for a file's `stat_key`, or None."""
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        if i == len(self._keys) or self._keys[i] != key:
            return None
        line = int(self._lines_of[i])
        return digest_at(self._digests, line), int(self._rows[line]), self._reasons.get(line)

    def record(self, key: int, digest: bytes, image: np.ndarray | None, reason: str | None) -> int:
        """Keep one file's outcome; returns the pixel row (-1 when there are no new pixels)."""
        row = -1
        if image is not None:
            self._pixels.write(np.ascontiguousarray(image).tobytes())
            self._pixels.flush()  # readable by `pixels` at once; durable at the next `sync`
            row, self.rows = self.rows, self.rows + 1
        self._pending.append(json.dumps({"key": key, "sha256": digest.hex(), "row": row, "reason": reason}))
        if len(self._pending) >= CHUNK and time.monotonic() - self._synced_at >= SYNC_EVERY_S:
            self.sync()
        return row

    def sync(self) -> None:
        """Make the pixels durable, then write the lines that point at them."""
        self._pixels.flush()
        os.fsync(self._pixels.fileno())
        if self._pending:
            self._lines.write("\n".join(self._pending) + "\n")
            self._lines.flush()
            os.fsync(self._lines.fileno())
            self._pending.clear()
        self._synced_at = time.monotonic()

    def pixels(self, row: int) -> np.ndarray:
        """One decoded image back (pread, not a memory map: see `PreviousStore.pixels`)."""
        if self._reader is None:
            self._pixels.flush()
            self._reader = os.open(self.work / "decoded.u8", os.O_RDONLY)
        return read_frame(self._reader, row, self.shape)

    def close(self) -> None:
        self.sync()
        self._lines.close()
        self._pixels.close()
        if self._reader is not None:
            os.close(self._reader)
            self._reader = None
