"""POST /tokenize checks a chat's tools as /v1/chat/completions does (the app in-process, over a
backend that is never reached: the check answers first)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from services.config import GatewayConfig
from services.gateway.app import create_app
from services.gateway.tools import MAX_TOOLS

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("tools, param", [
    ([{"x": 1}], "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
    ([TOOL] * (MAX_TOOLS + 1), "tools"),
])
def test_tokenize_refuses_the_tools_a_chat_request_refuses(tools, param):
    catalog = SimpleNamespace(names=["m"], vocab_sizes={"m": 100}, max_model_lens={"m": 64}, resolve=lambda m: m)
    client = TestClient(create_app(GatewayConfig(), SimpleNamespace(catalog=catalog)))
    r = client.post("/tokenize", json={"messages": HI, "tools": tools})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


class TokenizingBackend:
    """Records each TokenizeRequest /tokenize sends."""

    def __init__(self) -> None:
        self.sent: list = []
        self.catalog = SimpleNamespace(names=["m"], vocab_sizes={"m": 100}, max_model_lens={"m": 64},
                                       resolve=lambda m: m)

    def bounded(self, req, model):
        return req

    async def token_ids(self, req):
        self.sent.append(req)
        return [1, 2]


def tokenize(**fields):
    backend = TokenizingBackend()
    r = TestClient(create_app(GatewayConfig(), backend)).post("/tokenize", json=fields)
    return r, backend.sent


OPEN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer:"}]


def test_continue_final_message_renders_as_on_the_chat_route_and_refuses_add_generation_prompt():
    r, sent = tokenize(messages=OPEN, continue_final_message=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert not sent
    r, sent = tokenize(messages=OPEN, continue_final_message=True, add_generation_prompt=False)
    assert r.status_code == 200, r.text
    assert sent[0].continue_final_message and not sent[0].add_generation_prompt
    r, sent = tokenize(messages=OPEN)
    assert not sent[0].continue_final_message and sent[0].add_generation_prompt


def test_add_special_tokens_defaults_as_vllms_true_for_a_prompt_false_for_a_chat():
    """A chat's template writes its own bos: add_special_tokens adds the tokenizer's on top only when asked."""
    assert tokenize(prompt="p")[1][0].add_special_tokens
    assert not tokenize(prompt="p", add_special_tokens=False)[1][0].add_special_tokens
    assert not tokenize(messages=HI)[1][0].chat_special_tokens
    assert tokenize(messages=HI, add_special_tokens=True)[1][0].chat_special_tokens
