"""Speculation with one-step-ahead scheduling (Engine._step_async), n-gram on the fake runner (its
KV stores token ids: a wrong slot changes the tokens): a step that may propose settles the
launched step and verifies synchronously, a step without drafts launches one step ahead. Greedy
tokens identical to decoding without speculation (synchronously) through batching, chunked
prefill and preemption, with the batch crossing disable_by_batch_size both ways; a sequence that
cannot match keeps its steps ahead; aborts while a step is in flight leak no block; exact block
accounting after every step. test_spec_async_models.py: draft_model and mtp."""
from __future__ import annotations

from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.engine_fakes import assert_clean, collect
from tests.gpu_worker.spec_decode.spec_fakes import MAX_STEPS, fake_engine, ngram


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def spy_modes(eng: Engine) -> list[str]:
    """The kind of every step's forward, in order: "async" (launched one step ahead), "sync"
    (launched with nothing in flight), "spec" (a synchronous verification)."""
    modes: list[str] = []
    launch, speculative = eng._launch, eng._speculative_step

    def spy_launch(out, prev):
        modes.append("async" if prev is not None else "sync")
        return launch(out, prev)

    def spy_speculative(out, drafts):
        assert eng._inflight is None and not any(-1 in s.token_ids for s in eng.scheduler.running)
        modes.append("spec")
        return speculative(out, drafts)

    eng._launch, eng._speculative_step = spy_launch, spy_speculative
    return modes


def drive(eng: Engine, arrivals: dict[int, list], abort_at: dict[int, list] | None = None,
          in_flight_aborts: list | None = None) -> dict:
    """Step until idle (bounded); arrivals {step: [(rid, prompt, params)]}, abort_at {step: [rid]}
    (in_flight_aborts: where an abort found a step in flight)."""
    out: dict = {}
    arrivals, abort_at = dict(arrivals), dict(abort_at or {})
    for step in range(MAX_STEPS):
        for rid, ids, params in arrivals.pop(step, []):
            eng.add_request(rid, ids, params)
        for rid in abort_at.pop(step, []):
            if in_flight_aborts is not None and eng._inflight is not None:
                in_flight_aborts.append((step, rid))
            eng.abort_request(rid)
            eng.block_manager.check_integrity()
        if not (eng.has_unfinished_requests() or arrivals):
            break
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
    assert not eng.has_unfinished_requests()
    assert_clean(eng)
    return {key: v["tokens"] for key, v in out.items()}


def phases(modes: list[str]) -> list[str]:
    """Runs of equal kinds collapsed, "sync" counted with the async launches."""
    runs: list[str] = []
    for mode in modes:
        kind = "spec" if mode == "spec" else "ahead"
        if not runs or runs[-1] != kind:
            runs.append(kind)
    return runs


def spec_stats(eng: Engine) -> dict:
    return eng.stats().extra["spec_decode"]


def crossing_arrivals(max_tokens: int = 60) -> dict[int, list]:
    """One request speculates alone; two more join (3 running > disable_by_batch_size 2: drafts
    off, steps launch ahead) and finish early; the first speculates again alone."""
    ps = [[(7 * i + 3 * j) % 47 + 2 for j in range(5 + 3 * i)] for i in range(3)]
    return {0: [("long", ps[0], greedy(max_tokens))],
            8: [("s1", ps[1], greedy(12)), ("s2", ps[2], greedy(15))]}


def test_ngram_crossing_disable_by_batch_size_both_ways_gives_identical_tokens():
    kw = dict(block_size=4, num_gpu_blocks=128, max_num_batched_tokens=8)
    plain = drive(fake_engine(None, **kw), crossing_arrivals())
    eng = fake_engine(ngram(disable_by_batch_size=2), async_scheduling=True, **kw)
    modes = spy_modes(eng)
    assert drive(eng, crossing_arrivals()) == plain
    assert phases(modes)[:4] == ["ahead", "spec", "ahead", "spec"]   # prefill; alone; three; alone again
    assert modes.count("async") >= 8 and spec_stats(eng)["accepted"] > 10


def test_ngram_batching_chunks_and_preemption_give_identical_tokens():
    ps = {f"r{i}": [(7 * i + 3 * j) % 47 + 2 for j in range(5 + 3 * i)] for i in range(5)}
    arrivals = {0: [(r, p, greedy(60)) for r, p in list(ps.items())[:3]],
                4: [(r, p, greedy(45)) for r, p in list(ps.items())[3:]]}
    kw = dict(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=8)
    plain = drive(fake_engine(None, **kw), arrivals)
    eng = fake_engine(ngram(disable_by_batch_size=3), async_scheduling=True, **kw)
    modes = spy_modes(eng)
    assert drive(eng, arrivals) == plain
    assert eng.stats().num_preemptions > 0 and spec_stats(eng)["accepted"] > 10
    assert "async" in modes and "spec" in modes


def test_no_match_possible_keeps_the_step_ahead():
    """A sequence whose known tokens leave no n-gram match possible (prompt_lookup_min 3, its
    last 2 tokens never seen before) launches ahead: the speculator does not force a settle."""
    eng = fake_engine(ngram(lo=3, hi=3), async_scheduling=True, window=None)
    modes = spy_modes(eng)
    drive(eng, {0: [("u", list(range(2, 40)), greedy(3))]})       # fake logits: no repeat within 3 steps
    assert modes == ["sync", "async", "async"] and spec_stats(eng)["proposed"] == 0


def test_aborts_while_a_step_is_in_flight_leak_nothing():
    ps = {f"r{i}": [(7 * i + 3 * j) % 47 + 2 for j in range(5 + 3 * i)] for i in range(5)}
    arrivals = {0: [(r, p, greedy(50)) for r, p in ps.items()]}
    eng = fake_engine(ngram(disable_by_batch_size=2), async_scheduling=True, block_size=4, num_gpu_blocks=128)
    spy_modes(eng)
    hits: list = []
    out = drive(eng, arrivals, abort_at={5: ["r0"], 9: ["r1", "r2"], 30: ["r3"]}, in_flight_aborts=hits)
    assert [rid for _, rid in hits][:3] == ["r0", "r1", "r2"]       # launched ahead while > 2 ran
    plain = drive(fake_engine(None, block_size=4, num_gpu_blocks=128), {0: [("r4", ps["r4"], greedy(50))]})
    assert out["r4", 0] == plain["r4", 0] and spec_stats(eng)["accepted"] > 0


def sampled(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True)


def test_seeded_sampling_across_both_kinds_of_step_gives_the_same_tokens():
    """Every draw keeps the key (seed, sample, position) of a plain step, whichever kind of step
    makes it: seed for seed the tokens of decoding without speculation (the fake logits are exact)."""
    arrivals = {0: [("s0", [9, 2, 9, 2, 9], sampled(0, 40))],
                6: [("s1", [4, 7, 4, 7], sampled(1, 10)), ("s2", [5, 5, 6, 5, 5], sampled(2, 12))]}
    plain = drive(fake_engine(None), arrivals)
    eng = fake_engine(ngram(disable_by_batch_size=2), async_scheduling=True)
    modes = spy_modes(eng)
    assert drive(eng, arrivals) == plain
    assert phases(modes)[:4] == ["ahead", "spec", "ahead", "spec"] and spec_stats(eng)["accepted"] > 0
