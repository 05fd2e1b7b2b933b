"""KV tiers over tensor-parallel ranks: rank 0 decides, every follower repeats on its shard.

    rank 0 (engine)                                  follower rank r
    KVTiers -> TPTierMirror                          FollowerTiers
      offload / disk_write / forget / scatter ...      (queued) --TIERS, before rank 0's next
                                                        command--> replay, in order
      stage(sources)       --TIER_STAGE, at once-->    read slots / files -> staging; MIN of the
                                                        blocks staged: the load is cut there (a
                                                        load that joins its step)
      read_files(sources)  (queued) --READ_FILES-->    host slots -> staging, file reads started on
                                                        reader threads (a load beside the step)
      agree_read (later)   --TIER_LAND-->              MIN of the file blocks verified, -1 while a
                                                        rank reads (tp_file_reads.py)
      attach (start-up)    --TIER_INIT-->             same host slots, <dir>/rank<r>; the files
                                                        restored on every rank are kept, the rest
                                                        deleted everywhere; the shared tier's
                                                        <layout>-<key id>-rank<r> and its key

Every follower holds rank 0's number of host slots and the same file names in a directory of its
own, so the block ids, slots and hashes of rank 0's records mean the same there. Loads land whole
before the step on every rank (no per-layer hooks in the followers' forwards). Loads beside the
step read their files on every rank's reader threads while the forwards go on, as with one rank.

The shared tier's files are every worker's, so only rank 0's lookup decides what a load tries; a
file another engine's bound deleted, or that fails its MAC, on any rank ends the load at that
block on every rank (the MIN), and nothing is forgotten. Followers get the tier's MAC key in the
TIER_INIT payload, over the control group (the children's argv and environment are readable by
other processes; their EngineConfig does not exist: they build from argv).
"""
from __future__ import annotations

import os

import torch

from gpu_worker.kv_tiers.block_mover import BlockMover, Staged
from gpu_worker.kv_tiers.disk_tier import DiskTier
from gpu_worker.kv_tiers.mirror import DEVICE_BLOCK, DISK_FILE, HOST_SLOT, SHARED_FILE, BlockSource, TierMirror
from gpu_worker.kv_tiers.shared_tier import SharedTier
from gpu_worker.parallel import tp_tier_records as rec
from gpu_worker.parallel.tp_file_reads import FollowerFileLoads, LandedRead
from gpu_worker.parallel.tp_protocol import OP_TIER_CHECK, OP_TIER_INIT, OP_TIER_LAND, OP_TIER_STAGE, make_header


def rank_dir(disk_dir: str, rank: int) -> str:
    """Each rank's files (its shard of every block) in a subdirectory of kv_offload_dir."""
    return os.path.join(disk_dir, f"rank{rank}")


class TPTierMirror(TierMirror):
    """Rank 0's side: records to the followers through the TPModelRunner's command channel."""
    layered_loads = False

    def __init__(self, runner, disk_dir: str | None) -> None:
        self.runner = runner                  # gpu_worker.parallel.tp_worker.TPModelRunner
        self.disk_dir = disk_dir
        self._next_load = 0
        self.live_loads: set[int] = set()     # staged or reading on every rank, not scattered or released yet

    def attach(self, tiers) -> None:
        index = [h for h, _ in tiers.disk.hashes()] if tiers.disk is not None else []
        shared = tiers.shared
        init = rec.TierInit(rec.TIER_INIT_VERSION, tiers.host.num_slots if tiers.host is not None else 0,
                            self.disk_dir if tiers.disk is not None else None,
                            tiers.disk.max_blocks if tiers.disk is not None else 0,
                            tiers.mover.block_bytes, tiers.layout, shared.root if shared is not None else None,
                            shared.max_bytes if shared is not None else 0).encode()
        hashes = torch.tensor([x for h in index for x in rec.hash_ints(h)], dtype=torch.int64)
        key = torch.tensor(list(shared.key) if shared is not None else [], dtype=torch.int64)
        held = self.runner.tier_command(make_header(OP_TIER_INIT, len(init), len(index), len(key)),
                                        torch.cat([init, hashes, key]), torch.ones(len(index), dtype=torch.int64))
        for block_hash, everywhere in zip(index, held.tolist()):
            if not everywhere:                # restored here but not on every rank: recomputed
                tiers.disk.forget(block_hash)

    def offload(self, block_ids: list[int], slots: list[int]) -> None:
        self.runner.queue_tier_records(rec.offload(block_ids, slots))

    def disk_write(self, source: BlockSource, block_hash: bytes, block) -> None:
        self.runner.queue_tier_records(rec.disk_write(source, block_hash, block))

    def disk_forget(self, block_hash: bytes) -> None:
        self.runner.queue_tier_records(rec.disk_forget(block_hash))

    def shared_write(self, source: BlockSource, block_hash: bytes, block) -> None:
        self.runner.queue_tier_records(rec.shared_write(source, block_hash, block))

    def disk_clear(self) -> None:
        self.runner.queue_tier_records(rec.disk_clear())

    def stage(self, sources: list[BlockSource]) -> tuple[int, int]:
        if not sources:
            return -1, 0
        load_id, self._next_load = self._next_load, self._next_load + 1
        staged = self.runner.tier_command(make_header(OP_TIER_STAGE, load_id, len(sources)),
                                          rec.stage_sources(sources), torch.tensor([len(sources)]))
        n = int(staged[0])
        if n:
            self.live_loads.add(load_id)
        return load_id, n

    def read_files(self, sources: list[BlockSource]) -> int:
        load_id, self._next_load = self._next_load, self._next_load + 1
        self.live_loads.add(load_id)
        self.runner.queue_tier_records(rec.read_files(load_id, sources))
        return load_id

    def agree_read(self, load_id: int, verified: int) -> int:
        return int(self.runner.tier_command(make_header(OP_TIER_LAND, load_id), None,
                                            torch.tensor([verified]))[0])

    def scatter(self, load_id: int, block_ids: list[int]) -> None:
        self.live_loads.discard(load_id)
        self.runner.queue_tier_records(rec.scatter(load_id, block_ids))

    def release(self, load_id: int) -> None:
        if load_id in self.live_loads:
            self.live_loads.discard(load_id)
            self.runner.queue_tier_records(rec.release(load_id))

    def check(self, tiers) -> None:
        index = [h for h, _ in tiers.disk.hashes()] if tiers.disk is not None else []
        payload = torch.tensor(sorted(self.live_loads) + [x for h in index for x in rec.hash_ints(h)],
                               dtype=torch.int64)
        ok = self.runner.tier_command(make_header(OP_TIER_CHECK, len(self.live_loads), len(index)), payload,
                                      torch.ones(1, dtype=torch.int64))
        assert int(ok[0]) == 1, "a tensor-parallel rank's KV tiers differ from rank 0's (see its log)"


class FollowerTiers:
    """A follower's tiers: host slots and files only; every decision comes from rank 0."""

    def __init__(self, kv_caches, init: rec.TierInit, rank: int, shared_key: bytes) -> None:
        self.mover = BlockMover(kv_caches)
        if self.mover.block_bytes != init.block_bytes:
            raise RuntimeError(f"rank {rank}: a KV block is {self.mover.block_bytes} bytes here, "
                               f"{init.block_bytes} on rank 0")
        self.host = self.mover.host_blocks(init.host_slots) if init.host_slots else None
        self.offloaded: dict[int, torch.cuda.Event | None] = {}     # host slot -> its last D2H copy
        self.disk = (DiskTier(rank_dir(init.disk_dir, rank), init.disk_max_blocks, init.layout, init.block_bytes)
                     if init.disk_dir else None)
        self.shared = (SharedTier(init.shared_dir, init.shared_max_bytes, init.layout, init.block_bytes, shared_key,
                                  rank=rank) if init.shared_dir else None)
        self.staged: dict[int, Staged | LandedRead] = {}             # load id -> its staging
        self.file_loads = (FollowerFileLoads(self.mover, self.host, self.offloaded, self.disk, self.shared)
                           if self.disk is not None or self.shared is not None else None)

    def agree_index(self, index: list[bytes], everywhere: list[int]) -> None:
        """Keep exactly the restored files every rank holds (rank 0 forgets the others too)."""
        if self.disk is None:
            return
        keep = {h for h, ok in zip(index, everywhere) if ok}
        for block_hash, _ in self.disk.hashes():
            if block_hash not in keep:
                self.disk.forget(block_hash)

    def held(self, index: list[bytes]) -> torch.Tensor:
        return torch.tensor([int(self.disk is not None and h in self.disk) for h in index], dtype=torch.int64)

    # ---- replay ----------------------------------------------------------------------------
    def replay(self, payload: list[int]) -> None:
        for r in rec.decode(payload):
            if r.kind == rec.OFFLOAD:
                done = self.mover.offload(r.ids, self.host, r.slots)
                self.offloaded.update((slot, done) for slot in r.slots)
            elif r.kind == rec.DISK_WRITE:
                if self.disk.writes_on:      # off here: a miss of this rank, cut by the loads' MIN
                    self.disk.write(r.block_hash, r.block, self._source_bytes(r.source))
            elif r.kind == rec.SHARED_WRITE:
                self.shared.write(r.block_hash, r.block, self._source_bytes(r.source))
            elif r.kind == rec.DISK_FORGET:
                self.disk.forget(r.block_hash)
            elif r.kind == rec.DISK_CLEAR:
                self.disk.clear()
            elif r.kind == rec.SCATTER:
                staged = self.staged.pop(r.load_id)
                if isinstance(staged, LandedRead):
                    staged.scatter(self.mover, r.ids)
                else:
                    self.mover.scatter(staged, r.ids)
            elif r.kind == rec.RELEASE:
                self.staged.pop(r.load_id, None)
                if self.file_loads is not None:
                    self.file_loads.drop(r.load_id)
            elif r.kind == rec.READ_FILES:
                self.file_loads.begin(r.load_id, r.sources)
        if self.disk is not None:
            self.disk.poll()
            # a failed write or a vanished file here: a miss of this rank; a load that reaches it
            # stops there on every rank and rank 0 forgets the block everywhere
            self.disk.take_dropped()
        if self.shared is not None:
            self.shared.poll()               # a failed write is counted there: that block is a miss
        if self.file_loads is not None:
            self.file_loads.reader.pump()    # batches queued for the budget start as others end

    def _source_bytes(self, source: BlockSource) -> bytearray:
        """A block's bytes for its file, copied out of its host slot or device block."""
        if source.kind == HOST_SLOT:
            self.mover.wait_offloaded(self.offloaded.get(source.index))
            data = self.host[source.index]
        elif source.kind == DEVICE_BLOCK:
            data = self.mover.offload_to_memory([source.index])[0]
        else:
            raise RuntimeError(f"a file write from source kind {source.kind}")
        return bytearray(data.reshape(-1).numpy())

    def stage(self, load_id: int, sources: list[BlockSource]) -> int:
        """Read the load's sources up to the first one missing here; -> how many were read."""
        data, pending = [], []
        for s in sources:
            if s.kind == HOST_SLOT:
                data.append(self.host[s.index])
                pending.append(self.offloaded.get(s.index))
                continue
            tier = self.disk if s.kind == DISK_FILE else self.shared if s.kind == SHARED_FILE else None
            payload = tier.read(s.block_hash) if tier is not None else None
            if payload is None:              # missing or not verifying here: the load ends here everywhere
                break
            data.append(torch.frombuffer(payload, dtype=torch.uint8).view(self.mover.block_shape))
            pending.append(None)
        self._pending_stage = (load_id, data, pending)
        return len(data)

    def agree_stage(self, agreed: int) -> None:
        """Stage the first `agreed` blocks read (every rank read at least those)."""
        load_id, data, pending = self._pending_stage
        self._pending_stage = None
        if agreed:
            self.staged[load_id] = self.mover.stage(data[:agreed], pending[:agreed])

    def check(self, live_loads: list[int], index: list[bytes]) -> bool:
        reading = set(self.file_loads.reading) if self.file_loads is not None else set()
        if set(self.staged) | reading != set(live_loads):
            return False
        if self.file_loads is not None:
            self.file_loads.check_integrity()
        if self.shared is not None:
            self.shared.check_integrity()
        if self.disk is None:
            return True
        self.disk.check_integrity()
        # rank 0's blocks, less those this rank dropped by itself (a failed write, a vanished file)
        return {h for h, _ in self.disk.hashes()} <= set(index)

    def close(self) -> None:
        if self.file_loads is not None:
            self.file_loads.close()          # no reader thread outlives the rank
        if self.disk is not None:
            self.disk.close()
        if self.shared is not None:
            self.shared.close()


def follower_command(tiers: FollowerTiers | None, op: int, header: torch.Tensor, recv, vote, kv_caches,
                     rank: int) -> FollowerTiers | None:
    """Run one of the tier commands on a follower: recv(n) -> the next n-int64 payload, vote(t)
    -> the MIN of t over every rank. Returns the follower's tiers (made by TIER_INIT)."""
    if op == OP_TIER_INIT:
        json_len, n, key_len = int(header[1]), int(header[2]), int(header[3])
        payload = recv(json_len + 2 * n + key_len)
        key = bytes(payload[json_len + 2 * n:].tolist())
        tiers = FollowerTiers(kv_caches, rec.TierInit.decode(payload[:json_len]), rank, key)
        index = [rec.ints_hash(lo, hi) for lo, hi in payload[json_len:json_len + 2 * n].view(-1, 2).tolist()]
        tiers.agree_index(index, vote(tiers.held(index)).tolist())
        return tiers
    if op == OP_TIER_STAGE:
        sources = rec.decode_sources(recv(4 * int(header[2])))
        tiers.agree_stage(int(vote(torch.tensor([tiers.stage(int(header[1]), sources)]))[0]))
        return tiers
    if op == OP_TIER_LAND:
        load_id = int(header[1])
        agreed = int(vote(torch.tensor([tiers.file_loads.verified(load_id)]))[0])
        if agreed >= 0:
            tiers.staged[load_id] = tiers.file_loads.land(load_id, agreed)
        return tiers
    if op == OP_TIER_CHECK:
        num_loads, n = int(header[1]), int(header[2])
        payload = recv(num_loads + 2 * n)
        index = [rec.ints_hash(lo, hi) for lo, hi in payload[num_loads:].view(-1, 2).tolist()]
        try:
            ok = tiers.check(payload[:num_loads].tolist(), index)
        except AssertionError:
            ok = False
        vote(torch.tensor([int(ok)]))
        return tiers
    raise RuntimeError(f"unknown tensor-parallel tier command {op}")
