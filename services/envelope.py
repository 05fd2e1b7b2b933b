"""What a service's pure core hands its shell: a message and where to send it.

Every core (scheduler_svc/core.py, gpu_worker/service/core.py, services/text/streams.py) returns
a list of these; the shell sends each one (services/transport.py) and never looks inside `msg`
except to pick the socket.
"""
from __future__ import annotations

from typing import Any, NamedTuple

# Envelope.dest of a message for the scheduler(s): a core that cannot know the scheduler's
# address (workers and detokenizers follow the scheduler set in Redis) names it by this role
SCHEDULER = "scheduler"


class Envelope(NamedTuple):
    dest: str   # a ZMQ address (worker, gateway, detokenizer) or SCHEDULER
    msg: Any    # one services/protocol message
