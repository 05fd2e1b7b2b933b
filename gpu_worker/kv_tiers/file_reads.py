"""Reads of tier files off the engine's thread: a small pool of reader threads reads and verifies
a load's disk and shared-tier blocks while the engine keeps stepping.

    engine thread   submit(reads) -> ReadBatch (queued while the bytes in flight are over budget)
    reader threads  open, read, verify (xxh3; the MAC for shared files) -> on CUDA, copy into
                    pinned host memory (the H2D copy then needs no host memcpy)
    engine thread   batch.done() at a later schedule -> the results, in order; the tiers settle
                    them (index, counters, deletes: no tier state is touched on a reader thread)

File I/O, the hashes and the HMAC release the GIL, so the readers run beside the engine's Python.
The budget bounds the bytes of the batches started and not yet collected: a batch starts when it
fits, or when nothing else is in flight (a single load larger than the budget still runs, alone:
the synchronous path held as much). A dropped batch's queued reads are cancelled; a read already
running finishes and its buffer is freed with the batch.
"""
from __future__ import annotations

import os
import stat
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, NamedTuple

import torch

READ_THREADS = 2
MAX_READ_BYTES = 256 << 20      # bytes of batches in flight: 128 blocks of Llama-3.1-8B's 2 MiB


class FileRead(NamedTuple):
    """One block file's read: its verified payload, or None with why."""
    payload: "memoryview | torch.Tensor | None"    # (block_bytes,) uint8 on CUDA: pinned
    error: str | None               # None when the payload verified
    missing: bool                   # the file could not be opened (deleted by a writer, never written)
    start: float                    # perf_counter at the read's start and end (the bandwidth)
    end: float


def read_block_file(path: str, limit: int, decode: Callable[[bytearray], memoryview],
                    errors: tuple[type[Exception], ...]) -> FileRead:
    """(any thread) A file's payload after `decode`'s checks; reads at most `limit` bytes.
    Touches no tier state: the caller settles the result on the engine's thread."""
    t = time.perf_counter()
    try:
        # non-blocking: a FIFO planted under the name would otherwise block the open until written
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:           # gone (deleted by a writer), or not a file we may open
        return FileRead(None, e.strerror or "cannot open", True, t, time.perf_counter())
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):     # a FIFO, a device: nothing a writer made
            return FileRead(None, "not a regular file", False, t, time.perf_counter())
        payload = decode(read_at_most(fd, limit))
    except (OSError, *errors) as e:
        return FileRead(None, str(e), False, t, time.perf_counter())
    finally:
        os.close(fd)
    return FileRead(payload, None, False, t, time.perf_counter())


def read_at_most(fd: int, limit: int) -> bytearray:
    """Up to `limit` bytes of a file, in a writable buffer (torch.frombuffer views it in place)."""
    data = bytearray()
    while len(data) < limit:
        chunk = os.read(fd, min(limit - len(data), 1 << 24))
        if not chunk:
            break
        data += chunk
    return data


class ReadBatch:
    """One load's file reads, in order."""

    def __init__(self, reads: list[Callable[[], FileRead]], num_bytes: int) -> None:
        self.reads = reads
        self.num_bytes = num_bytes
        self.started = False
        self.futures: list[Future] = []      # once started

    def done(self) -> bool:
        return self.started and all(f.done() for f in self.futures)

    def results(self) -> list[FileRead]:
        """Once done(); a reader's unexpected exception (a bug, not a bad file) is raised here."""
        return [f.result() for f in self.futures]


class FileReader:
    def __init__(self, block_bytes: int, device: torch.device, threads: int = READ_THREADS,
                 max_bytes: int = MAX_READ_BYTES) -> None:
        self.block_bytes = block_bytes
        self.pin = device.type == "cuda"
        self.max_bytes = max_bytes
        self.in_flight_bytes = 0
        self._queued: deque[ReadBatch] = deque()       # waiting for the budget, oldest first
        self._started: list[ReadBatch] = []            # started, not collected or dropped
        # a reader's pinned allocations belong to the engine's device (not a context on device 0)
        init = (lambda: torch.cuda.set_device(device)) if self.pin else None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvmesh-kv-read", initializer=init)

    def submit(self, reads: list[Callable[[], FileRead]]) -> ReadBatch:
        batch = ReadBatch(reads, len(reads) * self.block_bytes)
        self._queued.append(batch)
        self.pump()
        return batch

    def pump(self) -> None:
        """Start the queued batches that fit the budget (the first always, when none is in flight)."""
        while self._queued and (not self._started or
                                self.in_flight_bytes + self._queued[0].num_bytes <= self.max_bytes):
            batch = self._queued.popleft()
            batch.futures = [self._pool.submit(self._run, read) for read in batch.reads]
            batch.started = True
            self._started.append(batch)
            self.in_flight_bytes += batch.num_bytes

    def _run(self, read: Callable[[], FileRead]) -> FileRead:
        result = read()
        if self.pin and isinstance(result.payload, memoryview):    # queued bytes are pinned at staging
            pinned = torch.empty(len(result.payload), dtype=torch.uint8, pin_memory=True)
            pinned.copy_(torch.frombuffer(result.payload, dtype=torch.uint8))
            result = result._replace(payload=pinned)
        return result

    def collect(self, batch: ReadBatch) -> list[FileRead]:
        """A done batch's results; its bytes leave the budget."""
        results = batch.results()
        self._release(batch)
        return results

    def drop(self, batch: ReadBatch) -> None:
        """A batch whose load was dropped: queued reads are cancelled, running ones discarded."""
        if batch in self._queued:
            self._queued.remove(batch)
            return
        for future in batch.futures:
            future.cancel()
        self._release(batch)

    def _release(self, batch: ReadBatch) -> None:
        self._started.remove(batch)
        self.in_flight_bytes -= batch.num_bytes
        self.pump()

    def wait_any(self, timeout_s: float) -> bool:
        """Block until a started read finishes or timeout_s passes (an engine with nothing to run);
        -> whether a read was running."""
        pending = [f for batch in self._started for f in batch.futures if not f.done()]
        if pending:
            wait(pending, timeout_s, return_when=FIRST_COMPLETED)
        return bool(pending)

    @property
    def num_batches(self) -> int:
        return len(self._queued) + len(self._started)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def check_integrity(self) -> None:
        """The budget counts exactly the started batches."""
        assert self.in_flight_bytes == sum(b.num_bytes for b in self._started), \
            f"file reads: {self.in_flight_bytes} bytes in flight, {len(self._started)} batches started"
