"""vLLM's request extensions through the routes, in-process: what reaches the engine's
SamplingParams and prompt, and the 400s that name a bad field."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from services.config import GatewayConfig
from services.gateway.app import create_app
from services.gateway.backend import Backend
from services.protocol.messages import TextDelta
from services.text.chat_formats import ChatFormats

HI = [{"role": "user", "content": "hi"}]


class OneDelta:
    submitted = first_read = 0.0

    async def batches(self):
        yield [(0, TextDelta(request_id="r", index=0, text="ok", num_new_tokens=1, finish_reason="stop"))]

    def close(self) -> None:
        pass


class CapturingBackend:
    """Records each started request's prompts and SamplingParams."""

    def __init__(self) -> None:
        self.started: list[tuple] = []
        self.catalog = SimpleNamespace(names=["m"], vocab_sizes={"m": 100}, max_model_lens={"m": 64},
                                       resolve=lambda m: m)
        self.text = SimpleNamespace(formats=lambda: ChatFormats("hermes", "none"))

    check_vocab = Backend.check_vocab    # the real one, over catalog.vocab_sizes

    async def start(self, prompts, params, **kwargs):
        self.started.append((prompts, params))
        return OneDelta(), [3]


def post(route: str, **fields):
    backend = CapturingBackend()
    client = TestClient(create_app(GatewayConfig(), backend))
    body = {"model": "m", **({"messages": HI} if route == "chat" else {"prompt": "p"}), **fields}
    r = client.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    return r, backend.started


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_include_stop_str_in_output_reaches_the_params(route):
    r, started = post(route, include_stop_str_in_output=True, stop=["x"])
    assert r.status_code == 200, r.text
    assert started[0][1].include_stop_str_in_output and started[0][1].stop == ["x"]
    r, started = post(route)
    assert not started[0][1].include_stop_str_in_output


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_allowed_token_ids_and_bad_words_reach_the_params(route):
    r, started = post(route, allowed_token_ids=[1, 5], bad_words=["foo", " bar"])
    assert r.status_code == 200, r.text
    params = started[0][1]
    assert params.allowed_token_ids == [1, 5] and params.bad_words == ["foo", " bar"]


@pytest.mark.parametrize("fields, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [100]}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(4097))}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": ["w"] * 65}, "bad_words"), ({"bad_words": [""]}, "bad_words"), ({"bad_words": ["x" * 257]}, "bad_words"),
])
def test_token_mask_fields_out_of_bounds_are_400s_naming_them(fields, param):
    r, started = post("chat", **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not started


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_truncate_prompt_tokens_reaches_the_tokenizer_request(route):
    r, started = post(route, truncate_prompt_tokens=5)
    assert r.status_code == 200, r.text
    assert [p.truncate_prompt_tokens for p in started[0][0]] == [5]
    r, started = post(route)
    assert [p.truncate_prompt_tokens for p in started[0][0]] == [0]


@pytest.mark.parametrize("value", [0, -2, 2**31])
def test_truncate_prompt_tokens_out_of_range_is_a_400_naming_it(value):
    r, started = post("completions", truncate_prompt_tokens=value)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert not started


def answers(fields: dict) -> tuple[str, str]:
    """The whole answer's content and the streamed one's, assembled as a client does."""
    client = TestClient(create_app(GatewayConfig(), CapturingBackend()))
    body = {"model": "m", **fields}
    whole = client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    streamed = ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return whole.json()["choices"][0]["message"]["content"], streamed


OPEN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer:"}]


def test_continue_final_message_renders_the_last_message_open_and_needs_add_generation_prompt_false():
    r, started = post("chat", messages=OPEN, continue_final_message=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert not started
    r, started = post("chat", messages=OPEN, continue_final_message=True, add_generation_prompt=False)
    assert r.status_code == 200, r.text
    assert started[0][0][0].continue_final_message and not started[0][0][0].add_generation_prompt


@pytest.mark.parametrize("fields, echoed", [
    ({"messages": OPEN, "continue_final_message": True, "add_generation_prompt": False}, "The answer:"),
    ({"messages": OPEN}, "The answer:"),                                       # the assistant's role
    ({"messages": HI}, ""),                                                    # the last is the user's
    ({"messages": HI, "add_generation_prompt": False}, "hi"),                  # its role is the answer's
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "add_generation_prompt": False}, "a\nb"),
])
def test_chat_echo_begins_the_answer_with_the_last_message_of_its_role(fields, echoed):
    assert answers({**fields, "echo": True}) == (echoed + "ok", echoed + "ok")
    assert answers(fields) == ("ok", "ok")


def test_add_special_tokens_on_a_chat_reaches_the_tokenizer_request_default_false():
    r, started = post("chat")
    assert r.status_code == 200 and not started[0][0][0].chat_special_tokens, r.text
    r, started = post("chat", add_special_tokens=True)
    assert started[0][0][0].chat_special_tokens


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_guided_whitespace_pattern_is_a_400_naming_it(route):
    """xgrammar (the only backend) compiles JSON schemas with no whitespace pattern: set, the
    answer would not be the one asked for."""
    schema = {"type": "object"}
    r, started = post(route, guided_json=schema, guided_whitespace_pattern=r"[ ]?")
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_whitespace_pattern", r.text
    assert not started
    r, started = post(route, guided_json=schema, guided_whitespace_pattern=None)
    assert r.status_code == 200, r.text


def test_best_of_on_a_chat_must_equal_n():
    r, started = post("chat", best_of=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    assert not started
    r, started = post("chat", best_of=2, n=2)
    assert r.status_code == 200, r.text
