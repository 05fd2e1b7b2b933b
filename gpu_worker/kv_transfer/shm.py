"""Same-host KV frames through POSIX shared memory: the payload skips the socket and CURVE.

    P  SegmentRing (one per decode worker, on its sender thread): a segment
       /dev/shm/kvmesh-kv-<32 random hex> (mode 0600, O_EXCL) used as a ring; place(payload)
       copies a frame's payload in, and only the frame's header, naming the ring, the offset and
       the ring position after it, goes over the CURVE-authenticated ZMQ socket
    D  RingReader.read(name, offset, size, end): maps the ring the first time it is named (no
       symlinks; owned by this user, mode 0600) and unlinks it at once, hands the bytes to the
       consumer's usual checks and copy, then writes `end` into the ring's header: P may reuse
       everything before it

    ring: | header: D's consumed position (u64) | payload bytes ...................... |
          P writes at head (total bytes placed), never past D's position + capacity; a payload
          that would wrap starts at the ring's beginning instead

The ring is mapped once and reused, so its pages are faulted in once: fresh pages per frame cost
more than the copy itself. Why this is as safe as the frames: the name is random and travels only
inside the encrypted, authenticated plane; the segment is readable by this user only (who could
ptrace either process anyway); D accepts only names of our exact pattern (no path ever comes from
the wire), checks every offset and size against the ring, and checks the payload's size, shape and
checksum as for an inline frame. Rings do not outlive their use: D unlinks one as soon as it has
mapped it, P unlinks its own when its sender thread ends (idle, or the worker stops). A P killed
before D first mapped its ring leaves that one file; kvmesh-kv-* files of dead workers can be
removed by hand. A frame that does not fit the ring goes inline over ZMQ (back-pressure that
never waits).

The host identity (hostname + kernel boot id) is what P offers and D compares: equal only for two
processes of one kernel that also see the same hostname, i.e. not two pods (each has its own
hostname and its own /dev/shm).
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import stat
import struct
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

SHM_DIR = "/dev/shm"
PREFIX = "kvmesh-kv-"
_NAME = re.compile(r"kvmesh-kv-[0-9a-f]{32}")
HEADER_BYTES = 64                       # D's consumed position, alone on its cache line
DEFAULT_RING_BYTES = 256 << 20          # per decode worker: a 1k-token 8B hand-off (128 MiB) twice
ALLOCATION_STEP = 16 << 20             # the ring's memory is allocated in steps as it first fills
MAX_RINGS = 64                          # rings D keeps mapped (one per prefill worker sending)
MAX_RING_BYTES = 4 << 30


def host_identity() -> str:
    """hostname/boot id, or "" where there is no usable /dev/shm (then shm is never chosen)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}" if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else ""


def _path(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError("not a KV segment name")
    return os.path.join(SHM_DIR, name)


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


class Placed(NamedTuple):
    offset: int         # in the ring's payload area
    end: int            # the ring position after this payload (D writes it back once done)


class SegmentRing:
    """P's ring towards one decode worker; used by that worker's sender thread only. Raises
    OSError when /dev/shm cannot hold even its header."""

    def __init__(self, capacity: int = DEFAULT_RING_BYTES) -> None:
        self.capacity = capacity
        self.name = PREFIX + secrets.token_hex(16)
        self._fd = os.open(_path(self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, HEADER_BYTES)
            os.ftruncate(self._fd, HEADER_BYTES + capacity)
            self._map = mmap.mmap(self._fd, HEADER_BYTES + capacity)
        except BaseException:
            _unlink(self.name)
            os.close(self._fd)
            raise
        self._allocated = 0             # payload bytes backed by memory (the rest is a sparse hole)
        self.head = 0                   # bytes placed so far (ring positions only grow)
        self.frames_inline = 0          # payloads that did not fit: sent over ZMQ

    def consumed(self) -> int:
        return struct.unpack_from("<Q", self._map, 0)[0]

    def place(self, payload: memoryview) -> Placed | None:
        """Copy payload into the ring; None when it does not fit now (send it inline)."""
        n = len(payload)
        start = self.head
        if start % self.capacity + n > self.capacity:      # would wrap: start at the beginning
            start += self.capacity - start % self.capacity
        end = start + n
        offset = start % self.capacity
        if n == 0 or end - self.consumed() > self.capacity or not self._backed(offset + n):
            self.frames_inline += 1
            return None
        self._map[HEADER_BYTES + offset:HEADER_BYTES + offset + n] = payload
        self.head = end
        return Placed(offset, end)

    def _backed(self, upto: int) -> bool:
        """Memory behind payload bytes [0, upto), allocated in steps as the ring first fills: a
        /dev/shm without room (a container's 64 MiB default) answers ENOSPC here, where touching
        a hole would raise SIGBUS. False when it has no room."""
        if upto <= self._allocated:
            return True
        want = min(self.capacity, max(upto, self._allocated + ALLOCATION_STEP))
        try:
            os.posix_fallocate(self._fd, HEADER_BYTES + self._allocated, want - self._allocated)
        except OSError:
            return False
        self._allocated = want
        return True

    def close(self) -> None:
        _unlink(self.name)
        self._map.close()
        os.close(self._fd)


class RingReader:
    """D's mapped rings, by name (at most MAX_RINGS; the least recently used is dropped)."""

    def __init__(self) -> None:
        self._rings: OrderedDict[str, mmap.mmap] = OrderedDict()

    def _ring(self, name: str) -> mmap.mmap:
        ring = self._rings.get(name)
        if ring is not None:
            self._rings.move_to_end(name)
            return ring
        fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.unlink(_path(name))
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
                raise ValueError("KV segment with an unexpected owner or mode")
            if not HEADER_BYTES < st.st_size <= HEADER_BYTES + MAX_RING_BYTES:
                raise ValueError(f"KV segment of {st.st_size} bytes")
            ring = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        self._rings[name] = ring
        while len(self._rings) > MAX_RINGS:
            _close(self._rings.popitem(last=False)[1])
        return ring

    @contextmanager
    def read(self, name: str, offset: int, size: int, end: int) -> Iterator[memoryview]:
        """The `size` payload bytes at `offset` of ring `name`; afterwards (whatever became of
        them) the ring's consumed position is `end`. ValueError when the name, owner, mode or
        range is not that of a ring of ours."""
        ring = self._ring(name)
        capacity = len(ring) - HEADER_BYTES
        try:
            if not (0 < size and 0 <= offset and offset + size <= capacity):
                raise ValueError(f"{size} bytes at {offset} do not fit a ring of {capacity}")
            view = memoryview(ring)[HEADER_BYTES + offset:HEADER_BYTES + offset + size]
            try:
                yield view
            finally:
                view.release()
        finally:
            if end > struct.unpack_from("<Q", ring, 0)[0]:      # positions only grow
                struct.pack_into("<Q", ring, 0, end)

    def close(self) -> None:
        while self._rings:
            _close(self._rings.popitem()[1])


def _close(ring: mmap.mmap) -> None:
    try:
        ring.close()
    except BufferError:      # a tensor still views it: the mapping goes with the tensor
        pass
