"""The local-disk tier: one file per block (tier_file.py's format) in a private directory.

    <dir>/ (0700)   <block hash hex>.kvb (0600)     written as <name>.tmp, then renamed, so a
                                                    reader never sees a half-written file under
                                                    its final name (a crash leaves only .tmp)

The index (hash -> parent, token ids) lives in memory, LRU first, bounded by `max_blocks`
(the configured bytes over one file's largest size). At start-up the directory's block files are
removed: their parents and tokens, which the KV events need, are not in the files.

Failures never fail a request: a file that does not verify is deleted and reported missing
(the caller recomputes the block); a write that fails (disk full, directory gone) turns the
whole tier off with one warning, and every block it held is reported removed.
"""
from __future__ import annotations

import logging
import os
import re
import stat
from collections import OrderedDict
from typing import NamedTuple

from gpu_worker.kv_tiers import tier_file
from gpu_worker.kv_transfer.layout import KVLayout

log = logging.getLogger("kvmesh.kv_tiers")

DISK_OVERHEAD = 4 + tier_file.MAX_HEADER_BYTES      # a file's bytes beyond its payload, at most
_BLOCK_FILE = re.compile(r"^[0-9a-f]{32}\.kvb(\.tmp)?$")


class DiskBlock(NamedTuple):
    parent: bytes | None
    token_ids: tuple[int, ...]


class DiskTier:
    def __init__(self, directory: str, max_blocks: int, layout: KVLayout, payload_len: int) -> None:
        self.directory = directory
        self.max_blocks = max_blocks
        self.layout = layout
        self.payload_len = payload_len
        self.enabled = True
        self.num_corrupt = 0          # files dropped because they did not verify
        self._blocks: OrderedDict[bytes, DiskBlock] = OrderedDict()    # LRU first
        _private_directory(directory)
        for name in os.listdir(directory):
            if _BLOCK_FILE.match(name):
                os.unlink(os.path.join(directory, name))

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".kvb")

    def is_full(self) -> bool:
        return len(self._blocks) >= self.max_blocks

    def pop_lru(self) -> bytes:
        """Delete the least recently used block's file; returns its hash."""
        block_hash, _ = self._blocks.popitem(last=False)
        self._unlink(block_hash)
        return block_hash

    def write(self, block_hash: bytes, block: DiskBlock, payload: memoryview) -> bool:
        """Store a block (the caller made room). False when the write failed: the tier is off now."""
        path = self._path(block_hash)
        tmp = path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                for part in tier_file.encode(block_hash, self.layout, payload):
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("KV disk tier %s turned off: writing a block failed (%s); blocks evicted from "
                        "host memory are dropped from now on", self.directory, e)
            self._unlink_path(tmp)
            self.enabled = False
            return False
        self._blocks[block_hash] = block
        return True

    def read(self, block_hash: bytes) -> memoryview | None:
        """The verified payload of a block (marked most recently used), or None when it is not held
        or its file does not verify (the file is deleted and the block forgotten)."""
        if block_hash not in self._blocks:
            return None
        try:
            fd = os.open(self._path(block_hash), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                data = _read_at_most(fd, tier_file.MAX_HEADER_BYTES + 4 + self.payload_len + 1)
            finally:
                os.close(fd)
            payload = tier_file.decode(data, block_hash, self.layout, self.payload_len)
        except (OSError, tier_file.TierFileError) as e:
            log.warning("KV disk tier: dropped block %s (%s); it will be recomputed", block_hash.hex(), e)
            self.num_corrupt += 1
            self.forget(block_hash)
            return None
        self._blocks.move_to_end(block_hash)
        return payload

    def forget(self, block_hash: bytes) -> None:
        if self._blocks.pop(block_hash, None) is not None:
            self._unlink(block_hash)

    def clear(self) -> list[bytes]:
        """Delete every block file (best effort); returns the hashes the tier held."""
        gone = list(self._blocks)
        for block_hash in gone:
            self._unlink(block_hash)
        self._blocks.clear()
        return gone

    def hashes(self) -> list[tuple[bytes, DiskBlock]]:
        return list(self._blocks.items())

    def _unlink(self, block_hash: bytes) -> None:
        self._unlink_path(self._path(block_hash))

    @staticmethod
    def _unlink_path(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def check_integrity(self) -> None:
        """cached <= total; while on, every indexed block has its file (nothing else is ours)."""
        assert len(self._blocks) <= self.max_blocks, f"disk tier: {len(self._blocks)} > {self.max_blocks}"
        if self.enabled:
            on_disk = {n for n in os.listdir(self.directory) if _BLOCK_FILE.match(n)}
            assert on_disk == {h.hex() + ".kvb" for h in self._blocks}, "disk tier: files differ from the index"


def _private_directory(directory: str) -> None:
    """Create `directory` (0700) or check an existing one is ours; tighten it to 0700."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.stat(directory, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"invalid engine argument kv_offload_dir: {directory!r} is not a directory")
    if info.st_uid != os.getuid():
        raise ValueError(f"invalid engine argument kv_offload_dir: {directory!r} belongs to another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(directory, 0o700)


def _read_at_most(fd: int, limit: int) -> bytearray:
    """Up to `limit` bytes of a file, in a writable buffer (torch.frombuffer views it in place)."""
    data = bytearray()
    while len(data) < limit:
        chunk = os.read(fd, min(limit - len(data), 1 << 24))
        if not chunk:
            break
        data += chunk
    return data
