"""Engines for speculative-decoding tests on the fake runner (tests/gpu_worker/engine/engine_fakes.py):
its KV cache stores token ids, so a wrong slot, a rolled-back slot read again or a lost block
changes the tokens. Here any row of a chunk may ask for logits (verification), and the logits
can be made to depend on the last few tokens only, so greedy decoding falls into cycles that
n-gram drafts predict."""
from __future__ import annotations

import json

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.forward_batch import ForwardBatch
from tests.gpu_worker.engine.engine_fakes import FakeRunner, context_logits, fake_model_config

MAX_STEPS = 5_000     # every drive loop is bounded


class VerifyingFakeRunner(FakeRunner):
    """FakeRunner whose logits rows may be any row of a sequence's chunk; with `window`, the
    logits depend on the last `window` tokens of the context only."""

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.forward_calls += 1
        self.batches.append(batch)
        self.store[batch.slot_mapping] = batch.input_ids
        bs, starts = self.block_size, batch.query_start_loc.tolist()
        positions = batch.positions.tolist()
        rows = []
        for idx in batch.logits_indices.tolist():
            i = max(j for j in range(batch.num_seqs) if starts[j] <= idx < starts[j + 1])
            table = batch.block_tables[i].tolist()
            n = positions[idx] + 1                   # the context of this row: up to its token
            ctx = [int(self.store[table[p // bs] * bs + p % bs]) for p in range(n)]
            assert -1 not in ctx, "context reads a slot that was never written"
            rows.append(context_logits(ctx[-self.window:] if self.window else ctx, self.vocab_size))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)   # (S, V)


def ngram(k: int = 4, lo: int = 1, hi: int = 3, disable_by_batch_size: int = 64) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
                       "prompt_lookup_max": hi, "disable_by_batch_size": disable_by_batch_size})


def fake_engine(spec: str | None, window: int | None = 1, max_len: int = 512, **kwargs) -> Engine:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("model_id", "fake")
    config = EngineConfig(model="fake-model", speculative_config=spec, **kwargs)
    return Engine(config, runner=VerifyingFakeRunner(window), model_config=fake_model_config(max_len))


def prompt(n: int, seed: int) -> list[int]:
    """n random token ids in [3, 1000)."""
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def repetitive(n: int, period: int, seed: int) -> list[int]:
    """n tokens repeating a random pattern of `period` ids."""
    return (prompt(period, seed) * n)[:n]


def step_to_end(eng: Engine) -> dict[str, list[int]]:
    """Step eng until it has nothing left (at most MAX_STEPS): each request's tokens, in order."""
    tokens: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            break
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return tokens
