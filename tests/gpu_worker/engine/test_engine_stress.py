"""Randomized run on the fake runner: arrivals, priorities, n > 1, aborts, chunking and
preemption together; block integrity after every step, reference outputs at the end, and the
KV event stream agrees with the block manager's snapshot."""
import random

from engine_fakes import assert_clean, collect, make_engine, reference_greedy
from services.protocol.sampling import SamplingParams


class EventLog:
    def __init__(self):
        self.live = {}

    def on_stored(self, h, parent, tokens):
        assert h not in self.live and (parent is None or len(parent) == 16) and len(tokens) == 4
        self.live[h] = (parent, tokens)

    def on_removed(self, h):
        del self.live[h]

    def on_cleared(self):
        self.live.clear()


def test_random_workload_stays_consistent():
    rng = random.Random(0)
    eng = make_engine(block_size=4, num_gpu_blocks=14, max_num_batched_tokens=20, max_num_seqs=6)
    events = EventLog()
    eng.block_manager.add_listener(events)
    shared = [rng.randrange(2, 50) for _ in range(9)]
    specs, aborted, out = {}, set(), {}
    for step in range(400):
        if len(specs) < 30 and rng.random() < 0.5:
            rid = f"r{len(specs)}"
            ids = (shared if rng.random() < 0.5 else []) + [rng.randrange(2, 50) for _ in range(rng.randrange(1, 20))]
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randrange(1, 24),
                                    n=rng.choice([1, 1, 2, 3]))
            eng.add_request(rid, ids, params, priority=rng.choice([0, 0, 1]))
            specs[rid] = (ids, params)
        if specs and rng.random() < 0.05:
            rid = rng.choice(sorted(specs))
            eng.abort_request(rid)
            aborted.add(rid)
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
        snapshot = {h: (p, t) for h, p, t in eng.block_manager.cached_block_hashes()}
        assert snapshot == events.live
        if len(specs) == 30 and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert eng.stats().num_preemptions > 0
    for rid, (ids, params) in specs.items():
        if rid in aborted:
            continue
        ref = reference_greedy(ids, params.max_tokens)
        for i in range(params.n):
            assert out[(rid, i)]["tokens"] == ref and out[(rid, i)]["finish"] == "length", (rid, i)
    assert_clean(eng)
