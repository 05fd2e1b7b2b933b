"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for drafts drawn from a draft
model's distribution q, verified against the target's distribution p:

    for j = 0 .. k-1:   accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
                        on rejection: emit a draw of norm(max(0, p_j - q_j)) and stop
    all k accepted:     emit a draw of p_k (the bonus token)

Every emitted token is then distributed exactly as a draw of p at its position. p and q are the
PROCESSED distributions, each computed as the non-speculative sampler computes its draw's
(gpu_worker/sampler.py): allowed_token_ids and bad_words masks, min_tokens mask, logit_bias, penalties over the output up to that
position, temperature, min_p, top_k, top_p, softmax. A rejected d_j has p_j(d_j) < q_j(d_j), so
the residual gives it no mass: the residual draw never equals d_j, which is how the engine's
_accept finds the first rejected position (the longest prefix where draw == draft).

Randomness is counter-based like the sampler's: the acceptance uniform and the residual's Gumbel
noise of a row are pure functions of (request seed, sample index, output position), each with its
own salt, so a seeded request gives the same tokens again. Greedy requests never come here: the
draft proposes its argmax and the target's argmax decides (exact, see speculator.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gpu_worker.outputs import TokenLogprob
from gpu_worker.sampler import (_SAMPLING_EPS, SampleRequest, SampleResult, _add_logit_bias, _apply_filters,
                                _apply_penalties, _logprobs, _mask_stop_ids, _needs_penalty, _position,
                                _to_device, apply_token_masks, blocked_rows, draw_keys, gumbel_draw, hash_uniform,
                                needs_token_mask, to_device)

_MASK63 = (1 << 63) - 1
# Salts that make the draft's draw, the acceptance test and the residual draw of a position use
# noise independent of each other and of the target's own draw at that position.
_DRAFT_SALT = 0x2545F4914F6CDD1D
_ACCEPT_SALT = 0x5851F42D4C957F2D
_RESIDUAL_SALT = 0x14057B7EF767814F
REJECTED = -1      # a draw's token past the first rejection: never emitted, never equal to a draft
BLOCKED = -2       # a draw whose masks left no token (its SampleResult is blocked)


def draft_seed(seed: int) -> int:
    return (seed ^ _DRAFT_SALT) & _MASK63


def wants_rejection(params: Any) -> bool:
    """A request that samples randomly (greedy ones verify by argmax)."""
    return params.temperature >= _SAMPLING_EPS


def processed_probs(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """(R, V) float32: the distribution each request's draw samples from (rows `r.row` of logits);
    NaN on a row whose masks left no token (blocked_rows of masked_logits)."""
    return _probs(masked_logits(logits, requests), requests)


def masked_logits(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """(R, V) float32 copies of rows `r.row` of logits with the sampler's masks, bias and
    penalties applied (before temperature and the filters)."""
    dev = logits.device
    x = logits.index_select(0, to_device([r.row for r in requests], dev)).float()     # (R, V), a copy
    if any(needs_token_mask(r.params) for r in requests):
        apply_token_masks(x, requests)
    masked = [i for i, r in enumerate(requests)
              if r.params.min_tokens and r.stop_ids and _position(r) < r.params.min_tokens]
    if masked:
        _mask_stop_ids(x, [requests[i] for i in masked], masked)
    biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
    if biased:
        _add_logit_bias(x, [requests[i].params for i in biased], biased)
    penalized = [i for i, r in enumerate(requests) if _needs_penalty(r.params)]
    if penalized:
        _apply_penalties(x, [requests[i] for i in penalized], penalized)
    return x


def _probs(x: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """softmax of masked logits x (R, V) at each request's temperature, after its filters."""
    dev = x.device
    x = x / to_device([r.params.temperature for r in requests], dev, torch.float32)[:, None]
    x = _apply_filters(x, [r.params for r in requests])
    return torch.softmax(x, dim=-1)


def _keys(requests: list[SampleRequest], salt: int, dev: torch.device) -> torch.Tensor:
    keys = draw_keys([(r.seed ^ salt) & _MASK63 for r in requests], [r.sample_index for r in requests],
                     [_position(r) for r in requests])
    return _to_device(keys, dev)


class Verified(NamedTuple):
    """One sequence's draws, in the engine's verification layout: k + 1 results, the accepted
    drafts, then the emitted residual or bonus token, then REJECTED."""
    results: list[SampleResult]


def verify(logits: torch.Tensor, groups: list[tuple[list[int], list[SampleRequest], torch.Tensor]]
           ) -> list[Verified]:
    """groups: per sequence (drafts d_0..d_{k-1}, the k + 1 target draws' requests (rows of
    `logits`), q (k, V) of the drafts). One host sync for all of them."""
    dev = logits.device
    requests = [r for _, reqs, _ in groups for r in reqs]
    x = masked_logits(logits, requests)                                                # (N, V)
    blocked = blocked_rows(x)                                 # (N,) p is NaN there: never emitted
    p = _probs(x, requests)                                                            # (N, V)
    q = torch.zeros_like(p)
    drafted, tokens = [], []
    at = 0
    for draft, reqs, q_seq in groups:
        q[at:at + len(draft)] = q_seq.to(p.dtype)
        drafted += range(at, at + len(draft))
        tokens += draft + [0]                                 # the bonus row has no draft
        at += len(reqs)
    d = to_device(tokens, dev)                                                         # (N,)
    rows = torch.arange(len(requests), device=dev)
    u = hash_uniform(_keys(requests, _ACCEPT_SALT, dev), 1)[:, 0].float()              # (N,) in (0, 1)
    accept = u * q[rows, d] < p[rows, d]                      # u < p/q without dividing by q = 0
    residual = (p - q).clamp_(min=0.0)                                                 # (N, V)
    empty = residual.sum(-1) <= 0                             # p == q where it rejected: rounding
    residual = torch.where(empty[:, None], p, residual)
    drawn = gumbel_draw(torch.log(residual), _keys(requests, _RESIDUAL_SALT, dev))     # (N,)
    accept_l, drawn_l, blocked_l = accept.tolist(), drawn.tolist(), blocked.tolist()   # the host sync
    out_tokens: list[list[int]] = []
    at = 0
    for draft, reqs, _ in groups:
        seq_tokens = [REJECTED] * len(reqs)
        for j in range(len(reqs)):
            if blocked_l[at + j]:             # no token: the engine ends the sample here (Engine._blocked)
                seq_tokens[j] = BLOCKED
                break
            if j < len(draft) and accept_l[at + j]:
                seq_tokens[j] = draft[j]
                continue
            seq_tokens[j] = drawn_l[at + j]
            break
        out_tokens.append(seq_tokens)
        at += len(reqs)
    logprobs = _emitted_logprobs(logits, requests, [t for seq in out_tokens for t in seq])
    results, at = [], 0
    for seq_tokens in out_tokens:
        results.append(Verified([SampleResult(0, None, blocked=True) if t == BLOCKED
                                 else SampleResult(t, logprobs.get(at + j)) for j, t in enumerate(seq_tokens)]))
        at += len(seq_tokens)
    return results


def _emitted_logprobs(logits: torch.Tensor, requests: list[SampleRequest], tokens: list[int]
                      ) -> dict[int, TokenLogprob]:
    """Raw-logit logprobs of the emitted tokens, for the requests that asked (as the sampler)."""
    want = [i for i, (r, t) in enumerate(zip(requests, tokens)) if r.params.logprobs is not None and t >= 0]
    if not want:
        return {}
    raw = logits.index_select(0, to_device([r.row for r in requests], logits.device)).float()
    return _logprobs(raw, tokens, want, [requests[i].params.logprobs for i in want])
