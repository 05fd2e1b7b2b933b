"""A gateway that tokenizes and detokenizes in its own process (--local-tokenizer DIR
--local-detokenizer, as `kvmesh serve` starts it) on the session stack: the worker sends it the
tokens directly, and every answer is the one the tokenizer service's detokenizer streams through
the default gateway."""
from __future__ import annotations

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
                      "--local-tokenizer", stack.model, "--local-detokenizer")
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
