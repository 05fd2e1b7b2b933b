"""PrefixCore: in-order batches, duplicates, gaps, new epochs, stale epochs, snapshots and
consistency checks, ownership changes for Redis; every test ends with the index's integrity check."""
from __future__ import annotations

from prefix_cache_svc.core import ClearTier, Disown, ForgetWorker, Outcome, Own, Position, PrefixCore
from prefix_cache_svc.hashing import block_hash
from services.protocol.kv_events import (
    AllCleared, BlockRemoved, BlockStored, KVEventBatch, MatchRequest, Snapshot, SnapshotBlock,
    cache_salt_for, pack_token_ids,
)

BS = 4
MODEL = "m"
PROMPT = list(range(1, 17))  # 4 blocks


def stored(tokens=PROMPT, salt=""):
    out, parent = [], None
    for i in range(0, len(tokens), BS):
        h = block_hash(parent, MODEL, salt, tokens[i:i + BS])
        out.append(BlockStored(h, parent, tokens[i:i + BS]))
        parent = h
    return out


def batch(seq, events, worker="w1", epoch=1):
    return KVEventBatch(worker_id=worker, epoch=epoch, seq=seq, ts=0.0, events=events)


def matched(core, tokens=PROMPT, salt=""):
    resp = core.match(MatchRequest(model_id=MODEL, tokens=pack_token_ids(tokens), cache_salt=salt))
    return {m.worker_id: m.matched_blocks for m in resp.workers}


def snapshot(events, seq, worker="w1", epoch=1, request_id="r"):
    blocks = [SnapshotBlock(e.block_hash, e.parent_hash, e.token_ids, e.tier) for e in events]
    return Snapshot(request_id=request_id, worker_id=worker, epoch=epoch, seq=seq, block_size=BS, blocks=blocks)


def test_in_order_batches_apply_and_duplicates_drop():
    core = PrefixCore(BS)
    ev = stored()
    assert core.on_batch(batch(0, ev[:2]), 0) is Outcome.APPLIED
    assert core.on_batch(batch(1, ev[2:]), 0) is Outcome.APPLIED
    assert core.on_batch(batch(1, ev[2:]), 0) is Outcome.DUPLICATE
    assert core.on_batch(batch(1, []), 0) is Outcome.DUPLICATE          # heartbeat in sync
    assert matched(core) == {"w1": 4}
    assert core.on_batch(batch(2, [BlockRemoved(ev[1].block_hash)]), 0) is Outcome.APPLIED
    assert matched(core) == {"w1": 1}
    changes = core.drain_changes()
    assert [type(c) for c in changes] == [ForgetWorker, Own, Own, Position, Own, Own, Position, Disown, Position]
    assert changes[-1] == Position("w1", 1, 2)
    core.index.check_integrity()


def test_gap_buffers_and_snapshot_catches_up():
    core = PrefixCore(BS)
    ev = stored()
    core.on_batch(batch(0, ev[:1]), 0)
    assert core.on_batch(batch(2, ev[2:3]), 10.0) is Outcome.NEED_SNAPSHOT   # seq 1 lost
    assert core.on_batch(batch(3, ev[3:]), 10.5) is Outcome.BUFFERED
    assert core.snapshot_overdue(11.0, timeout_s=2.0) == []
    assert core.snapshot_overdue(12.5, timeout_s=2.0) == ["w1"]
    # the worker's state after seq 2: blocks 0..2; batch 3 is applied on top from the buffer
    assert core.on_snapshot(snapshot(ev[:3], seq=2)) is Outcome.APPLIED
    assert core.streams["w1"].seq == 3 and core.streams["w1"].awaiting_since is None
    assert matched(core) == {"w1": 4}
    assert core.on_batch(batch(4, [AllCleared()]), 13) is Outcome.APPLIED
    assert matched(core) == {}
    assert core.stats.gaps == 1 and core.stats.snapshots_applied == 1
    core.index.check_integrity()


def test_heartbeat_ahead_reveals_a_lost_last_batch():
    core = PrefixCore(BS)
    core.on_batch(batch(0, stored()[:1]), 0)
    assert core.on_batch(batch(1, []), 1.0) is Outcome.NEED_SNAPSHOT
    core.index.check_integrity()


def test_new_epoch_forgets_the_old_incarnation():
    core = PrefixCore(BS)
    ev = stored()
    core.on_batch(batch(0, ev), 0)
    assert core.on_batch(batch(0, ev[:1], epoch=2), 1) is Outcome.APPLIED
    assert matched(core) == {"w1": 1}
    assert core.on_batch(batch(5, ev, epoch=1), 2) is Outcome.STALE
    assert core.on_batch(batch(7, ev, epoch=3), 3) is Outcome.NEED_SNAPSHOT   # restarted, joined late
    assert matched(core) == {}
    assert core.on_snapshot(snapshot(ev[:2], seq=7, epoch=2)) is Outcome.STALE
    assert core.on_snapshot(snapshot(ev[:2], seq=7, epoch=3)) is Outcome.APPLIED
    assert matched(core) == {"w1": 2} and core.stats.new_epochs == 2
    core.index.check_integrity()


def test_first_sight_mid_stream_needs_a_snapshot_and_heartbeat_minus_one_does_not():
    core = PrefixCore(BS)
    assert core.on_batch(batch(-1, [], worker="w2"), 0) is Outcome.DUPLICATE
    assert core.on_batch(batch(0, stored()[:1], worker="w2"), 0) is Outcome.APPLIED
    assert core.on_batch(batch(4, stored()[:1], worker="w3"), 0) is Outcome.NEED_SNAPSHOT
    assert core.on_batch(batch(0, [], worker="w4"), 0) is Outcome.NEED_SNAPSHOT  # batch 0 was missed
    core.index.check_integrity()


def test_second_gap_while_catching_up_asks_again():
    core = PrefixCore(BS)
    ev = stored()
    core.on_batch(batch(0, ev[:1]), 0)
    core.on_batch(batch(2, ev[1:2]), 0)
    core.on_batch(batch(5, ev[3:]), 0)
    assert core.on_snapshot(snapshot(ev[:2], seq=2)) is Outcome.NEED_SNAPSHOT  # 3, 4 missing
    assert core.on_snapshot(snapshot(ev, seq=5)) is Outcome.APPLIED
    assert matched(core) == {"w1": 4}
    core.index.check_integrity()


def test_consistency_check_waits_for_its_seq_then_repairs():
    core = PrefixCore(BS)
    ev = stored()
    core.on_batch(batch(0, ev[:2]), 0)
    core.index.remove("w1", ev[0].block_hash)      # the index drifted (a bug, a lost write)
    assert core.on_snapshot(snapshot(ev[:3], seq=1)) is Outcome.APPLIED   # ahead: held back
    assert core.stats.checks == 0
    core.on_batch(batch(1, ev[2:3]), 0)
    assert core.stats.checks == 1 and core.stats.inconsistent == 1
    assert core.last_report.missing == 1 and core.last_report.extra == 0
    assert matched(core) == {"w1": 3}
    core.on_snapshot(snapshot(ev[:3], seq=1))
    assert core.stats.checks == 2 and core.stats.inconsistent == 1   # consistent now
    assert core.on_snapshot(snapshot(ev[:3], seq=0)) is Outcome.STALE
    core.index.check_integrity()


def test_remove_worker_and_tiers_and_tenants():
    core = PrefixCore(BS)
    salt = cache_salt_for("t1", "conv-9")
    ev = stored(salt=salt)
    core.on_batch(batch(0, ev), 0)
    core.on_batch(batch(0, [BlockStored(e.block_hash, e.parent_hash, e.token_ids, "cpu") for e in ev[:2]],
                        worker="w2"), 0)
    resp = core.match(MatchRequest(model_id=MODEL, tokens=pack_token_ids(PROMPT), tenant_salt="t1",
                                   cache_salt="conv-9"))
    assert [(m.worker_id, m.matched_blocks, m.gpu_blocks) for m in resp.workers] == [("w1", 4, 4), ("w2", 2, 0)]
    assert matched(core) == {}   # another tenant
    core.on_batch(batch(1, [AllCleared("cpu")], worker="w2"), 0)
    assert ClearTier("w2", "cpu") in core.drain_changes()
    assert core.remove_worker("w1") == 4 and "w1" not in core.streams
    assert core.index.workers() == ["w2"] and len(core.index) == 0
    assert core.stats.queries == 2 and core.stats.worker_matched_blocks == {"w1": 4, "w2": 2}
    core.index.check_integrity()


def test_bad_version_and_block_size_are_rejected():
    core = PrefixCore(BS)
    bad = KVEventBatch(worker_id="w1", epoch=1, seq=0, ts=0, events=stored(), version=99)
    assert core.on_batch(bad, 0) is Outcome.REJECTED
    snap = Snapshot(request_id="r", worker_id="w1", epoch=1, seq=0, block_size=16)
    assert core.on_snapshot(snap) is Outcome.REJECTED
    assert core.stats.rejected == 2 and len(core.index) == 0
    huge = BlockStored(b"z" * 16, None, [2**40, 1, 2, 3])   # not a uint32 token id
    assert core.on_batch(batch(0, [huge]), 0) is Outcome.APPLIED
    assert core.stats.rejected == 3 and len(core.index) == 0
    core.index.check_integrity()


def test_metrics_collector_reports_hit_rates():
    from prometheus_client import CollectorRegistry, generate_latest

    from prefix_cache_svc.metrics import CoreCollector

    core = PrefixCore(BS)
    core.on_batch(batch(0, stored()[:2]), 0)
    matched(core)                                  # 4 query blocks, 2 matched on w1
    registry = CollectorRegistry()
    registry.register(CoreCollector(core))
    text = generate_latest(registry).decode()
    assert "kvmesh_prefix_hit_rate 0.5" in text
    assert 'kvmesh_prefix_worker_hit_rate{worker="w1"} 0.5' in text
    assert 'kvmesh_prefix_worker_blocks{worker="w1"} 2.0' in text
    assert "kvmesh_prefix_match_queries_total 1.0" in text
