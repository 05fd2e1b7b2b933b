"""The shared KV tier: a directory every worker on the node reads and writes at once, so a
conversation that moves to another worker loads its history instead of recomputing it.

    <dir>/ (0700, ours)
      <layout>-<key id>/ (0700)  16 hex digits of xxh3-64 over the engine's KVLayout, and 16 naming
                                 the MAC key (shared_file.key_id): engines of another model, layout
                                 or deployment never meet on a block's name
        <hash>.kvb (0600)        shared_file.py's format (tier_file's, then a MAC), written as
                                 <hash>.kvb.<random>.tmp, then renamed: a reader sees a whole file
                                 or none
      <layout>-<key id>-rank<r>/ a tensor-parallel engine's rank r: its shard of every block (the
                                 layout carries tp_size, so engines of another TP size never meet
                                 these files; rank r of one TP=2 engine shares with rank r of another)

No lock and no index, since the files are other workers' as much as ours: a lookup is one stat
of the block's name, a load reads the file and checks its MAC, then every check of
tier_file.decode. Other processes may be able to write here (a pod mounting the same hostPath, one
of the same uid), so the MAC, keyed by the workers' trust material, is what makes a file KV: one
that vanished (another writer's bound deleted it) is a miss; one that fails the MAC or a check is
deleted and is a miss too (one warning a minute): the caller recomputes the block, a request never
fails for this tier.

Routing: blocks here belong to no worker. The subdirectory's store id (shared_store_id.py) names
them; the worker announces it, and its KV events with tier "shared" report the blocks it writes
here and the ones it finds gone (`take_gone`: deleted by its bound, missing or not verifying on a
read, a failed write), which the prefix index files under that id (docs/kv_events.md), and the
blocks a lookup found no file for (`note_miss`, `take_missing`: shared_misses.py), so that a
removal lost in a gap of the event stream does not leave a stale credit.

Size: every writer of a one-rank engine bounds the whole directory (every subdirectory above);
each rank of a tensor-parallel engine bounds its own subdirectory, to its share of the bound (the
caller splits it, as it splits the disk tier's). It estimates the bytes there from a scan plus its
own writes since, and scans again when that estimate passes the bound, every SCAN_EVERY_S
seconds, and every 1/16 of the bound's files it writes (at most SCAN_EVERY_WRITES); a scan counts
at most twice the bound's files (at least SCAN_MAX_FILES) and, past the bound, deletes the oldest
(mtime) until the directory is at 90% of it (one that reached that count also deletes down to 90%
of it: the rest of the directory is seen by the next scans). Between two of a writer's scans the
directory may pass the bound by what the other writers wrote since (each of them at most 1/16 of
it before its own scan). Writers deleting the same file at once is fine (a missing file is
skipped). Writes, deletes and scans run on one background thread.
"""
from __future__ import annotations

import logging
import os
import stat
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import msgspec
import xxhash

from gpu_worker.kv_tiers import shared_file, shared_store_id, tier_file
from gpu_worker.kv_tiers.disk_tier import DiskBlock, _unlink_path, owned_directory, write_file
from gpu_worker.kv_tiers.file_reads import FileRead, read_block_file
from gpu_worker.kv_tiers.shared_misses import SharedMisses
from gpu_worker.kv_transfer.layout import KVLayout

log = logging.getLogger("kvmesh.kv_tiers")

FLAG = "kv_offload_shared_dir"
SCAN_EVERY_S = 10.0
SCAN_EVERY_WRITES = 256
SCAN_MAX_FILES = 50_000      # one scan's stats: a few tens of ms on a local disk
MAX_GONE = 65_536            # gone blocks kept until take_gone (routing hints: the oldest may drop)
# gone blocks checked per take_gone (one stat each, on the engine thread): a bound's big deletion
# is reported over several flushes
GONE_PER_TAKE = 256
STALE_TMP_S = 60.0           # a .tmp this old was left by a writer that died mid-write
_LOW_WATER = 0.9             # a scan past the bound deletes down to this share of it
_WARN_EVERY_S = 60.0


class ScanResult(NamedTuple):
    files: int
    bytes: int
    deleted: int


class SharedTier:
    def __init__(self, directory: str, max_bytes: int, layout: KVLayout, payload_len: int, key: bytes,
                 max_queued: int = 64, rank: int = 0) -> None:
        shared_file.check_key(key)
        self.root = directory
        self.key = key                  # a secret: never logged (nor is this object's repr)
        self.max_bytes = max_bytes
        self.layout = layout
        self.payload_len = payload_len
        self.file_bytes = payload_len + tier_file.file_overhead(layout.block_size) + shared_file.MAC_BYTES  # at most
        self.max_queued = max_queued
        self.scan_every_writes = max(1, min(SCAN_EVERY_WRITES, max_bytes // self.file_bytes // 16))
        # a scan that stopped short of the bound's own file count would never see the bound passed
        self.scan_max_files = max(SCAN_MAX_FILES, 2 * (max_bytes // self.file_bytes))
        owned_directory(directory, FLAG)
        name = f"{xxhash.xxh3_64_hexdigest(msgspec.msgpack.encode(layout))}-{shared_file.key_id(key)}"
        # a rank bounds only its own shard's files: its siblings bound theirs
        self.own_subdir_only = layout.tp_size > 1
        if self.own_subdir_only:
            name += f"-rank{rank}"
        self.directory = os.path.join(directory, name)
        owned_directory(self.directory, FLAG)
        # what the worker announces (None: no routing credit); rank 0's names a tensor-parallel engine's store
        self.store_id = shared_store_id.store_id(self.directory, key) if rank == 0 else None
        # blocks found gone, oldest first: appended by the writer thread's scans too (deque:
        # thread-safe); bounded, as a rank that never takes them (a tensor-parallel follower) keeps
        # the last ones only
        self._gone: deque[bytes] = deque(maxlen=MAX_GONE)
        self._misses = SharedMisses()
        self.num_corrupt = 0            # files dropped because they did not verify
        self.num_write_errors = 0
        self.estimate = self._scan()    # the directory's files and bytes, at the last scan + our writes
        self._writes_since_scan = 0
        self._scanned_at = time.monotonic()
        self._queued: dict[bytes, tuple[Future, bytearray]] = {}      # writes not done, oldest first
        self._copies: list[tuple[int, float]] = []                    # (bytes, seconds) of file I/O
        self._warned_at = -_WARN_EVERY_S          # write failures
        self._dropped_warned_at = -_WARN_EVERY_S  # files that did not verify
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-kv-shared")

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".kvb")

    def holds(self, block_hash: bytes) -> bool:
        """Whether the block's file is there now (one stat; it may still vanish before the read)."""
        return block_hash in self._queued or os.path.exists(self._path(block_hash))

    # ---- writes (queued) -----------------------------------------------------------------
    def write(self, block_hash: bytes, block: DiskBlock, payload: bytearray) -> None:
        """Queue a block's file (`payload` is handed over); a file already there is kept."""
        if block_hash in self._queued:
            return
        self._queued[block_hash] = (self._writer.submit(self._write_file, block_hash, block, payload), payload)
        while len(self._queued) > self.max_queued:
            self._settle(next(iter(self._queued)), wait=True)

    def _write_file(self, block_hash: bytes, block: DiskBlock, payload: bytearray) -> None:
        """(writer thread) The file, unless another worker wrote it already; then the bound."""
        path = self._path(block_hash)
        if not os.path.exists(path):
            # a name of our own: two workers writing the same block never share a .tmp (random,
            # not a pid: workers in other pods have pid namespaces of their own)
            tmp = f"{path}.{os.urandom(8).hex()}.tmp"
            t = time.perf_counter()
            size = write_file(path, tmp, shared_file.encode(self.key, block_hash, self.layout, payload,
                                                            block.parent, block.token_ids), exclusive=True)
            self._copies.append((len(payload), time.perf_counter() - t))
            self.estimate = ScanResult(self.estimate.files + 1, self.estimate.bytes + size, 0)
            self._writes_since_scan += 1
        if (self._writes_since_scan >= self.scan_every_writes or self.estimate.bytes > self.max_bytes
                or time.monotonic() - self._scanned_at >= SCAN_EVERY_S):
            self.estimate = self._scan()

    def _settle(self, block_hash: bytes, wait: bool) -> bool:
        future, _ = self._queued[block_hash]
        if not (wait or future.done()):
            return False
        del self._queued[block_hash]
        error = future.exception()
        if error is not None:           # a full disk: this block is not shared, the next may be
            self._gone.append(block_hash)
            self.num_write_errors += 1
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning("KV shared tier %s: writing a block failed (%s); such blocks are not shared",
                            self.directory, error)
        return True

    def poll(self) -> list[tuple[int, float]]:
        """Settle finished writes; the (bytes, seconds) of file reads and writes since the last call."""
        for block_hash in list(self._queued):
            if not self._settle(block_hash, wait=False):
                break
        copies, self._copies = self._copies, []
        return copies

    def drain(self) -> None:
        """Wait until every queued write (and the scan after it) is done."""
        self._writer.submit(lambda: None).result()
        for block_hash in list(self._queued):
            self._settle(block_hash, wait=True)

    # ---- reads ---------------------------------------------------------------------------
    def read(self, block_hash: bytes) -> memoryview | None:
        """The verified payload of a block, or None: no file (never written, or deleted by a
        bound), or one that does not verify (deleted here). The time taken, MAC included, is the
        tier's read bandwidth."""
        queued = self.queued_payload(block_hash)
        if queued is not None:                   # our own write, not settled yet: its bytes
            return queued
        result = self.read_file(block_hash)
        if result.payload is not None:
            self._copies.append((len(result.payload), result.end - result.start))
        return self.settle_read(block_hash, result)

    def queued_payload(self, block_hash: bytes) -> memoryview | None:
        queued = self._queued.get(block_hash)
        return memoryview(queued[1]) if queued is not None else None

    def read_file(self, block_hash: bytes) -> FileRead:
        """(any thread) Read and verify a block's file, deleting one that does not verify (other
        workers may be reading it too: a missing file is a miss for them); no tier state is
        touched."""
        path = self._path(block_hash)
        result = read_block_file(
            path, self.file_bytes + 1,
            lambda data: shared_file.decode(self.key, data, block_hash, self.layout, self.payload_len),
            (tier_file.TierFileError,))
        if result.payload is None and not result.missing:
            _unlink_path(path)
        return result

    def settle_read(self, block_hash: bytes, result: FileRead) -> memoryview | None:
        """(engine thread) A read's payload, or None; a file that did not verify is counted and
        logged (one warning a minute). A missing file (another writer's bound deleted it) is a
        plain miss."""
        if result.payload is not None:
            return result.payload
        self._gone.append(block_hash)          # deleted by another writer, or just now by read_file
        if result.missing:
            return None
        self.num_corrupt += 1
        now = time.monotonic()
        if now - self._dropped_warned_at >= _WARN_EVERY_S:
            self._dropped_warned_at = now
            log.warning("KV shared tier %s: dropped block %s (%s); it will be recomputed (%d files "
                        "dropped so far)", self.directory, block_hash.hex(), result.error, self.num_corrupt)
        return None

    def take_gone(self, limit: int = GONE_PER_TAKE) -> list[bytes]:
        """(engine thread) Blocks found gone since the last call that are still not here (a block
        written again since keeps its place in the index); at most `limit` checked, the rest at
        later calls."""
        gone = []
        for _ in range(min(limit, len(self._gone))):
            block_hash = self._gone.popleft()
            if not self.holds(block_hash):
                gone.append(block_hash)
        return gone

    def note_miss(self, block_hash: bytes, now: float | None = None) -> None:
        """(engine thread) A lookup found no file for the block: reported by take_missing if it
        stays missing (the index may credit it still). A store without an id has no credit to heal."""
        if self.store_id is not None:
            self._misses.note(block_hash, time.monotonic() if now is None else now)

    def take_missing(self, now: float | None = None) -> list[bytes]:
        """(engine thread) Noted misses still missing after their grace (shared_misses.py)."""
        return self._misses.take(time.monotonic() if now is None else now, self.holds)

    def forget(self, block_hash: bytes) -> None:
        """Delete a block's file (the bandwidth probe's), behind its own write."""
        self._writer.submit(_unlink_path, self._path(block_hash))

    # ---- the bound -----------------------------------------------------------------------
    def _scan(self) -> ScanResult:
        """Files and bytes under the root (every layout's; a tensor-parallel rank: its own
        subdirectory's), at most scan_max_files of them; the oldest deleted when they pass the
        bound, and .tmp files a dead writer left."""
        self._scanned_at, self._writes_since_scan = time.monotonic(), 0
        now = time.time()
        files: list[tuple[float, int, str]] = []          # (mtime, bytes, path)
        if self.own_subdir_only:
            subdirs = [self.directory]
        else:
            try:
                subdirs = [e.path for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
            except OSError:
                return ScanResult(0, 0, 0)
        for subdir in subdirs:
            try:
                entries = os.scandir(subdir)
            except OSError:
                continue
            with entries:
                for entry in entries:
                    if len(files) >= self.scan_max_files:
                        break
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:               # deleted by another writer meanwhile
                        continue
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    if entry.name.endswith(".tmp"):
                        if now - info.st_mtime > STALE_TMP_S:
                            _unlink_path(entry.path)
                        continue
                    if entry.name.endswith(".kvb"):
                        files.append((info.st_mtime, info.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        deleted = 0
        # a scan that stopped at its cap saw part of the directory only (many smaller files of
        # other layouts): it also deletes the oldest it saw down to 90% of the cap, so later scans
        # see everything
        max_files = self.scan_max_files * _LOW_WATER if len(files) >= self.scan_max_files else len(files)
        if total > self.max_bytes or len(files) > max_files:
            files.sort()
            for _, size, path in files:
                if total <= self.max_bytes * _LOW_WATER and len(files) - deleted <= max_files:
                    break
                _unlink_path(path)
                total -= size
                deleted += 1
                if os.path.dirname(path) == self.directory:    # our store's: its id's readers lose it
                    try:
                        self._gone.append(bytes.fromhex(os.path.basename(path)[:-len(".kvb")]))
                    except ValueError:
                        pass
        return ScanResult(len(files) - deleted, total, deleted)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def check_integrity(self) -> None:
        """Every write settled; the estimate within the bound after a scan."""
        self.drain()
        assert not self._queued, "shared tier: unsettled writes"
        self._misses.check_integrity()
        self.estimate = self._writer.submit(self._scan).result()
        assert self.estimate.bytes <= self.max_bytes, f"shared tier: {self.estimate} over {self.max_bytes} bytes"
