"""The OpenAI API through the whole stack, driven by the official `openai` client."""
from __future__ import annotations

import httpx
import openai
import pytest


def chat(stack, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Tell me a story."}])
    kw.setdefault("max_tokens", 8)
    return stack.openai().chat.completions.create(model=stack.model_name, **kw)


def test_models_health_ready_metrics(stack):
    ids = [m.id for m in stack.openai().models.list().data]
    assert ids == [stack.model_name]
    assert httpx.get(stack.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(stack.base_url + "/ready").status_code == 200
    chat(stack)
    text = httpx.get(stack.base_url + "/metrics").text
    assert "kvmesh_time_to_first_token_seconds_count" in text and "kvmesh_requests_total" in text


GATEWAY_STAGES = ("kvmesh_gateway_submit_seconds", "kvmesh_gateway_tokenize_seconds",
                  "kvmesh_gateway_upstream_first_token_seconds", "kvmesh_gateway_first_chunk_write_seconds",
                  "kvmesh_time_to_first_token_seconds")


def gateway_histograms(stack) -> dict[str, tuple[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(httpx.get(stack.base_url + "/metrics").text):
        values = {s.name: s.value for s in family.samples}
        if family.name in GATEWAY_STAGES:
            out[family.name] = (values[family.name + "_count"], values[family.name + "_sum"])
    return out


def test_gateway_first_token_stages(stack):
    """One streamed request counts once in every gateway stage of its first token, and the stages
    fit inside its TTFT (submit + upstream <= TTFT); a non-streamed one writes no first chunk."""
    before = gateway_histograms(stack)
    list(stack.openai().completions.create(model=stack.model_name, prompt="Once upon a time", max_tokens=3,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}))
    after = gateway_histograms(stack)
    d = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in GATEWAY_STAGES}
    assert all(count == 1 for count, _ in d.values()), d
    submit, tokenize, upstream, write, ttft = (d[k][1] for k in GATEWAY_STAGES)
    assert 0 < tokenize <= submit and upstream > 0 and write >= 0
    assert submit + upstream <= ttft + 1e-6 < 60
    chat(stack, max_tokens=2)
    again = gateway_histograms(stack)
    assert again["kvmesh_gateway_first_chunk_write_seconds"][0] == after["kvmesh_gateway_first_chunk_write_seconds"][0]
    assert again["kvmesh_gateway_upstream_first_token_seconds"][0] == after["kvmesh_gateway_upstream_first_token_seconds"][0] + 1


def test_chat_non_streaming(stack):
    r = chat(stack, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_with_usage(stack):
    stream = chat(stack, temperature=0, max_tokens=7, stream=True, stream_options={"include_usage": True},
                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = chat(stack, temperature=0, max_tokens=7, extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content


def test_completions_stream_and_not(stack):
    client = stack.openai()
    r = client.completions.create(model=stack.model_name, prompt="Once upon a time", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=stack.model_name, prompt="Once upon a time", max_tokens=5,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert r.usage.completion_tokens == 5


def test_completions_token_prompts_and_lists(stack):
    client = stack.openai()
    r = client.completions.create(model=stack.model_name, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0,
                                  n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_n2_and_seed(stack):
    a = chat(stack, n=2, temperature=1.0, seed=1234, max_tokens=12, extra_body={"ignore_eos": True})
    b = chat(stack, n=2, temperature=1.0, seed=1234, max_tokens=12, extra_body={"ignore_eos": True})
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    stream = chat(stack, n=2, temperature=1.0, seed=1234, max_tokens=12, stream=True, extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_stop_strings(stack):
    base = chat(stack, temperature=0, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    cut = next((i for i in range(3, len(base)) if base[i - 2:i].strip()), None)
    assert cut is not None, base
    stop = base[cut - 2:cut]
    r = chat(stack, temperature=0, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == base[:base.index(stop)]
    chunks = list(chat(stack, temperature=0, max_tokens=24, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == base[:base.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_logprobs(stack):
    r = chat(stack, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the chosen one is the best
    c = stack.openai().completions.create(model=stack.model_name, prompt="abc", max_tokens=3, temperature=0,
                                          logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(top[tok] == pytest.approx(v) for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset[0] == 0


def test_greedy_matches_offline_engine(stack):
    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine
    from services.protocol.sampling import SamplingParams
    from services.text.tokenizer import load_tokenizer

    prompts = [[11, 12, 13, 14, 15], list(range(40, 75)), [900, 3, 77]]
    eng = Engine(EngineConfig(model=stack.model, device="cpu", num_gpu_blocks=256))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    tok = load_tokenizer(stack.model)
    client = stack.openai()
    for i, p in enumerate(prompts):
        r = client.completions.create(model=stack.model_name, prompt=p, max_tokens=12, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == tok.decode(tokens[f"r{i}"])
        assert r.usage.completion_tokens == len(tokens[f"r{i}"]) == 12


def test_logit_bias_forces_and_bans_tokens(stack):
    from services.text.tokenizer import load_tokenizer
    tok, client = load_tokenizer(stack.model), stack.openai()
    kw = dict(model=stack.model_name, prompt=[11, 12, 13], max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    forced = client.completions.create(**kw, logit_bias={"777": 100}).choices[0].text
    assert forced == tok.decode([777] * 5) != plain
    first = client.completions.create(**{**kw, "max_tokens": 1}, logprobs=0).choices[0].logprobs.tokens[0]
    banned = [i for i in range(tok.vocab_size) if tok.decode([i]) == first][:8]
    r = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, temperature=0, logit_bias={str(i): -100 for i in banned})
    assert r.choices[0].message.content != first


@pytest.mark.parametrize("bias, stream", [({"x1": 5}, False), ({"5": 101}, False), ({"1" * 12: 1}, False),
                                          ({"999999": 1}, False), ({"999999": 1}, True)])
def test_bad_logit_bias_is_a_400_naming_it_before_any_stream(stack, bias, stream):
    """Token ids past the vocabulary too: the gateway knows the workers' vocabulary size."""
    with pytest.raises(openai.BadRequestError) as err:
        r = stack.openai().completions.create(model=stack.model_name, prompt="hi", max_tokens=2,
                                              logit_bias=bias, stream=stream)
        list(r) if stream else None
    assert err.value.body["param"] == "logit_bias", err.value.body


@pytest.mark.parametrize("body, status, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "n": 100}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000_000}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 17}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 1000]}, 400, "stop"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"prompt": "x"}, 400, "messages"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
])
def test_malformed_chat_requests(stack, body, status, param):
    body = {"model": stack.model_name, **body}
    r = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param, err


@pytest.mark.parametrize("raw", [b"{not json", b"[" * 100_000 + b"]" * 100_000, b'{"model": 1}', b""])
def test_malformed_bodies(stack, raw):
    r = httpx.post(stack.base_url + "/v1/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "error" in r.json()


def test_limits_on_prompts_and_body(stack):
    r = httpx.post(stack.base_url + "/v1/completions", timeout=30,
                   json={"model": stack.model_name, "prompt": ["a"] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(stack.base_url + "/v1/completions", timeout=30,
                   json={"model": stack.model_name, "prompt": [5, 99999999]})
    assert r.status_code == 400
    r = httpx.post(stack.base_url + "/v1/completions", timeout=30, content=b"x" * (9 << 20))
    assert r.status_code == 413


def test_openai_client_raises_on_4xx_and_stack_keeps_serving(stack):
    with pytest.raises(openai.BadRequestError):
        chat(stack, n=99)
    assert chat(stack).choices[0].message.content is not None


def test_grpc_health_of_every_internal_service(stack):
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.security import bundle
    from services.transport import grpc_channel
    from tests.integration.stack import records

    targets = [(r.addrs["grpc"], kind) for kind in ("tokenizer", "scheduler", "worker")
               for r in records(stack.redis_url, kind)]
    assert len(targets) >= 3
    trust = bundle.load(stack.procs.trust_dir, "gateway")   # health: any certificate of the deployment

    async def check(target: str, role: str) -> int:
        async with grpc_channel(target, trust, role) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            return resp.status

    async def check_all() -> list[int]:
        return await asyncio.wait_for(asyncio.gather(*(check(t, role) for t, role in targets)), 20)

    statuses = asyncio.run(check_all())
    assert set(statuses) == {health_pb2.HealthCheckResponse.SERVING}


def test_prefix_cache_hits_reported_in_usage(stack):
    prompt = list(range(100, 164))  # 64 tokens: 4 full blocks
    client = stack.openai()
    client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 48


def test_tokenize_and_detokenize_routes(stack):
    """vLLM's /tokenize and /detokenize, here through the tokenizer service's gRPC (this stack's
    gateway has no model of its own); they match the tokenizer the workers use."""
    from services.text.tokenizer import load_tokenizer
    tok = load_tokenizer(stack.model)
    post = lambda path, body: httpx.post(stack.base_url + path, json=body, timeout=30)  # noqa: E731
    r = post("/tokenize", {"model": stack.model_name, "prompt": "Tell me a story.", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Tell me a story.") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]] and body["max_model_len"] > 0
    chat_ids = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]   # model left out
    assert chat_ids == tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    r = post("/detokenize", {"model": stack.model_name, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(body["tokens"], skip_special_tokens=False)}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_bodies(stack, path, body, status, param):
    r = httpx.post(stack.base_url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
