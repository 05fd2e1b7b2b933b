"""The shared KV tier's store id: what a worker announces (registry info `kv_shared_tier`) so the
prefix index credits blocks in the shared tier to exactly the workers that read the same files.

    <dir>/<layout>-<key id>[-rank0]/store-id     16 random bytes, then HMAC-SHA256 (the files'
                                                  key) over a label, those bytes and the
                                                  subdirectory's name

Two workers agree on the id exactly when they use the same subdirectory (same directory, layout
and key): the first one creates the file, exclusively (written under a name of its own, then
hard-linked into place: a reader sees the whole file or none, and a second creator finds it there
and reads the winner's). The MAC binds the id to the subdirectory's name, so a file copied from
another layout's subdirectory does not verify.

Others may be able to write the directory (shared_tier.py). What they can do here only touches
routing, never KV (each block file has its own MAC): a file that does not verify (planted, or
damaged; or no regular file: a directory, a FIFO, opened without waiting for a writer) makes the
worker announce no id, with a warning naming it, and the shared tier is then used without
routing credit; a valid file copied from another node's directory of the same
deployment would make routing credit this node's workers with that node's blocks, whose loads
then miss and are recomputed. Neither is fixed by replacing the file here: two workers replacing
it at once would announce different ids.
"""
from __future__ import annotations

import errno
import hmac
import logging
import os
import stat

from gpu_worker.kv_tiers.disk_tier import _unlink_path

log = logging.getLogger("kvmesh.kv_tiers")

NAME = "store-id"
ID_BYTES = 16
_LABEL = b"kvmesh shared KV store id\x00"
_FILE_BYTES = ID_BYTES + 32


def _tag(key: bytes, store_id: bytes, subdir_name: str) -> bytes:
    return hmac.new(key, _LABEL + store_id + subdir_name.encode(), "sha256").digest()


def _create(path: str, key: bytes, subdir_name: str) -> None:
    """Write a fresh id at `path` unless one is there already (then nothing changes)."""
    store_id = os.urandom(ID_BYTES)
    tmp = f"{path}.{os.urandom(8).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, store_id + _tag(key, store_id, subdir_name))
        finally:
            os.close(fd)
        os.link(tmp, path)              # FileExistsError: another worker's id is there
    except FileExistsError:
        pass
    finally:
        _unlink_path(tmp)


def _read(path: str, key: bytes, subdir_name: str) -> str | None:
    """The id in `path` as 32 hex digits, or None (a warning) when the file does not verify."""
    try:
        # non-blocking: a FIFO planted under the name would otherwise hold the worker's start
        # until someone writes it; a directory or a FIFO is no id file (checked before the read)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            data = os.read(fd, _FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("KV shared tier: cannot read %s (%s); the shared tier gets no routing credit", path, e.strerror)
        return None
    store_id, tag = data[:ID_BYTES], data[ID_BYTES:]
    if len(data) != _FILE_BYTES or not hmac.compare_digest(tag, _tag(key, store_id, subdir_name)):
        log.warning("KV shared tier: %s does not verify (damaged, or not written by this deployment); the "
                    "shared tier gets no routing credit until it is deleted (every worker of the directory then "
                    "agrees on a new one at its next start)", path)
        return None
    return store_id.hex()


def store_id(subdir: str, key: bytes) -> str | None:
    """The id of the shared store in `subdir` (created on first use), or None where the file there
    does not verify or cannot be made."""
    path = os.path.join(subdir, NAME)
    name = os.path.basename(os.path.normpath(subdir))
    if not os.path.lexists(path):
        try:
            _create(path, key, name)
        except OSError as e:
            log.warning("KV shared tier: cannot create %s (%s); the shared tier gets no routing credit",
                        path, e.strerror)
            return None
    return _read(path, key, name)
