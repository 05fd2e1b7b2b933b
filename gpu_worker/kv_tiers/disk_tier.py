"""The local-disk tier: one file per block (tier_file.py's format) in a private directory.

    <dir>/ (0700)   <block hash hex>.kvb (0600)     written as <name>.tmp, then renamed, so a
                                                    reader never sees a half-written file under
                                                    its final name (a crash leaves only .tmp)

The index (hash -> parent, token ids) lives in memory, LRU first, bounded by `max_blocks`
(the configured bytes over one file's largest size). At start-up the directory is locked (one
engine per directory) and the index is rebuilt from the files a previous engine left
(disk_restore.py: headers checked, the oldest beyond `max_blocks` deleted), so a restarted worker
starts warm; its KV-event stream then opens with these blocks.

Files are written and deleted by one background thread, in the order asked, so the engine's
thread never waits for the disk: a block is in the index as soon as its write is queued, and
reads of a block still queued come from the queued bytes. Reads run on the caller's thread
(`read`) or on the loads' reader threads (`read_file`, then `settle_read` on the engine's thread:
only the latter touches the index). At most `max_queued` writes wait; a
further one waits for the oldest (the only time the engine waits for this tier).

Failures never fail a request, and cost only the blocks they touch (the caller takes them with
`take_dropped` and reports them removed; each is recomputed when asked for):
- a file that does not verify is deleted; one gone (deleted outside kvmesh) is forgotten, at its
  read or at the periodic check of the index against the directory (disk_reconcile.py);
- a write that fails drops its block (the writer removed its .tmp: no partial file stays);
  persistent failure turns writes off for a back-off and then tries again (write_backoff.py),
  while the blocks already on disk are still read.
"""
from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple

from gpu_worker.kv_tiers import disk_restore, tier_file
from gpu_worker.kv_tiers.disk_reconcile import Reconciler
from gpu_worker.kv_tiers.file_reads import FileRead, read_block_file
from gpu_worker.kv_tiers.write_backoff import WARN_EVERY_S, WriteBackoff
from gpu_worker.kv_transfer.layout import KVLayout

log = logging.getLogger("kvmesh.kv_tiers")


class DiskBlock(NamedTuple):
    parent: bytes | None
    token_ids: tuple[int, ...]


class DiskTier:
    def __init__(self, directory: str, max_blocks: int, layout: KVLayout, payload_len: int,
                 max_queued: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.max_blocks = max_blocks
        self.layout = layout
        self.payload_len = payload_len
        self.max_queued = max_queued
        self.num_corrupt = 0          # files dropped because they did not verify
        self.num_vanished = 0         # indexed files found gone (deleted outside kvmesh)
        self.clock = clock            # time.monotonic; the back-off and the periodic check read it
        self.backoff = WriteBackoff(directory, lambda: self.clock())
        self._reconciler = Reconciler(lambda: self.clock())
        self._vanished_logged: tuple[float, int] | None = None     # (when, num_vanished then)
        self._dropped: list[bytes] = []     # blocks forgotten by the tier itself, until take_dropped
        self._blocks: OrderedDict[bytes, DiskBlock] = OrderedDict()    # LRU first
        # writes not settled: (its future, its bytes, the index entry it was queued for)
        self._queued: OrderedDict[bytes, tuple[Future, bytearray, DiskBlock]] = OrderedDict()
        self._copies: deque[tuple[int, float]] = deque(maxlen=256)   # (bytes, seconds) of file I/O
        owned_directory(directory, "kv_offload_dir")
        self._lock = disk_restore.lock_directory(directory)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-kv-disk")
        self.num_restored = self._restore()

    def _restore(self) -> int:
        """Index the blocks a previous engine left here, newest `max_blocks` (the rest deleted)."""
        t = time.monotonic()
        found = disk_restore.scan(self.directory, self.layout, self.payload_len)
        self.num_corrupt += found.dropped
        keep = found.blocks[-self.max_blocks:] if self.max_blocks else []
        for block in found.blocks[:len(found.blocks) - len(keep)]:
            _unlink_path(self._path(block.block_hash))
        for block in keep:
            self._blocks[block.block_hash] = DiskBlock(block.parent, block.token_ids)
        if found.blocks or found.dropped:
            log.info("KV disk tier %s: restored %d blocks in %.1f s (%d over its size deleted, %d files "
                     "dropped)", self.directory, len(keep), time.monotonic() - t, len(found.blocks) - len(keep),
                     found.dropped + found.unscanned)
        return len(keep)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".kvb")

    def is_full(self) -> bool:
        return len(self._blocks) >= self.max_blocks

    @property
    def writes_on(self) -> bool:
        """Whether blocks may be written now (off for a back-off after persistent failures)."""
        return self.backoff.writes_on()

    def take_dropped(self) -> list[bytes]:
        """The blocks the tier forgot by itself since the last call (a failed write, a file gone at
        the periodic check): the caller reports them removed."""
        dropped, self._dropped = self._dropped, []
        # one written again since (its new write queued) is held: nothing to report
        return [h for h in dropped if h not in self._blocks]

    # ---- writes (queued) -----------------------------------------------------------------
    def write(self, block_hash: bytes, block: DiskBlock, payload: bytearray) -> None:
        """Queue a block's file (the caller made room, checked `writes_on`, and hands over `payload`)."""
        self.backoff.resume()
        self._blocks[block_hash] = block
        self._queued[block_hash] = (self._writer.submit(self._write_file, block_hash, block, payload), payload,
                                    block)
        while len(self._queued) > self.max_queued:
            self._settle_oldest(wait=True)

    def _write_file(self, block_hash: bytes, block: DiskBlock, payload: bytearray) -> None:
        """(writer thread) Raises OSError when the write fails."""
        path = self._path(block_hash)
        t = time.perf_counter()
        # one writer per directory (its lock): a .tmp left by a crash is simply overwritten
        write_file(path, path + ".tmp", tier_file.encode(block_hash, self.layout, payload, block.parent,
                                                         block.token_ids), exclusive=False)
        self._copies.append((len(payload), time.perf_counter() - t))

    def poll(self) -> list[tuple[int, float]]:
        """Settle finished writes (a failed one drops its block) and step the check of the index
        against the directory. Returns the (bytes, seconds) of file reads and writes since the
        last call."""
        while self._queued and self._settle_oldest(wait=False):
            pass
        found = 0
        for block_hash, entry in self._reconciler.step(self._blocks, self._queued, self._path, self._writer):
            if self._blocks.get(block_hash) is entry and block_hash not in self._queued:
                del self._blocks[block_hash]
                self._dropped.append(block_hash)
                found += 1
        self._note_vanished(found)
        copies = list(self._copies)
        self._copies.clear()
        return copies

    def _settle_oldest(self, wait: bool) -> bool:
        """Retire the oldest queued write (waiting for it when `wait`); False when it is not done."""
        block_hash, (future, _, entry) = next(iter(self._queued.items()))
        if not (wait or future.done()):
            return False
        error = future.exception()
        del self._queued[block_hash]
        if error is None:
            self.backoff.succeeded()
            return True
        self.backoff.failed(error)
        if self._blocks.get(block_hash) is entry:     # no file: the writer removed its .tmp
            del self._blocks[block_hash]
            self._dropped.append(block_hash)
        return True

    def _note_vanished(self, found: int) -> None:
        """Count files found gone; one line per WARN_EVERY_S at most (a cleaner may take thousands)."""
        self.num_vanished += found
        now = self.clock()
        last = self._vanished_logged
        if self.num_vanished > (last[1] if last else 0) and (last is None or now - last[0] >= WARN_EVERY_S):
            log.warning("KV disk tier %s: %d indexed block files gone (deleted outside kvmesh?); their blocks "
                        "are forgotten and recomputed when asked for", self.directory,
                        self.num_vanished - (last[1] if last else 0))
            self._vanished_logged = (now, self.num_vanished)

    def drain(self) -> None:
        """Wait until every queued write and delete is done, and retire the writes (a failed one
        drops its block; poll() still returns their times)."""
        self._writer.submit(lambda: None).result()
        while self._queued:
            self._settle_oldest(wait=True)

    # ---- reads ---------------------------------------------------------------------------
    def read(self, block_hash: bytes) -> memoryview | None:
        """The verified payload of a block (marked most recently used), or None when it is not held
        or its file does not verify (the file is deleted and the block forgotten)."""
        if block_hash not in self._blocks:
            return None
        queued = self.queued_payload(block_hash)
        if queued is not None:                   # not settled yet: its bytes are still here
            self._blocks.move_to_end(block_hash)
            return queued
        entry = self.entry(block_hash)
        result = self.read_file(block_hash)
        if result.payload is not None:
            self._copies.append((len(result.payload), result.end - result.start))
        return self.settle_read(block_hash, entry, result)

    def entry(self, block_hash: bytes) -> DiskBlock | None:
        """The index's entry of a block, marked most recently used (a load is about to read it):
        a new object at each write, so settle_read can tell the block a read started on from one
        evicted and written again meanwhile."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
        return self._blocks.get(block_hash)

    def queued_payload(self, block_hash: bytes) -> memoryview | None:
        """The bytes of a block whose write is still queued (its file may not exist yet)."""
        queued = self._queued.get(block_hash)
        return memoryview(queued[1]) if queued is not None else None

    def read_file(self, block_hash: bytes) -> FileRead:
        """(any thread) Read and verify a block's file; no tier state is touched."""
        limit = tier_file.file_overhead(self.layout.block_size) + self.payload_len + 1
        return read_block_file(self._path(block_hash), limit,
                               lambda data: tier_file.decode(data, block_hash, self.layout, self.payload_len),
                               (tier_file.TierFileError,))

    def settle_read(self, block_hash: bytes, entry: DiskBlock | None, result: FileRead) -> memoryview | None:
        """(engine thread) A read's outcome: a verified payload is returned (the block marked most
        recently used if still held); a failed read of the block still indexed as `entry` (the
        one the read started on) forgets it, counted and logged. A block evicted while it was
        being read (its file deleted by the writer) is a miss and nothing else."""
        held = entry is not None and self._blocks.get(block_hash) is entry
        if result.payload is not None:
            if held:
                self._blocks.move_to_end(block_hash)
            return result.payload
        if held and result.missing:             # deleted outside kvmesh: not damage
            self.forget(block_hash)             # (the name may hold what we cannot open: deleted)
            self._note_vanished(1)
        elif held:
            log.warning("KV disk tier: dropped block %s (%s); it will be recomputed", block_hash.hex(),
                        result.error)
            self.num_corrupt += 1
            self.forget(block_hash)
        return None

    # ---- removal -------------------------------------------------------------------------
    def pop_lru(self) -> bytes:
        """Forget the least recently used block and delete its file; returns its hash."""
        block_hash, _ = self._blocks.popitem(last=False)
        self._delete(block_hash)
        return block_hash

    def forget(self, block_hash: bytes) -> None:
        if self._blocks.pop(block_hash, None) is not None:
            self._delete(block_hash)

    def clear(self) -> list[bytes]:
        """Forget every block and delete the files; returns the hashes the tier held."""
        gone = list(self._blocks)
        for block_hash in gone:
            self._delete(block_hash)
        self._blocks.clear()
        self._dropped.clear()
        return gone

    def _delete(self, block_hash: bytes) -> None:
        """Queued behind the block's own write, so the file cannot appear after its delete."""
        self._queued.pop(block_hash, None)
        self._writer.submit(_unlink_path, self._path(block_hash))

    def hashes(self) -> list[tuple[bytes, DiskBlock]]:
        return list(self._blocks.items())

    def close(self) -> None:
        """Finish the queued writes, then let another engine have the directory."""
        self._writer.shutdown(wait=True)
        self._lock.close()

    def check_integrity(self) -> None:
        """cached <= total; every indexed block has its file, and no other block file (nor a .tmp)
        is there (files deleted outside kvmesh: only once a read or a check found them gone)."""
        self.drain()
        assert len(self._blocks) <= self.max_blocks, f"disk tier: {len(self._blocks)} > {self.max_blocks}"
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:               # removed outside kvmesh
            names = []
        on_disk = {n for n in names if disk_restore.BLOCK_FILE.match(n) or disk_restore.PARTIAL_FILE.match(n)}
        assert on_disk == {h.hex() + ".kvb" for h in self._blocks}, "disk tier: files differ from the index"


def write_file(path: str, tmp: str, parts: list, exclusive: bool) -> int:
    """Write a tier file's parts to `tmp`, then rename it onto `path`: a reader sees the whole file
    or none. `exclusive`: `tmp` must not exist (a name of the writer's own, in a directory others
    write too). Returns the bytes written; raises OSError (a tmp file this call created removed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(tmp, flags, 0o600)     # not ours if this fails (exclusive: another writer's): kept
    try:
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        _unlink_path(tmp)
        raise
    return sum(len(part) for part in parts)


def _unlink_path(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def owned_directory(directory: str, flag: str) -> None:
    """Create `directory` (0700) or check an existing one is ours; tighten it to 0700. Errors
    name the engine argument `flag` that gave it."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.stat(directory, follow_symlinks=False)
    except OSError as e:
        raise ValueError(f"invalid engine argument {flag}: cannot use {directory!r} ({e.strerror})") from None
    if stat.S_ISLNK(info.st_mode):
        # refused, not followed: the link, not the directory, is what we could check is ours
        raise ValueError(f"invalid engine argument {flag}: {directory!r} is a symbolic link; give the directory "
                         f"it points to ({os.path.realpath(directory)!r})")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"invalid engine argument {flag}: {directory!r} is not a directory")
    if info.st_uid != os.getuid():
        raise ValueError(f"invalid engine argument {flag}: {directory!r} belongs to another user")
    if info.st_mode & stat.S_ISVTX:
        # /tmp, /dev/shm: the chmod below would lock every other user out (root may always make it)
        raise ValueError(f"invalid engine argument {flag}: {directory!r} is a shared temporary directory "
                         "(sticky bit) that cannot be made private; give a directory of its own inside it")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(directory, 0o700)
