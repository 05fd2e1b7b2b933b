"""Cache-aware worker choice: expected prefix hit against load, one pure function for the scheduler.

    score = hit_weight  * hit          hit: fraction of the prompt's tokens the worker need not
                                            prefill: GPU blocks count fully, CPU/disk blocks at
                                            cpu_credit/disk_credit (reload is cheaper than
                                            recompute, not free)
          - queue_weight   * waiting / max_num_seqs
          - running_weight * running / max_num_seqs
          - kv_weight      * kv_used      kv_used: fraction of KV blocks in use after admitting
                                            the prompt's uncached blocks (> 1: does not fit)
          - overflow_penalty                when the prompt's new blocks do not fit in free KV

Every term is a fraction, so the weights read as exchange rates: with the defaults a worker
holding the whole prompt (hit 1.0) is worth a queue of one max_num_seqs batch. An overloaded
worker with the prefix loses to an idle one; between equal loads the longer prefix wins.
Depends only on services/ so it can move there with the scheduler's other imports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from services.protocol.kv_events import MatchResponse


@dataclass(frozen=True)
class RoutingWeights:
    hit_weight: float = 1.0
    queue_weight: float = 1.0
    running_weight: float = 0.3
    kv_weight: float = 0.3
    overflow_penalty: float = 10.0
    cpu_credit: float = 0.8       # a CPU-tier block saves this fraction of its prefill
    disk_credit: float = 0.5


class WorkerLoad(NamedTuple):
    """What the scheduler knows of a worker (WorkerStatus fields)."""

    worker_id: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    max_num_seqs: int


class WorkerScore(NamedTuple):
    worker_id: str
    score: float
    hit: float            # tier-weighted fraction of the prompt already cached there
    cached_tokens: int    # prompt tokens reusable there (any tier; never the last token's block)


def score_worker(load: WorkerLoad, match: MatchResponse | None, prompt_tokens: int,
                 weights: RoutingWeights = RoutingWeights()) -> WorkerScore:
    """One worker's score (higher is better). `match` None or unavailable: no prefix credit."""
    block_size = match.block_size if match is not None and match.block_size else 16
    prompt_blocks = max(1, -(-prompt_tokens // block_size))
    wm = match.blocks_for(load.worker_id) if match is not None else None
    # the engine recomputes the block holding the last prompt token (it needs its logits)
    cap = max(0, (prompt_tokens - 1) // block_size)
    gpu, gpu_cpu, total = (min(cap, n) for n in ((wm.gpu_blocks, wm.gpu_cpu_blocks, wm.matched_blocks)
                                                 if wm else (0, 0, 0)))
    saved = gpu + weights.cpu_credit * (gpu_cpu - gpu) + weights.disk_credit * (total - gpu_cpu)
    hit = min(1.0, saved / prompt_blocks)
    score = _score(load, hit, prompt_blocks - gpu, weights)
    return WorkerScore(load.worker_id, score, hit, min(prompt_tokens, total * block_size))


def rank_workers(loads: list[WorkerLoad], match: MatchResponse | None, prompt_tokens: int,
                 weights: RoutingWeights = RoutingWeights()) -> list[WorkerScore]:
    """Workers best first (ties: lower load, then worker id)."""
    pressure = {load.worker_id: _pressure(load) for load in loads}
    scored = [score_worker(load, match, prompt_tokens, weights) for load in loads]
    scored.sort(key=lambda s: (-s.score, pressure[s.worker_id], s.worker_id))
    return scored


def prefix_scorer(match: MatchResponse | None, prompt_tokens: int,
                  weights: RoutingWeights = RoutingWeights()) -> Callable[[Any, Any], float]:
    """An adapter for scheduler_svc.routing.Scorer (lowest wins) over its WorkerView
    (id, running, waiting, free_blocks, cached_blocks, total_blocks, max_num_seqs):

        match = await prefix_client.match(model_id, prompt_token_ids, tenant_salt=..., cache_salt=...)
        worker = pick(candidates, request, prefix_scorer(match, len(prompt_token_ids)))
    """
    def scorer(worker: Any, request: Any = None) -> float:
        load = WorkerLoad(worker.id, worker.running, worker.waiting,
                          worker.free_blocks + getattr(worker, "cached_blocks", 0),
                          worker.total_blocks, worker.max_num_seqs)
        return -score_worker(load, match, prompt_tokens, weights).score

    return scorer


def _score(load: WorkerLoad, hit: float, new_blocks: int, w: RoutingWeights) -> float:
    seqs = max(1, load.max_num_seqs)
    total = max(1, load.total_blocks)
    used_after = (total - load.free_blocks + new_blocks) / total
    score = (w.hit_weight * hit
             - w.queue_weight * load.waiting / seqs
             - w.running_weight * load.running / seqs
             - w.kv_weight * min(used_after, 1.0))
    if new_blocks > load.free_blocks:
        score -= w.overflow_penalty
    return score


def _pressure(load: WorkerLoad) -> float:
    return (load.waiting + load.running) / max(1, load.max_num_seqs)
