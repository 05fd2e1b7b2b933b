"""Sampling: logits (one row per sampling sequence) -> next token and its logprobs, batched on
the logits' device, with one host sync per step (the `.tolist()` of the chosen ids).

vLLM's order and semantics:
  1. logprobs are taken from the RAW model logits (log_softmax before any processing), and only
     for the rows that asked for them;
  1b. grammar (constrained decoding, gpu_worker/structured): tokens a row's grammar disallows
     get -inf, one op for the batch;
  1c. allowed_token_ids: every other token gets -inf; bad_words: a word's last token gets -inf
     when the output ends in its other tokens (the host matches them: output ids are there);
  2. min_tokens: EOS and stop_token_ids are masked until min_tokens outputs exist;
  2b. logit_bias: each listed token's bias is added to its logit (a -inf mask stays -inf);
  3. penalties: repetition over prompt + output (positive logits divided, negative multiplied),
     presence and frequency over the output only (subtracted);
  4. greedy (temperature < 1e-5) -> argmax; otherwise temperature, then min_p, top_k, top_p,
     then a Gumbel-max draw: argmax_v(x_v + G_v), G = -log(-log(u)), which samples softmax(x).

Each stage runs once for the whole batch, only when some row needs it (decided on the host from
the requests' parameters): an all-greedy batch without penalties costs one argmax. Logits may
arrive in the model's dtype (an eager step's bf16 head, ModelRunner.forward): the stages that
compute on them cast their rows to float32; the greedy argmax reads them as they are.

Reproducibility: the noise of a draw is a pure function of (request seed, sample index, output
position, vocab id). The host mixes the first three into a 63-bit row key (splitmix64, numpy);
the device turns (row key, vocab id) into u: Philox in gpu_worker.kernels.sampling on CUDA, a
splitmix64 hash in int64 torch ops elsewhere. No torch.Generator, no per-row loop; the same
request gives the same tokens alone, in any batch, and after preemption + recompute (the
position of a token never changes).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from gpu_worker.outputs import TokenLogprob
from gpu_worker.structured.bitmask import GrammarMask, apply_grammar_mask
from services.protocol.sampling import SamplingParams

_SAMPLING_EPS = 1e-5
_MASK63 = (1 << 63) - 1


class SampleRequest(NamedTuple):
    """One draw: which logits row, with which parameters, for which sequence state."""
    row: int                    # row of the logits tensor
    params: SamplingParams
    seed: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far; may be () when neither penalties nor
                                 # min_tokens need them and `position` is given
    stop_ids: tuple[int, ...]    # EOS (unless ignore_eos) + stop_token_ids, masked under min_tokens
    position: int = -1           # output position of this draw; -1: len(output_token_ids)


class SampleResult(NamedTuple):
    token_id: int
    logprob: TokenLogprob | None  # only when params.logprobs is not None
    blocked: bool = False         # the masks (grammar, allowed_token_ids, bad_words, min_tokens)
                                  # left no token: token_id is a placeholder, never to be emitted


def _position(r: SampleRequest) -> int:
    return r.position if r.position >= 0 else len(r.output_token_ids)


def blocked_rows(x: torch.Tensor) -> torch.Tensor:
    """(R,) bool: the rows of masked logits x (R, V) where every token is -inf. Their draw is
    meaningless (argmax of -inf, or of the NaN the filters make of them): the engine must not
    emit it (Engine._blocked)."""
    return x.amax(dim=-1) == float("-inf")


def needs_token_mask(p: SamplingParams) -> bool:
    return p.allowed_token_ids is not None or bool(p.bad_words_token_ids)


def needs_output_for_bad_words(p: SamplingParams) -> bool:
    """A bad word of several tokens is matched against the output on the host."""
    return any(len(w) > 1 for w in p.bad_words_token_ids)


def banned_words(output: list[int] | tuple[int, ...], words: list[list[int]]) -> list[int]:
    """vLLM's bad words: the last token of each word whose other tokens end the output."""
    banned = []
    for word in words:
        before = len(word) - 1
        if before == 0 or (before <= len(output) and list(output[len(output) - before:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def _needs_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# ---- counter-based noise ---------------------------------------------------------------------
def _splitmix64_np(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (numpy wraps on overflow)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_keys(seeds: list[int], indices: list[int], positions: list[int]) -> np.ndarray:
    """(R,) int64 row keys in [0, 2**63): a stable mix of (seed, sample index, position)."""
    with np.errstate(over="ignore"):
        z = _splitmix64_np(np.array(seeds, dtype=np.uint64))
        z = _splitmix64_np(z ^ np.array(indices, dtype=np.uint64))
        z = _splitmix64_np(z ^ np.array(positions, dtype=np.uint64))
    return (z & np.uint64(_MASK63)).astype(np.int64)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _C1, _C2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def hash_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R,) int64 keys -> (R, V) float64 uniforms in (0, 1): splitmix64(key + (v+1) * golden),
    in wrapping int64 torch ops (any device)."""
    cols = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)     # (V,)
    z = keys[:, None] + cols[None, :] * _GOLDEN                                   # (R, V)
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    z = z ^ _srl(z, 31)
    return (_srl(z, 11).double() + 0.5) * (2.0 ** -53)


def gumbel_draw(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(R,) int64 draws from softmax(x) per row; x (R, V) with -inf for excluded tokens."""
    if x.is_cuda:
        try:
            from gpu_worker.kernels.sampling import gumbel_argmax   # Philox, one pass per row
        except ImportError:
            pass
        else:
            return gumbel_argmax(x.float().contiguous(), keys)
    g = -torch.log(-torch.log(hash_uniform(keys, x.shape[1])))                  # (R, V) float64
    return (x.double() + g).argmax(dim=-1)


# ---- the sampler -----------------------------------------------------------------------------
class PendingSample:
    """Tokens chosen on the device and not yet read back: `results()` is the step's host sync.
    `tokens` (R,) int64 on the device can feed the next step's inputs before that.

    `raw` (R, V) holds the unprocessed logits only when some request wants logprobs (None
    otherwise: a step's (256, 128k) fp32 logits need not outlive the draw).

    `blocked` (R,) bool marks the rows whose masks left no token (None when no row was masked).
    What is read back is `tokens` with -1 on those rows (one copy, one sync); `tokens` itself
    keeps a valid id there, as it may feed the next step's inputs on the device."""

    def __init__(self, tokens: torch.Tensor, raw: torch.Tensor | None, requests: list[SampleRequest],
                 blocked: torch.Tensor | None = None):
        self.tokens, self.raw, self.requests = tokens, raw, requests
        self._readback = tokens if blocked is None else torch.where(blocked, -1, tokens)   # (R,)
        self._host: torch.Tensor | None = None
        self._ready = None

    def stage(self) -> "PendingSample":
        """CUDA: copy the tokens to pinned host memory now, behind the draw, and mark the copy's
        end with an event that `results()` waits for. A plain `.tolist()` later would be queued
        behind everything launched since (async_scheduling launches step N+1 before reading
        step N), so it would wait for step N+1 too and nothing would overlap. The copy runs on a
        side stream: on the compute stream it would sit between step N's draw and step N+1."""
        readback = self._readback
        if readback.is_cuda and readback.numel():
            self._host = torch.empty(readback.shape, dtype=readback.dtype, pin_memory=True)
            stream = _readback_stream(readback.device)
            stream.wait_stream(torch.cuda.current_stream(readback.device))   # behind the draw
            with torch.cuda.stream(stream):
                self._host.copy_(readback, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record(stream)
            readback.record_stream(stream)           # not reused before the copy has read it
        return self

    def results(self) -> list[SampleResult]:
        if self._ready is not None:
            self._ready.synchronize()                                           # the host sync
            tokens: list[int] = self._host.tolist()
        else:
            tokens = self._readback.tolist()
        params = [r.params for r in self.requests]
        if self._readback is self.tokens:       # no row was masked: none is blocked (the common step)
            want = [i for i, p in enumerate(params) if p.logprobs is not None]
            logprobs = _logprobs(self.raw, tokens, want, [params[i].logprobs for i in want]) if want else {}
            return [SampleResult(tok, logprobs.get(i)) for i, tok in enumerate(tokens)]
        blocked = [tok < 0 for tok in tokens]
        tokens = [max(tok, 0) for tok in tokens]
        want = [i for i, p in enumerate(params) if p.logprobs is not None and not blocked[i]]
        logprobs = _logprobs(self.raw, tokens, want, [params[i].logprobs for i in want]) if want else {}
        return [SampleResult(tok, logprobs.get(i), blocked[i]) for i, tok in enumerate(tokens)]


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest],
                 grammar: GrammarMask | None = None) -> list[SampleResult]:
        """Draw and read back at once (nothing else is queued behind the draw: no staging).
        grammar: the constrained rows' token bitmask (rows index `requests`)."""
        return self._choose(logits, requests, grammar).results() if requests else []

    def launch(self, logits: torch.Tensor, requests: list[SampleRequest],
               grammar: GrammarMask | None = None) -> PendingSample:
        """Queue the whole draw on the logits' device, and the tokens' copy to the host behind
        it; nothing waits for the GPU here."""
        return self._choose(logits, requests, grammar).stage()

    def _choose(self, logits: torch.Tensor, requests: list[SampleRequest],
                grammar: GrammarMask | None = None) -> PendingSample:
        dev = logits.device
        rows = [r.row for r in requests]
        # (R, V) in the logits' dtype: a bf16 head's logits (ModelRunner.forward) are cast to
        # float32 only where maths runs on them; a greedy row's argmax over the bf16 values is
        # that of their (exact) float32 copies, ties included
        raw = logits if rows == list(range(logits.shape[0])) else \
            logits.index_select(0, to_device(rows, dev))
        params = [r.params for r in requests]
        if not requests:
            return PendingSample(torch.empty(0, dtype=torch.int64, device=dev), None, requests)

        x, blocked = raw, None
        masked = [i for i, r in enumerate(requests)
                  if r.params.min_tokens and r.stop_ids and _position(r) < r.params.min_tokens]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalized = [i for i, p in enumerate(params) if _needs_penalty(p)]
        token_masked = any(needs_token_mask(p) for p in params)
        if masked or biased or penalized or token_masked or grammar is not None:
            x = raw.to(torch.float32, copy=True)
            if grammar is not None:         # raw (logprobs) stays the model's own distribution
                apply_grammar_mask(x, grammar)
            if token_masked:
                apply_token_masks(x, requests)
            if masked:
                _mask_stop_ids(x, [requests[i] for i in masked], masked)
            if masked or token_masked or grammar is not None:   # only masks make a row all -inf
                blocked = blocked_rows(x)
            if biased:                      # before the penalties, as vLLM and OpenAI apply it
                _add_logit_bias(x, [params[i] for i in biased], biased)
            if penalized:
                _apply_penalties(x, [requests[i] for i in penalized], penalized)

        random_rows = [i for i, p in enumerate(params) if p.temperature >= _SAMPLING_EPS]
        if not random_rows:
            tokens_t = x.argmax(dim=-1)                                         # (R,)
        elif len(random_rows) == len(requests):
            tokens_t = self._draw(x, requests)
        else:
            tokens_t = x.argmax(dim=-1)
            idx = to_device(random_rows, dev)
            drawn = self._draw(x.index_select(0, idx), [requests[i] for i in random_rows])
            tokens_t = tokens_t.index_copy(0, idx, drawn)
        if not any(p.logprobs is not None for p in params):
            raw = None
        elif raw.data_ptr() == logits.data_ptr():
            # logits may be a graph's output, overwritten by the next step
            raw = raw.to(torch.float32, copy=True)
        else:
            raw = raw.float()
        return PendingSample(tokens_t, raw, requests, blocked)

    @staticmethod
    def _draw(x: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """(R,) draws for rows that all sample randomly; x (R, V) processed logits."""
        dev = x.device
        x = x.float()
        temps = [r.params.temperature for r in requests]
        if all(t == temps[0] for t in temps):
            x = x if temps[0] == 1.0 else x / temps[0]     # (R, V); no copy at temperature 1
        else:
            x = x / to_device(temps, dev, torch.float32)[:, None]
        x = _apply_filters(x, [r.params for r in requests])
        keys = draw_keys([r.seed for r in requests], [r.sample_index for r in requests],
                         [_position(r) for r in requests])
        return gumbel_draw(x, _to_device(keys, dev))


_READBACK_STREAMS: dict[int, torch.cuda.Stream] = {}


def _readback_stream(dev: torch.device) -> torch.cuda.Stream:
    """The side stream that copies a device's sampled tokens to the host, made once."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _READBACK_STREAMS:
        _READBACK_STREAMS[index] = torch.cuda.Stream(index)
    return _READBACK_STREAMS[index]


def to_device(values: list, dev: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list on `dev` without a host sync: pinned + non-blocking on CUDA (torch.tensor(...,
    device=cuda) would wait for the whole stream, i.e. for the step's forward)."""
    t = torch.tensor(values, dtype=dtype)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _to_device(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _mask_stop_ids(x: torch.Tensor, reqs: list[SampleRequest], rows: list[int]) -> None:
    """-inf on the stop ids of rows still under min_tokens (one indexed write)."""
    ri = [row for row, r in zip(rows, reqs) for _ in r.stop_ids]
    ci = [t for r in reqs for t in r.stop_ids]
    x[to_device(ri, x.device), to_device(ci, x.device)] = float("-inf")


def apply_token_masks(x: torch.Tensor, reqs: list[SampleRequest]) -> None:
    """allowed_token_ids and bad_words of rows 0..len(reqs)-1 of x (R, V): -inf on what they ban,
    a few batched writes from host-built indices (no read back)."""
    allowed = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids is not None]
    if allowed:
        banned = torch.zeros(x.shape, dtype=torch.bool, device=x.device)                 # (R, V)
        banned[to_device(allowed, x.device)] = True
        ri = [i for i in allowed for _ in reqs[i].params.allowed_token_ids]
        ci = [t for i in allowed for t in reqs[i].params.allowed_token_ids]
        banned[to_device(ri, x.device), to_device(ci, x.device)] = False
        x.masked_fill_(banned, float("-inf"))
    ri, ci = [], []
    for i, r in enumerate(reqs):
        if r.params.bad_words_token_ids:
            words = banned_words(r.output_token_ids, r.params.bad_words_token_ids)
            ri += [i] * len(words)
            ci += words
    if ci:
        x[to_device(ri, x.device), to_device(ci, x.device)] = float("-inf")


def _add_logit_bias(x: torch.Tensor, ps: list[SamplingParams], rows: list[int]) -> None:
    """x[row, token] += bias for every (token, bias) of each row's logit_bias (one indexed add)."""
    ri = [row for row, p in zip(rows, ps) for _ in p.logit_bias]
    ci = [t for p in ps for t in p.logit_bias]
    bias = [b for p in ps for b in p.logit_bias.values()]
    x.index_put_((to_device(ri, x.device), to_device(ci, x.device)), to_device(bias, x.device, x.dtype),
                 accumulate=True)


def _padded(lists: list, pad: int) -> np.ndarray:
    """Ragged int lists -> (N, max_len) int64, padded with `pad`."""
    width = max(1, max(len(v) for v in lists))
    out = np.full((len(lists), width), pad, dtype=np.int64)
    for i, v in enumerate(lists):
        out[i, :len(v)] = v
    return out


def _apply_penalties(x: torch.Tensor, reqs: list[SampleRequest], rows: list[int]) -> None:
    """vLLM penalties on `rows` of x, all rows in one pass (counts by scatter_add)."""
    dev, vocab = x.device, x.shape[1]
    n = len(rows)
    idx = to_device(rows, dev)
    out_ids = _to_device(_padded([r.output_token_ids for r in reqs], vocab), dev)     # (n, Lo)
    counts = torch.zeros((n, vocab + 1), dtype=x.dtype, device=dev)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=x.dtype))
    counts = counts[:, :vocab]                                                        # (n, V)
    ps = [r.params for r in reqs]
    sub = x.index_select(0, idx)                                                       # (n, V)
    rep_rows = [k for k, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if rep_rows:
        with_rep = set(rep_rows)
        prompt_ids = _to_device(_padded([reqs[k].prompt_token_ids if k in with_rep else []
                                         for k in range(n)], vocab), dev)              # (n, Lp)
        seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=dev)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        rep = to_device([p.repetition_penalty for p in ps], dev, x.dtype)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device([p.frequency_penalty for p in ps], dev, x.dtype)[:, None]
    pres = to_device([p.presence_penalty for p in ps], dev, x.dtype)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(x.dtype)
    x.index_copy_(0, idx, sub)


def _apply_filters(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """min_p, then top_k, then top_p (vLLM's order), batched; x (R, V) temperature-scaled."""
    R, V = x.shape
    dev = x.device
    if any(p.min_p > 0.0 for p in ps):
        min_p = to_device([p.min_p for p in ps], dev, x.dtype)[:, None]
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    any_k = any(0 < p.top_k < V for p in ps)
    any_p = any(p.top_p < 1.0 for p in ps)
    if not (any_k or any_p):
        return x
    srt, order = x.sort(dim=-1, descending=True)                                   # (R, V)
    if any_k:
        k = to_device([p.top_k if 0 < p.top_k < V else V for p in ps], dev)
        kth = srt.gather(1, (k - 1)[:, None])                                       # (R, 1)
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if any_p:
        top_p = to_device([p.top_p for p in ps], dev, x.dtype)[:, None]
        probs = torch.softmax(srt, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs       # mass of strictly better tokens
        srt = srt.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, srt)


def _logprobs(raw: torch.Tensor, tokens: list[int], rows: list[int], ks: list[int]
              ) -> dict[int, TokenLogprob]:
    """Raw-logit logprobs of the chosen tokens (+ top-k) for `rows` only; one more host copy."""
    dev = raw.device
    idx = torch.tensor(rows, device=dev)
    lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)                        # (n, V)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=dev)[:, None])[:, 0]
    kmax = max(ks)
    if kmax > 0:
        values, ids = torch.topk(lp, kmax, dim=-1)                                  # (n, kmax)
        chosen_l, values_l, ids_l = chosen.tolist(), values.tolist(), ids.tolist()
    else:
        chosen_l, values_l, ids_l = chosen.tolist(), [[]] * len(rows), [[]] * len(rows)
    return {i: TokenLogprob(tokens[i], chosen_l[j], tuple(zip(ids_l[j][:k], values_l[j][:k])))
            for j, (i, k) in enumerate(zip(rows, ks))}
