"""The shared KV tier in the prefix index: blocks filed under a store id, credited to every live
worker announcing that id and to no other, removed by any reader's removal, kept when a worker
dies or resyncs, written to and rebuilt from Redis; a moved conversation routes to a reader."""
from __future__ import annotations

import msgspec
import pytest
import redis.asyncio as aioredis

from prefix_cache_svc.core import Disown, Own, PrefixCore
from prefix_cache_svc.hashing import block_hash
from prefix_cache_svc.radix_index import RadixIndex
from prefix_cache_svc.store import SHARED_KEY, OwnershipStore, worker_key
from scheduler_svc.recent import RecentDispatches
from scheduler_svc.routing import CacheAware, RoutingWeights, WorkerView, prefix_hit
from services.embedded_redis import EmbeddedRedis
from services.protocol.kv_events import (
    ENCODER, KV_EVENT_BATCH_DECODER, AllCleared, BlockRemoved, BlockStored, KVEventBatch, MatchRequest, Snapshot,
    SnapshotBlock, pack_token_ids, shared_tier_id,
)
from services.protocol.messages import Submit
from services.protocol.sampling import SamplingParams

BS = 4
MODEL = "m"
PROMPT = list(range(1, 33))          # 8 blocks
STORE, OTHER = "a" * 32, "b" * 32


def stored(tier="gpu", tokens=PROMPT):
    out, parent = [], None
    for i in range(0, len(tokens), BS):
        h = block_hash(parent, MODEL, "", tokens[i:i + BS])
        out.append(BlockStored(h, parent, tokens[i:i + BS], tier))
        parent = h
    return out


def batch(seq, events, worker, epoch=1):
    return KVEventBatch(worker_id=worker, epoch=epoch, seq=seq, ts=0.0, events=events)


def credits(core, tokens=PROMPT) -> dict[str, tuple[int, int, int]]:
    """worker -> (own tiers' prefix, on GPU, own or shared prefix)."""
    resp = core.match(MatchRequest(model_id=MODEL, tokens=pack_token_ids(tokens)))
    return {w.worker_id: (w.matched_blocks, w.gpu_blocks, w.any_blocks) for w in resp.workers}


def test_shared_blocks_count_for_every_reader_of_the_store_and_no_other():
    core = PrefixCore(BS)
    core.set_readers({"w1": STORE, "w2": STORE, "w3": OTHER})          # w4 reads no shared tier
    core.on_batch(batch(0, stored("shared"), "w1"), 0)
    core.on_batch(batch(0, stored("gpu")[:2], "w4"), 0)
    core.on_batch(batch(0, stored("gpu")[:3], "w2"), 0)
    assert credits(core) == {"w1": (0, 0, 8), "w2": (3, 3, 8), "w4": (2, 2, 2)}
    assert core.index.blocks_of("w1") == {} and len(core.index.blocks_of(STORE, "shared")) == 8
    # a reader's own copy past the shared prefix extends neither: the match stops where both end
    core.on_batch(batch(1, [BlockRemoved(stored()[4].block_hash, "shared")], "w2"), 0)   # any reader drops it
    assert credits(core) == {"w1": (0, 0, 4), "w2": (3, 3, 4), "w4": (2, 2, 2)}
    core.index.check_integrity()


def test_a_dead_worker_leaves_the_store_and_a_new_reader_is_credited_at_once():
    core = PrefixCore(BS)
    core.set_readers({"w1": STORE})
    core.on_batch(batch(0, stored("gpu") + stored("shared"), "w1"), 0)
    assert core.remove_worker("w1") == 8                               # its own GPU blocks only
    core.set_readers({"new": STORE})                                    # scale-up: no block of its own yet
    assert credits(core) == {"new": (0, 0, 8)}
    core.set_readers({})                                                # the reader left: nobody is credited
    assert credits(core) == {} and len(core.index.blocks_of(STORE, "shared")) == 8
    core.index.check_integrity()


def test_a_reader_that_stops_announcing_with_no_block_of_its_own_loses_its_slot():
    core = PrefixCore(BS)
    core.set_readers({"w1": STORE, "w2": STORE})
    core.on_batch(batch(0, stored("shared") + stored("gpu")[:2], "w2"), 0)
    core.set_readers({})                      # both restarted without a shared tier, still live
    assert core.index.workers() == ["w2"]     # w2 keeps its own blocks; w1 held nothing: no slot
    core.index.check_integrity()


def test_a_worker_cannot_clear_resync_or_speak_for_a_store_it_does_not_announce():
    core = PrefixCore(BS)
    core.set_readers({"w1": STORE, "w2": STORE})
    core.on_batch(batch(0, stored("shared"), "w1"), 0)
    core.on_batch(batch(0, [AllCleared("shared"), AllCleared(None)], "w2"), 0)
    # a snapshot (a new epoch's resync) replaces the worker's own tiers, not the store's blocks
    snap = Snapshot(request_id="r", worker_id="w1", epoch=2, seq=0, block_size=BS,
                    blocks=[SnapshotBlock(e.block_hash, e.parent_hash, e.token_ids, "gpu") for e in stored()[:1]])
    core.on_batch(batch(1, [], "w1", epoch=2), 0)
    core.on_snapshot(snap)
    assert credits(core) == {"w1": (1, 1, 8), "w2": (0, 0, 8)}
    # shared events from a worker announcing no store: dropped and counted, never filed under it
    core.on_batch(batch(0, [BlockRemoved(stored()[0].block_hash, "shared")], "stranger"), 0)
    assert core.stats.shared_unannounced == 1 and credits(core)["w2"] == (0, 0, 8)
    core.index.check_integrity()


def test_a_missing_report_drops_only_a_credited_shared_block_and_writes_redis_only_then():
    """A removal lost in w1's gap left the store crediting a gone file; w2's lookup found none."""
    core = PrefixCore(BS)
    core.set_readers({"w1": STORE, "w2": STORE, "w3": OTHER})
    core.on_batch(batch(0, stored("shared"), "w1"), 0)
    core.on_batch(batch(0, stored("shared"), "w3"), 0)          # another node's store holds it too
    core.on_batch(batch(0, stored("gpu")[:3], "w4"), 0)         # and a worker, on its own GPU
    gone = stored()[2].block_hash
    core.on_batch(batch(2, [BlockRemoved(gone, "shared")], "w1"), 0)     # seq 1 lost: a gap
    core.on_snapshot(Snapshot(request_id="r", worker_id="w1", epoch=1, seq=2, block_size=BS))
    core.drain_changes()
    assert credits(core)["w2"] == (0, 0, 8)                    # the removal was in the gap
    core.on_batch(batch(0, [BlockRemoved(gone, "shared", missing=True)], "w2"), 0)
    assert credits(core) == {"w1": (0, 0, 2), "w2": (0, 0, 2), "w3": (0, 0, 8), "w4": (3, 3, 3)}
    assert [c for c in core.drain_changes() if isinstance(c, Disown)] == [Disown(STORE, gone, "shared")]
    # most misses are blocks never stored (a prompt's first new block): no Redis write for them,
    # nor for the same miss reported again; a worker's own tiers are never touched by one
    never = block_hash(None, MODEL, "", [9, 9, 9, 9])
    core.on_batch(batch(1, [BlockRemoved(never, "shared", missing=True), BlockRemoved(gone, "shared", missing=True),
                            BlockRemoved(stored()[0].block_hash, "gpu", missing=True)], "w2"), 0)
    core.on_batch(batch(1, [BlockRemoved(stored()[0].block_hash, "shared", missing=True)], "w4"), 0)  # no store
    assert not [c for c in core.drain_changes() if isinstance(c, Disown)]
    assert credits(core)["w4"] == (3, 3, 3)
    assert (core.stats.shared_missing, core.stats.shared_repaired) == (3, 1)
    core.index.check_integrity()


def test_a_missing_report_is_a_removal_to_an_older_reader_and_old_removals_decode():
    """The flag is a trailing field of an array-like event: no version change in either direction."""
    class OldBlockRemoved(msgspec.Struct, tag="removed", frozen=True, array_like=True):
        block_hash: bytes
        tier: str = "gpu"

    new = BlockRemoved(b"h" * 16, "shared", missing=True)
    assert msgspec.msgpack.decode(ENCODER.encode(new), type=OldBlockRemoved) == OldBlockRemoved(b"h" * 16, "shared")
    old = KVEventBatch(worker_id="w", epoch=1, seq=0, ts=0.0, events=[])
    wire = msgspec.msgpack.encode(msgspec.structs.asdict(old) | {"type": "kv_batch",
                                                                  "events": [OldBlockRemoved(b"h" * 16, "shared")]})
    assert KV_EVENT_BATCH_DECODER.decode(wire).events == [BlockRemoved(b"h" * 16, "shared", missing=False)]


def test_index_snapshot_restores_the_store_separately_from_a_worker_of_the_same_name():
    index = RadixIndex(BS)
    for e in stored():
        index.insert(STORE, e.block_hash, e.parent_hash, pack_token_ids(e.token_ids), "shared")
    index.insert(STORE, stored()[0].block_hash, None, pack_token_ids(PROMPT[:BS]), "gpu")   # a worker so named
    again = RadixIndex.restore(index.snapshot())
    for ix in (index, again):
        assert len(ix.blocks_of(STORE, "shared")) == 8 and len(ix.blocks_of(STORE)) == 1
        assert ix.shared_tiers() == [STORE] and ix.workers() == [STORE]
        ix.check_integrity()


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


async def test_redis_records_the_store_and_a_restart_rebuilds_it(redis_server):
    redis = aioredis.Redis.from_url(redis_server.url)
    await redis.flushdb()
    try:
        core, store = PrefixCore(BS), OwnershipStore(redis, BS)
        core.set_readers({"w1": STORE, "w2": STORE})
        core.on_batch(batch(0, stored("shared") + stored("gpu")[:1], "w1"), 0)
        core.on_batch(batch(0, [BlockRemoved(stored()[7].block_hash, "shared")], "w2"), 0)
        changes = core.drain_changes()
        assert Own(STORE, stored()[0].block_hash, None, pack_token_ids(PROMPT[:BS]), "shared") in changes
        assert Disown(STORE, stored()[7].block_hash, "shared") in changes
        await store.apply(changes)
        core.remove_worker("w1")                                        # dies: its records go, the store's stay
        await store.apply(core.drain_changes())
        assert await store.known_workers() == set() and await store.known_shared_tiers() == {STORE}
        assert await redis.hlen(worker_key(STORE, "shared")) == 7
        assert await store.owners(stored()[0].block_hash) == {(STORE, "shared")}

        again = PrefixCore(BS)
        assert await OwnershipStore(redis, BS).load(again) == 7
        again.set_readers({"w3": STORE})
        assert credits(again) == {"w3": (0, 0, 7)}
        again.index.check_integrity()
        await redis.flushdb()                                           # Redis lost everything: rewritten
        assert await OwnershipStore(redis, BS).rewrite(again) == 7
        assert await redis.smembers(SHARED_KEY) == {STORE.encode()}
        assert again.remove_shared_tier(STORE) == 7                     # nobody announced it for long
        await OwnershipStore(redis, BS).apply(again.drain_changes())
        assert await redis.smembers(SHARED_KEY) == set() and not await redis.exists(worker_key(STORE, "shared"))
        assert await OwnershipStore(redis, BS).owners(stored()[0].block_hash) == set()
        assert credits(again) == {} and again.index.shared_tiers() == []
        again.index.check_integrity()
    finally:
        await redis.aclose()


def submit(n: int) -> Submit:
    return Submit(request_id="r", tenant="t", prompt_token_ids=PROMPT[:n], params=SamplingParams(max_tokens=4),
                  reply_addr="tcp://gw:1", detok_addr="tcp://dt:1")


def view(wid: str) -> WorkerView:
    return WorkerView(id=wid, epoch=1, addr=f"tcp://{wid}:1", max_num_seqs=8, running=0, waiting=0,
                      free_blocks=100, total_blocks=100, inflight=set())


def test_a_moved_conversation_routes_to_a_reader_of_the_store():
    """The conversation's worker drained its history to the shared tier and left: of the idle
    workers left, the one reading that store wins; one with a foreign store or none does not."""
    core = PrefixCore(BS)
    core.set_readers({"gone": STORE, "reader": STORE, "foreign": OTHER})
    core.on_batch(batch(0, stored("shared"), "gone"), 0)
    core.remove_worker("gone")
    core.set_readers({"reader": STORE, "foreign": OTHER})
    hint = core.match(MatchRequest(model_id=MODEL, tokens=pack_token_ids(PROMPT)))
    weights = RoutingWeights()
    scorer = CacheAware(weights)
    workers = [view("none"), view("foreign"), view("reader")]
    assert min(workers, key=lambda w: (scorer(w, submit(len(PROMPT)), hint), w.id)).id == "reader"
    assert prefix_hit("reader", len(PROMPT), hint, weights).hit == pytest.approx(0.3 * 7 / 8)   # last block recomputed
    assert prefix_hit("foreign", len(PROMPT), hint, weights).hit == 0.0
    # credits are ordered: a disk copy of the same prefix beats the shared one, which beats nothing
    assert weights.disk_credit > weights.shared_credit > 0
    # the scheduler's recent-dispatch overlay keeps a shared prefix past what it adds
    recent = RecentDispatches()
    recent.record("reader", [e.block_hash for e in stored()[:2]], 0.0)
    topped = recent.overlay(hint, [e.block_hash for e in stored()], BS, 0.0)
    assert topped.blocks_for("reader").any_blocks == 8 and topped.blocks_for("reader").gpu_blocks == 2


def test_a_shared_tier_id_must_be_32_lowercase_hex_digits():
    assert shared_tier_id(STORE) == STORE
    for bad in (None, 7, "A" * 32, "a" * 31, "a" * 33, "g" * 32, ["a" * 32]):
        assert shared_tier_id(bad) is None
