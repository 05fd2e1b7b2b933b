"""Sampling on the GPU: penalties, temperature, top-k, top-p, min-p, then a seeded draw.

Everything stays on the device; the only host sync of a step is the caller's one `.tolist()`
of the sampled ids. The host decides from the (host-side) request parameters which stages run
(`SamplingTensors`' flags), so an all-greedy batch costs one argmax.

    logits  <- penalties (repetition on prompt+output tokens; presence/frequency on output tokens)
    greedy  =  argmax(logits)                                   rows with temperature < 1e-5
    x       =  logits / temperature
    x       <- -inf below min_p * max prob, then outside the top-k, then outside the top-p nucleus
    sampled =  argmax_v(x_v + Gumbel_v),  Gumbel_v = -log(-log(u_v)),  u = Philox(seed_row, v)

The Gumbel-max draw (a Triton kernel, one program per row, one pass over the vocabulary) samples
exactly from softmax(x) and needs no sort, no cumulative sum and no torch.multinomial; its noise
comes from a per-row seed, so seeded requests are reproducible whatever batch they share.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._utils import check_device

_MASK_SEED = (1 << 63) - 1
_GREEDY_EPS = 1e-5   # temperature below this is greedy (vLLM's threshold)


class SamplingTensors(NamedTuple):
    temperature: torch.Tensor    # (S,) fp32, < 1e-5 = greedy
    top_k: torch.Tensor          # (S,) int64, <= 0 or >= vocab: disabled
    top_p: torch.Tensor          # (S,) fp32, 1 = disabled
    min_p: torch.Tensor          # (S,) fp32, 0 = disabled
    seeds: torch.Tensor          # (S,) int64, this step's noise seed per row (fold in the step index)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_lists(cls, temperature, top_k, top_p, min_p, seeds, device) -> "SamplingTensors":
        """Build from per-row Python lists in one host->device copy per field (non-blocking)."""
        def put(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        seeds = [int(s) & _MASK_SEED for s in seeds]
        return cls(
            put(temperature, torch.float32), put(top_k, torch.int64), put(top_p, torch.float32),
            put(min_p, torch.float32), put(seeds, torch.int64),
            all_greedy=all(t < _GREEDY_EPS for t in temperature), any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p), any_min_p=any(p > 0.0 for p in min_p),
        )


# ----------------------------------------------------------------------------- penalties

def _token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """(S, L) ids padded with any value outside [0, vocab) -> (S, vocab) int32 occurrence counts."""
    S = ids.shape[0]
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab).long()
    counts = torch.zeros((S, vocab + 1), dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties_(
    logits: torch.Tensor,          # (S, V) fp32, modified in place
    prompt_ids: torch.Tensor,      # (S, Lp) int64, padded with -1
    output_ids: torch.Tensor,      # (S, Lo) int64, padded with -1
    repetition: torch.Tensor,      # (S,) fp32, 1 = off
    presence: torch.Tensor,        # (S,) fp32, 0 = off
    frequency: torch.Tensor,       # (S,) fp32, 0 = off
) -> torch.Tensor:
    """vLLM semantics: a token seen in the prompt or output has its logit divided by the
    repetition penalty if positive, multiplied if negative; output tokens then lose
    frequency * count + presence * (count > 0)."""
    S, V = logits.shape
    out_counts = _token_counts(output_ids, V)
    seen = (_token_counts(prompt_ids, V) > 0) | (out_counts > 0)
    rep = repetition[:, None].expand(S, V)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency[:, None] * out_counts + presence[:, None] * (out_counts > 0)
    return logits


def apply_penalties_ref(logits, prompt_ids, output_ids, repetition, presence, frequency) -> torch.Tensor:
    """Row-by-row reference for apply_penalties_ (returns a new tensor)."""
    out = logits.clone()
    for i in range(out.shape[0]):
        p = [t for t in prompt_ids[i].tolist() if t >= 0]
        o = [t for t in output_ids[i].tolist() if t >= 0]
        for t in set(p) | set(o):
            out[i, t] = out[i, t] / repetition[i] if out[i, t] > 0 else out[i, t] * repetition[i]
        for t in set(o):
            out[i, t] -= frequency[i] * o.count(t) + presence[i]
    return out


# ----------------------------------------------------------------------------- filters

def apply_filters(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """-inf below min_p * max prob, then outside the top-k, then outside the top-p nucleus
    (vLLM V1's order, and gpu_worker.sampler's). x: (S, V) temperature-scaled logits."""
    S, V = x.shape
    if st.any_min_p:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if st.any_top_k or st.any_top_p:
        srt, idx = x.sort(dim=-1)                                   # ascending, (S, V)
        if st.any_top_k:
            k = torch.where((st.top_k <= 0) | (st.top_k > V), V, st.top_k)
            kth = srt.gather(1, (V - k)[:, None])                    # k-th largest per row
            srt = srt.masked_fill(srt < kth, float("-inf"))
        if st.any_top_p:
            cum = srt.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1.0 - st.top_p)[:, None]                 # mass of strictly better >= top_p
            drop[:, -1] = False                                     # always keep the best token
            srt = srt.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, idx, srt)
    return x


def allowed_tokens_ref(x_row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Reference for one row: the token ids apply_filters keeps (ties at the boundaries kept)."""
    V = x_row.shape[0]
    order = sorted(range(V), key=lambda t: -float(x_row[t]))      # best first
    if min_p > 0.0:
        probs = torch.softmax(x_row.double(), 0)
        order = [t for t in order if float(probs[t]) >= min_p * float(probs.max())]
    if 0 < top_k < len(order):
        kth = float(x_row[order[top_k - 1]])
        order = [t for t in order if float(x_row[t]) >= kth]
    if top_p < 1.0:
        probs = torch.softmax(x_row[order].double(), 0).tolist()
        nucleus, before = [], 0.0
        for t, p in zip(order, probs):         # keep while the mass of better tokens < top_p
            if before >= top_p:
                break
            nucleus.append(t)
            before += p
        order = nucleus
    return set(order)


# ----------------------------------------------------------------------------- the draw

@triton.jit
def _gumbel_argmax_kernel(x_ptr, seeds_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, cols)                                   # Philox, [0, 1)
        u = tl.maximum(u, 1e-20)
        score = x - tl.log(-tl.log(u))
        score = tl.where(mask, score, float("-inf"))
        better = score > best_val
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, axis=0)
    winner = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """(S,) int64 draws from softmax(x) per row (x: (S, V) logits, -inf = excluded)."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be (S, V) with unit last stride, got {tuple(x.shape)}"
    S, V = x.shape
    assert seeds.shape == (S,) and seeds.dtype == torch.int64, "seeds must be (S,) int64"
    check_device(x, seeds)
    out = torch.empty((S,), dtype=torch.int64, device=x.device)
    if S:
        _gumbel_argmax_kernel[(S,)](x, seeds, out, V, x.stride(0), BLOCK=1024 if V >= 1024 else triton.next_power_of_2(V),
                                    num_warps=4)
    return out


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """(S,) int64 token ids: greedy rows take the argmax, the others a filtered, seeded draw.
    `logits` (S, V) should already carry penalties (apply_penalties_)."""
    assert logits.dim() == 2 and st.temperature.shape == (logits.shape[0],)
    greedy = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy
    random_rows = st.temperature >= _GREEDY_EPS
    x = logits.float() / torch.where(random_rows, st.temperature, 1.0)[:, None]
    x = apply_filters(x, st)
    drawn = gumbel_argmax(x.contiguous(), st.seeds)
    return torch.where(random_rows, drawn, greedy)


def sample_ref(logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
    """Reference: the same filters row by row (allowed_tokens_ref) and torch.multinomial."""
    out = []
    for i in range(logits.shape[0]):
        t = float(st.temperature[i])
        if t < _GREEDY_EPS:
            out.append(int(logits[i].argmax()))
            continue
        x = logits[i].double() / t
        keep = sorted(allowed_tokens_ref(x, int(st.top_k[i]), float(st.top_p[i]), float(st.min_p[i])))
        probs = torch.softmax(x[keep], 0)
        out.append(keep[int(torch.multinomial(probs, 1, generator=generator))])
    return torch.tensor(out, dtype=torch.int64)
