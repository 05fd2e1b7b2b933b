"""Cache-aware routing's hint: which workers hold how much of a prompt, from the prefix-cache index
and from this scheduler's own recent dispatches. SchedulerCore (core.py) owns one under
`--routing cache_aware`; the worker choice itself stays in routing.py (`pick`, the scorers).

    core.submit(msg)          admitted, and several workers could take it: the core asks for a match,
                              Envelope(PREFIX_INDEX, PrefixQuery), and holds the request out of the
                              queue until the answer
    shell                     makes the one gRPC call (services/prefix_client.py: 50 ms deadline, a
                              breaker) and hands back what came: core.prefix_matched(request_id, match);
                              None or an unavailable answer when there is no index, or it was slow
                              or failing (fail open: routed by load)
    core.prefix_matched(..)   hint(): the answer topped up with the dispatches the index cannot know
                              yet (recent.py) is the request's routing hint; the request joins the queue
    core.dispatch()           dispatched(): the prompt's leading block hashes, remembered for its worker
    core.set_workers(..)      forget_worker(): a gone or restarted worker holds none of them any more
"""
from __future__ import annotations

from typing import NamedTuple

from scheduler_svc.recent import RecentDispatches
from scheduler_svc.routing import WorkerView
from services.prefix_hash import chain_hashes
from services.protocol.kv_events import MatchResponse, split_salt
from services.protocol.messages import Submit

PREFIX_INDEX = "prefix-index"   # Envelope.dest of a PrefixQuery: the shell asks the index over gRPC
RECENT_MAX_BLOCKS = 256         # leading blocks of a prompt hashed and remembered (at most ~0.5 ms of hashing)


class PrefixQuery(NamedTuple):
    """The core asks its shell for the index's longest-prefix match of one prompt."""
    request_id: str
    model_id: str
    prompt_token_ids: list[int]
    tenant_salt: str   # the two halves of Submit.cache_salt, as MatchRequest takes them
    cache_salt: str


class Hint(NamedTuple):
    match: MatchResponse | None    # what the scorer reads (routing.prefix_hit); None: load alone
    block_hashes: list[bytes]      # the prompt's leading full blocks, recorded once it is dispatched


class PrefixHints:
    def __init__(self, recent: RecentDispatches | None = None, max_blocks: int = RECENT_MAX_BLOCKS) -> None:
        self.recent = recent if recent is not None else RecentDispatches()
        self.max_blocks = max_blocks

    def query(self, msg: Submit, workers: list[WorkerView]) -> PrefixQuery:
        tenant_salt, cache_salt = split_salt(msg.cache_salt)
        return PrefixQuery(msg.request_id, _hashing_worker(workers).model_id, msg.prompt_token_ids,
                           tenant_salt, cache_salt)

    def hint(self, msg: Submit, workers: list[WorkerView], match: MatchResponse | None, now: float) -> Hint:
        """The index's answer topped up with recent dispatches of the same leading blocks."""
        w = _hashing_worker(workers)
        head = msg.prompt_token_ids[:self.max_blocks * w.block_size]          # bounds the hashing cost
        hashes = chain_hashes(None, w.model_id, msg.cache_salt, head, w.block_size)
        return Hint(self.recent.overlay(match, hashes, w.block_size, now), hashes)

    def dispatched(self, worker_id: str, block_hashes: list[bytes], now: float) -> None:
        self.recent.record(worker_id, block_hashes, now)

    def forget_worker(self, worker_id: str) -> None:
        self.recent.forget_worker(worker_id)


def _hashing_worker(workers: list[WorkerView]) -> WorkerView:
    """The worker whose model id and block size the hashes use (every worker serves one model)."""
    return next((w for w in workers if w.model_id), workers[0])
