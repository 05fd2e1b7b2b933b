"""Choosing a worker for a request: a score per (worker, request, hint), lowest wins.

    least_loaded   requests in flight / max_num_seqs (+ 0.1 x KV usage)
    round_robin    fewest dispatches so far (ties: worker id); ignores load and cache (a baseline)
    CacheAware     load and KV pressure against the prefix the worker already holds:

        score = - hit_weight       * hit              hit: fraction of the prompt's blocks the worker
                                                           need not prefill: GPU blocks count fully,
                                                           CPU/disk ones at cpu_credit/disk_credit,
                                                           ones in a shared tier the worker reads at
                                                           shared_credit (a reload is cheaper than a
                                                           recompute, not free); the block of the last prompt token
                                                           never counts (the engine recomputes it)
                + queue_weight     * waiting / max_num_seqs
                + running_weight   * running / max_num_seqs
                + kv_weight        * kv_used_after    KV in use after the prompt's new blocks
                + overflow_penalty                    when those blocks do not fit in free + evictable KV

Every term is a fraction, so the weights read as exchange rates: with the defaults a whole-prompt
hit is worth a queue of one max_num_seqs batch. An overloaded worker holding the prefix loses to
an idle one; between equal loads the longer (or faster-tier) prefix wins.

Prefill/decode pools (route()): the request goes to the best whole-request worker by the scorer
(mixed and decode workers; prefill workers too when no decode worker exists). A decode worker D so
chosen runs it alone when fewer than `min_prefill_tokens` of its prompt are not already cached on
D (a short prompt, or a conversation whose history D holds: moving the KV would cost more than
computing it there); otherwise the best prefill worker whose KV layout equals D's prefills it and
hands the KV to D. Workers whose layouts or KV transports differ are never paired.

Capabilities (`able`): a request that asks for prompt logprobs goes only to workers whose
engines make them (their records' `prompt_logprobs`: not tensor-parallel or mtp-speculation ones);
with none in the fleet it is refused (400, naming prompt_logprobs).

Conversations (`conversation_worker`): a request whose Submit names a conversation goes to the worker
that ran its last turn (the history's KV is there, in some tier), unless that worker is gone,
draining, full or loaded past `max_load` x max_num_seqs; then the scorer picks as for any request.
With prefill/decode pools the conversation keeps its decode worker; whether a prefill worker
computes the new part first is decided as above.

`hint` is what the shell attached at submission (`core.submit(msg, hint=...)`): the prefix-cache
index's MatchResponse for this prompt, or None (no index, or it did not answer: no prefix credit).
Load counts what this scheduler dispatched and what the worker last reported, whichever is larger,
so a burst does not all land on one worker before its next status report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from services.protocol.kv_events import MatchResponse
from services.protocol.messages import Submit


@dataclass
class WorkerView:
    """What the scheduler knows about one live worker."""

    id: str
    epoch: int
    addr: str                         # ZMQ dispatch address
    role: str = "mixed"
    max_num_seqs: int = 128
    max_model_len: int = 0
    draining: bool = False
    model_id: str = ""                # what the engine mixes into block hashes (prefix matches)
    block_size: int = 16              # tokens per KV block (the engine's, from the registry record)
    running: int = 0                  # as last reported by the worker
    waiting: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0            # unreferenced cached blocks (evictable)
    total_blocks: int = 0
    prefix_query_tokens: int = 0      # engine counters, cumulative (registry load record)
    prefix_hit_tokens: int = 0
    kv_addr: str = ""                 # decode role: its KV-transfer socket (`tcp://host:port#worker`)
    kv_layout: dict | None = None     # model id, block size, KV dtype, layers, KV heads, head dim, TP size, MTP
                                      # layers, weights digest
    kv_transport: str = "zmq"         # how its KV moves (--kv-transport): zmq frames or NIXL reads
    prompt_logprobs: bool = True      # its engine makes prompt logprobs (not tensor parallel, not mtp)
    dispatched: int = 0               # requests this scheduler sent it
    inflight: set[str] = field(default_factory=set)  # requests we dispatched and that did not end
    # requests the worker holds that this scheduler never dispatched (an earlier scheduler's, before
    # a restart), with their run (None: the worker numbers none): learnt from its heartbeat's
    # `active` list, counted like ours until they end
    inherited: dict[str, int | None] = field(default_factory=dict)
    reported: bool = False            # a heartbeat of its has listed what it holds (`inherited` is whole)

    @property
    def holding(self) -> int:
        """Requests in flight on the worker as far as this scheduler knows: ours and inherited."""
        return len(self.inflight) + len(self.inherited)

    def capacity(self, factor: float) -> int:
        return max(1, int(self.max_num_seqs * factor))

    @property
    def kv_usage(self) -> float:
        if not self.total_blocks:
            return 0.0
        return 1.0 - (self.free_blocks + self.cached_blocks) / self.total_blocks


class Scorer(Protocol):
    def __call__(self, worker: WorkerView, request: Submit, hint: Any = None) -> float: ...


def least_loaded(worker: WorkerView, request: Submit, hint: Any = None) -> float:
    """Fewest requests in flight relative to the worker's batch size; KV usage breaks ties."""
    return worker.holding / max(worker.max_num_seqs, 1) + 0.1 * worker.kv_usage


def round_robin(worker: WorkerView, request: Submit, hint: Any = None) -> float:
    """The worker this scheduler sent the fewest requests: strict rotation among workers with room."""
    return float(worker.dispatched)


@dataclass(frozen=True)
class RoutingWeights:
    """Exchange rates of CacheAware's terms (SchedulerConfig's route_* fields set them)."""

    hit_weight: float = 1.0
    queue_weight: float = 1.0
    running_weight: float = 0.3
    kv_weight: float = 0.3
    overflow_penalty: float = 10.0
    cpu_credit: float = 0.8       # a CPU-tier block saves this fraction of its prefill
    disk_credit: float = 0.5
    shared_credit: float = 0.3    # below disk: every read pays an HMAC, and another worker may delete the file


class PrefixHit(NamedTuple):
    hit: float        # tier-weighted fraction of the prompt's blocks already cached there
    gpu_blocks: int   # of those, blocks already on the GPU (need no new KV block)


def prefix_hit(worker_id: str, prompt_tokens: int, match: MatchResponse | None,
               weights: RoutingWeights = RoutingWeights()) -> PrefixHit:
    """What the index says `worker_id` holds of this prompt (nothing without an answer)."""
    if match is None or not match.available or not match.block_size:
        return PrefixHit(0.0, 0)
    wm = match.blocks_for(worker_id)
    if wm is None:
        return PrefixHit(0.0, 0)
    bs = match.block_size
    prompt_blocks = max(1, -(-prompt_tokens // bs))
    cap = max(0, (prompt_tokens - 1) // bs)      # the block of the last prompt token is recomputed
    gpu, gpu_cpu, total, shared = (min(cap, n) for n in (wm.gpu_blocks, wm.gpu_cpu_blocks, wm.matched_blocks,
                                                           wm.any_blocks))
    saved = (gpu + weights.cpu_credit * (gpu_cpu - gpu) + weights.disk_credit * (total - gpu_cpu)
             + weights.shared_credit * (shared - total))
    return PrefixHit(min(1.0, saved / prompt_blocks), gpu)


class CacheAware:
    """Prefix hit against load (module docstring); a Scorer."""

    def __init__(self, weights: RoutingWeights = RoutingWeights()) -> None:
        self.weights = weights

    def __call__(self, worker: WorkerView, request: Submit, hint: Any = None) -> float:
        w = self.weights
        prompt_tokens = len(request.prompt_token_ids)
        hit = prefix_hit(worker.id, prompt_tokens, hint, w)
        seqs = max(1, worker.max_num_seqs)
        inflight = worker.holding
        running = max(worker.running, min(inflight, seqs))
        waiting = max(worker.waiting, inflight - seqs)
        score = (-w.hit_weight * hit.hit + w.queue_weight * waiting / seqs
                 + w.running_weight * running / seqs)
        if worker.total_blocks:       # unknown KV (no report yet, null model): no KV terms
            bs = hint.block_size if isinstance(hint, MatchResponse) and hint.block_size else 16
            new_blocks = max(1, -(-prompt_tokens // bs)) - hit.gpu_blocks
            room = worker.free_blocks + worker.cached_blocks
            score += w.kv_weight * min(1.0, (worker.total_blocks - room + new_blocks) / worker.total_blocks)
            if new_blocks > room:
                score += w.overflow_penalty
        return score


cache_aware = CacheAware()
ROUTING_POLICIES = ("cache_aware", "least_loaded", "round_robin")


def make_scorer(policy: str, weights: RoutingWeights = RoutingWeights()) -> Scorer:
    """The scorer of a --routing policy name."""
    if policy == "cache_aware":
        return CacheAware(weights)
    if policy == "least_loaded":
        return least_loaded
    if policy == "round_robin":
        return round_robin
    raise ValueError(f"unknown routing policy {policy!r}; one of: {', '.join(ROUTING_POLICIES)}")


def able(workers: list[WorkerView], request: Submit) -> list[WorkerView]:
    """Those of `workers` that can compute what `request` asks: when it asks for prompt logprobs
    (prompt_logprobs, or completions' echo with logprobs), the ones whose engines make them."""
    if request.params.prompt_logprobs is None:
        return workers
    return [w for w in workers if w.prompt_logprobs]


def pick(workers: list[WorkerView], request: Submit, scorer: Scorer, hint: Any = None) -> WorkerView:
    return min(workers, key=lambda w: (scorer(w, request, hint), w.id))


class Route(NamedTuple):
    worker: WorkerView                # runs the request whole, or decodes it after `prefill`
    prefill: WorkerView | None        # prefills and hands the KV to `worker`; None: whole
    label: str                        # mixed | decode_short | decode_cached | decode_unpaired | pd


def same_layout(a: WorkerView, b: WorkerView) -> bool:
    """Their KV blocks can be exchanged (gpu_worker/kv_transfer/layout.py's fields all equal, the
    weights' digest among them: a worker still on the old weights of a rolling upgrade pairs only
    with others on the old weights)."""
    return a.kv_layout is not None and a.kv_layout == b.kv_layout


def layout_differences(a: WorkerView, b: WorkerView) -> list[str]:
    """The kv_layout fields whose values differ between two workers' records, by name."""
    mine, theirs = a.kv_layout or {}, b.kv_layout or {}
    return [f"{f}: {mine.get(f)!r} vs {theirs.get(f)!r}" for f in sorted(set(mine) | set(theirs))
            if mine.get(f) != theirs.get(f)]


def pairable(a: WorkerView, b: WorkerView) -> bool:
    """Their KV can move between them: the same layout, and the same transport."""
    return same_layout(a, b) and a.kv_transport == b.kv_transport


def uncached_tokens(worker: WorkerView, prompt_tokens: int, hint: Any = None) -> int:
    """Prompt tokens `worker` would compute: all but the GPU blocks the index says it holds."""
    if not isinstance(hint, MatchResponse) or not hint.block_size:
        return prompt_tokens
    return max(0, prompt_tokens - prefix_hit(worker.id, prompt_tokens, hint).gpu_blocks * hint.block_size)


def load_of(worker: WorkerView) -> float:
    """Requests in flight on the worker (ours or its own report, whichever is larger) / max_num_seqs."""
    return max(worker.holding, worker.running + worker.waiting) / max(worker.max_num_seqs, 1)


def conversation_worker(whole: list[WorkerView], last_id: str | None, max_load: float) -> WorkerView | None:
    """The worker that served the conversation's last turn, while it can take this one: still live,
    not draining, with room (all three: it is in `whole`) and below `max_load` (load_of). None: the
    conversation moves, routed by the scorer (whose prefix hint finds its history in any tier)."""
    if last_id is None:
        return None
    worker = next((w for w in whole if w.id == last_id), None)
    return worker if worker is not None and load_of(worker) < max_load else None


def route(whole: list[WorkerView], prefill: list[WorkerView], request: Submit, scorer: Scorer,
          hint: Any = None, min_prefill_tokens: int = 256, sticky: WorkerView | None = None) -> Route:
    """Where one request runs (module docstring). `whole`: workers with room that can run a request
    whole (not empty); `prefill`: prefill workers with room; `sticky`: the conversation's worker
    (conversation_worker), taken over the scorer's choice."""
    worker = sticky if sticky is not None else pick(whole, request, scorer, hint)
    if worker.role != "decode":
        return Route(worker, None, "mixed")
    prompt_tokens = len(request.prompt_token_ids)
    if prompt_tokens < min_prefill_tokens:
        return Route(worker, None, "decode_short")
    if uncached_tokens(worker, prompt_tokens, hint) < min_prefill_tokens:
        return Route(worker, None, "decode_cached")
    partners = [p for p in prefill if pairable(p, worker)]
    if not partners or not worker.kv_addr:
        return Route(worker, None, "decode_unpaired")
    return Route(worker, pick(partners, request, scorer, hint), "pd")
