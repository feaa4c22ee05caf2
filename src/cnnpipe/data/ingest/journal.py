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

from cnnpipe.data.store import codec
from cnnpipe.data.store.keys import digest_at
from cnnpipe.data.store.previous import RECIPE_FILE, read_frame
from cnnpipe.data.store.shards import OFFSET_DTYPE, OFFSETS

CHUNK = 16              # lines written per fsync at most once SYNC_EVERY_S has passed
SYNC_EVERY_S = 1.0      # the journal's fsyncs, at most this often: each rewrites the last page of both files


def where(segment: int, row: int) -> int:
    """One int for a frame of the journal: its segment and row (-1: no pixels)."""
    return (segment << 32) | row


class Journal:
    """Decoded pixels and one JSON line per finished file, appended as they come: the resume point,
    and the new shards of the store.

    Pixels go into segment files of `rows_per_segment` frames (a shard's worth); once the run is
    done, each segment is hard-linked into the new store as a shard as it is, so a new image is
    written once, not journalled and then copied (`writer.StoreWriter.keep`). A JPEG store's journal
    (`encoding`) holds the JPEG records instead, encoded by the decoding workers, up to
    `segment_bytes` a segment, each line with its record's offset and length; `sidecar` writes a
    segment's offsets, and the segment becomes a JPEG shard the same way: a new photo's record is
    written once, its raw pixels never. A segment is never appended to once a run has reopened it: it
    may be a shard of the store in place already.

    Lines wait until their pixels are fsynced (`sync`: after `CHUNK` files once `SYNC_EVERY_S` has
    passed, so at most one fsync a second even on NFS, where one can take 20 ms, and on a machine that
    reads every file of a pulled catalog once, a few pages a second written again), so a line on
    disk has its pixels on disk even after a power cut, which may keep a file's length but not its
    last blocks. A kill loses at most that much decoding. A reopened journal drops any line whose
    pixels are not there (and everything after it); frames past the last line are cut off by
    copying what is good into a new file, never by truncating one a store may share. What it holds is
    looked up in sorted arrays (`lookup`), 48 bytes a file.
    """

    def __init__(self, work: Path, wanted: dict[str, Any], rows_per_segment: int,
                 encoding: dict[str, Any] | None = None, segment_bytes: int | None = None) -> None:
        self.work, self.frame = work, wanted["size"] * wanted["size"] * wanted["channels"]
        self.shape, self.rows_per_segment = (wanted["size"], wanted["size"], wanted["channels"]), rows_per_segment
        # A JPEG store's journal holds its records (a tenth of the pixels), `segment_bytes` of them a segment.
        self.encoding = dict(encoding or {})
        self.encoded = bool(self.encoding)
        self.quality = int(self.encoding.get("quality", 0))
        self.segment_bytes = segment_bytes or rows_per_segment * self.frame
        recipe = {**wanted, **self.encoding}  # a raw journal's recipe is as it was before encodings
        recipe_path = work / RECIPE_FILE
        if work.exists() and (not recipe_path.exists() or json.loads(recipe_path.read_text()) != recipe):
            shutil.rmtree(work)
        (work / "segments").mkdir(parents=True, exist_ok=True)
        recipe_path.write_text(json.dumps(recipe))
        lines_path = work / "journal.jsonl"
        sizes = {int(p.stem): p.stat().st_size for p in (work / "segments").glob(f"*{self._suffix}")}
        keys, digests, wheres = array.array("Q"), bytearray(), array.array("q")
        reasons: dict[int, str] = {}  # line number -> why the file is unusable (a few)
        self._ends: dict[int, array.array] = {}  # segment -> where each of its rows ends (bytes)
        whole = 0  # bytes of the lines file up to the last complete line
        if lines_path.exists():
            with open(lines_path, "rb") as fh:
                for line in fh:
                    try:
                        item = json.loads(line) if line.endswith(b"\n") else None
                    except json.JSONDecodeError:
                        item = None
                    if item is None:  # the last line of a killed run may be cut short
                        break
                    if item["seg"] >= 0:
                        ends = self._ends.setdefault(item["seg"], array.array("Q"))
                        end = item["off"] + item["len"] if self.encoded else (item["row"] + 1) * self.frame
                        if item["row"] != len(ends) or end > sizes.get(item["seg"], 0):
                            break  # its pixels were lost (a power cut): decode it again
                        ends.append(end)
                    whole += len(line)
                    if item["reason"] is not None:
                        reasons[len(keys)] = item["reason"]
                    keys.append(item["key"])
                    digests += bytes.fromhex(item["sha256"])
                    wheres.append(where(item["seg"], item["row"]) if item["seg"] >= 0 else -1)
        all_keys = np.frombuffer(keys, dtype=np.uint64)
        # A file journalled twice (its copy source vanished, so it was read again) counts as its last line.
        order = np.argsort(all_keys, kind="stable")
        last = np.ones(len(order), dtype=bool)
        last[:-1] = all_keys[order][1:] != all_keys[order][:-1]
        self._lines_of = order[last]
        self._keys = all_keys[self._lines_of]
        self._digests = np.frombuffer(bytes(digests), dtype="S32")
        self._wheres = np.frombuffer(wheres, dtype=np.int64)
        self._reasons = reasons
        for segment, size in sizes.items():
            ends = self._ends.get(segment)
            self._keep_frames(segment, ends[-1] if ends else 0, size)
        with open(lines_path, "ab") as fh:  # a torn last line off, so new lines do not follow half of one
            fh.truncate(whole)
        self._lines = open(lines_path, "a", encoding="utf-8")
        self._segment = max(sizes, default=-1)  # new pixels go to a new segment, never a reopened one
        self._pixels: Any = None
        self._rows = self._bytes = 0  # rows and bytes in the open segment (none open yet)
        self._readers: dict[int, int] = {}
        self._pending: list[str] = []  # lines whose pixels are not yet fsynced
        self._synced_at = time.monotonic()

    @property
    def _suffix(self) -> str:
        return ".jpg" if self.encoded else ".u8"

    def _keep_frames(self, segment: int, used: int, size: int) -> None:
        """Keep only the first `used` bytes of a reopened segment (its rows that have lines), in a new
        file when that cuts any."""
        path = self.segment_path(segment)
        if used == 0:
            path.unlink()
        elif used != size:
            tmp = path.with_suffix(".tmp")
            with open(path, "rb") as src, open(tmp, "wb") as out:
                out.write(src.read(used))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)  # a new inode: a store that links the old one keeps it whole

    def segment_path(self, segment: int) -> Path:
        return self.work / "segments" / f"{segment:06d}{self._suffix}"

    def __len__(self) -> int:
        """Files the journal held when it was opened."""
        return len(self._keys)

    def lookup(self, key: int) -> tuple[bytes, int, str | None] | None:
        """(sha256, `where` its pixels are or -1, reason when unusable) journalled for a file's
        `stat_key`, or None."""
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        if i == len(self._keys) or self._keys[i] != key:
            return None
        line = int(self._lines_of[i])
        return digest_at(self._digests, line), int(self._wheres[line]), self._reasons.get(line)

    def record(self, key: int, digest: bytes, image: np.ndarray | bytes | None, reason: str | None) -> int:
        """Keep one file's outcome (its pixels, or a JPEG journal's record: pixels given are encoded
        here); returns `where` they are (-1 when there are none)."""
        at, segment, row, extra = -1, -1, -1, {}
        if image is not None:
            if self.encoded and isinstance(image, np.ndarray):
                image = codec.encode(image, self.quality)
            data = image if isinstance(image, bytes) else np.ascontiguousarray(image).tobytes()
            if self._pixels is None or (self._rows > 0 and (self._bytes + len(data) > self.segment_bytes if self.encoded
                                                            else self._rows >= self.rows_per_segment)):
                self._next_segment()
            self._pixels.write(data)
            self._pixels.flush()  # readable by `pixels` at once; durable at the next `sync`
            segment, row = self._segment, self._rows
            if self.encoded:
                extra = {"off": self._bytes, "len": len(data)}
            self._ends[segment].append(self._bytes + len(data))
            at, self._rows, self._bytes = where(segment, row), self._rows + 1, self._bytes + len(data)
        self._pending.append(json.dumps({"key": key, "sha256": digest.hex(), "seg": segment, "row": row,
                                         "reason": reason, **extra}))
        if len(self._pending) >= CHUNK and time.monotonic() - self._synced_at >= SYNC_EVERY_S:
            self.sync()
        return at

    def _next_segment(self) -> None:
        if self._pixels is not None:
            self.sync()
            self._pixels.close()
        self._segment += 1
        self._pixels, self._rows, self._bytes = open(self.segment_path(self._segment), "xb"), 0, 0
        self._ends[self._segment] = array.array("Q")

    def size_of(self, at: int) -> int:
        """Bytes the frame or record at `where` `at` takes in its segment."""
        ends = self._ends[at >> 32]
        row = at & 0xFFFFFFFF
        return ends[row] - (ends[row - 1] if row else 0)

    def sidecar(self, segment: int) -> Path:
        """A JPEG journal's segment's offsets (`store.offsets_name` beside it: (rows + 1) uint64, the
        layout of a JPEG shard's), written now, so the segment can become a shard as it is."""
        self.sync()
        path = self.segment_path(segment).with_suffix(OFFSETS)
        tmp = path.with_suffix(".off-tmp")
        np.asarray([0, *self._ends[segment]], dtype=OFFSET_DTYPE).tofile(tmp)
        os.replace(tmp, path)  # a new inode: never rewrite one a store may already share
        return path

    def sync(self) -> None:
        """Make the pixels durable, then write the lines that point at them."""
        if self._pixels is not None:
            self._pixels.flush()
            os.fsync(self._pixels.fileno())
        if self._pending:
            self._lines.write("\n".join(self._pending) + "\n")
            self._lines.flush()
            os.fsync(self._lines.fileno())
            self._pending.clear()
        self._synced_at = time.monotonic()

    def frame_of(self, at: int) -> tuple[Path, int]:
        """(segment file, row) of a `where`."""
        return self.segment_path(at >> 32), at & 0xFFFFFFFF

    def pixels(self, at: int) -> np.ndarray:
        """One decoded image back (pread, not a memory map: see `PreviousStore.pixels`)."""
        if self.encoded:
            return codec.decode(self.record_at(at), self.shape[2])
        segment, row = at >> 32, at & 0xFFFFFFFF
        if self._pixels is not None:
            self._pixels.flush()
        if segment not in self._readers:
            self._readers[segment] = os.open(self.segment_path(segment), os.O_RDONLY)
        return read_frame(self._readers[segment], row, self.shape)

    def record_at(self, at: int) -> bytes:
        """The bytes of the frame or record at `where` `at`."""
        size = self.size_of(at)
        with open(self.segment_path(at >> 32), "rb") as fh:
            fh.seek(self._ends[at >> 32][at & 0xFFFFFFFF] - size)
            return fh.read(size)

    def close(self) -> None:
        self.sync()
        self._lines.close()
        if self._pixels is not None:
            self._pixels.close()
            self._pixels = None
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
