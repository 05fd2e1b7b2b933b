"""KVEventPublisher -> EventSubscriber -> PrefixCore over real ZMQ sockets on 127.0.0.1:
slow joiner, in-order batches, a lost batch (gap -> snapshot), a restart (new epoch)."""
from __future__ import annotations

from prefix_fakes import FakeBlockManager, follow, planes, pumped

from gpu_worker.kv_events import KVEventPublisher
from prefix_cache_svc.channels import EventSubscriber, fetch_snapshot
from prefix_cache_svc.core import PrefixCore
from services.protocol.kv_events import MatchRequest, pack_token_ids

BS = 4
PROMPT = list(range(1, 21))  # 5 blocks


def matched(core: PrefixCore, tokens=PROMPT) -> dict[str, int]:
    resp = core.match(MatchRequest(model_id="m", tokens=pack_token_ids(tokens)))
    return {m.worker_id: m.matched_blocks for m in resp.workers}


async def test_publisher_to_index_over_zmq():
    bm = FakeBlockManager(BS)
    pub = KVEventPublisher(bm, "w1", epoch=7, plane=planes().worker, heartbeat_s=0.02)
    sub = EventSubscriber(planes().index)
    sub.connect(pub.events_addr)
    core = PrefixCore(BS)
    try:
        async with pumped(pub):
            hashes = bm.store_prompt(PROMPT[:8])     # seq 0, likely lost to the slow joiner
            await follow(core, sub, pub, lambda: matched(core) == {"w1": 2})
            bm.store_prompt(PROMPT)                  # in order
            await follow(core, sub, pub, lambda: matched(core) == {"w1": 5})
            bm.evict(hashes[1])
            await follow(core, sub, pub, lambda: matched(core) == {"w1": 1})

            gaps = core.stats.gaps
            pub.seq += 1                              # as if a batch was dropped by the PUB socket
            bm.store_prompt(PROMPT)
            await follow(core, sub, pub, lambda: core.stats.gaps > gaps and matched(core) == {"w1": 5})
            assert core.streams["w1"].seq == pub.seq

            bm.reset()                                # the worker restarts: new epoch, empty cache
            pub.set_epoch(8)
            bm.store_prompt(PROMPT[:4])
            await follow(core, sub, pub, lambda: core.streams["w1"].epoch == 8 and matched(core) == {"w1": 1})
            snap = await fetch_snapshot(pub.snapshot_addr, "check", timeout_s=2.0, plane=planes().index)
        assert core.compare(snap).consistent
        assert pub.snapshots_served >= 1
        core.index.check_integrity()
    finally:
        sub.close()
        pub.close()


async def test_snapshot_request_times_out_when_nobody_answers():
    bm = FakeBlockManager(BS)
    pub = KVEventPublisher(bm, "w1", epoch=1, plane=planes().worker)
    try:
        assert await fetch_snapshot(pub.snapshot_addr, "r", timeout_s=0.1, plane=planes().index) is None  # never flushed
    finally:
        pub.close()
