"""The engine's real BlockManager -> KVEventPublisher -> ZMQ -> PrefixCore: the index agrees with
the block manager's own prefix lookups through stores, LRU evictions and a cache reset."""
from __future__ import annotations

import pytest
from prefix_fakes import follow, planes, pumped

block_manager = pytest.importorskip("gpu_worker.block_manager")
sequence = pytest.importorskip("gpu_worker.sequence")

from gpu_worker.kv_events import KVEventPublisher  # noqa: E402
from prefix_cache_svc.channels import EventSubscriber, fetch_snapshot  # noqa: E402
from prefix_cache_svc.core import PrefixCore  # noqa: E402
from services.protocol.kv_events import MatchRequest, cache_salt_for, pack_token_ids  # noqa: E402
from services.protocol.sampling import SamplingParams  # noqa: E402

BS = 4
SALT = cache_salt_for("tenant", "")


def make_seq(tokens, rid):
    req = sequence.Request(rid, list(tokens), SamplingParams(), 0, SALT, 0, 0, 16)
    seq = sequence.Sequence(req, 0, list(tokens), len(tokens))
    req.seqs.append(seq)
    return seq


def run_prompt(bm, tokens, rid):
    """What the engine does for one prompt: reuse hits, compute the rest, publish, finish."""
    seq = make_seq(tokens, rid)
    hits = bm.lookup_prefix(seq)
    assert bm.allocate_prefill(seq, hits, seq.num_tokens - len(hits) * BS)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    bm.free(seq)


def engine_hits(bm, tokens):
    """Full blocks of `tokens` the block manager itself would reuse (ignoring the last-token rule)."""
    seq = make_seq(list(tokens) + [0], "probe")
    return len(bm.lookup_prefix(seq))


def index_hits(core, tokens):
    resp = core.match(MatchRequest(model_id="m", tokens=pack_token_ids(tokens), tenant_salt="tenant"))
    return resp.best_blocks


async def test_index_mirrors_the_engine_block_manager():
    bm = block_manager.BlockManager(6, BS, "m")
    pub = KVEventPublisher(bm, "w1", epoch=1, plane=planes().worker, heartbeat_s=0.02)
    sub = EventSubscriber(planes().index)
    sub.connect(pub.events_addr)
    core = PrefixCore(BS)
    a, b = list(range(100, 116)), list(range(200, 216))
    try:
        async with pumped(pub):
            run_prompt(bm, a, "a")                          # 4 blocks cached
            await follow(core, sub, pub, lambda: index_hits(core, a) == engine_hits(bm, a) == 4)
            run_prompt(bm, b, "b")                          # 6-block pool: evicts a's blocks LRU-first
            await follow(core, sub, pub, lambda: index_hits(core, b) == engine_hits(bm, b)
                         and index_hits(core, a) == engine_hits(bm, a) < 4)
            assert bm.reset_prefix_cache()                  # on_cleared
            await follow(core, sub, pub, lambda: index_hits(core, b) == 0)
            run_prompt(bm, a[:8], "a2")
            await follow(core, sub, pub, lambda: index_hits(core, a) == 2)
            snap = await fetch_snapshot(pub.snapshot_addr, "check", timeout_s=2.0, plane=planes().index)
        assert core.compare(snap).consistent and len(snap.blocks) == 2
        bm.check_integrity()
        core.index.check_integrity()
    finally:
        sub.close()
        pub.close()


async def test_a_rejoined_worker_keeps_its_cache_and_the_index_resyncs_from_a_snapshot():
    """A worker whose lease lapsed rejoins with a new epoch but keeps its cached blocks: its event
    stream restarts in the new epoch (begin_epoch) and the index, which forgets a worker on a new
    epoch, must fetch a snapshot rather than start the new epoch empty."""
    bm = block_manager.BlockManager(12, BS, "m")
    pub = KVEventPublisher(bm, "w1", epoch=1, plane=planes().worker, heartbeat_s=0.02)
    sub = EventSubscriber(planes().index)
    sub.connect(pub.events_addr)
    core = PrefixCore(BS)
    a, b = list(range(100, 116)), list(range(300, 308))
    try:
        async with pumped(pub):
            run_prompt(bm, a, "a")
            await follow(core, sub, pub, lambda: index_hits(core, a) == 4)
            snapshots = core.stats.snapshots_applied
            pub.begin_epoch(2)
            await follow(core, sub, pub, lambda: core.streams["w1"].epoch == 2
                         and core.streams["w1"].awaiting_since is None)
            assert index_hits(core, a) == 4 and core.stats.snapshots_applied == snapshots + 1
            assert core.stats.new_epochs == 1
            run_prompt(bm, b, "b")                          # the new epoch's events apply on top
            await follow(core, sub, pub, lambda: index_hits(core, b) == 2)
            snap = await fetch_snapshot(pub.snapshot_addr, "check", timeout_s=2.0, plane=planes().index)
        assert snap.epoch == 2 and core.compare(snap).consistent and index_hits(core, a) == 4
        bm.check_integrity()
        core.index.check_integrity()
    finally:
        sub.close()
        pub.close()
