"""Each stored image's metadata (source path, sha256, supplier), in sealed segments: written once,
like the shards, so a week's update writes the lines of its new photos only.

A store's metadata is a list of segments, `meta/<serial>.jsonl` (one JSON line per image, in the
order they were added) and `meta/<serial>.npy` (per line: the image's sha256, a hash of the line and
where the line ends: `SEGMENT`). A split points into them: `<split>_meta.npy`
is (N, 2) int32, each image's segment (its place in index.json's `meta` list) and line, in the
split's content order. A prepare keeps every line the previous store has as it is (the same bytes
of the same segment, hard-linked: its md5 and DVC cache object stay) and writes a new segment with
the lines that are new (new photos, moved or touched files); only the pointers (8 bytes an image)
are rewritten. A segment with under half its lines still pointed at is compacted like a shard. DVC
keeps whole files, so a file that grew would be a whole new object: sealed segments are the layout
MDS, WebDataset and LitData use for the data itself, applied to what describes it.

A file's size and mtime are this machine's, not the image's: another machine (`dvc pull`, a clone)
sees other mtimes for the same photos. So they stay out of the store, which every machine shares:
the **stat cache** beside it (`<store>.stat.npy`, machine-local, like DVC's own state database) maps
each file's `stat_key` to its sha256, so an unchanged file is not read again here.

Stores written before segments hold `<split>_meta.jsonl` (with size and mtime, and `<split>_keys.npy`)
in the split's order; `split_meta` and `split_keys` read both layouts.
"""

from __future__ import annotations

import array
import hashlib
import json
import mmap
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from cnnpipe.data.store.keys import stat_key

PathOf = Callable[[str], "Path | None"]
"""Where a store's file is, by its path relative to the store (None: not there): a folder's files, or
the DVC cache objects `previous.Tree.path` finds."""
META = "meta"
SEGMENT = np.dtype([("sha256", "S32"), ("line", "<u8"), ("end", "<u8")])
"""`meta/<serial>.npy`: per line of its segment, the image's sha256, the line's `line_hash` and the
byte where it ends."""
KEYS = np.dtype([("sha256", "S32"), ("stat", "<u8")])
"""Each image's content hash and `keys.stat_key`, in a split's order: what the next prepare looks
images up by, without parsing a JSON line (30x faster at 10M images); the stat is 0 where the store
records none (since segments: the stat cache has them)."""
LOCAL_KEYS = ("size", "mtime_ns")
"""Keys of a meta dict that are this machine's: in the stat cache, not in the store's lines."""
STAT = np.dtype([("stat", "<u8"), ("sha256", "S32")])
"""The stat cache, sorted by stat key."""


STAT_FILE = "stat.npy"
"""The stat cache's name in a prepare's work folder, until the store is in place."""


def stat_cache(store: Path) -> Path:
    """The machine-local stat cache of the store at `store`."""
    return Path(store).with_name(Path(store).name + ".stat.npy")


def read_stat_cache(store: Path) -> np.ndarray:
    """The stat cache of `store` (empty when there is none, or it cannot be read: then files are read
    once more to hash them, which is all it saves)."""
    try:
        table = np.load(stat_cache(store))
    except (OSError, ValueError, EOFError):
        return np.zeros(0, dtype=STAT)
    return table if table.dtype == STAT else np.zeros(0, dtype=STAT)


def table_digest(table: np.ndarray, row: int) -> bytes:
    """All 32 bytes of a table's sha256 at `row` (indexing an S32 field drops trailing zero bytes)."""
    return table["sha256"][row : row + 1].tobytes()


def in_folder(folder: Path) -> PathOf:
    """`PathOf` for a store on disk."""
    def path_of(rel: str) -> Path | None:
        path = Path(folder) / rel
        return path if path.is_file() else None
    return path_of


def line_hash(line: bytes) -> int:
    """64-bit hash of a meta line's bytes: a kept image whose line is unchanged keeps its old line."""
    return int.from_bytes(hashlib.blake2b(line, digest_size=8).digest(), "big")


def encode_line(meta: dict[str, Any]) -> bytes:
    return (json.dumps(meta, ensure_ascii=False) + "\n").encode()


def segment_files(name: str) -> tuple[str, str]:
    """(lines, table) of a segment, relative to the store."""
    return f"{META}/{name}.jsonl", f"{META}/{name}.npy"


def _segments(path_of: PathOf) -> list[str] | None:
    """The store's segment names (index.json's `meta`), or None for a store before segments."""
    index_path = path_of("index.json")
    index = json.loads(index_path.read_text(encoding="utf-8")) if index_path else {}
    return [m["name"] for m in index["meta"]] if "meta" in index else None


def _pointers(path_of: PathOf, split: str) -> np.ndarray:
    path = path_of(f"{split}_meta.npy")
    return np.load(path).reshape(-1, 2) if path else np.zeros((0, 2), np.int32)


def split_keys(path_of: PathOf, split: str) -> np.ndarray | None:
    """`KEYS` of every image of `split`, in its order; None when the store has no such split."""
    names = _segments(path_of)
    if names is None:  # a store before segments: `<split>_keys.npy`, or before it the lines themselves
        keys, lines = path_of(f"{split}_keys.npy"), path_of(f"{split}_meta.jsonl")
        if keys or not lines:
            return np.load(keys) if keys else None
        digests, stats = bytearray(), array.array("Q")  # streamed: 40 bytes an image
        with open(lines, encoding="utf-8") as fh:
            for item in map(json.loads, fh):
                digests += bytes.fromhex(item["sha256"])
                stats.append(stat_key(item["source"], item.get("size", -1), item.get("mtime_ns", -1)))
        out = np.zeros(len(stats), dtype=KEYS)
        out["sha256"], out["stat"] = np.frombuffer(bytes(digests), dtype="S32"), np.frombuffer(stats, dtype=np.uint64)
        return out
    if path_of(f"{split}_meta.npy") is None:
        return None
    pointers = _pointers(path_of, split)
    out = np.zeros(len(pointers), dtype=KEYS)
    for number, name in enumerate(names):
        mine = np.flatnonzero(pointers[:, 0] == number)
        if len(mine):
            out["sha256"][mine] = np.load(path_of(segment_files(name)[1]))["sha256"][pointers[mine, 1]]
    return out


def split_meta(path_of: PathOf, split: str, rows: np.ndarray | None = None) -> Iterator[dict[str, Any]]:
    """The meta dict of every image of `split` (or of its `rows`, in their order), in the split's order."""
    names = _segments(path_of)
    if names is None:  # a store before segments: its lines in the split's order
        lines = path_of(f"{split}_meta.jsonl")
        if lines is None:
            return
        wanted = None if rows is None else set(np.asarray(rows).tolist())
        found = {}
        with open(lines, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if wanted is None:
                    yield json.loads(line)
                elif i in wanted:
                    found[i] = json.loads(line)
        if wanted is not None:
            yield from (found[i] for i in np.asarray(rows).tolist())
        return
    pointers = _pointers(path_of, split)
    if rows is not None:
        pointers = pointers[np.asarray(rows, dtype=np.intp)]
    maps: dict[int, tuple[Any, np.ndarray]] = {}
    try:
        for number, line in pointers.tolist():
            if number not in maps:
                lines_file, table = (path_of(rel) for rel in segment_files(names[number]))
                with open(lines_file, "rb") as fh:
                    maps[number] = (mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), np.load(table)["end"])
            data, ends = maps[number]
            yield json.loads(data[(int(ends[line - 1]) if line else 0) : int(ends[line])])
    finally:
        for data, _ in maps.values():
            data.close()


class MetaWriter:
    """The metadata of a store being written: each image's line kept from the previous store's
    segments when it is the same, else appended to this update's new segment; `pointer` says where."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.names: list[str] = []       # segment names, in the order pointers number them
        self.files: list[tuple[Path, Path]] = []  # their (lines, table) files
        self.lines: list[int] = []       # lines each holds
        self._new: int | None = None     # the number of this update's segment, once opened
        self._fh: Any = None
        self._rows: list[tuple[bytes, int, int, int]] = []  # the new segment's SEGMENT rows
        self._end = 0
        self._old_hashes = np.zeros(0, np.uint64)
        self._old_where = np.zeros((0, 2), np.int64)
        self._old_tables: list[np.ndarray] = []

    def use_previous(self, path_of: PathOf) -> None:
        """Lend lines from the previous store's segments (none for a store before segments)."""
        names = _segments(path_of) or []
        hashes, wheres = [], []
        for name in names:
            files = tuple(path_of(rel) for rel in segment_files(name))
            if None in files:
                return  # not all there: write every line again rather than point at what is missing
            number = len(self.names)
            self.names.append(name)
            self.files.append(files)  # type: ignore[arg-type]
            table = np.load(files[1])
            self._old_tables.append(table)
            self.lines.append(len(table))
            hashes.append(table["line"])
            wheres.append(np.stack([np.full(len(table), number), np.arange(len(table))], axis=1))
        if hashes:
            all_hashes, all_wheres = np.concatenate(hashes), np.concatenate(wheres)
            order = np.argsort(all_hashes, kind="stable")
            self._old_hashes, self._old_where = all_hashes[order], all_wheres[order]

    def pointer(self, meta: dict[str, Any], digest: bytes, serial: Callable[[], str]) -> tuple[int, int]:
        """(segment, line) of this image's meta line (`meta` less `LOCAL_KEYS`): an old one with the
        same bytes, else a new one (the new segment named by `serial()` when it opens)."""
        line = encode_line({k: v for k, v in meta.items() if k not in LOCAL_KEYS})
        code = line_hash(line)
        i = int(np.searchsorted(self._old_hashes, np.uint64(code)))
        while i < len(self._old_hashes) and int(self._old_hashes[i]) == code:
            number, row = (int(v) for v in self._old_where[i])
            if table_digest(self._old_tables[number], row) == digest:  # and the line's 64-bit hash: the same line
                return number, row
            i += 1
        return self.append(line, digest, code, serial)

    def append(self, line: bytes, digest: bytes, code: int, serial: Callable[[], str]) -> tuple[int, int]:
        """A line into this update's segment."""
        if self._new is None:
            name = serial()
            (self.out_dir / META).mkdir(parents=True, exist_ok=True)
            lines_rel, table_rel = segment_files(name)
            self._new = len(self.names)
            self.names.append(name)
            self.files.append((self.out_dir / lines_rel, self.out_dir / table_rel))
            self.lines.append(0)
            self._fh = open(self.out_dir / lines_rel, "wb")
        self._fh.write(line)
        self._end += len(line)
        self._rows.append((digest, code, self._end))
        self.lines[self._new] += 1
        return self._new, self.lines[self._new] - 1

    def line_of(self, number: int, row: int) -> tuple[bytes, bytes, int]:
        """(line bytes, sha256, hash) of an old segment's line: what compaction moves."""
        table = self._old_tables[number]
        start = int(table["end"][row - 1]) if row else 0
        with open(self.files[number][0], "rb") as fh:
            fh.seek(start)
            line = fh.read(int(table["end"][row]) - start)
        return line, table_digest(table, row), int(table["line"][row])

    def seal(self) -> None:
        """Close the new segment and write its table."""
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        table = np.zeros(len(self._rows), dtype=SEGMENT)
        if self._rows:
            digests, codes, ends = zip(*self._rows)
            table["sha256"], table["line"], table["end"] = digests, codes, ends
        np.save(self.files[self._new][1], table)

    def is_new(self, number: int) -> bool:
        return number == self._new
