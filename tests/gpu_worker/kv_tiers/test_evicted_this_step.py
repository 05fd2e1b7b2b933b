"""A prompt admitted in the very schedule whose running request evicted the first block of its
history (the device's LRU had let the rest of it go already) still reuses that history: the
blocks evicted earlier in a schedule go down a tier before the admission's plan, so the whole
history loads back from the host tier instead of being computed again with 0 cached tokens.

    pool (24 blocks of 4):  history h0..h3 cached (LRU: h3 h2 h1 h0), "late" L0..L7 cached after
    "other" (60 tokens):    12 free blocks + h3 h2 h1 evicted -> host tier (end of its schedule)
    next schedule:          other's 61st token needs a block: h0 evicted, not yet flushed
                            -> the turn is admitted in the same schedule: device miss at h0
"""
from __future__ import annotations

from tests.gpu_worker.kv_tiers.conftest import (
    BLOCK_SIZE, MAX_STEPS, check_all_tiers, decoding, greedy, prompt_hashes, run, tier_stats, tiered_engine, tokens)

POOL = 24


class _Removals:
    """The hashes the device's prefix cache let go of."""

    def __init__(self) -> None:
        self.hashes: list[bytes] = []

    def on_stored(self, block_hash, parent, token_ids, tier="gpu") -> None:
        pass

    def on_removed(self, block_hash, tier="gpu") -> None:
        if tier == "gpu":
            self.hashes.append(block_hash)

    def on_missing(self, block_hash, tier) -> None:
        pass

    def on_cleared(self) -> None:
        pass


def test_a_history_evicted_in_the_admitting_schedule_still_loads(llama):
    model_dir, hf = llama
    eng = tiered_engine(model_dir, num_gpu_blocks=POOL, kv_offload_cpu_gb=0.001)
    bm = eng.block_manager
    history = tokens(14, 1)
    answer, _ = run(eng, "turn-0", history)             # 17 tokens computed: h0..h3 cached
    run(eng, "late", tokens(8 * BLOCK_SIZE, 2), max_tokens=1)   # 8 blocks cached after the history's
    prompt = history + answer + tokens(5, 3)
    first = prompt_hashes(eng, prompt)[0]
    assert bm.num_cached_blocks == 4 + 8 and bm.num_free_blocks == POOL

    other_prompt = tokens(15 * BLOCK_SIZE, 4)           # the 12 free blocks, then h3 h2 h1 evicted
    outputs = {"other": decoding(eng, "other", other_prompt, 6)}
    assert first in bm._by_hash and bm.num_cached_blocks == 1 + 8     # only h0 of the history left
    assert tier_stats(eng)["cpu_blocks"] == 3

    removed = _Removals()
    bm.add_listener(removed)
    eng.add_request("turn-1", prompt, greedy(4))
    deltas = eng.step()
    # the schedule that admitted the turn (it waits no more) is the one that evicted h0
    assert not eng.scheduler.waiting and first in removed.hashes
    cached = None
    for _ in range(MAX_STEPS):
        for d in deltas:
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.request_id == "turn-1" and cached is None:
                cached = d.num_cached_tokens
        if not eng.has_unfinished_requests():
            break
        deltas = eng.step()
    assert cached == 4 * BLOCK_SIZE, cached              # h0..h3, all from the host tier
    assert tier_stats(eng)["loaded_blocks"]["cpu"] == 4
    assert outputs["turn-1"] == hf.greedy(prompt, 4)[0]
    assert outputs["other"] == hf.greedy(other_prompt, 6)[0]
    check_all_tiers(eng)
