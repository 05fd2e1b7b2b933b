"""A shared-tier lookup that finds no file is reported to the prefix index, so a credit left by a
removal lost in a gap heals on the first miss: reported once past its grace (not when another
worker's write lands meanwhile), once per block per repeat window, a bounded number per flush;
through an engine, the index stops crediting the gone block and nothing else."""
from __future__ import annotations

import os
from types import SimpleNamespace

from gpu_worker.kv_events import KVEventPublisher
from gpu_worker.kv_tiers import shared_misses
from gpu_worker.kv_tiers.shared_misses import MAX_MISSES, MISS_GRACE_S, MISS_REPEAT_S, MISSES_PER_TAKE
from gpu_worker.kv_tiers.shared_tier import SharedTier
from prefix_cache_svc.core import Outcome, PrefixCore
from services.protocol.kv_events import (
    BlockRemoved, BlockStored, KVEventBatch, MatchRequest, Snapshot, SnapshotBlock, pack_token_ids,
)
from tests.gpu_worker.kv_tiers.conftest import BLOCK_SIZE, prompt_hashes, push_out, run, tiered_engine, tokens
from tests.gpu_worker.kv_tiers.test_shared_tier import KEY, LAYOUT, PAYLOAD, block, write
from tests.gpu_worker.kv_tiers.test_shared_tier_routing import Events


def test_repeated_misses_of_one_block_are_one_report_per_window(tmp_path):
    tier = SharedTier(str(tmp_path / "shared"), 1 << 20, LAYOUT, PAYLOAD, KEY)
    try:
        h = block(1)[0]
        for _ in range(100):                         # a burst of requests routed on one stale credit
            tier.note_miss(h, now=0.0)
        assert tier.take_missing(now=MISS_GRACE_S / 2) == []          # not past its grace yet
        assert tier.take_missing(now=MISS_GRACE_S) == [h]
        for t in range(100):
            tier.note_miss(h, now=MISS_GRACE_S + t * 0.1)
        assert tier.take_missing(now=MISS_REPEAT_S) == []             # reported within the window
        later = MISS_GRACE_S + MISS_REPEAT_S
        tier.note_miss(h, now=later)                 # a credit made stale again heals again
        assert tier.take_missing(now=later + MISS_GRACE_S) == [h]
        # a burst of distinct misses: bounded while waiting, a bounded number per flush
        for i in range(2 * MAX_MISSES):
            tier.note_miss(block(100 + i)[0], now=later)
        taken = [tier.take_missing(now=later + MISS_GRACE_S) for _ in range(MAX_MISSES // MISSES_PER_TAKE + 1)]
        assert all(len(t) == MISSES_PER_TAKE for t in taken[:-1]) and taken[-1] == []
        assert sum(map(len, taken)) == MAX_MISSES
        tier.check_integrity()
    finally:
        tier.close()


def test_a_block_written_by_another_worker_during_the_grace_is_not_reported(tmp_path):
    root = str(tmp_path / "shared")
    reader, writer = SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY), SharedTier(root, 1 << 20, LAYOUT, PAYLOAD, KEY)
    try:
        h = block(7)[0]
        reader.note_miss(h, now=0.0)                 # the writer announced it when it queued the write
        assert write(writer, 7) == h
        writer.drain()
        assert reader.take_missing(now=MISS_GRACE_S) == []
        os.unlink(writer._path(h))                   # deleted later: a later miss reports it
        reader.note_miss(h, now=MISS_GRACE_S)
        assert reader.take_missing(now=2 * MISS_GRACE_S) == [h]
        # a store without an id (its id file does not verify) has no credit to heal
        reader.store_id = None
        reader.note_miss(block(8)[0], now=0.0)
        assert reader.take_missing(now=MISS_GRACE_S) == []
    finally:
        reader.close()
        writer.close()


def test_a_shared_removal_lost_in_a_gap_is_repaired_by_a_readers_miss(llama, tmp_path, monkeypatch):
    model_dir, _ = llama
    monkeypatch.setattr(shared_misses, "MISS_GRACE_S", 0.0)     # the engine's flushes read the clock
    shared = dict(kv_offload_shared_dir=str(tmp_path / "shared"), kv_offload_shared_gb=0.001,
                  kv_offload_shared_key=KEY)
    a = tiered_engine(model_dir, num_gpu_blocks=16, **shared)      # no host tier: evictions go to shared
    b = tiered_engine(model_dir, **shared)
    events_a, events_b = Events("a"), Events("b")
    a.block_manager.add_listener(events_a)
    b.block_manager.add_listener(events_b)
    try:
        store = a.kv_tiers.shared.store_id
        gone_history, kept_history = tokens(30, 1), tokens(30, 2)
        run(a, "gone", gone_history)
        run(a, "kept", kept_history)
        push_out(a, 1)
        a.kv_tiers.shared.drain()
        a.kv_tiers.flush()
        core = PrefixCore(BLOCK_SIZE)
        core.set_readers({"a": store, "b": store})
        assert core.on_batch(events_a.batch(), 0.0) is Outcome.APPLIED
        full = (len(gone_history) - 1) // BLOCK_SIZE
        hashes = prompt_hashes(a, gone_history)[:full]
        # w, reading no shared tier, holds the gone history's blocks on its own GPU
        parents = [None] + hashes[:-1]
        own = [BlockStored(h, p, gone_history[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], "gpu")
               for i, (h, p) in enumerate(zip(hashes, parents))]
        core.on_batch(KVEventBatch(worker_id="w", epoch=1, seq=0, ts=0.0, events=own), 0.0)

        def credited(history):
            resp = core.match(MatchRequest(model_id=a.block_manager.model_id, tokens=pack_token_ids(history)))
            return {m.worker_id: (m.matched_blocks, m.any_blocks) for m in resp.workers}
        assert credited(gone_history) == {"a": (0, full), "b": (0, full), "w": (full, full)}
        # a's bound (or a's read) finds the first block gone; the batch reporting it is lost
        os.unlink(a.kv_tiers.shared._path(hashes[0]))
        assert a.kv_tiers.shared.read(hashes[0]) is None
        a.kv_tiers.flush()
        lost = events_a.batch()
        assert lost.events
        run(a, "after", tokens(3 * BLOCK_SIZE, 3), max_tokens=1)
        a.kv_tiers.flush()
        assert core.on_batch(events_a.batch(), 0.0) is Outcome.NEED_SNAPSHOT
        own = [SnapshotBlock(h, p, list(t)) for h, p, t in a.block_manager.cached_block_hashes()]
        snap = Snapshot(request_id="r", worker_id="a", epoch=1, seq=events_a.seq, block_size=BLOCK_SIZE, blocks=own)
        assert core.on_snapshot(snap) is Outcome.APPLIED    # its own tiers only: the shared files are everyone's
        assert credited(gone_history)["b"] == (0, full)              # the stale credit
        # b is routed on it: its load planner finds no file, and its next flush reports the miss
        run(b, "moved", gone_history, max_tokens=1)
        b.kv_tiers.flush()
        batch = events_b.batch()
        assert [e.block_hash for e in batch.events if isinstance(e, BlockRemoved) and e.missing] == [hashes[0]]
        core.on_batch(batch, 0.0)
        after = credited(gone_history)
        assert "a" not in after and after["w"] == (full, full)       # w's own copies stay credited
        assert after["b"][0] == after["b"][1]                        # b: its own new GPU copies only
        assert hashes[0] not in core.index.blocks_of(store, "shared")
        assert credited(kept_history) == {"a": (0, full), "b": (0, full)}   # files still there keep theirs
        assert core.stats.shared_repaired == 1
        # the worker's publisher sends the same event the test's listener recorded
        publisher = SimpleNamespace(_pending=[])
        KVEventPublisher.on_missing(publisher, hashes[0], "shared")
        assert publisher._pending == [BlockRemoved(hashes[0], "shared", missing=True)]
        core.index.check_integrity()
        b.kv_tiers.check_integrity()
    finally:
        a.close()
        b.close()
