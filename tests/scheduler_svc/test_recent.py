"""RecentDispatches: the index's answer topped up with dispatches it cannot know yet."""
from __future__ import annotations

from scheduler_svc.recent import RecentDispatches
from scheduler_svc.routing import WorkerView, cache_aware, pick
from services.prefix_hash import chain_hashes
from services.protocol.kv_events import MatchResponse, WorkerMatch
from services.protocol.messages import Submit
from services.protocol.sampling import SamplingParams

SYSTEM = list(range(100, 164))   # 4 blocks


def hashes(tokens, salt=""):
    return chain_hashes(None, "m", salt, tokens, 16)


def test_a_burst_follows_the_first_dispatch_until_the_ttl():
    rd = RecentDispatches(ttl_s=2.0)
    rd.record("w1", hashes(SYSTEM + [1] * 16), now=0.0)
    later = hashes(SYSTEM + [2] * 16)                 # same system prompt, another question
    assert rd.held(later, now=1.0) == {"w1": 4}
    m = rd.overlay(None, later, 16, now=1.0)
    assert m.workers == [WorkerMatch("w1", 4, 4, 4)] and m.available
    req = Submit(request_id="b", tenant="t", prompt_token_ids=SYSTEM + [2] * 16, params=SamplingParams(),
                 reply_addr="a", detok_addr="b")
    workers = [WorkerView(id=w, epoch=1, addr=w, max_num_seqs=8) for w in ("w0", "w1")]
    assert pick(workers, req, cache_aware, m).id == "w1"
    assert rd.held(later, now=2.5) == {} and len(rd) == 0   # expired: the index is the source again


def test_overlay_keeps_the_longer_of_index_and_recent_and_other_tenants_miss():
    rd = RecentDispatches()
    rd.record("w1", hashes(SYSTEM), now=0.0)
    rd.record("w2", hashes(SYSTEM[:32]), now=0.0)
    index = MatchResponse(block_size=16, query_blocks=4, workers=[WorkerMatch("w2", 3, 1, 2)])
    m = rd.overlay(index, hashes(SYSTEM), 16, now=0.5)
    assert m.blocks_for("w1") == WorkerMatch("w1", 4, 4, 4)
    assert m.blocks_for("w2") == WorkerMatch("w2", 3, 2, 2)
    assert rd.overlay(index, hashes(SYSTEM, salt="other"), 16, now=0.5) is index
    unavailable = MatchResponse(block_size=0, query_blocks=0, available=False)
    assert rd.overlay(unavailable, hashes(SYSTEM), 16, now=0.5).blocks_for("w1").matched_blocks == 4


def test_forget_worker_and_bounded_size():
    rd = RecentDispatches(max_blocks=8)
    for i in range(10):
        rd.record(f"w{i}", hashes(SYSTEM), now=float(i) / 100)
    assert len(rd._order) <= 8
    rd.forget_worker("w9")
    assert "w9" not in rd.held(hashes(SYSTEM), now=0.2)
