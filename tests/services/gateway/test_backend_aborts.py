"""The gateway's shell (services/gateway/backend.py) in-process: a job's deliveries reach the
route through its queue, an Abort, a shutdown or a deadline ends it with an ApiError, which the
routes turn into an error chunk and [DONE] (a stream) or an error body; no job is left waiting for
text that will not come."""
from __future__ import annotations

import time

import pytest

from gpu_worker.make_model import make_model
from services.config import GatewayConfig
from services.gateway.backend import Backend, Job
from services.gateway.schemas import ApiError
from services.protocol.messages import Abort, Admitted, StreamOpen, Submit
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane

SELF = "tcp://127.0.0.1:1#gateway"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("m") / "tiny", arch="llama", size="tiny", progress=False))


def backend_of(model_dir: str, **cfg) -> Backend:
    """A gateway backend that makes its own text; nothing here touches its Redis."""
    return Backend(GatewayConfig(redis_url="redis://127.0.0.1:9/0", text_in_gateway=True, model=model_dir,
                                 insecure_internal_planes=True, **cfg), Plane.insecure())


def submits(*rids: str) -> list[Submit]:
    return [Submit(request_id=rid, tenant="t", prompt_token_ids=[1, 2], params=SamplingParams(), reply_addr=SELF,
                   detok_addr=SELF) for rid in rids]


async def failure(job: Job) -> ApiError:
    with pytest.raises(ApiError) as info:
        async for _ in job.batches():
            pass
    return info.value


async def test_an_abort_for_a_stream_this_gateway_detokenizes_fails_its_request(model_dir):
    backend = backend_of(model_dir)
    job = backend.open_job(submits("r1"), 1)
    backend.carry_out(backend.core.step([
        Admitted(request_id="r1"),
        StreamOpen(request_id="r1", params=SamplingParams(), reply_addr=SELF, num_prompt_tokens=3),
        Abort(request_id="r1", reason="worker_failed")], time.monotonic()))
    await job.admitted()
    err = await failure(job)
    assert (err.status, err.code) == (503, "worker_failed")
    job.close()
    assert not backend.jobs and not backend.core.jobs
    await backend.registry.close()


async def test_a_stopping_gateway_fails_every_request_in_flight(model_dir):
    backend = backend_of(model_dir)
    jobs = [backend.open_job(submits("a", "b"), 1), backend.open_job(submits("c"), 2)]
    backend.fail_inflight()
    for job in jobs:
        with pytest.raises(ApiError) as info:
            await job.admitted()
        err = info.value
        assert (err.status, err.code) == (503, "shutdown") and err.body()["error"]["type"] == "server_error"
    await backend.registry.close()


async def test_a_job_waits_only_until_its_deadline(model_dir):
    backend = backend_of(model_dir, admission_timeout_s=0.2)
    job = backend.open_job(submits("r1"), 1)
    t0 = time.monotonic()
    with pytest.raises(ApiError) as info:
        await job.admitted()
    assert (info.value.status, info.value.code) == (503, "scheduler_unavailable")
    assert 0.2 <= time.monotonic() - t0 < 5
    await backend.registry.close()


async def test_bad_words_are_encoded_by_the_gateways_tokenizer_into_the_submit(model_dir):
    """The Submit's SamplingParams carry bad_words_token_ids (the engine masks by them), encoded
    with the first prompt by the tokenizer that encodes prompts."""
    import asyncio

    from services.protocol.messages import TokenizeRequest
    from services.text.requests import bad_words_token_ids
    backend = backend_of(model_dir)
    sent: list = []
    backend.scheduler = type("Sched", (), {"send": lambda self, m: sent.append(m)})()
    params = SamplingParams(bad_words=["hello", "world"])
    task = asyncio.create_task(backend.start([TokenizeRequest(prompt="a b"), TokenizeRequest(prompt="c")], params,
                                             model="m", tenant="t", priority=0, cache_salt=""))
    for _ in range(200):
        if len(sent) == 2:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    expected = bad_words_token_ids(backend.text.tok, ["hello", "world"])
    assert expected and all(s.params.bad_words_token_ids == expected for s in sent) and len(sent) == 2
    for job in list(backend.jobs.values()):
        job.close()
    await backend.registry.close()


async def test_bad_words_a_tokenizer_did_not_encode_are_a_retryable_503_not_ignored(model_dir):
    """A tokenizer service that predates bad_words answers without their ids: the words would not
    be masked, so the request is refused before it is submitted."""
    from services.protocol.messages import TokenizeReply, TokenizeRequest
    backend = backend_of(model_dir)
    sent: list = []
    backend.scheduler = type("Sched", (), {"send": lambda self, m: sent.append(m)})()

    async def old_tokenize(req):
        return TokenizeReply(prompt_token_ids=[1, 2], detok_addr=SELF, vocab_size=100)
    backend.text.tokenize = old_tokenize
    with pytest.raises(ApiError) as info:
        await backend.start([TokenizeRequest(prompt="a")], SamplingParams(bad_words=["x"]), model="m", tenant="t",
                            priority=0, cache_salt="")
    assert (info.value.status, info.value.code) == (503, "tokenizer_unavailable") and not sent
    await backend.registry.close()
