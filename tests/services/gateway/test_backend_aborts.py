"""The gateway's request state (services/gateway/backend.py) in-process: a request an Abort or a
shutdown ends fails with an ApiError, which the routes turn into an error chunk and [DONE] (a
stream) or an error body; no job is left waiting for text that will not come."""
from __future__ import annotations

import pytest

from gpu_worker.make_model import make_model
from services.config import GatewayConfig
from services.gateway.backend import Backend, Job
from services.gateway.schemas import ApiError
from services.protocol.messages import Abort, StreamOpen
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane

TIMEOUT_S = 5.0   # batches() gives up with a 504 after this: a test that hangs fails instead


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("m") / "tiny", arch="llama", size="tiny", progress=False))


def backend_of(model_dir: str) -> Backend:
    """A gateway backend that detokenizes its own requests; nothing here touches its Redis."""
    return Backend(GatewayConfig(redis_url="redis://127.0.0.1:9/0", local_tokenizer=model_dir,
                                 local_detokenizer=True, insecure_internal_planes=True),
                   Plane.insecure())


async def failure(job: Job) -> ApiError:
    with pytest.raises(ApiError) as info:
        async for _ in job.batches():
            pass
    return info.value


async def test_an_abort_for_a_stream_this_gateway_detokenizes_fails_its_request(model_dir):
    backend = backend_of(model_dir)
    job = Job(backend, ["r1"], 1, TIMEOUT_S)
    backend._detokenize(StreamOpen(request_id="r1", params=SamplingParams(), reply_addr="self", num_prompt_tokens=3))
    backend._detokenize(Abort(request_id="r1", reason="worker_failed"))
    err = await failure(job)
    assert (err.status, err.code) == (503, "worker_failed")
    await backend.registry.close()


async def test_a_stopping_gateway_fails_every_request_in_flight(model_dir):
    backend = backend_of(model_dir)
    jobs = [Job(backend, ["a", "b"], 1, TIMEOUT_S), Job(backend, ["c"], 2, TIMEOUT_S)]
    backend.fail_inflight()
    for job in jobs:
        err = await failure(job)
        assert (err.status, err.code) == (503, "shutdown") and err.body()["error"]["type"] == "server_error"
    await backend.registry.close()
