"""WorkerCore over a real engine: a grammar the worker cannot compile is a 400 to the gateway
naming the field, its stream is closed, and a request beside it is served."""
from __future__ import annotations

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.service.core import WorkerCore
from services.protocol.messages import Abort, Dispatch, RequestFailed, StepOutput
from services.protocol.sampling import SamplingParams, StructuredOutput

MAX_RUNS = 20_000        # a run with nothing but held draws waits up to 5 ms for a compile


def dispatch(rid: str, params: SamplingParams) -> Dispatch:
    return Dispatch(request_id=rid, epoch=1, prompt_token_ids=[5, 6, 7], params=params, reply_addr="gw",
                    detok_addr="d1")


def test_a_grammar_the_worker_cannot_compile_is_a_400_naming_the_field(tiny_llama):
    engine = Engine(EngineConfig(model=tiny_llama, device="cpu"))
    core = WorkerCore(engine, "w", 1)
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput(grammar="root ::= ("))
    good = SamplingParams(max_tokens=4, temperature=0.0, structured=StructuredOutput(regex="[a-z]{2}"))
    out = core.run([dispatch("bad", bad), dispatch("good", good)])
    for _ in range(MAX_RUNS):
        if not core.has_work():
            break
        out += core.run([])
    failed = [e for e in out if isinstance(e.msg, RequestFailed)]
    assert [(e.dest, e.msg.request_id, e.msg.status, e.msg.code) for e in failed] == [
        ("gw", "bad", 400, "invalid_request")]
    assert failed[0].msg.message.startswith("invalid grammar: ")
    assert any(isinstance(e.msg, Abort) and e.dest == "d1" and e.msg.request_id == "bad" for e in out)
    seqs = [s for e in out if isinstance(e.msg, StepOutput) for s in e.msg.seqs]
    assert {s.request_id for s in seqs} == {"good"} and seqs[-1].finish_reason == "stop"
    stats = engine.stats()
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
    engine.close()
