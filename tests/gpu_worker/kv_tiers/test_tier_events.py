"""KV events carry the tier: an engine with host and disk tiers -> KVEventPublisher -> ZMQ (CURVE)
-> the prefix-cache index, which then reports the chat's history on the worker's CPU and disk
tiers exactly as the engine holds it, and agrees with the worker's snapshot."""
from __future__ import annotations

from tests.gpu_worker.kv_tiers.conftest import chat, check_all_tiers, prompt_hashes, tiered_engine
from gpu_worker.kv_events import KVEventPublisher
from prefix_cache_svc.channels import EventSubscriber, fetch_snapshot
from prefix_cache_svc.core import PrefixCore
from services.protocol.kv_events import MatchRequest, pack_token_ids
from tests.prefix_cache_svc.prefix_fakes import follow, planes, pumped


def held_prefix(eng, prompt) -> tuple[int, int, int]:
    """(device, device-or-host, any tier) prefix lengths in blocks, from the engine's own state."""
    tiers = eng.kv_tiers
    where = []
    for h in prompt_hashes(eng, prompt):
        where.append("gpu" if h in eng.block_manager._by_hash else "cpu" if h in tiers.host
                     else "disk" if h in tiers.disk else None)

    def prefix(allowed):
        n = 0
        while n < len(where) and where[n] in allowed:
            n += 1
        return n
    return prefix({"gpu"}), prefix({"gpu", "cpu"}), prefix({"gpu", "cpu", "disk"})


async def test_the_index_sees_the_cpu_and_disk_tiers(llama, tmp_path):
    model_dir, _ = llama
    eng = tiered_engine(model_dir, kv_offload_cpu_gb=6e-6, kv_offload_dir=str(tmp_path / "kv"),
                        kv_offload_disk_gb=0.001)
    pub = KVEventPublisher(eng.block_manager, "w1", epoch=1, plane=planes().worker, heartbeat_s=0.02)
    sub = EventSubscriber(planes().index)
    sub.connect(pub.events_addr)
    core = PrefixCore(eng.config.block_size)
    following: list[list[int]] = []

    def match(prompt):
        resp = core.match(MatchRequest(model_id=eng.block_manager.model_id, tokens=pack_token_ids(prompt)))
        w = resp.blocks_for("w1")
        return (0, 0, 0) if w is None else (w.gpu_blocks, w.gpu_cpu_blocks, w.matched_blocks)

    try:
        async with pumped(pub):
            chat(eng, 3, between=lambda eng, turn, nxt: following.append(nxt))
            history = following[-1]
            expected = held_prefix(eng, history)
            assert expected[0] < expected[1] < expected[2], expected      # host then disk blocks
            await follow(core, sub, pub, lambda: match(history) == expected)
            snap = await fetch_snapshot(pub.snapshot_addr, "check", timeout_s=2.0, plane=planes().index)
        assert snap is not None and core.compare(snap).consistent
        assert {b.tier for b in snap.blocks} == {"gpu", "cpu", "disk"}
        assert eng.reset_prefix_cache()                                     # every tier forgotten
        check_all_tiers(eng)
        assert len(eng.kv_tiers.host) == len(eng.kv_tiers.disk) == 0
    finally:
        sub.close()
        pub.close()
