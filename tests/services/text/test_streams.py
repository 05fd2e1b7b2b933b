"""DetokCore without sockets, over a toy tokenizer: streaming text, stop strings, aborts, logprobs."""
from __future__ import annotations

from services.protocol.messages import Abort, RequestFailed, SeqTokens, StepOutput, StreamOpen, TextBatch
from services.protocol.sampling import SamplingParams
from services.envelope import SCHEDULER
from services.text.streams import DetokCore

VOCAB = {i: ch for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz .!")}


class ToyTok:
    vocab_size = len(VOCAB)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids)


def ids(text):
    inv = {c: i for i, c in VOCAB.items()}
    return [inv[c] for c in text]


def open_(core, rid="r", **params):
    core.open(StreamOpen(request_id=rid, params=SamplingParams(**params), reply_addr="gw", num_prompt_tokens=3))


def step(core, *seqs):
    return core.step(StepOutput(worker_id="w", epoch=1, step=0, seqs=list(seqs)))


def texts(out):
    return [(d.index, d.text, d.finish_reason) for e in out if isinstance(e.msg, TextBatch) for d in e.msg.deltas]


def test_streams_text_and_finishes():
    core = DetokCore(ToyTok())
    open_(core)
    assert texts(step(core, SeqTokens("r", 0, ids("hel")))) == [(0, "hel", None)]
    assert texts(step(core, SeqTokens("r", 0, ids("lo"), finish_reason="length"))) == [(0, "lo", "length")]
    assert not core.streams


def test_samples_started_counts_first_tokens():
    """The shell times the steps that carry some sample's first tokens (kvmesh_detok_first_token_seconds)."""
    core = DetokCore(ToyTok())
    open_(core, n=2)
    step(core, SeqTokens("r", 0, ids("a")))
    assert core.samples_started == 1
    step(core, SeqTokens("r", 0, ids("b")), SeqTokens("r", 1, ids("c")))
    assert core.samples_started == 2
    step(core, SeqTokens("r", 0, ids("d")), SeqTokens("r", 1, ids("e")), SeqTokens("gone", 0, ids("f")))
    assert core.samples_started == 2


def test_stop_string_across_steps_aborts_the_sample_upstream():
    core = DetokCore(ToyTok())
    open_(core, n=2, stop=["lo w"])
    out = step(core, SeqTokens("r", 0, ids("hello")), SeqTokens("r", 1, ids("abc")))
    assert texts(out) == [(0, "hel", None), (1, "abc", None)]          # "lo" held back: maybe a stop
    out = step(core, SeqTokens("r", 0, ids(" wor")), SeqTokens("r", 1, ids("d")))
    assert texts(out) == [(0, "", "stop"), (1, "d", None)]
    aborts = [e for e in out if e.dest == SCHEDULER]
    assert len(aborts) == 1 and aborts[0].msg.index == 0 and aborts[0].msg.reason == "stop"
    # late tokens of the stopped sample are ignored; the other sample continues to its end
    out = step(core, SeqTokens("r", 0, ids("x")), SeqTokens("r", 1, ids("e"), finish_reason="stop"))
    assert texts(out) == [(1, "e", "stop")]
    assert not core.streams


def test_held_text_flushed_at_natural_end():
    core = DetokCore(ToyTok())
    open_(core, stop=["xyz"])
    assert texts(step(core, SeqTokens("r", 0, ids("abx")))) == [(0, "ab", None)]
    assert texts(step(core, SeqTokens("r", 0, ids("y"), finish_reason="length"))) == [(0, "xy", "length")]


def test_abort_and_unknown_requests():
    core = DetokCore(ToyTok())
    open_(core)
    core.abort(Abort(request_id="r"))
    assert step(core, SeqTokens("r", 0, ids("a"))) == []
    assert step(core, SeqTokens("other", 0, ids("a"))) == []
    assert core.abort(Abort(request_id="never-opened", reason="timeout")) == []


def test_an_abort_of_an_unfinished_stream_fails_it_at_its_gateway():
    """Whatever stopped it (worker failure, timeout, shutdown, the scheduler), the gateway is told,
    so its client gets an error chunk and [DONE] rather than a stream that never ends."""
    for reason, status, code in (("worker_failed", 503, "worker_failed"), ("timeout", 504, "timeout"),
                                 ("shutdown", 503, "shutdown"), ("client", 500, "aborted")):
        core = DetokCore(ToyTok())
        open_(core, n=2)
        step(core, SeqTokens("r", 0, ids("ab"), finish_reason="length"), SeqTokens("r", 1, ids("c")))
        [env] = core.abort(Abort(request_id="r", reason=reason))
        assert env.dest == "gw" and isinstance(env.msg, RequestFailed)
        assert (env.msg.request_id, env.msg.status, env.msg.code) == ("r", status, code)
        assert not core.streams


def test_an_abort_after_every_sample_ended_tells_nobody():
    core = DetokCore(ToyTok())
    open_(core, stop=["c"])
    out = step(core, SeqTokens("r", 0, ids("abc")))
    assert texts(out) == [(0, "ab", "stop")]
    assert core.abort(Abort(request_id="r", reason="stop")) == []


def test_logprobs_and_batching_per_gateway():
    core = DetokCore(ToyTok())
    open_(core, "a", logprobs=1)
    core.open(StreamOpen(request_id="b", params=SamplingParams(), reply_addr="gw2", num_prompt_tokens=1))
    out = step(core, SeqTokens("a", 0, ids("h"), [-0.5], [[(ids("h")[0], -0.5)]]), SeqTokens("b", 0, ids("x")))
    assert sorted(e.dest for e in out) == ["gw", "gw2"]
    [d] = next(e.msg.deltas for e in out if e.dest == "gw")
    assert d.logprobs[0].token == "h" and d.logprobs[0].logprob == -0.5 and d.logprobs[0].top[0][0] == "h"


def test_expire():
    core = DetokCore(ToyTok())
    open_(core)
    assert core.expire(0.0) == 1 and not core.streams


def reasons(out):
    return [(d.index, d.finish_reason, d.stop_reason) for e in out if isinstance(e.msg, TextBatch) for d in e.msg.deltas]


def test_stop_reason_names_the_stop_string_or_the_stop_token():
    """vLLM's stop_reason: the stop string that matched, the stop_token_ids entry sampled, or None
    (EOS, length, still running)."""
    core = DetokCore(ToyTok())
    open_(core, n=4, stop=["b!", "xy"], stop_token_ids=[ids(".")[0]])
    out = step(core, SeqTokens("r", 0, ids("axy")), SeqTokens("r", 1, ids("a."), finish_reason="stop"),
               SeqTokens("r", 2, ids("a"), finish_reason="stop"), SeqTokens("r", 3, ids("ab")))
    assert reasons(out) == [(0, "stop", "xy"), (1, "stop", ids(".")[0]), (2, "stop", None), (3, None, None)]
    assert reasons(step(core, SeqTokens("r", 3, ids("c"), finish_reason="length"))) == [(3, "length", None)]


def test_a_stale_epochs_tokens_are_dropped_and_counted():
    """Once a worker's newer incarnation has been heard from, anything its older one still sends
    is dropped whole, even for a stream the detokenizer holds; tokens for streams it does not hold
    are counted too."""
    core = DetokCore(ToyTok())
    open_(core, "a")
    out = core.step(StepOutput(worker_id="w", epoch=2, step=0, seqs=[SeqTokens("a", 0, ids("hi"))]))
    assert texts(out) == [(0, "hi", None)]
    stale = StepOutput(worker_id="w", epoch=1, step=9, seqs=[SeqTokens("a", 0, ids("xyz"))])
    assert core.step(stale) == []
    other = StepOutput(worker_id="v", epoch=1, step=0, seqs=[SeqTokens("a", 0, ids("!"))])
    assert texts(core.step(other)) == [(0, "!", None)]        # epochs are per worker
    gone = StepOutput(worker_id="w", epoch=2, step=1, seqs=[SeqTokens("failed", 0, ids("ab"))])
    assert core.step(gone) == []
    assert core.dropped_tokens == {"stale_epoch": 3, "no_stream": 2, "moved": 0}


def test_a_re_run_stream_skips_the_tokens_the_client_has():
    """The prefill worker streamed each sample's first token and died; the decode worker re-runs the
    request from its prompt (StreamOpen.resumes): the client sees every token once."""
    core = DetokCore(ToyTok())
    open_(core, n=2)
    assert texts(step(core, SeqTokens("r", 0, ids("h")), SeqTokens("r", 1, ids("y")))) == [(0, "h", None),
                                                                                             (1, "y", None)]
    core.open(StreamOpen(request_id="r", params=SamplingParams(n=2), reply_addr="gw", num_prompt_tokens=3,
                         resumes=True))
    assert texts(step(core, SeqTokens("r", 0, ids("h")), SeqTokens("r", 1, ids("y")))) == []
    out = step(core, SeqTokens("r", 0, ids("ello"), finish_reason="length"), SeqTokens("r", 1, ids("es")))
    assert texts(out) == [(0, "ello", "length"), (1, "es", None)]
    # a re-run whose first step carries the seen token and more: only the new ones
    open_(core, "s")
    step(core, SeqTokens("s", 0, ids("ab")))
    core.open(StreamOpen(request_id="s", params=SamplingParams(), reply_addr="gw", num_prompt_tokens=3, resumes=True))
    assert texts(step(core, SeqTokens("s", 0, ids("abc")))) == [(0, "c", None)]
    # a resumed open of a stream this detokenizer does not hold is a plain open
    core.open(StreamOpen(request_id="t", params=SamplingParams(), reply_addr="gw", num_prompt_tokens=3, resumes=True))
    assert texts(step(core, SeqTokens("t", 0, ids("x")))) == [(0, "x", None)]


def test_a_moved_stream_resumes_from_its_tokens_and_drops_the_old_workers_late_ones():
    """Its worker stopped: the scheduler's Migrate gets each sample's tokens (the next worker goes on
    after them, so nothing is skipped), and tokens the old worker sent after that are dropped."""
    from services.protocol.messages import Migrate, Resume
    core = DetokCore(ToyTok())
    open_(core, n=3, stop=["xyz"])
    sent = texts(step(core, SeqTokens("r", 0, ids("hel")), SeqTokens("r", 1, ids("ab"), finish_reason="length")))
    sent += texts(step(core, SeqTokens("r", 0, ids("lo x"))))            # "x" may start the stop string
    [env] = core.migrate(Migrate(request_id="r", worker_id="w", reply_addr="sched"))
    assert env.dest == "sched" and env.msg == Resume(request_id="r", output_token_ids=[ids("hello x"), ids("ab"), []],
                                                     ended=[1])
    assert texts(step(core, SeqTokens("r", 0, ids("q")))) == []           # late, from the worker it left
    assert core.dropped_tokens["moved"] == 1
    core.open(StreamOpen(request_id="r", params=SamplingParams(n=3, stop=["xyz"]), reply_addr="gw",
                         num_prompt_tokens=3, resumes=True))
    out = core.step(StepOutput(worker_id="w2", epoch=1, step=0, seqs=[
        SeqTokens("r", 0, ids("yz"), finish_reason=None), SeqTokens("r", 2, ids("c"), finish_reason="length")]))
    # the stop string spans the move: the held-back "x" and the new "yz" end sample 0
    assert texts(out) == [(0, "", "stop"), (2, "c", "length")]
    assert "".join(t for i, t, _ in sent if i == 0) == "hello "
    # a stream it does not hold: known=False
    [env] = core.migrate(Migrate(request_id="nope", worker_id="w", reply_addr="sched"))
    assert env.msg.known is False and env.msg.output_token_ids == []


def test_a_stream_moved_off_a_worker_takes_the_tokens_of_its_restart_under_the_same_id():
    """kvmesh serve restarts a killed worker under the same id: the new incarnation (a newer epoch)
    is another worker, and the moved stream may continue there; the old incarnation's late tokens
    are still dropped."""
    from services.protocol.messages import Migrate
    core = DetokCore(ToyTok())
    open_(core)
    core.step(StepOutput(worker_id="w", epoch=1, step=0, seqs=[SeqTokens("r", 0, ids("ab"))]))
    core.migrate(Migrate(request_id="r", worker_id="w", reply_addr="sched", worker_epoch=1))
    assert texts(core.step(StepOutput(worker_id="w", epoch=1, step=1, seqs=[SeqTokens("r", 0, ids("q"))]))) == []
    core.open(StreamOpen(request_id="r", params=SamplingParams(), reply_addr="gw", num_prompt_tokens=3,
                         resumes=True))
    out = core.step(StepOutput(worker_id="w", epoch=2, step=0, seqs=[SeqTokens("r", 0, ids("cd"))]))
    assert texts(out) == [(0, "cd", None)]
    assert core.dropped_tokens["moved"] == 1


def test_a_migrate_naming_no_worker_leaves_the_one_that_streamed_it_last():
    """A restarted scheduler does not know where a resubmitted request ran: its Migrate names no
    worker, and the worker whose tokens came last is the one left (a late step of it is dropped)."""
    from services.protocol.messages import Migrate
    core = DetokCore(ToyTok())
    open_(core)
    core.step(StepOutput(worker_id="w", epoch=3, step=0, seqs=[SeqTokens("r", 0, ids("ab"))]))
    [env] = core.migrate(Migrate(request_id="r", worker_id="", reply_addr="sched"))
    assert env.msg.output_token_ids == [ids("ab")]
    assert texts(core.step(StepOutput(worker_id="w", epoch=3, step=1, seqs=[SeqTokens("r", 0, ids("q"))]))) == []
    core.open(StreamOpen(request_id="r", params=SamplingParams(), reply_addr="gw", num_prompt_tokens=3,
                         resumes=True))
    out = core.step(StepOutput(worker_id="w2", epoch=1, step=0, seqs=[SeqTokens("r", 0, ids("cd"))]))
    assert texts(out) == [(0, "cd", None)] and core.dropped_tokens["moved"] == 1


def test_a_moved_hand_off_leaves_both_halves_until_a_new_run_opens_on_one_of_them():
    """The decode worker d died; its prefill worker p, which had taken the hand-off back, streams on
    until the scheduler's Abort reaches it: the Migrate names p too, so p's late tokens are dropped.
    The move then sends the request back to p (the one worker left): its new run's StreamOpen comes
    after every late token of the old run on p's connection, so p's tokens count again from there."""
    from services.protocol.messages import Migrate
    core = DetokCore(ToyTok())
    open_(core)
    core.step(StepOutput(worker_id="p", epoch=1, step=0, seqs=[SeqTokens("r", 0, ids("ab"))]))
    [env] = core.migrate(Migrate(request_id="r", worker_id="d", worker_epoch=1, reply_addr="sched",
                                 also_worker_id="p", also_worker_epoch=1))
    assert env.msg.output_token_ids == [ids("ab")]
    assert texts(core.step(StepOutput(worker_id="p", epoch=1, step=1, seqs=[SeqTokens("r", 0, ids("q"))]))) == []
    core.open(StreamOpen(request_id="r", params=SamplingParams(), reply_addr="gw", num_prompt_tokens=3,
                         resumes=True, worker_id="p", worker_epoch=1))
    out = core.step(StepOutput(worker_id="p", epoch=1, step=2, seqs=[SeqTokens("r", 0, ids("cd"))]))
    assert texts(out) == [(0, "cd", None)] and core.dropped_tokens["moved"] == 1
    assert texts(core.step(StepOutput(worker_id="d", epoch=1, step=9, seqs=[SeqTokens("r", 0, ids("z"))]))) == []


def test_a_kept_hand_off_drops_the_decode_worker_s_late_tokens_and_answers_nothing():
    """p kept its failed hand-off and decodes it; d, told to drop it, may have admitted it after all
    (its Ack came past p's lease): the scheduler's Migrate without a Resume leaves d, so whatever d
    streams before its Abort lands never reaches the client, and p's tokens go on."""
    from services.protocol.messages import Migrate
    core = DetokCore(ToyTok())
    open_(core)
    core.step(StepOutput(worker_id="p", epoch=1, step=0, seqs=[SeqTokens("r", 0, ids("a"))]))
    assert core.migrate(Migrate(request_id="r", worker_id="d", worker_epoch=1, reply_addr="sched",
                                resume=False)) == []
    assert texts(core.step(StepOutput(worker_id="d", epoch=1, step=1, seqs=[SeqTokens("r", 0, ids("b"))]))) == []
    out = core.step(StepOutput(worker_id="p", epoch=1, step=1, seqs=[SeqTokens("r", 0, ids("b"))]))
    assert texts(out) == [(0, "b", None)] and core.dropped_tokens["moved"] == 1
    assert core.migrate(Migrate(request_id="gone", worker_id="d", reply_addr="sched", resume=False)) == []


class EosTok(ToyTok):
    eos_token_ids = frozenset(ids("!"))


def test_the_stop_token_or_eos_that_ended_a_sample_is_not_text():
    """vLLM's: the EOS or stop_token_ids entry that ended a sample is counted (and has logprobs) but
    is not part of the text, whatever skip_special_tokens says. A sample a grammar ended ("stop" on
    another token) and one with ignore_eos keep their last token's text."""
    core = DetokCore(EosTok())
    open_(core, n=4, stop_token_ids=ids("."), skip_special_tokens=False, logprobs=0)
    out = step(core, SeqTokens("r", 0, ids("ab."), finish_reason="stop"),
               SeqTokens("r", 1, ids("ab!"), finish_reason="stop"),
               SeqTokens("r", 2, ids("abc"), finish_reason="stop"),
               SeqTokens("r", 3, ids("a"), logprobs=[-1.0]))
    assert texts(out) == [(0, "ab", "stop"), (1, "ab", "stop"), (2, "abc", "stop"), (3, "a", None)]
    assert [d.num_new_tokens for e in out for d in e.msg.deltas] == [3, 3, 3, 1]
    out = step(core, SeqTokens("r", 3, ids("."), logprobs=[-0.5], finish_reason="stop"))
    [delta] = [d for e in out for d in e.msg.deltas]
    assert (delta.text, delta.stop_reason, len(delta.logprobs)) == ("", ids(".")[0], 1)
    open_(core, rid="q", ignore_eos=True, skip_special_tokens=False)
    assert texts(step(core, SeqTokens("q", 0, ids("a!"), finish_reason="length"))) == [(0, "a!", "length")]


def test_stop_strings_count_only_from_min_tokens_on():
    """vLLM's min_tokens: a stop string ending in the text of the first min_tokens tokens is text;
    one ending in a later token's ends the sample, also when an early token began it (tokens of
    one step split at min_tokens)."""
    core = DetokCore(ToyTok())
    open_(core, n=3, stop=["b", "xy"], min_tokens=4)
    out = step(core, SeqTokens("r", 0, ids("ab")), SeqTokens("r", 1, ids("abcb")), SeqTokens("r", 2, ids("abcx")))
    # an early "b" is text (held a step, as any tail a stop string may begin); "x" may begin "xy"
    assert texts(out) == [(0, "a", None), (1, "abc", None), (2, "abc", None)]
    out = step(core, SeqTokens("r", 0, ids("cdb")), SeqTokens("r", 1, ids("b")), SeqTokens("r", 2, ids("y")))
    assert texts(out) == [(0, "bcd", "stop"), (1, "b", "stop"), (2, "", "stop")]


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token_in_the_text():
    """vLLM's include_stop_str_in_output: the text runs to the end of the stop string (nothing is
    held back while streaming) and the stop or EOS token that ended a sample is text too."""
    core = DetokCore(EosTok())
    open_(core, n=3, stop=["lo w"], stop_token_ids=ids("."), include_stop_str_in_output=True,
          skip_special_tokens=False)
    out = step(core, SeqTokens("r", 0, ids("hello")), SeqTokens("r", 1, ids("ab."), finish_reason="stop"),
               SeqTokens("r", 2, ids("ab!"), finish_reason="stop"))
    assert texts(out) == [(0, "hello", None), (1, "ab.", "stop"), (2, "ab!", "stop")]
    out = step(core, SeqTokens("r", 0, ids(" worx")))
    assert texts(out) == [(0, " w", "stop")]
    aborts = [e for e in out if e.dest == SCHEDULER]
    assert len(aborts) == 1 and aborts[0].msg.reason == "stop"


def test_prompt_logprobs_get_their_tokens_text_through_the_wire():
    """The worker's entries (gpu_worker/service/core._seq_tokens) -> msgpack -> the detokenizer's."""
    import msgspec

    from gpu_worker.outputs import PromptLogprob, SequenceDelta
    from gpu_worker.service.core import _seq_tokens
    from services.protocol.messages import PromptLogprobText
    core = DetokCore(ToyTok())
    open_(core, prompt_logprobs=1)
    d = SequenceDelta("r", 0, ids("!"), num_prompt_tokens=2,
                      prompt_logprobs=[PromptLogprob(ids("h")[0], None, None, ()),
                                       PromptLogprob(ids("i")[0], -0.5, 2, ((ids("a")[0], -0.25),))])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(StepOutput(worker_id="w", epoch=1, step=0,
                                                                    seqs=[_seq_tokens(d, "length")])), type=StepOutput)
    [delta] = [d for e in core.step(wire) if isinstance(e.msg, TextBatch) for d in e.msg.deltas]
    assert delta.prompt_logprobs == [PromptLogprobText(ids("h")[0], "h", None, None),
                                     PromptLogprobText(ids("i")[0], "i", -0.5, 2, [(ids("a")[0], "a", -0.25)])]


def test_prompt_logprobs_are_bounded_on_the_wire():
    import msgspec
    import pytest

    from services.protocol.messages import PromptTokenLogprob
    from services.protocol.sampling import MAX_LOGPROBS, MAX_PROMPT_LOGPROBS_TOKENS

    def wire(entries):
        msg = StepOutput(worker_id="w", epoch=1, step=0, seqs=[SeqTokens("r", 0, [1], prompt_logprobs=entries)])
        return msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=StepOutput)

    wire([PromptTokenLogprob(1, -1.0, 1, [(2, -0.5)] * MAX_LOGPROBS)])
    with pytest.raises(msgspec.ValidationError):
        wire([PromptTokenLogprob(1, -1.0, 1, [(2, -0.5)] * (MAX_LOGPROBS + 1))])
    with pytest.raises(msgspec.ValidationError):
        wire([PromptTokenLogprob(1, None, None)] * (MAX_PROMPT_LOGPROBS_TOKENS + 1))
