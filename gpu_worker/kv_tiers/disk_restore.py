"""A disk tier's directory at start-up: one engine at a time, and the blocks a previous one left.

    <dir>/.lock         flock'ed for the engine's life (released by the kernel when the process
                        dies, so a crash leaves no stale lock): a second engine on the same
                        directory is refused with an error naming kv_offload_dir
    <hash>.kvb          headers read (not payloads: the checksum is checked at each read) ->
                        kept when the header names the file's hash, this engine's exact layout
                        (its weights' digest included) and one block's token ids; deleted
                        otherwise (anything but a regular file, a FIFO or a symlink planted
                        under the name, is dropped without blocking or following it). Files of
                        another layout or other weights (the model was upgraded under the same
                        name) are logged in one line that counts them
    <hash>.kvb.tmp      a write cut short by a crash: deleted

The scan is bounded in time (files past the budget are deleted unread: a cold block costs a
recompute, a slow start costs the whole worker), logs its progress on large directories, and
returns the blocks oldest first (by file time) so the tier's LRU continues where it stopped.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import time
from typing import IO, NamedTuple

from gpu_worker.kv_tiers import tier_file
from gpu_worker.kv_transfer.layout import KVLayout

log = logging.getLogger("kvmesh.kv_tiers")

BLOCK_FILE = re.compile(r"^([0-9a-f]{32})\.kvb$")
PARTIAL_FILE = re.compile(r"^[0-9a-f]{32}\.kvb\.tmp$")
LOCK_NAME = ".lock"
SCAN_BUDGET_S = 30.0
_PROGRESS_EVERY = 10_000     # files between two progress lines


class RestoredBlock(NamedTuple):
    block_hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    mtime_ns: int


class ScanResult(NamedTuple):
    blocks: list[RestoredBlock]      # oldest first
    dropped: int                     # files that did not verify (foreign ones too), or torn writes: deleted
    unscanned: int                   # files past the time budget: deleted
    foreign: int = 0                 # of `dropped`: sound files of another layout or other weights


def lock_directory(directory: str) -> IO[bytes]:
    """Hold the directory's lock (keep the returned file open for the engine's life); raises
    ValueError naming kv_offload_dir when another engine holds it, or when the name holds
    something that cannot be opened as our lock file."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        lock = open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+b")
    except OSError as e:        # a symlink (never followed) or a directory planted under the name
        raise ValueError(f"invalid engine argument kv_offload_dir: cannot lock {path!r} ({e.strerror}); "
                         "remove it or give a directory of its own") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = lock.read(32).decode(errors="replace").strip() or "unknown"
        lock.close()
        raise ValueError(f"invalid engine argument kv_offload_dir: {directory!r} is in use by another "
                         f"engine (process {holder}); give each worker a directory of its own") from None
    lock.truncate(0)
    lock.write(str(os.getpid()).encode())
    lock.flush()
    return lock


def scan(directory: str, layout: KVLayout, payload_len: int, budget_s: float = SCAN_BUDGET_S) -> ScanResult:
    """The blocks a previous engine of the same layout left in `directory`; everything else of
    ours there (bad, torn or unscanned block files) is deleted."""
    t0 = time.monotonic()
    names = os.listdir(directory)
    blocks: list[RestoredBlock] = []
    dropped = unscanned = 0
    foreign: list[tier_file.ForeignLayout] = []    # at most one per file version: the log line's examples
    counts: dict[int, int] = {}                     # file version -> foreign files
    for i, name in enumerate(names):
        path = os.path.join(directory, name)
        if PARTIAL_FILE.match(name):
            _unlink(path)
            dropped += 1
            continue
        match = BLOCK_FILE.match(name)
        if match is None:
            continue
        if time.monotonic() - t0 > budget_s:
            _unlink(path)
            unscanned += 1
            continue
        try:
            block = _read_block(path, bytes.fromhex(match.group(1)), layout, payload_len)
        except tier_file.ForeignLayout as e:   # not logged one by one: an upgrade leaves thousands
            block, counts[e.version] = None, counts.get(e.version, 0) + 1
            if counts[e.version] == 1:
                foreign.append(e)
        if block is None:
            _unlink(path)
            dropped += 1
        else:
            blocks.append(block)
        if i and i % _PROGRESS_EVERY == 0:
            log.info("KV disk tier %s: scanned %d of %d files (%.1f s)", directory, i, len(names),
                     time.monotonic() - t0)
    if unscanned:
        log.warning("KV disk tier %s: the scan took over %.0f s; %d files past it were deleted",
                    directory, budget_s, unscanned)
    if foreign:
        log.warning("KV disk tier %s: deleted %d block files of another KV layout (%s)", directory,
                    sum(counts.values()), "; ".join(_differences(layout, e, counts[e.version]) for e in foreign))
    blocks.sort(key=lambda b: b.mtime_ns)
    return ScanResult(blocks, dropped, unscanned, sum(counts.values()))


def _differences(mine: KVLayout, first: tier_file.ForeignLayout, count: int) -> str:
    """How the first foreign file of a file version differs, field by field; the cause when only the
    weights' digest does (same model and shapes: the weights were upgraded)."""
    if first.version != tier_file.VERSION:
        return f"{count} of file format version {first.version}, this engine writes {tier_file.VERSION}"
    theirs = first.layout
    diffs = [f"{f}: {getattr(theirs, f)!r} there, {getattr(mine, f)!r} here"
             for f in mine.__struct_fields__ if getattr(mine, f) != getattr(theirs, f)]
    if len(diffs) == 1 and mine.weights_digest != theirs.weights_digest:
        diffs.append("the model's weights changed since they were written: their KV is recomputed")
    return f"{count} of this file format, the first differing in " + ", ".join(diffs)


def _read_block(path: str, block_hash: bytes, layout: KVLayout, payload_len: int) -> RestoredBlock | None:
    """A file's block, when its header and size are right (its payload is checked when read);
    raises tier_file.ForeignLayout for a sound file of another layout."""
    try:
        # non-blocking: a FIFO planted under a block's name would block the engine's start
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):      # a FIFO, a device, a directory: nothing we wrote
                raise tier_file.TierFileError("not a regular file")
            header_len = tier_file.header_length(os.pread(fd, tier_file.LEN_BYTES, 0), layout)
            raw = os.pread(fd, header_len, tier_file.LEN_BYTES)
        finally:
            os.close(fd)
        if len(raw) != header_len:
            raise tier_file.TierFileError("torn file")
        header = tier_file.decode_header(raw, block_hash, layout, payload_len)   # a foreign file's size may differ
        if info.st_size != tier_file.LEN_BYTES + header_len + payload_len:
            raise tier_file.TierFileError("torn file")
    except tier_file.ForeignLayout:
        raise
    except (OSError, tier_file.TierFileError) as e:
        log.info("KV disk tier: dropped %s (%s)", os.path.basename(path), e)
        return None
    return RestoredBlock(block_hash, header.parent, tuple(header.token_ids), info.st_mtime_ns)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
