"""The tokenizer service's detokenizer streams: workers' StreamOpen / StepOutput / Abort (and the
scheduler's Abort / Migrate) off its ZMQ inbox into DetokCore (services/text/streams.py), and what
it answers onto the sockets: text (TextBatch) or a RequestFailed to each request's gateway, a stop
string's Abort to the schedulers (which forward it to the sample's worker), and a moving stream's
Resume to the scheduler that asked.

SENDERS names the roles (CURVE keys) each message may come from; the inbox drops the rest.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from services import metrics
from services.protocol.messages import Abort, Migrate, StepOutput, StreamOpen
from services.envelope import SCHEDULER, Envelope
from services.text.streams import DetokCore
from services.transport import Receiver, SenderPool

log = logging.getLogger("kvmesh.tokenizer")
# message -> the roles that may send it (the scheduler aborts or moves the streams of a worker that stopped)
SENDERS = {StreamOpen: ("worker",), StepOutput: ("worker",), Abort: ("worker", "scheduler"), Migrate: ("scheduler",)}


class DetokStreams:
    def __init__(self, tok: Any, senders: SenderPool) -> None:
        self.core = DetokCore(tok)
        self.senders = senders
        self.scheduler_addrs: list[str] = []     # the discovery loop keeps it current
        self.handlers = {StreamOpen: self.core.open, StepOutput: self.core.step, Abort: self.core.abort,
                         Migrate: self.core.migrate}

    async def run(self, receiver: Receiver) -> None:
        while True:
            msg = await receiver.recv()
            read_at, started = time.perf_counter(), self.core.samples_started
            try:
                out = self.handlers[type(msg)](msg)
            except Exception:  # one bad stream must not stop the others
                log.exception("detokenizer failed on a %s", type(msg).__name__)
                continue
            self.send(out)
            if self.core.samples_started != started:   # it carried some request's first tokens
                metrics.DETOK_FIRST_TOKEN.observe(time.perf_counter() - read_at)

    def send(self, out: list[Envelope]) -> None:
        for env in out:
            if env.dest == SCHEDULER:
                metrics.STOP_HITS.inc()
                for addr in self.scheduler_addrs:
                    self.senders.send(addr, env.msg)
            else:
                self.senders.send(env.dest, env.msg)
