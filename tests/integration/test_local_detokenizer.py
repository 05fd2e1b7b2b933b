"""A gateway that makes its own text (--text-in-gateway --model DIR, as `kvmesh serve` starts it)
on the session stack: the worker sends it the tokens directly, every answer is the one the
tokenizer service's detokenizer streams through the default gateway, and a stop string it finds
stops the sample on the worker at once."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import FAST, wait_for, wait_ready

IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def local_gw(stack):
    port = free_port()
    stack.procs.start("gateway-local", "gateway", *FAST, "--port", str(port), "--zmq-port", "0",
                      "--text-in-gateway", "--model", stack.model)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, 60)
    yield base
    stack.procs.kill("gateway-local")


def chat(stack, base_url: str, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Tell me a story."}])
    return stack.openai(base_url=base_url).chat.completions.create(model=stack.model_name, **kw)


def test_same_text_as_through_the_detokenizer_service(stack, local_gw):
    for kw in ({"max_tokens": 16}, {"max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 7},
               {"max_tokens": 4, "logprobs": True, "top_logprobs": 2}):
        kw = {"temperature": 0, **kw, "extra_body": IGNORE_EOS}
        ref, got = chat(stack, stack.base_url, **kw), chat(stack, local_gw, **kw)
        assert [c.message.content for c in got.choices] == [c.message.content for c in ref.choices]
        assert got.usage.completion_tokens == ref.usage.completion_tokens
        if "logprobs" in kw:
            assert [t.token for t in got.choices[0].logprobs.content] == [t.token for t in ref.choices[0].logprobs.content]
    client = stack.openai(base_url=local_gw)
    chunks = list(client.completions.create(model=stack.model_name, prompt="Once upon a time", max_tokens=8,
                                            temperature=0, stream=True, extra_body=IGNORE_EOS))
    ref = stack.openai().completions.create(model=stack.model_name, prompt="Once upon a time", max_tokens=8,
                                            temperature=0, extra_body=IGNORE_EOS)
    assert "".join(c.choices[0].text for c in chunks) == ref.choices[0].text


def test_stop_string_ends_the_sample_and_frees_it(stack, local_gw):
    base = chat(stack, local_gw, temperature=0, max_tokens=24, extra_body=IGNORE_EOS).choices[0].message.content
    cut = next((i for i in range(3, len(base)) if base[i - 2:i].strip()), None)
    assert cut is not None, base
    stop = base[cut - 2:cut]
    r = chat(stack, local_gw, temperature=0, max_tokens=24, stop=[stop], extra_body=IGNORE_EOS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == base[:base.index(stop)]
    # the stop's Abort went to the scheduler and on to the worker: nothing is left running there
    wait_for(lambda: (w := stack.worker("worker-0")) and w.load.get("requests") == 0, 15, "an idle worker")


def test_a_stop_string_stops_the_worker_promptly_and_spares_another_request(stack, local_gw):
    idle = lambda: (w := stack.worker("worker-0")) and w.load.get("requests") == 0  # noqa: E731
    other_kw = {"temperature": 0, "max_tokens": 64, "extra_body": IGNORE_EOS,
                "messages": [{"role": "user", "content": "Count the stars."}]}
    alone = chat(stack, local_gw, **other_kw).choices[0].message.content
    base = chat(stack, local_gw, temperature=0, max_tokens=24, extra_body=IGNORE_EOS).choices[0].message.content
    cut = next((i for i in range(3, len(base)) if base[i - 2:i].strip()), None)
    assert cut is not None, base
    stop = base[cut - 2:cut]
    wait_for(idle, 20, "an idle worker")
    before = stack.worker("worker-0").load["tokens_out"]
    other: list = []
    runner = threading.Thread(target=lambda: other.append(chat(stack, local_gw, **other_kw)))
    runner.start()
    # 2,000 tokens unless the stop string ends it: only the worker stopping the sample ends it soon
    r = chat(stack, local_gw, temperature=0, max_tokens=2000, stop=[stop], extra_body=IGNORE_EOS)
    runner.join(120)
    assert not runner.is_alive()
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == base[:base.index(stop)]
    assert other[0].choices[0].message.content == alone and other[0].usage.completion_tokens == 64
    wait_for(idle, 30, "the worker to finish both requests")
    generated = stack.worker("worker-0").load["tokens_out"] - before
    # the stopped sample ran a few steps past its stop string at most, not toward its 2,000 tokens
    assert generated - 64 < 24 + 200, generated


def test_disconnect_mid_stream_aborts_upstream(stack, local_gw):
    wait_for(lambda: (w := stack.worker("worker-0")) and w.load.get("requests") == 0, 20, "idle worker")
    body = {"model": stack.model_name, "prompt": "a long story " * 20, "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", local_gw + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got, lines = 0, r.iter_lines()    # held: a dropped iterator closes the connection
            for line in lines:
                got += line.startswith("data: {")
                if got >= 3:
                    break
            wait_for(lambda: (w := stack.worker("worker-0")) and w.load["requests"] == 1, 10, "the request running")
    t0 = time.monotonic()
    wait_for(lambda: (w := stack.worker("worker-0")) and w.load["requests"] == 0, 15, "the abort to reach the worker")
    assert time.monotonic() - t0 < 15
    assert chat(stack, local_gw, max_tokens=2).choices[0].message.content is not None


def test_first_token_stages_include_the_gateways_detokenizer(stack, local_gw):
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> dict[str, float]:
        text = httpx.get(local_gw + "/metrics").text
        return {f.name: next(s.value for s in f.samples if s.name == f.name + "_count")
                for f in text_string_to_metric_families(text) if f.type == "histogram"}
    before = counts()
    list(stack.openai(base_url=local_gw).completions.create(model=stack.model_name, prompt="hi", max_tokens=3,
                                                            stream=True, extra_body=IGNORE_EOS))
    after = counts()
    for name in ("kvmesh_detok_first_token_seconds", "kvmesh_gateway_upstream_first_token_seconds",
                 "kvmesh_gateway_first_chunk_write_seconds", "kvmesh_gateway_submit_seconds"):
        assert after[name] - before[name] == 1, name
