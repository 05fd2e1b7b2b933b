"""A fake model runner for engine tests: its "KV cache" stores the token id of each slot, and
its logits are a pseudo-random function of the whole context read back through the block
table. Any wrong slot, block table, prefix hit or copy-on-write changes the tokens."""
from __future__ import annotations

import hashlib
import struct
from types import SimpleNamespace

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.forward_batch import ForwardBatch

VOCAB = 50
EOS = 1


def context_logits(context: list[int], vocab: int = VOCAB) -> torch.Tensor:
    digest = hashlib.blake2b(struct.pack(f"<{len(context)}I", *context), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.randn(vocab, generator=gen) * 3.0           # (V,)


def reference_greedy(prompt: list[int], num_tokens: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(num_tokens):
        ctx.append(int(context_logits(ctx).argmax()))
    return ctx[len(prompt):]


class FakeRunner:
    def __init__(self, vocab: int = VOCAB) -> None:
        self.vocab_size = vocab
        self.num_layers = 1
        self.forward_calls = 0
        self.copies: list[tuple[int, int]] = []
        self.batches: list[ForwardBatch] = []

    def block_size_bytes(self, block_size: int) -> int:
        return block_size * 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.store = torch.full((num_blocks * block_size,), -1, dtype=torch.long)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        bs = self.block_size
        for s, d in zip(src, dst):
            self.copies.append((s, d))
            self.store[d * bs:(d + 1) * bs] = self.store[s * bs:(s + 1) * bs]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.forward_calls += 1
        self.batches.append(batch)
        self.store[batch.slot_mapping] = batch.input_ids
        bs, starts = self.block_size, batch.query_start_loc.tolist()
        rows = []
        for idx in batch.logits_indices.tolist():
            i = max(j for j in range(batch.num_seqs) if starts[j] <= idx)
            assert idx == starts[i + 1] - 1, "logits must come from a sequence's last new token"
            table = batch.block_tables[i].tolist()
            n = int(batch.context_lens[i])
            ctx = [int(self.store[table[p // bs] * bs + p % bs]) for p in range(n)]
            assert -1 not in ctx, "context reads a slot that was never written"
            rows.append(context_logits(ctx, self.vocab_size))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)   # (S, V)


def fake_model_config(max_len: int = 512) -> SimpleNamespace:
    return SimpleNamespace(max_position_embeddings=max_len, eos_token_ids=(EOS,), torch_dtype="float32")


def make_engine(max_len: int = 512, **kwargs) -> Engine:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("model_id", "fake")
    config = EngineConfig(model="fake-model", **kwargs)
    return Engine(config, runner=FakeRunner(), model_config=fake_model_config(max_len))


def run_all(engine: Engine, out: dict | None = None, max_steps: int = 10_000) -> dict[tuple[str, int], dict]:
    """Step until idle; returns {(request_id, index): {"tokens", "logprobs", "finish", "cached"}}."""
    out = {} if out is None else out
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        collect(engine.step(), out)
    assert not engine.has_unfinished_requests()
    return out


def collect(deltas, out: dict) -> None:
    for d in deltas:
        rec = out.setdefault((d.request_id, d.index), {"tokens": [], "logprobs": [], "finish": None})
        assert rec["finish"] is None, "delta after finish"
        rec["tokens"] += d.new_token_ids
        rec["logprobs"] += d.new_logprobs or []
        rec["finish"] = d.finish_reason
        rec["cached"] = d.num_cached_tokens


def assert_clean(engine: Engine) -> None:
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0, "blocks leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
