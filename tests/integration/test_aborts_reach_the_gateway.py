"""An abort never leaves a gateway waiting: real scheduler, tokenizer (detokenizer) and null-model
worker processes, and this test in the gateway's place (its own inbox, its own request ids). An
Abort the scheduler gets for a request, queued or already on the worker, for any reason, ends with
a RequestFailed at the gateway's inbox, which its client sees as an error chunk and [DONE].

The planes run with --insecure-internal-planes: the test speaks plain ZeroMQ as a gateway would."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.embedded_redis import EmbeddedRedis
from services.protocol.messages import Abort, Admitted, GatewayInbox, RequestFailed, Submit, TextBatch
from services.gateway.backend import inbox_senders
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane
from services.transport import Receiver, Sender, tcp_addr
from tests.integration.stack import FAST, INTERNAL, Procs, records, wait_for

WAIT_S = 20


@pytest.fixture(scope="module")
def planes(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("abort-logs")
    redis = EmbeddedRedis().start()
    procs = Procs(redis.url, logs)
    insecure = ["--insecure-internal-planes"]
    try:
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, *insecure, "--metrics-port", "-1",
                    "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, *insecure, "--metrics-port", "-1",
                    "--worker-capacity-factor", "1")
        procs.start("worker", "worker", *FAST, *INTERNAL, *insecure, "--metrics-port", "-1", "--model", tiny_model,
                    "--null-model", "--null-step-ms", "50", "--max-num-seqs", "1", "--worker-id", "null-0")
        wait_for(lambda: all(records(redis.url, kind) for kind in ("tokenizer", "scheduler", "worker")), 120,
                 "tokenizer, scheduler and worker registered")
        [sched], [tok] = records(redis.url, "scheduler"), records(redis.url, "tokenizer")
        yield sched.addrs["zmq"], tok.addrs["zmq"]
    except BaseException:
        print(procs.logs())
        raise
    finally:
        procs.stop_all()
        redis.stop()


INSECURE = Plane.insecure()


class FakeGateway:
    def __init__(self, scheduler_addr: str, detok_addr: str) -> None:
        # the stack runs --insecure-internal-planes: this test speaks for the gateway without its key
        self.inbox: Receiver = Receiver(GatewayInbox, "127.0.0.1", 0, name="test-gateway", plane=INSECURE,
                                        senders=inbox_senders(local_text=False))
        self.scheduler = Sender(scheduler_addr, plane=INSECURE)
        self.detok_addr = detok_addr

    def submit(self, rid: str) -> None:
        self.scheduler.send(Submit(request_id=rid, tenant="t", prompt_token_ids=[1, 2, 3],
                                   params=SamplingParams(max_tokens=2000, ignore_eos=True),
                                   reply_addr=tcp_addr("127.0.0.1", self.inbox.port), detok_addr=self.detok_addr,
                                   arrival=time.time()))

    async def until(self, pred, what: str):
        """The first message on the inbox that `pred` accepts (others are skipped)."""
        try:
            async with asyncio.timeout(WAIT_S):
                while not pred(msg := await self.inbox.recv()):
                    pass
                return msg
        except TimeoutError:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}") from None

    def close(self) -> None:
        self.inbox.close()
        self.scheduler.close()


def test_an_abort_of_a_running_or_queued_request_fails_it_at_its_gateway(planes):
    gw = FakeGateway(*planes)

    async def go() -> None:
        gw.submit("running")
        await gw.until(lambda m: isinstance(m, TextBatch) and any(d.request_id == "running" for d in m.deltas),
                       "the first tokens of the running request")
        gw.submit("queued")             # the worker runs one sequence at a time: this one waits
        await gw.until(lambda m: isinstance(m, Admitted) and m.request_id == "queued", "the queued admission")

        gw.scheduler.send(Abort(request_id="queued", reason="shutdown"))
        failed = await gw.until(lambda m: isinstance(m, RequestFailed), "a RequestFailed for the queued one")
        assert (failed.request_id, failed.status, failed.code) == ("queued", 503, "shutdown")

        gw.scheduler.send(Abort(request_id="running", reason="timeout"))   # on the worker: via its detokenizer
        failed = await gw.until(lambda m: isinstance(m, RequestFailed), "a RequestFailed for the running one")
        assert (failed.request_id, failed.status, failed.code) == ("running", 504, "timeout")
    try:
        asyncio.run(go())
    finally:
        gw.close()
