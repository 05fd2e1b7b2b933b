"""Back-off of sequences whose drafts fail (gpu_worker/spec_decode/backoff.py): the schedule as a
unit (exponential, capped, reset by an accepted draft, judged over the last verifications), and
in the engine on the fake runner with async scheduling: drafts that are always wrong back off and
the steps launch ahead again, drafts that are always right never back off; tokens identical to
decoding without speculation either way."""
from __future__ import annotations

import json

from gpu_worker.engine import PENDING, Engine
from gpu_worker.sequence import Request, Sequence
from gpu_worker.spec_decode.backoff import WINDOW, Backoff
from gpu_worker.spec_decode.speculator import Speculator
from services.speculative import parse_speculative_config
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.engine.engine_fakes import VOCAB, assert_clean, collect, context_logits
from tests.gpu_worker.spec_decode.spec_fakes import MAX_STEPS, fake_engine


class Seq:
    """What Backoff reads of a sequence: its token count (the clock)."""

    def __init__(self, num_tokens: int = 100) -> None:
        self.num_tokens = num_tokens


def skipped_steps(backoff: Backoff, seq: Seq) -> int:
    """Steps seq now goes without drafts, each adding a token as a plain step does."""
    n = 0
    while backoff.waiting(seq):
        seq.num_tokens += 1
        n += 1
    return n


def reject(backoff: Backoff, seq: Seq, k: int = 4):
    """A verification of k drafts that accepts none; its next step comes after one more token."""
    seq.num_tokens += 1
    return backoff.verified(seq, k, 0, seq.num_tokens)


def test_failures_back_off_exponentially_up_to_the_cap_and_an_accept_resets():
    backoff, seq = Backoff(max_steps=16), Seq()
    lengths = []
    for _ in range(7):
        backed = reject(backoff, seq)
        lengths.append(skipped_steps(backoff, seq))
        assert backed.steps == lengths[-1]
    assert lengths == [1, 2, 4, 8, 16, 16, 16]
    for _ in range(WINDOW):              # a stretch of full accepts: the window forgets the failures
        assert backoff.verified(seq, 4, 4, seq.num_tokens) is None
    assert reject(backoff, seq) is None  # acceptance over the window still 75%: no back-off
    assert backoff.verified(seq, 4, 1, seq.num_tokens) is None
    for _ in range(3):                   # the window fills with rejections: back off from 1 again
        if reject(backoff, seq) is not None:
            break
    assert skipped_steps(backoff, seq) == 1
    assert reject(backoff, seq).steps == 2


def test_a_miss_backs_off_after_its_own_step():
    backoff, seq = Backoff(max_steps=64), Seq(50)
    assert backoff.missed(seq).steps == 1
    seq.num_tokens += 1                  # the step that missed computes its token: the next one waits
    assert skipped_steps(backoff, seq) == 1
    assert backoff.missed(seq).steps == 2


def test_half_accepted_drafts_never_back_off():
    """Acceptance 50% over the window, alternating all and nothing: never below 25%."""
    backoff, seq = Backoff(max_steps=64), Seq()
    for i in range(40):
        assert backoff.verified(seq, 4, 4 if i % 2 == 0 else 0, seq.num_tokens + 1) is None
        assert not backoff.waiting(seq)


def test_max_steps_zero_never_backs_off():
    backoff, seq = Backoff(max_steps=0), Seq()
    for _ in range(10):
        assert reject(backoff, seq) is None and backoff.missed(seq) is None and not backoff.waiting(seq)


# ---- the engine ---------------------------------------------------------------------------
def ngram_spec(backoff_max_steps: int | None) -> str:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return json.dumps(spec if backoff_max_steps is None else {**spec, "backoff_max_steps": backoff_max_steps})


def run(eng: Engine, ids: list[int], max_tokens: int) -> list[int]:
    eng.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out: dict = {}
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            break
        collect(eng.step(), out)
        eng.block_manager.check_integrity()
    assert_clean(eng)
    return out["r", 0]["tokens"]


def test_drafts_always_wrong_back_off_and_steps_launch_ahead():
    """The fake model's logits hash the whole context: greedy never repeats, so the n-gram drafts
    (prompt_lookup_min 1: every token of the small vocabulary soon occurred) are rejected."""
    ids, steps = list(range(2, VOCAB)), 150
    want = run(fake_engine(None, window=None), ids, steps)
    stats, ahead = {}, {}
    for name, cap in (("on", None), ("off", 0)):
        eng = fake_engine(ngram_spec(cap), window=None, async_scheduling=True)
        assert run(eng, ids, steps) == want
        stats[name], ahead[name] = eng.stats().extra["spec_decode"], eng.steps_ahead
    on, off = stats["on"], stats["off"]
    assert off["proposed"] > 4 * steps // 2 and off["acceptance_rate"] < 0.1 and off["backoffs"] == 0
    assert on["proposed"] * 5 < off["proposed"] and on["backoffs"] >= 5
    assert on["backoff_steps"] >= 64                                # the schedule reached the cap
    assert ahead["on"] > steps // 2 > ahead["off"]                  # most steps launched ahead again


def cycle_prompt(start: int) -> list[int]:
    """The fake model with window 1 maps its last token to the next: the path from `start` until
    its cycle closed twice, so every n-gram draft follows the model's own cycle."""
    path = [start]
    while path.count(path[-1]) < 3:
        path.append(int(context_logits([path[-1]]).argmax()))
    return path


def test_drafts_always_right_never_back_off():
    ids = cycle_prompt(7)
    want = run(fake_engine(None), ids, 60)
    stats = []
    for cap in (None, 0):
        eng = fake_engine(ngram_spec(cap), async_scheduling=True)
        assert run(eng, ids, 60) == want
        stats.append(eng.stats().extra["spec_decode"])
    on, off = stats
    assert on["backoffs"] == 0 and on["acceptance_rate"] == 1.0
    counts = ("proposed", "accepted", "verify_steps")
    assert [on[c] for c in counts] == [off[c] for c in counts] and on["verify_steps"] > 5


def test_a_miss_is_charged_to_the_sequence_that_made_the_step_settle_only():
    """may_propose says "maybe" for A (its known tokens could continue a match); B could never
    draft at that step. Both find no draft once the step settled: A pays a back-off, B does not
    (it cost nothing)."""
    spec = Speculator(parse_speculative_config(json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3})), 512, None)

    def decoding(rid: str, prompt: list[int]) -> Sequence:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        seq = Sequence(Request(rid, prompt, params, 0, "", 0, 0, 64), 0, [*prompt, PENDING], len(prompt))
        seq.num_computed_tokens = seq.num_tokens - 1
        return seq

    a, b = decoding("a", [5, 6, 7, 5]), decoding("b", [10, 11, 12, 13])
    assert spec.may_propose([a, b], PENDING)              # for a: "5" occurred before, followed by 6
    a.token_ids[-1], b.token_ids[-1] = 9, 14              # the settled tokens: neither continues a match
    assert spec.propose([a, b]) == {}
    assert spec.backoff.waiting(a) and not spec.backoff.waiting(b)
    assert spec.stats.backoffs == 1
