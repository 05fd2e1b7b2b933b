"""Sampling: logits (one row per sampling sequence) -> next token and its logprobs, in torch,
on the logits' device.

vLLM's order and semantics:
  1. logprobs are taken from the RAW model logits (log_softmax before any processing);
  2. min_tokens: EOS and stop_token_ids are masked until min_tokens outputs exist;
  3. penalties: repetition over prompt + output (positive logits divided, negative multiplied),
     presence and frequency over the output only (subtracted);
  4. greedy (temperature < 1e-5) -> argmax; otherwise temperature, then min_p, top_k, top_p,
     then a draw.

Reproducibility: each draw uses its own torch.Generator seeded from (request seed, sample
index, output position). The same request gives the same tokens alone, in any batch, and after
preemption + recompute (the position of a token never changes).
"""
from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import torch

from gpu_worker.outputs import TokenLogprob
from services.protocol.sampling import SamplingParams

_SAMPLING_EPS = 1e-5


class SampleRequest(NamedTuple):
    """One draw: which logits row, with which parameters, for which sequence state."""
    row: int                    # row of the logits tensor
    params: SamplingParams
    seed: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (the position of this draw is their count)
    stop_ids: tuple[int, ...]    # EOS (unless ignore_eos) + stop_token_ids, masked under min_tokens


class SampleResult(NamedTuple):
    token_id: int
    logprob: TokenLogprob | None  # only when params.logprobs is not None


def draw_seed(seed: int, sample_index: int, position: int) -> int:
    """Generator seed of one draw: a stable mix of the three integers (63 bits)."""
    digest = hashlib.blake2b(struct.pack("<QQQ", seed, sample_index, position), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampleResult]:
        if not requests:
            return []
        rows = torch.tensor([r.row for r in requests], device=logits.device)
        raw = logits.index_select(0, rows).float()                        # (R, V)
        want_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else None  # (R, V)

        x = raw.clone()
        self._mask_min_tokens(x, requests)
        self._apply_penalties(x, requests)
        greedy_ids = x.argmax(dim=-1)                                      # (R,)
        picks = [greedy_ids[i] if r.params.temperature < _SAMPLING_EPS else self._draw(x[i], r)
                 for i, r in enumerate(requests)]
        tokens: list[int] = torch.stack(picks).tolist()                    # one device sync

        results = []
        for i, (req, tok) in enumerate(zip(requests, tokens)):
            lp = None
            if raw_logprobs is not None and req.params.logprobs is not None:
                lp = self._logprob(raw_logprobs[i], tok, req.params.logprobs)
            results.append(SampleResult(tok, lp))
        return results

    # ---- processing ----------------------------------------------------------------------
    @staticmethod
    def _mask_min_tokens(x: torch.Tensor, requests: list[SampleRequest]) -> None:
        for i, r in enumerate(requests):
            if len(r.output_token_ids) < r.params.min_tokens and r.stop_ids:
                x[i, list(r.stop_ids)] = float("-inf")

    @staticmethod
    def _apply_penalties(x: torch.Tensor, requests: list[SampleRequest]) -> None:
        vocab = x.shape[1]
        for i, r in enumerate(requests):
            p = r.params
            if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
                continue
            out_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=x.device)
            counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(x.dtype)   # (V,)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=x.device)] = True
                row = x[i]
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                x[i] = torch.where(seen, penalized, row)
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)

    @staticmethod
    def _draw(row: torch.Tensor, r: SampleRequest) -> torch.Tensor:
        """A random token (0-dim tensor) from one row of processed logits (V,)."""
        p = r.params
        row = row / p.temperature
        if p.min_p > 0.0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            row = _top_p(row, p.top_p)
        probs = torch.softmax(row, dim=-1)
        gen = torch.Generator(device=row.device)
        gen.manual_seed(draw_seed(r.seed, r.sample_index, len(r.output_token_ids)))
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / noise).argmax()  # exponential race == a draw from probs

    @staticmethod
    def _logprob(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            values, ids = torch.topk(logprobs, k)
            top = tuple(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token_id, float(logprobs[token_id]), top)


def _top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    sorted_logits, order = torch.sort(row, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs          # mass of strictly better tokens
    drop_sorted = mass_before >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
    return row.masked_fill(drop, float("-inf"))
