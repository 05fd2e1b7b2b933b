"""`kubectl scale deployment <fullname>-decode` down, on real processes: two workers run with the
environment the chart renders for decode pods (null model, so tokens cost no compute), one gets
SIGTERM as a pod that leaves does, and the chart README's drain holds:

  - its registry record says `draining` at once, and new requests go to another worker;
  - a request it runs that ends within the drain window streams to its end;
  - one still running when the window closes moves to the other worker and streams to its end
    there, from the tokens already streamed (no client request fails);
  - the worker exits 0 within the pod's terminationGracePeriodSeconds.
"""
from __future__ import annotations

import signal
import threading
import time

import openai

from services.ports import free_port
from tests.helm.chart import FULLNAME, by_kind, helm, render  # noqa: F401
from tests.helm.live_pod import start_pool_worker
from tests.integration.conftest import tiny_model  # noqa: F401  (the session's model fixture)
from tests.integration.stack import FAST, INTERNAL, records, redis_and_procs, wait_for, wait_ready

STEP_MS = 20          # the null model's step: 50 tokens/s per sequence
DRAIN_GRACE_S = 10    # the drain window (30 s as the chart renders it; shortened, as the step is)
SHORT_TOKENS = 150    # ~3 s: ends inside the drain window
LONG_TOKENS = 800     # ~16 s: still running when the window closes, ends on the other worker


def stream(client: openai.OpenAI, model: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    chunks, t0 = 0, time.monotonic()
    out["tokens"] = 0
    try:
        for chunk in client.completions.create(model=model, prompt="x", max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
                continue
            chunks += 1
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish_reason"] = chunk.choices[0].finish_reason
    except openai.APIError as exc:
        out["error"] = exc
    finally:
        out["chunks"], out["ended_at"] = chunks, time.monotonic() - t0
        started.set()


def record(redis_url: str, worker_id: str):
    return next((r for r in records(redis_url, "worker") if r.id == worker_id), None)


def test_a_decode_pod_that_leaves_drains(helm, tiny_model, tmp_path_factory, tmp_path):  # noqa: F811
    docs = render(helm, "defaults", tmp_path_factory)
    grace = by_kind(docs, "Deployment")[f"{FULLNAME}-decode"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    model = tiny_model.rsplit("/", 1)[-1]
    port = free_port()
    timing = {"KVMESH_NULL_STEP_MS": str(STEP_MS), "KVMESH_LEASE_MS": "1500", "KVMESH_HEARTBEAT_MS": "250",
              "KVMESH_DRAIN_GRACE_S": str(DRAIN_GRACE_S)}
    with redis_and_procs(tmp_path) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "-1")
        procs.start("gateway", "gateway", *FAST, "--port", str(port), "--zmq-port", "0")
        leaving, _ = start_pool_worker(docs, "decode", "decode-0", procs, redis.url, tiny_model, tmp_path, **timing)
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 120)
        wait_for(lambda: record(redis.client_url, "decode-0"), 60, "decode-0 to register")
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)

        # both requests run on decode-0, the only worker
        short, long_ = {}, {}
        threads = []
        for max_tokens, out in ((SHORT_TOKENS, short), (LONG_TOKENS, long_)):
            started = threading.Event()
            threads.append(threading.Thread(target=stream, args=(client, model, max_tokens, started, out), daemon=True))
            threads[-1].start()
            assert started.wait(60), "a stream did not start"
        # the record's load is renewed every heartbeat: wait until it counts both streams
        served_before = wait_for(lambda: record(redis.client_url, "decode-0").load["requests_total"] == 2, 5,
                                 "decode-0's record to count both streams") and 2

        # the pod leaves; a new one comes up beside it
        leaving.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        wait_for(lambda: (r := record(redis.client_url, "decode-0")) is None or r.info.get("draining"), 3,
                 "decode-0's record to say draining")
        assert "chunks" not in short, "the short request ended before the pod left: lengthen it"
        start_pool_worker(docs, "decode", "decode-1", procs, redis.url, tiny_model, tmp_path, **timing)
        wait_for(lambda: record(redis.client_url, "decode-1"), 60, "decode-1 to register")
        for i in range(3):
            r = client.completions.create(model=model, prompt=f"during the drain {i}", max_tokens=4)
            assert r.choices[0].finish_reason == "length"
        wait_for(lambda: record(redis.client_url, "decode-1").load["requests_total"] == 3, 5,
                 "decode-1's record to count the three requests (renewed every heartbeat)")
        if (draining := record(redis.client_url, "decode-0")) is not None:   # still draining: took none of them
            assert draining.load["requests_total"] == served_before

        for t in threads:
            t.join(max(t_term + DRAIN_GRACE_S + 60 - time.monotonic(), 0.1))
        assert short.get("finish_reason") == "length" and "error" not in short, short
        assert short["chunks"] >= SHORT_TOKENS // 2   # streamed through the drain, not cut short
        # handed back at the window's end, it went on at decode-1 and ended there, its budget whole
        assert long_.get("finish_reason") == "length" and "error" not in long_, long_
        assert long_["tokens"] == LONG_TOKENS
        leaving.wait(timeout=max(t_term + grace - time.monotonic(), 0.1))
        assert leaving.returncode == 0
        assert time.monotonic() - t_term < grace
        assert record(redis.client_url, "decode-0") is None   # its lease released, not left to expire
