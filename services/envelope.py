"""What a service's pure core hands its shell: a message and where to send it.

Every core (scheduler_svc/core.py, gpu_worker/service/core.py, services/text/streams.py,
services/gateway/core.py) returns
a list of these; its shell sends each one (services/transport.py), or, for a destination that is
a name rather than an address, does what that name stands for.
"""
from __future__ import annotations

from typing import Any, NamedTuple

# Envelope.dest of a message for the scheduler(s): a core that cannot know the scheduler's
# address (workers and detokenizers follow the scheduler set in Redis) names it by this role
SCHEDULER = "scheduler"


class Envelope(NamedTuple):
    dest: str   # a ZMQ address (worker, gateway, detokenizer), SCHEDULER, or the scheduler core's
                # PREFIX_INDEX (scheduler_svc/prefix_hints.py: its shell asks the index over gRPC)
    msg: Any    # a services/protocol message (to PREFIX_INDEX: a PrefixQuery)
