"""One kvmesh engine at a time measures a GPU's memory.

An engine sizes its KV cache by what it used since it started (model_runner.kv_cache_budget), and
the only measure of non-torch memory (CUDA context, cuBLAS workspaces) is the device's used
memory, which counts every process. Two engines starting together on one GPU (a prefill and a
decode worker of `kvmesh serve`, or two mixed workers at a fraction each) would each charge the
other's weights and profiling peak to themselves: the one that measured last got a few hundred
blocks instead of its share. So an engine holds this GPU's lock from before its weights load
until its KV cache and CUDA graphs are allocated; the next one starts measuring after that, with
the first one's memory already in its baseline.

The lock is an flock on a file named by the user and the GPU's UUID in $XDG_RUNTIME_DIR (else the
temporary directory): released by the kernel if its holder dies, so a crashed worker blocks no
one. Engines of other users, or in other containers, are not serialized; a GPU shared with them
should be given by num_gpu_blocks or started in turn.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import time
from typing import Iterator

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0          # how often a waiting engine says it still waits
MAX_WAIT_S = 900.0         # past this the holder is taken for stuck: measure anyway, with a warning
POLL_S = 0.2


def lock_path(device_uuid: str) -> str:
    directory = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(directory, f"kvmesh-{os.getuid()}-gpu-{device_uuid}.lock")


def _open(path: str) -> int | None:
    """The lock file, created 0600; None (logged) where it cannot be opened, for example a file
    of that name that is a link or belongs to someone else."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.warning("GPU memory lock %s cannot be opened (%s); measuring without it", path, e.strerror)
        return None
    if os.fstat(fd).st_uid != os.getuid():
        os.close(fd)
        log.warning("GPU memory lock %s belongs to another user; measuring without it", path)
        return None
    return fd


@contextlib.contextmanager
def measuring_device(device_uuid: str, *, max_wait_s: float = MAX_WAIT_S) -> Iterator[None]:
    """Hold this GPU's lock for the body: other kvmesh engines of this user wait to measure."""
    path = lock_path(device_uuid)
    fd = _open(path)
    if fd is None:
        yield
        return
    try:
        start, last_said = time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            now = time.monotonic()
            if now - start >= max_wait_s:
                log.warning("another kvmesh engine has held GPU %s's memory lock for %.0f s; measuring "
                            "anyway (this KV cache may come out smaller than its share)", device_uuid, now - start)
                break
            if last_said is None or now - last_said >= WAIT_LOG_S:
                log.info("another kvmesh engine on GPU %s is measuring its memory; waiting for it "
                         "(%.0f s so far)", device_uuid, now - start)
                last_said = now
            time.sleep(POLL_S)
        yield
    finally:
        os.close(fd)        # releases the flock
