"""Decoding processes that never stall `prepare`: each file is read once, hashed and decoded in a
worker; a file that kills its worker or runs past its time limit costs that file, never the run.

Each worker takes chunks of files and answers file by file, so the parent always knows which file a
worker is on. A worker that dies (a segfault in a codec, the out-of-memory killer) or stays on one
file past `data.decode_timeout_s` (killed by the parent) leaves that one file as a suspect; the rest
of its chunk goes to the next worker. Once every other file is done, each suspect is decoded again
alone, in a fresh process with nothing else running, and a second death or timeout lists it as bad
(the journal remembers it, so a rerun does not try it again). Decoding always runs in worker
processes, even with one: a crash in the main process would crash the rerun too, forever.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import resource
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from cnnpipe.data.store import codec
from cnnpipe.data.ingest.decode import decode_bytes

CHUNK = 16              # files per task: amortises the inter-process round trip
CHUNKS_PER_WORKER = 2   # tasks queued per worker: it never waits for work, and memory stays bounded
STARTUP_S = 300         # a worker that is not ready by then (imports on a swamped machine) is an error
FAILED_TWICE = "its decoding process failed twice"
Outcome = tuple[bytes, "np.ndarray | bytes | None", "str | None", bool]
"""One file's result: (sha256, pixels (or, for a JPEG store, their JPEG record) or None, why it is
unusable or None, known to the previous store)."""

_KNOWN: dict[str, np.ndarray] = {}
READY = "ready"


class DecodersFailed(RuntimeError):
    """Decoding processes die as they start, before any file: the environment's fault, not a file's."""


def _is_known(digest: bytes, prefixes_file: str | None) -> bool:
    if prefixes_file is None:
        return False
    if prefixes_file not in _KNOWN:  # once per worker process
        _KNOWN[prefixes_file] = np.load(prefixes_file, mmap_mode="r")
    known = _KNOWN[prefixes_file]
    prefix = np.frombuffer(digest[:8], dtype=">u8")[0].astype(np.uint64)
    i = int(np.searchsorted(known, prefix))
    return i < len(known) and known[i] == prefix


def unusable(path: str, reason: str) -> Outcome:
    """The outcome of a file whose bytes could not be had: keyed by the hash of its path."""
    return hashlib.sha256(os.fsencode(path)).digest(), None, reason, False


def ingest_file(path: str, size: int, max_pixels: int, prefixes_file: str | None, quality: int | None = None) -> Outcome:
    """Read one file once: its sha256 and, unless the previous store may hold those bytes (then its
    pixels are kept, not decoded), its pixels, or with a `quality` their JPEG record (`codec.encode`:
    a JPEG store's bytes, encoded here in parallel). Never raises for a bad file."""
    try:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            return unusable(path, f"unreadable: {exc.strerror or exc}")
        digest = hashlib.sha256(data).digest()
        if _is_known(digest, prefixes_file):
            return digest, None, None, True
        decoded = decode_bytes(data, path, size, max_pixels, digest=digest.hex())
        if quality is not None and decoded.image is not None:
            return digest, codec.encode(decoded.image, quality), decoded.reason, False
        return digest, decoded.image, decoded.reason, False
    except Exception as exc:  # noqa: BLE001 - one odd file must not stop the catalog, nor lose its name
        return unusable(path, f"cannot be read: {type(exc).__name__}: {exc}")


def _serve(conn: Connection, size: int, max_pixels: int, prefixes_file: str | None, quality: int | None) -> None:
    """A worker: decode each (position, path) of each chunk received, answering file by file."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a codec crash leaves no core file behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn.send(READY)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent is gone
            return
        if chunk is None:
            return
        for position, path in chunk:
            conn.send((position, ingest_file(path, size, max_pixels, prefixes_file, quality)))


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext, args: tuple) -> None:
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(theirs, *args), daemon=True)
        self.process.start()
        theirs.close()
        self.pending: deque[tuple[int, str]] = deque()
        self.since = time.monotonic()  # when it last answered (or got work while idle)
        self.ready = False  # it has started: a death before that is no file's fault

    def give(self, chunk: list[tuple[int, str]]) -> None:
        if not self.pending:
            self.since = time.monotonic()
        self.pending.extend(chunk)
        self.conn.send(chunk)

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                pass
        self.process.join(timeout=None if kill else 5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _death(worker: _Worker) -> str:
    code = worker.process.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


class DecodePool:
    """`workers` decoding processes; `run(paths)` yields (position, outcome) for every path, in their
    order, with at most `workers * CHUNKS_PER_WORKER` chunks in flight; with a `quality`, each image
    comes back as its JPEG record."""

    def __init__(self, workers: int, size: int, max_pixels: int, prefixes_file: str | None, timeout_s: float,
                 quality: int | None = None) -> None:
        self.workers, self.timeout_s = max(1, workers), timeout_s
        self.args = (size, max_pixels, prefixes_file, quality)
        self.ctx = mp.get_context("spawn")  # no fork: the parent's threads and open files stay its own
        self.suspects: list[tuple[int, str, str]] = []  # (position, path, what happened the first time)

    def run(self, paths: Sequence[str]) -> Iterator[tuple[int, Outcome]]:
        todo: deque[tuple[int, str]] = deque()
        # Answers are passed on in the order of `paths` (a suspect's at the very end): what the
        # journal holds, and so the store's bytes, do not depend on which worker was quicker.
        done: dict[int, Outcome] = {}
        following, deferred = 0, set()
        chunks = ((i, min(i + CHUNK, len(paths))) for i in range(0, len(paths), CHUNK))
        pool: list[_Worker] = []
        try:
            pool = [_Worker(self.ctx, self.args) for _ in range(min(self.workers, -(-len(paths) // CHUNK)))]
            while True:
                for worker in pool:
                    while len(worker.pending) < CHUNKS_PER_WORKER * CHUNK:
                        if not todo and len(done) < 4 * self.workers * CHUNKS_PER_WORKER * CHUNK:
                            # (not past one slow file by more than that: what waits is held in memory)
                            start, stop = next(chunks, (0, 0))
                            todo.extend((i, paths[i]) for i in range(start, stop))
                        if not todo:
                            break
                        worker.give([todo.popleft() for _ in range(min(CHUNK, len(todo)))])
                busy = [w for w in pool if w.pending]
                if not busy:
                    break
                done.update(self._step(pool, busy, todo))
                deferred = {position for position, _, _ in self.suspects}
                while following in done or following in deferred:
                    if following in done:
                        yield following, done.pop(following)
                    following += 1
        finally:
            for worker in pool:
                worker.stop(kill=bool(worker.pending))
        yield from self._retry_alone()

    def _step(self, pool: list[_Worker], busy: list[_Worker], todo: deque) -> Iterator[tuple[int, Outcome]]:
        """Wait for the next answers (or a death, or a deadline) and handle them. A worker's clock
        starts when it is ready: a slow start on a loaded machine is no file's fault."""
        now = time.monotonic()
        deadline = min(w.since + (self.timeout_s if w.ready else STARTUP_S) for w in busy)
        ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=max(0.0, deadline - now))
        for worker in busy:
            what = None
            if worker.conn in ready:
                try:
                    while worker.conn.poll():
                        answer = worker.conn.recv()
                        if answer == READY:
                            worker.ready, worker.since = True, time.monotonic()
                            continue
                        position, outcome = answer
                        worker.pending.popleft()
                        worker.since = time.monotonic()
                        yield position, outcome
                    continue
                except (EOFError, OSError):  # it answered what it could, then died
                    worker.process.join(5)
                    what = _death(worker)
            elif worker.process.sentinel in ready:
                worker.process.join(5)
                what = _death(worker)
            elif time.monotonic() - worker.since > (self.timeout_s if worker.ready else STARTUP_S):
                what = f"over data.decode_timeout_s={self.timeout_s:g} s" if worker.ready else "no start"
            if what is not None:
                self._replace(pool, worker, what, todo)

    def _replace(self, pool: list[_Worker], worker: _Worker, what: str, todo: deque) -> None:
        """A worker died or hung on its current file: that file is a suspect, the rest of its work
        goes back to the queue, and a fresh worker takes its place."""
        worker.stop(kill=True)
        if not worker.ready:
            _failed_to_start(what)
        position, path = worker.pending.popleft()
        self.suspects.append((position, path, what))
        todo.extendleft(reversed(worker.pending))
        worker.pending.clear()
        pool[pool.index(worker)] = _Worker(self.ctx, self.args)

    def _retry_alone(self) -> Iterator[tuple[int, Outcome]]:
        """Each suspect once more, alone in a fresh process; a second failure lists it as bad."""
        for position, path, first in self.suspects:
            worker = _Worker(self.ctx, self.args)
            if _answer(worker, STARTUP_S) != READY:
                worker.stop(kill=True)
                _failed_to_start(_death(worker))
            worker.give([(position, path)])
            answer = _answer(worker, self.timeout_s)
            if answer is None or answer == "died":
                worker.stop(kill=True)
                again = _death(worker) if answer else f"over data.decode_timeout_s={self.timeout_s:g} s"
                outcome = unusable(path, f"{FAILED_TWICE}, the second time alone ({first}; then {again}): a crash "
                                         "in an image codec, the out-of-memory killer, or a file too slow to decode")
            else:
                outcome = answer[1]
                worker.pending.clear()
                worker.stop()
            yield position, outcome
        self.suspects.clear()


def _answer(worker: _Worker, timeout: float) -> object:
    """The worker's next message; None if it sends none within `timeout`, "died" if it dies first."""
    ready = wait([worker.conn, worker.process.sentinel], timeout=timeout)
    if worker.conn in ready:
        try:
            return worker.conn.recv()
        except (EOFError, OSError):
            pass
    if not ready:
        return None
    worker.process.join(5)
    return "died"


def _failed_to_start(what: str) -> None:
    raise DecodersFailed(f"a decoding process died as it started ({what}), before it read any file: check that "
                         "`python -c 'import cnnpipe.data.ingest.workers'` runs in this environment, and that the machine "
                         "has memory for data.prepare_workers processes")
