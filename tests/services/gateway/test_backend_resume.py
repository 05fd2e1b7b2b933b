"""The gateway's shell answers a Migrate with a Resume to the scheduler that asked, on a socket of
its own: discovery, which closes the sockets of workers that left, never drops a Resume still
queued on a connection being made (the moved request would wait forever)."""
from __future__ import annotations

import time

import pytest

from gpu_worker.make_model import make_model
from scheduler_svc.main import SENDERS as SCHEDULER_SENDERS
from services.config import GatewayConfig
from services.gateway.backend import Backend
from services.gateway.discovery import Members
from services.ports import free_port
from services.protocol.messages import Admitted, Migrate, Resume, SchedulerInbox, StreamOpen, Submit
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane
from services.transport import SyncReceiver

SELF = "tcp://127.0.0.1:1#gateway"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("m") / "tiny", arch="llama", size="tiny", progress=False))


async def test_a_resume_queued_before_its_scheduler_is_reachable_survives_discovery(model_dir, monkeypatch):
    backend = Backend(GatewayConfig(redis_url="redis://127.0.0.1:9/0", text_in_gateway=True, model=model_dir,
                                    insecure_internal_planes=True), Plane.insecure())
    port = free_port()
    inbox = f"tcp://127.0.0.1:{port}#scheduler"       # nothing listens there yet: the Resume waits queued
    job = backend.open_job([Submit(request_id="r1", tenant="t", prompt_token_ids=[1, 2], params=SamplingParams(),
                                   reply_addr=SELF, detok_addr=SELF)], 1)
    backend.carry_out(backend.core.step([
        Admitted(request_id="r1"),
        StreamOpen(request_id="r1", params=SamplingParams(), reply_addr=SELF, num_prompt_tokens=2),
        Migrate(request_id="r1", worker_id="worker-0", worker_epoch=1, reply_addr=inbox)], time.monotonic()))

    # a discovery round that lists no worker (the one that died is gone from the registry)
    async def no_workers() -> Members:
        return Members(scheduler_addr="", scheduler_key="", tokenizers=[], workers=[])
    monkeypatch.setattr(backend.discovery, "read", no_workers)
    await backend.discover()

    receiver = SyncReceiver(SchedulerInbox, "127.0.0.1", port, name="scheduler", plane=Plane.insecure(),
                            senders=SCHEDULER_SENDERS)
    try:
        got = receiver.recv_all(10_000)     # zmq reconnects to the address once it is bound
        assert [type(m) for m in got] == [Resume] and got[0].request_id == "r1" and got[0].known
    finally:
        receiver.close()
        job.close()
        backend.schedulers.close()
        await backend.registry.close()
