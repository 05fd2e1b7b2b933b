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
