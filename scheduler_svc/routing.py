"""Choosing a worker for a request: a score per (worker, request), lowest wins.

The default scorer is least-loaded. Cache-aware routing plugs in here without touching the
scheduler loop: pass another `Scorer` to `SchedulerCore(scorer=...)`. `hint` is whatever the
shell attached at submission (`core.submit(msg, hint=...)`), e.g. the prefix-cache index's
longest-prefix match for this prompt, so a scorer can subtract the prefix-hit fraction that the
index reports for this worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

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
    running: int = 0                  # as last reported by the worker
    waiting: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    total_blocks: int = 0
    inflight: set[str] = field(default_factory=set)  # requests we dispatched and that did not end

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
    return len(worker.inflight) / max(worker.max_num_seqs, 1) + 0.1 * worker.kv_usage


PREFIX_HIT_WEIGHT = 1.0  # a whole-prompt hit is worth one full batch (max_num_seqs) of load


def cache_aware(worker: WorkerView, request: Submit, hint: Any = None) -> float:
    """least_loaded minus the fraction of the prompt this worker already holds (from the
    prefix-cache index's MatchResponse given as `hint`; no hint: plain least-loaded)."""
    score = least_loaded(worker, request)
    if hint is None or not getattr(hint, "block_size", 0):
        return score
    match = hint.blocks_for(worker.id)
    if match is None:
        return score
    blocks = max(1, -(-len(request.prompt_token_ids) // hint.block_size))
    cap = max(0, (len(request.prompt_token_ids) - 1) // hint.block_size)  # last block is recomputed
    return score - PREFIX_HIT_WEIGHT * min(match.matched_blocks, cap) / blocks


def pick(workers: list[WorkerView], request: Submit, scorer: Scorer, hint: Any = None) -> WorkerView:
    return min(workers, key=lambda w: (scorer(w, request, hint), w.id))
