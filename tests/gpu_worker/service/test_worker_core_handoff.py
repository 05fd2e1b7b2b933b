"""WorkerCore's prefill/decode hand-off without sockets: a prefill core and a decode core over real
CPU engines, the KV moved by the in-process transport between their steps, as the shell moves it."""
from __future__ import annotations

import pytest

from gpu_worker.kv_transfer.local import hand_off
from gpu_worker.kv_transfer.messages import Ack
from gpu_worker.service.core import SCHEDULER, WorkerCore
from gpu_worker.service.handoff import AwaitedImports
from services.protocol.messages import (Abort, AwaitKV, Dispatch, RequestFailed, StepOutput, StreamOpen,
                                        WorkerStatus)
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, engine, greedy, prompt, run_single

D_ADDR = "tcp://d:1#worker"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("model") / "llama", arch="llama", size="tiny", progress=False))


class Pair:
    def __init__(self, model: str) -> None:
        self.p = WorkerCore(engine(model, max_num_batched_tokens=16), "p", 1)
        self.p.hands_off = True
        self.d = WorkerCore(engine(model), "d", 1)
        self.d.imports = AwaitedImports(self.d.engine, lease_s=5.0)
        from gpu_worker.kv_transfer.connector import EngineKVProducer
        self.producer = EngineKVProducer(self.p.engine)
        self.out: list = []

    def submit(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        self.out += self.d.run([AwaitKV(request_id=rid, epoch=1, n=params.n, reply_addr="gw", detok_addr="dt")])
        self.out += self.p.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=ids, params=params,
                                         reply_addr="gw", detok_addr="dt", handoff_to=D_ADDR)])

    def drive(self) -> None:
        for _ in range(MAX_STEPS):
            if not (self.p.has_work() or self.d.has_work() or self.p.requests):
                return
            self.out += self.p.run([])
            todo, _ = self.p.take_handoffs()
            for rid, to in todo:
                assert to == D_ADDR
                answer = hand_off(self.producer, self.d.imports, rid)
                self.p.handoff_done(rid, isinstance(answer, Ack), "", self.out)
            self.d.adopt_imports([])
            self.out += self.d.run([])
        raise AssertionError("the P/D run did not end")

    def tokens(self) -> dict:
        got: dict = {}
        for env in self.out:
            if isinstance(env.msg, StepOutput):
                for s in env.msg.seqs:
                    got.setdefault((s.request_id, s.index), []).extend(s.token_ids)
        return got

    def finished(self, core_id: str) -> list[str]:
        return [r for e in self.out if e.dest == SCHEDULER and isinstance(e.msg, WorkerStatus)
                and e.msg.worker_id == core_id for r in e.msg.finished]


def clean(core: WorkerCore) -> bool:
    s = core.engine.stats()
    return not core.requests and not core.awaiting and s.num_free_blocks + s.num_cached_blocks == s.num_total_blocks


def test_the_two_cores_stream_what_one_engine_streams(llama):
    requests = [("a", prompt(50, 1), greedy(6)), ("b", prompt(37, 2), greedy(5, n=2)),
                ("c", prompt(20, 3), SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, n=2))]
    expected = run_single(engine(llama), requests)
    pair = Pair(llama)
    for rid, ids, params in requests:
        pair.submit(rid, ids, params)
    pair.drive()
    assert pair.tokens() == expected
    # the first tokens reach the detokenizer unfinished: the stream goes on at D
    opens = [e.msg.request_id for e in pair.out if isinstance(e.msg, StreamOpen)]
    assert sorted(opens) == ["a", "b", "c"]        # from P only: D does not open the streams again
    assert sorted(pair.finished("p")) == sorted(pair.finished("d")) == ["a", "b", "c"]
    assert clean(pair.p) and clean(pair.d)


def test_a_request_that_ends_at_its_first_token_cancels_the_hand_off(llama):
    pair = Pair(llama)
    pair.submit("a", prompt(30, 4), greedy(1))
    cancels: list = []
    for _ in range(MAX_STEPS):
        if not pair.p.requests:
            break
        pair.out += pair.p.run([])
        todo, cancel = pair.p.take_handoffs()
        assert not todo
        cancels += cancel
    assert cancels == [("a", D_ADDR)]               # P's shell tells D to stop awaiting it
    assert pair.finished("p") == ["a"] and "a" in pair.d.awaiting
    pair.d.imports.abort("a")                       # what D's endpoint does with that Abort
    pair.d.adopt_imports([])
    assert clean(pair.p) and clean(pair.d)


def test_aborts_free_both_cores_and_spare_other_requests(llama):
    pair = Pair(llama)
    pair.submit("a", prompt(60, 5), greedy(20))
    pair.submit("b", prompt(60, 6), greedy(8))
    pair.out += pair.p.run([Abort(request_id="a")])      # prefilling on P
    pair.out += pair.d.run([Abort(request_id="a")])      # awaited on D
    pair.drive()
    assert pair.tokens().get(("a", 0), []) == []
    assert pair.tokens()[("b", 0)] == run_single(engine(llama), [("b", prompt(60, 6), greedy(8))])[("b", 0)]
    assert clean(pair.p) and clean(pair.d)


def test_a_failed_hand_off_that_p_cannot_decode_fails_the_request_to_its_client(llama):
    """P decodes a failed hand-off itself while it holds the KV (test_prefill_sender.py); with its
    blocks gone the engine cannot keep it, and its client gets an error, not a hang."""
    pair = Pair(llama)
    pair.submit("a", prompt(30, 7), greedy(5))
    for _ in range(MAX_STEPS):
        pair.out += pair.p.run([])
        todo, _ = pair.p.take_handoffs()
        if todo:
            break
    pair.producer.release("a")                       # the KV P held is gone
    pair.p.handoff_done("a", False, "timeout", pair.out)
    failed = [e.msg for e in pair.out if isinstance(e.msg, RequestFailed)]
    assert [f.code for f in failed] == ["worker_failed"] and clean(pair.p)


def test_a_re_run_replaces_the_awaited_request_and_runs_whole(llama):
    """P died before handing off: the scheduler re-runs the request on D (Dispatch.resumes)."""
    ids = prompt(40, 8)
    pair = Pair(llama)
    pair.out += pair.d.run([AwaitKV(request_id="a", epoch=1, n=1, reply_addr="gw", detok_addr="dt")])
    pair.out += pair.d.run([Dispatch(request_id="a", epoch=1, prompt_token_ids=ids, params=greedy(6),
                                     reply_addr="gw", detok_addr="dt", resumes=True)])
    [opened] = [e.msg for e in pair.out if isinstance(e.msg, StreamOpen)]
    assert opened.resumes and not pair.d.awaiting
    pair.drive()
    assert pair.tokens()[("a", 0)] == run_single(engine(llama), [("a", ids, greedy(6))])[("a", 0)]
    assert clean(pair.d)


def test_a_worker_that_cannot_hand_off_runs_the_request_whole(llama):
    core = WorkerCore(engine(llama), "m", 1)          # no sender: a mixed worker given a stale pairing
    ids = prompt(30, 9)
    out = core.run([Dispatch(request_id="a", epoch=1, prompt_token_ids=ids, params=greedy(4),
                             reply_addr="gw", detok_addr="dt", handoff_to=D_ADDR)])
    for _ in range(MAX_STEPS):
        if not core.has_work():
            break
        out += core.run([])
    got = [t for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs for t in s.token_ids]
    assert got == run_single(engine(llama), [("a", ids, greedy(4))])[("a", 0)] and clean(core)


def test_a_run_sent_back_while_the_old_run_s_blocks_are_read_waits_for_them_and_reports_apart(llama):
    """1 prefill + 1 decode worker, D dies mid-transfer: the scheduler aborts P's half ("moved") and
    moves the request to P, the one worker left, as run 2, while P's sender still reads run 1's
    blocks. Run 2 starts once they are released (never two engine requests under one id), goes on
    from the token streamed, and every report names its run: run 1's end is not run 2's."""
    ids, pair = prompt(30, 11), Pair(llama)
    out = pair.p.run([Dispatch(request_id="a", epoch=1, prompt_token_ids=ids, params=greedy(6), reply_addr="gw",
                               detok_addr="dt", handoff_to=D_ADDR, run=1)])
    for _ in range(MAX_STEPS):
        out += pair.p.run([])
        todo, _ = pair.p.take_handoffs()
        if todo:
            break
    assert todo == [("a", D_ADDR)]                   # its blocks are the sender's now
    first = [t for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs for t in s.token_ids]
    out = pair.p.run([Abort(request_id="a", reason="moved"),
                      Dispatch(request_id="a", epoch=1, prompt_token_ids=ids, params=greedy(6), reply_addr="gw",
                               detok_addr="dt", resumes=True, resume_output=[first], run=2)])
    assert not [e for e in out if isinstance(e.msg, (StreamOpen, StepOutput))]     # run 2 waits
    [ended] = [e.msg for e in out if isinstance(e.msg, WorkerStatus)]
    assert (ended.finished, ended.finished_runs) == (["a"], [1])
    beat = pair.p.status(with_active=True)
    assert (beat.active, beat.active_runs) == (["a"], [2])
    assert pair.p.take_stops() == ["a"]
    pair.p.handoff_done("a", False, "aborted", out)  # the sender let go: run 1's blocks are freed
    [opened] = [e.msg for e in out if isinstance(e.msg, StreamOpen)]
    assert opened.resumes and (opened.worker_id, opened.worker_epoch) == ("p", 1)
    for _ in range(MAX_STEPS):
        if not pair.p.has_work():
            break
        out += pair.p.run([])
    rest = [t for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs for t in s.token_ids]
    assert first + rest == run_single(engine(llama), [("a", ids, greedy(6))])[("a", 0)]
    reports = [(r, run) for e in out if isinstance(e.msg, WorkerStatus)
               for r, run in zip(e.msg.finished, e.msg.finished_runs)]
    assert reports == [("a", 1), ("a", 2)] and clean(pair.p)


def test_a_sample_stopped_while_its_hand_off_runs_stays_stopped_when_p_keeps_the_request(llama):
    """A stop string ends sample 0 at its first token while the sender reads the blocks (the Abort
    cannot reach the engine then); the hand-off fails and P decodes the request itself: sample 0
    must not come back to life and decode to max_tokens for nobody."""
    pair = Pair(llama)
    params = greedy(8, n=2)
    pair.out += pair.p.run([Dispatch(request_id="a", epoch=1, prompt_token_ids=prompt(30, 12), params=params,
                                     reply_addr="gw", detok_addr="dt", handoff_to=D_ADDR, run=1)])
    for _ in range(MAX_STEPS):
        pair.out += pair.p.run([])
        todo, _ = pair.p.take_handoffs()
        if todo:
            break
    assert todo == [("a", D_ADDR)]
    pair.out += pair.p.run([Abort(request_id="a", index=0, reason="stop")])
    pair.p.handoff_done("a", False, "the decode worker did not answer within the hand-off lease", pair.out)
    for _ in range(MAX_STEPS):
        if not pair.p.requests:
            break
        pair.out += pair.p.run([])
    got = pair.tokens()
    assert len(got[("a", 0)]) == 1 and len(got[("a", 1)]) == 8
    kept = [(r, run) for e in pair.out if isinstance(e.msg, WorkerStatus) for r, run in zip(e.msg.kept, e.msg.kept_runs)]
    assert kept == [("a", 1)] and pair.finished("p") == ["a"] and clean(pair.p)
