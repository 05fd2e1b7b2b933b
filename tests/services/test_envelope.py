"""One Envelope for every pure core: the scheduler's, the worker's and the detokenizer's outputs
are the same (dest, msg) type, and messages for the scheduler carry the one SCHEDULER name."""
from __future__ import annotations

from gpu_worker.service.core import WorkerCore
from gpu_worker.service.null_engine import NullEngine
from scheduler_svc.core import SchedulerCore
from scheduler_svc.routing import WorkerView
from services.envelope import SCHEDULER, Envelope
from services.protocol.messages import Abort, Dispatch, SeqTokens, StepOutput, StreamOpen, Submit, WorkerStatus
from services.protocol.sampling import SamplingParams
from services.text.streams import DetokCore


class OneCharTokenizer:
    vocab_size = 26

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def test_every_core_answers_with_the_one_envelope():
    sched = SchedulerCore()
    sched.set_workers([WorkerView(id="w", epoch=1, addr="tcp://w:1")])
    out = sched.submit(Submit(request_id="r", tenant="t", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2),
                              reply_addr="tcp://gw:1", detok_addr="tcp://dt:1"))
    assert [type(e) for e in out] == [Envelope, Envelope] and isinstance(out[0].msg, Dispatch)

    worker = WorkerCore(NullEngine(vocab_size=26, num_blocks=8), "w", 1)
    out = worker.run([out[0].msg])
    assert [type(e.msg) for e in out] == [StreamOpen, StepOutput] and all(type(e) is Envelope for e in out)

    detok = DetokCore(OneCharTokenizer())
    detok.open(StreamOpen(request_id="r", params=SamplingParams(stop=["bc"]), reply_addr="tcp://gw:1",
                          num_prompt_tokens=2))
    out = detok.step(StepOutput(worker_id="w", epoch=1, step=0, seqs=[SeqTokens("r", 0, [0, 1, 2])]))
    assert all(type(e) is Envelope for e in out)
    assert [e.msg for e in out if e.dest == SCHEDULER] == [Abort(request_id="r", index=0, reason="stop")]
