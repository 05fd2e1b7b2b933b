"""The worker core's record of one request it holds (WorkerCore.requests, .awaiting)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Req:
    """A request this worker holds: where its tokens go, its run, its stage times."""

    detok_addr: str
    reply_addr: str
    n: int
    received: float                      # perf_counter() when the Dispatch was read off the socket
    run: int = 0                         # Dispatch.run / AwaitKV.run: echoed in reports
    done: set[int] = field(default_factory=set)
    scheduled: float | None = None       # start of the step that first computed prompt tokens
    first_token: float | None = None     # end of the step that produced the first token
    last_token: float = 0.0              # end of the latest step that produced tokens
    prompt_tokens: int = 0               # prompt tokens to prefill here: the backlog until the first token
    handoff_to: str = ""                 # prefill worker: the decode worker that gets the KV
    exported: bool = False               # prefill worker: some sample goes on at the decode worker
    handed: set[int] = field(default_factory=set)   # prefill worker: those samples
    streamed: int = 0                    # prefill worker: leading blocks given to the sender while prefilling
    stopped: set[int] = field(default_factory=set)   # samples aborted while the sender read its blocks
