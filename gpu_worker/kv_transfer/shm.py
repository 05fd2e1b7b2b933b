"""Same-host KV frames through POSIX shared memory: the payload skips the socket and CURVE.

    P  SegmentWriter.parts(rid, frame, payload): the payload goes into a fresh segment
       /dev/shm/kvmesh-kv-<32 random hex> (mode 0600, O_EXCL), and only the frame's header, naming
       it, goes over the CURVE-authenticated ZMQ socket
    D  read_segment(name, size): opens it (no symlinks; owned by this user, mode 0600, exactly the
       expected size), maps it, unlinks it at once, and hands the mapping to the consumer's usual
       checks and copy

Why this is as safe as the frames: the name is random and travels only inside the encrypted,
authenticated plane; the segment is readable by this user only (who could ptrace either process
anyway); D accepts only names of our exact pattern (no path ever comes from the wire) and checks
the payload's size, shape and checksum as for a frame. Segments never outlive a hand-off: D unlinks
each as soon as it has mapped it, and P unlinks the ones D never took when the hand-off ends (Ack,
Fail, lease, abort). P keeps at most `max_bytes` in segments D has not taken; past it, frames go
inline over ZMQ (back-pressure without waiting). A P killed between creating a segment and D
taking it leaves it until D's lease drops the request; kvmesh-kv-* files of dead processes can be
removed by hand.

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
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SHM_DIR = "/dev/shm"
PREFIX = "kvmesh-kv-"
_NAME = re.compile(r"kvmesh-kv-[0-9a-f]{32}")
DEFAULT_MAX_SEGMENT_BYTES = 1 << 30     # P's segments not yet taken by D, all peers together


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


class SegmentWriter:
    """P's segments, per request, shared by P's sender threads (one per decode worker)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_SEGMENT_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._open: dict[str, list[tuple[str, int]]] = {}     # request -> (name, bytes) D may not have taken
        self.segments_written = 0
        self.frames_inline = 0          # frames sent over ZMQ because the bound was reached

    def outstanding_bytes(self) -> int:
        """Bytes in segments D has not taken yet (D unlinks what it maps); forgets the taken ones."""
        with self._lock:
            total = 0
            for rid, segs in self._open.items():
                segs[:] = [(name, n) for name, n in segs if os.path.exists(os.path.join(SHM_DIR, name))]
                total += sum(n for _, n in segs)
            return total

    def write(self, request_id: str, payload: memoryview) -> str | None:
        """A new segment holding payload, its name; None when P is at its bound (send inline)."""
        if self.outstanding_bytes() + len(payload) > self.max_bytes:
            self.frames_inline += 1
            return None
        name = PREFIX + secrets.token_hex(16)
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with self._lock:
            self._open.setdefault(request_id, []).append((name, len(payload)))
        try:
            os.ftruncate(fd, len(payload))
            with mmap.mmap(fd, len(payload)) as m:
                m[:] = payload
        except BaseException:
            _unlink(name)
            raise
        finally:
            os.close(fd)
        self.segments_written += 1
        return name

    def release(self, request_id: str) -> None:
        """The hand-off ended: unlink the segments D did not take."""
        with self._lock:
            segs = self._open.pop(request_id, [])
        for name, _ in segs:
            _unlink(name)

    def release_all(self) -> None:
        with self._lock:
            rids = list(self._open)
        for rid in rids:
            self.release(rid)


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


@contextmanager
def read_segment(name: str, size: int) -> Iterator[memoryview]:
    """D: the payload in segment `name` (unlinked before this yields); ValueError when the name,
    owner, mode or size is not what a segment of ours has."""
    fd = os.open(_path(name), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.unlink(_path(name))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
            raise ValueError("KV segment with an unexpected owner or mode")
        if st.st_size != size or size == 0:
            raise ValueError(f"KV segment of {st.st_size} bytes, expected {size}")
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    view = memoryview(m)
    try:
        yield view
    finally:
        view.release()
        try:
            m.close()
        except BufferError:      # a tensor still views it: the mapping goes with the tensor
            pass
