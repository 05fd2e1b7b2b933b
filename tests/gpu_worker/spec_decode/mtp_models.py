"""Models with an MTP layer for the mtp tests, and a recompute of an MTP draft from scratch.

    random   `make_model(..., mtp_layers=1)`: the MTP layer is random (acceptance near zero) but
             reads everything it reads in production (h_i, t_{i+1}, its own KV)
    oracle   gpu_worker/mtp_oracle.py (write_mtp_oracle): the target made a bigram model plus `branch` of its
             layers, the MTP layer its bigram. branch 0: every draft is the target's argmax;
             branch 0.05: drafts often right (context moves some argmaxes), so steps accept
             and reject
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from gpu_worker.batch_builder import build_forward_batch
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.spec_decode.mtp_runner import MtpRunner


def random_mtp(arch: str, out_dir: Path) -> str:
    from gpu_worker.make_model import make_model
    return str(make_model(out_dir, arch=arch, size="tiny", mtp_layers=1, progress=False))


def mtp_spec(k: int = 3, disable_by_batch_size: int = 64, backoff_max_steps: int | None = None) -> str:
    """None: the engine's default back-off; 0: every eligible step drafts, however often rejected."""
    spec = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": disable_by_batch_size}
    return json.dumps(spec if backoff_max_steps is None else {**spec, "backoff_max_steps": backoff_max_steps})


class Recompute:
    """The first draft after `tokens` computed from scratch: one target prefill of every token
    (its pre-norm states), one MTP prefill of positions 0..n-2 (inputs t_1..t_{n-1}) in a fresh
    cache, the argmax at the last row. What the proposer must reach through chunks, prefix hits
    and preemptions, if its KV and pending rows are kept right."""

    def __init__(self, model_dir: str, block_size: int = 16, max_len: int = 256) -> None:
        cfg = ModelConfig.from_dir(model_dir)
        self.block_size = block_size
        self.runner = ModelRunner(cfg, model_dir, device="cpu", dtype=torch.float32, attention_backend="torch")
        self.runner.allocate_kv_cache(max_len // block_size, block_size)
        self.mtp = MtpRunner(self.runner, model_dir)
        self.mtp.allocate_kv_cache(max_len // block_size, block_size)
        self.table = list(range(max_len // block_size))

    def first_draft(self, tokens: list[int]) -> int:
        n = len(tokens)
        whole = SimpleNamespace(token_ids=tokens, num_computed_tokens=0, block_table=self.table)
        out = self.runner.forward_with_prenorm(build_forward_batch([(whole, n)], self.block_size, "cpu"))
        shifted = SimpleNamespace(token_ids=tokens[1:], num_computed_tokens=0, block_table=self.table)
        g = self.mtp.forward(build_forward_batch([(shifted, n - 1)], self.block_size, "cpu"), out.prenorm[:n - 1])
        return int(self.mtp.logits(g[-1:]).argmax())


def spy_first_drafts(engine) -> list[tuple[list[int], int]]:
    """(tokens before the drafts, greedy first draft) of every propose() of the engine's mtp proposer."""
    proposer, seen = engine.speculator.proposer, []
    propose = proposer.propose

    def spy(drafts, request_at):
        before = {seq: seq.token_ids[:seq.num_tokens - len(d)] for seq, d in drafts.items()}
        out = propose(drafts, request_at)
        seen.extend((before[seq], d[0]) for seq, d in drafts.items() if seq.params.temperature == 0)
        return out

    proposer.propose = spy
    return seen
