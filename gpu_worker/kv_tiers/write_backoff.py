"""When the disk tier takes writes: a failed write costs its own block only; persistent failure
turns writes off for a back-off, after which they are tried again (reads go on throughout).

    on --a write fails--> that block dropped (recomputed when asked for); still on
    on --ENOSPC / EDQUOT / EROFS / EFBIG, or MAX_CONSECUTIVE failures in a row--> off
    off --backoff_s passed--> on (the next writes are the trial)
        trial write succeeds: backoff_s back to FIRST_BACKOFF_S
        trial fails persistently: off again, backoff_s doubled (at most MAX_BACKOFF_S)

A full disk that got space again (or a remounted filesystem) is used again within minutes, and a
dead one costs one failed write per back-off. The log says each change of state once; single
failures are logged at most once per WARN_EVERY_S.
"""
from __future__ import annotations

import errno
import logging
from typing import Callable

log = logging.getLogger("kvmesh.kv_tiers")

# errors no retry of the next block would fix: the filesystem is full, read-only or over a quota
# (EFBIG: a file-size limit, and every block file has the same size)
PERSISTENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
MAX_CONSECUTIVE = 3           # failures in a row of any other kind that turn writes off
FIRST_BACKOFF_S = 30.0
MAX_BACKOFF_S = 300.0
WARN_EVERY_S = 60.0


class WriteBackoff:
    """The disk tier's write state; `clock` is time.monotonic (tests pass their own)."""

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self.name = name
        self.clock = clock
        self.num_errors = 0           # failed writes (cumulative)
        self.consecutive = 0          # failed writes since the last one that succeeded
        self.backoff_s = FIRST_BACKOFF_S
        self.off_until: float | None = None
        self._warned_at: float | None = None

    def writes_on(self) -> bool:
        """Whether a block may be written now. Reads state only: the stats read it from the
        heartbeat's thread."""
        return self.off_until is None or self.clock() >= self.off_until

    def resume(self) -> None:
        """(the writing thread, before a write) Once the back-off passed, this write is a trial."""
        if self.off_until is not None and self.clock() >= self.off_until:
            self.off_until, self.consecutive = None, 0
            log.info("KV disk tier %s: trying writes again after a back-off", self.name)

    def succeeded(self) -> None:
        self.consecutive = 0
        if self.off_until is None:
            self.backoff_s = FIRST_BACKOFF_S

    def failed(self, error: BaseException) -> None:
        """A write failed (its block is dropped by the caller)."""
        self.num_errors += 1
        self.consecutive += 1
        if self.off_until is not None:        # a write queued before the turn-off (or before resume)
            return
        now = self.clock()
        if getattr(error, "errno", None) in PERSISTENT_ERRNOS or self.consecutive >= MAX_CONSECUTIVE:
            self.off_until = now + self.backoff_s
            log.warning("KV disk tier %s: writes turned off for %.0f s after %d failed write(s) (%s); blocks "
                        "evicted from host memory are dropped meanwhile, blocks already on disk are still read",
                        self.name, self.backoff_s, self.consecutive, error)
            self.backoff_s = min(2 * self.backoff_s, MAX_BACKOFF_S)
        elif self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("KV disk tier %s: writing a block failed (%s); that block is dropped (recomputed when "
                        "asked for), writes go on", self.name, error)
