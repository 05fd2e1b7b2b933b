"""OpenAI / vLLM compatibility of the gateway through the whole stack: error shapes on every route,
/v1/models/{id}, field-naming errors for malformed values, stop_reason, tool_calls, X-Request-Id,
stream_options, a tool_choice naming no tool, and the model names a stack answers to (served names and the
--model path, hand-started and under `kvmesh serve`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import ROOT, wait_ready

HI = [{"role": "user", "content": "hi"}]
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS and body["error"]["message"], body
    return body["error"]


# ----------------------------------------------------------------------------- item 6: error shapes


@pytest.mark.parametrize("method, path", [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/chat"),
                                          ("POST", "/v1/completions/extra")])
def test_unknown_routes_are_openai_404s(stack, method, path):
    err = openai_error(httpx.request(method, stack.base_url + path, timeout=30), 404)
    assert err["code"] == "not_found" and path in err["message"]


@pytest.mark.parametrize("method, path, allowed", [("GET", "/v1/chat/completions", "POST"),
                                                   ("GET", "/v1/completions", "POST"),
                                                   ("DELETE", "/v1/models", "GET"),
                                                   ("POST", "/v1/models/x", "GET"),
                                                   ("POST", "/health", "GET"), ("PUT", "/tokenize", "POST")])
def test_wrong_methods_are_openai_405s(stack, method, path, allowed):
    r = httpx.request(method, stack.base_url + path, timeout=30)
    err = openai_error(r, 405)
    assert err["code"] == "method_not_allowed" and allowed in r.headers["allow"]


def test_models_retrieve_by_name_and_path_and_the_slash_list(stack):
    client = stack.openai()
    assert client.models.retrieve(stack.model_name).id == stack.model_name
    assert client.models.retrieve(stack.model).id == stack.model          # the --model path, slashes and all
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.get(stack.base_url + "/v1/models/", timeout=30)              # not a redirect
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [stack.model_name]


def raw_chat(stack, body_text: str) -> httpx.Response:
    """What `requests.post(json=...)` and Python's json.dumps send: lone surrogates as \\ud800
    escapes, NaN as a bare NaN (the openai client refuses to send either)."""
    return httpx.post(stack.base_url + "/v1/chat/completions", content=body_text.encode(), timeout=30,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("fields, param, words", [
    ({"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages[0].content", "surrogate"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\udc00"}]}]}, "messages[1].content[1].text",
     "surrogate"),
    ({"messages": HI, "temperature": float("nan")}, "temperature", "NaN"),
    ({"messages": HI, "presence_penalty": float("inf")}, "presence_penalty", "Infinity"),
])
def test_malformed_values_are_400s_naming_the_field(stack, fields, param, words):
    err = openai_error(raw_chat(stack, json.dumps({"model": stack.model_name, **fields})), 400)
    assert err["param"] == param and words in err["message"], err
    assert stack.openai().chat.completions.create(model=stack.model_name, messages=HI, max_tokens=2).choices


# ----------------------------------------------------------------------------- item 7: stop_reason


def greedy(stack, **kw):
    kw = {"model": stack.model_name, "temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}, **kw}
    return stack.openai().completions.create(prompt="Once upon a time", **kw)


def stop_string_of(text: str) -> str:
    cut = next((i for i in range(3, len(text)) if text[i - 2:i].strip()), None)
    assert cut is not None, text
    return text[cut - 2:cut]


def streamed_choice_ends(chunks) -> list[tuple[str | None, object]]:
    return [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in chunks if c.choices]


def test_stop_reason_is_the_matched_stop_string(stack):
    stop = stop_string_of(greedy(stack).choices[0].text)
    r = greedy(stack, stop=[stop, "\x00never"])
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", stop)
    ends = streamed_choice_ends(greedy(stack, stop=[stop], stream=True))
    assert ends[-1] == ("stop", stop) and all(e == (None, None) for e in ends[:-1])
    client = stack.openai()
    chat_kw = dict(model=stack.model_name, messages=HI, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    chat_stop = stop_string_of(client.chat.completions.create(**chat_kw).choices[0].message.content)
    c = client.chat.completions.create(**chat_kw, stop=chat_stop)
    assert (c.choices[0].finish_reason, c.choices[0].stop_reason) == ("stop", chat_stop)
    ends = streamed_choice_ends(client.chat.completions.create(**chat_kw, stop=chat_stop, stream=True))
    assert ends[-1] == ("stop", chat_stop) and all(e == (None, None) for e in ends[:-1])


def test_stop_reason_is_the_stop_token_id_and_null_at_length(stack):
    """logit_bias forces token 777 first; stop_token_ids=[777] then ends the sample on it."""
    forced = dict(logit_bias={"777": 100}, extra_body={"ignore_eos": True, "stop_token_ids": [777]})
    r = greedy(stack, **forced)
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", 777)
    assert streamed_choice_ends(greedy(stack, stream=True, **forced))[-1] == ("stop", 777)
    c = stack.openai().chat.completions.create(model=stack.model_name, messages=HI, temperature=0, max_tokens=8,
                                               **forced)
    assert (c.choices[0].finish_reason, c.choices[0].stop_reason) == ("stop", 777)
    r = greedy(stack, max_tokens=2)
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("length", None)
    assert streamed_choice_ends(greedy(stack, max_tokens=2, stream=True))[-1] == ("length", None)


# ----------------------------------------------------------------------------- item 7: the rest


def test_no_tool_calls_key_without_tool_calls(stack):
    r = httpx.post(stack.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": stack.model_name, "messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    c = stack.openai().chat.completions.create(model=stack.model_name, messages=HI, max_tokens=2)
    assert c.choices[0].message.tool_calls is None


def test_x_request_id_is_echoed_streamed_and_not(stack):
    client = stack.openai()
    kw = dict(model=stack.model_name, messages=HI, max_tokens=2)
    raw = client.chat.completions.with_raw_response.create(**kw, extra_headers={"X-Request-Id": "bench-7.a:b"})
    assert raw.headers["x-request-id"] == "bench-7.a:b"
    with client.completions.with_streaming_response.create(model=stack.model_name, prompt="x", max_tokens=2,
                                                           stream=True, extra_headers={"X-Request-Id": "s-1"}) as r:
        assert r.headers["x-request-id"] == "s-1"
        assert "[DONE]" in "".join(r.iter_lines())
    raw = client.chat.completions.with_raw_response.create(**kw)     # none sent: the completion's own id
    assert raw.headers["x-request-id"] == raw.parse().id
    r = httpx.post(stack.base_url + "/v1/chat/completions", json={**kw, "model": "nope"}, timeout=30,
                   headers={"X-Request-Id": "e-1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "e-1"


@pytest.mark.parametrize("value", ["x" * 129, "has space", "semi;colon"])
def test_bad_x_request_id_is_a_400_naming_it(stack, value):
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().chat.completions.create(model=stack.model_name, messages=HI, max_tokens=2,
                                               extra_headers={"X-Request-Id": value})
    assert e.value.body["param"] == "X-Request-Id"


def test_stream_options_without_stream_is_a_400(stack):
    client = stack.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=stack.model_name, messages=HI, max_tokens=2,
                                       stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack.model_name, prompt="x", max_tokens=2, stream=False,
                                  stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuous_usage_stats_in_every_chunk(stack, kind):
    client = stack.openai()
    kw = dict(model=stack.model_name, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=HI, **kw))
    else:
        chunks = list(client.completions.create(prompt="Once upon a time", **kw))
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 5 and chunks[-1].choices == []
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens > 0 for c in chunks)
    with_text = [c for c in chunks if c.choices and (getattr(c.choices[0], "text", None)
                                                     or getattr(getattr(c.choices[0], "delta", None), "content", None))]
    assert with_text and all(c.usage.completion_tokens >= 1 for c in with_text)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["anything", {"type": "function", "function": {"name": "get_time"}}])
def test_a_tool_choice_naming_no_tool_is_refused(stack, choice, stream):
    with pytest.raises(openai.BadRequestError) as e:
        r = stack.openai().chat.completions.create(model=stack.model_name, messages=HI, max_tokens=2, tools=TOOLS,
                                                   tool_choice=choice, stream=stream)
        list(r) if stream else None
    assert e.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_unforced_tool_choice_is_served(stack, choice):
    r = stack.openai().chat.completions.create(model=stack.model_name, messages=HI, max_tokens=2, tools=TOOLS,
                                               tool_choice=choice)
    assert r.choices[0].finish_reason in ("stop", "length")


# ----------------------------------------------------------------------------- item 7: model names


def test_the_model_path_is_accepted_as_the_model(stack):
    """What `vllm bench serve --model PATH` sends; responses carry the served name, as vLLM's do."""
    client = stack.openai()
    r = client.completions.create(model=stack.model, prompt="x", max_tokens=2)
    assert r.model == stack.model_name and r.choices[0].text is not None
    chunks = list(client.chat.completions.create(model=stack.model, messages=HI, max_tokens=2, stream=True))
    assert chunks and all(c.model == stack.model_name for c in chunks)


def test_serve_answers_to_several_served_names_and_the_path(tiny_model, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_SERVED_MODEL_NAME"] = "tiny-chat, org/tiny"        # the environment takes the same list
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", tiny_model, "--port", str(port),
                             "--device", "cpu", "--heartbeat-ms", "250", "--num-gpu-blocks", "256",
                             "--no-prefix-cache"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-chat", "org/tiny"]
        assert client.models.retrieve("org/tiny").id == "org/tiny"
        for name in ("tiny-chat", "org/tiny", tiny_model):
            r = client.chat.completions.create(model=name, messages=HI, max_tokens=2)
            assert r.model == "tiny-chat"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=os.path.basename(tiny_model), messages=HI, max_tokens=2)
    except BaseException:
        print((tmp_path / "serve.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
