"""Tiny random models of every architecture the engine parity tests cover, with their Hugging
Face greedy references; helpers that run a request through a prefill engine (P) and a decode
engine (D) joined by the KV hand-off."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.connector import EngineKVConsumer, EngineKVProducer
from gpu_worker.kv_transfer.local import hand_off
from gpu_worker.kv_transfer.messages import Ack
from services.protocol.sampling import SamplingParams
# the engine tests' models and transformers references, shared rather than made twice
from tests.gpu_worker.engine.conftest import _one_torch_thread, arch_model, tiny_models  # noqa: F401  (fixtures)

MAX_STEPS = 5_000        # every drive loop below is bounded


@pytest.fixture
def llama(tiny_models) -> str:
    return tiny_models["llama"]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(steps: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, n=n)


def engine(model_dir: str, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 64)
    return Engine(EngineConfig(model=model_dir, device="cpu", **kw))


def collect(out: dict, deltas) -> None:
    for d in deltas:
        out.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)


def run_single(eng: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Every request on one engine, as a mixed worker serves it: {(rid, index): tokens}."""
    out: dict = {}
    for rid, ids, params in requests:
        eng.add_request(rid, ids, params)
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            break
        collect(out, eng.step())
    assert not eng.has_unfinished_requests()
    check_clean(eng)
    return out


class PD:
    """A prefill engine and a decode engine joined by the in-process hand-off."""

    def __init__(self, p: Engine, d: Engine) -> None:
        self.p, self.d = p, d
        self.producer, self.consumer = EngineKVProducer(p), EngineKVConsumer(d)
        self.answers: dict[str, object] = {}

    def run(self, requests: list[tuple[str, list[int], SamplingParams]], arrivals: dict | None = None) -> dict:
        """Requests go to P (export_kv), each hands off to D as its prefill ends; arrivals =
        {P step: [(rid, ids, params[, priority])]} arrive later. {(rid, index): tokens} across both engines."""
        out: dict = {}
        arrivals = dict(arrivals or {})
        for rid, ids, params in requests:
            self.p.add_request(rid, ids, params, export_kv=True)
        for step in range(MAX_STEPS):
            for rid, ids, params, *priority in arrivals.pop(step, []):
                self.p.add_request(rid, ids, params, priority=priority[0] if priority else 0, export_kv=True)
            if not (self.p.has_unfinished_requests() or self.d.has_unfinished_requests()
                    or self.p.exported or arrivals):
                break
            if self.p.has_unfinished_requests():
                collect(out, self.p.step())
            for rid in list(self.p.exported):
                self.answers[rid] = hand_off(self.producer, self.consumer, rid)
                assert isinstance(self.answers[rid], Ack), self.answers[rid]
            if self.d.has_unfinished_requests():
                collect(out, self.d.step())
        else:
            raise AssertionError("the P/D run did not end")
        check_clean(self.p)
        check_clean(self.d)
        return out


def check_clean(eng: Engine) -> None:
    """free + cached + used == total, ref counts match, and nothing is held any more."""
    eng.block_manager.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.exported and not eng.has_unfinished_requests()
