"""The disk tier's periodic check that its indexed files still exist: files deleted by hand or by
an external cleaner leave the index (and `disk_blocks`, and the prefix index's disk credit) within
about a pass, not only when a load happens to ask for them.

    every EVERY_S    the index's hashes are listed (a list copy on the engine's thread)
    each poll        the next BATCH of them still indexed and not queued for writing
                     -> stat()ed on the tier's writer thread (behind the writes queued before)
    a later poll     the missing ones the index still holds as they were -> dropped

The engine's thread never waits for a stat: a batch is settled only once done, and one batch is in
flight at a time, so a slow disk delays the writes queued behind it by one batch at most. Only
ENOENT (and ENOTDIR: the directory itself gone) counts: another error leaves the entry to the read
that would fail on it.
"""
from __future__ import annotations

import errno
import os
from collections import deque
from concurrent.futures import Executor, Future
from typing import Callable, Collection, Mapping

EVERY_S = 60.0
BATCH = 512


class Reconciler:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.next_pass = clock() + EVERY_S
        self._pending: deque[bytes] = deque()          # this pass's hashes not checked yet
        self._checking: Future | None = None
        self._batch: list[tuple[bytes, object]] = []   # (hash, index entry) being stat()ed

    def step(self, index: Mapping[bytes, object], queued: Collection[bytes], path: Callable[[bytes], str],
             writer: Executor) -> list[tuple[bytes, object]]:
        """(engine thread, from the tier's poll) Settle the batch in flight if done, start the next
        one; -> the (hash, entry) whose file was missing (the caller drops those still indexed
        as `entry`: one evicted and written again meanwhile has a new entry)."""
        vanished: list[tuple[bytes, object]] = []
        if self._checking is not None:
            if not self._checking.done():
                return vanished
            vanished = [self._batch[i] for i in self._checking.result()]
            self._checking, self._batch = None, []
        if not self._pending:
            now = self.clock()
            if now < self.next_pass:
                return vanished
            self.next_pass = now + EVERY_S
            self._pending = deque(index)
        batch = []
        while self._pending and len(batch) < BATCH:
            block_hash = self._pending.popleft()
            entry = index.get(block_hash)
            if entry is not None and block_hash not in queued:     # a queued write's file may not exist yet
                batch.append((block_hash, entry))
        if batch:
            self._batch = batch
            self._checking = writer.submit(_missing, [path(h) for h, _ in batch])
        return vanished


def _missing(paths: list[str]) -> list[int]:
    """(writer thread) The positions of the paths that do not exist."""
    out = []
    for i, path in enumerate(paths):
        try:
            os.stat(path, follow_symlinks=False)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                out.append(i)
    return out
