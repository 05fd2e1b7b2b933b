"""API keys: a second gateway on the same stack with --api-key."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.conftest import free_port
from tests.integration.stack import FAST, wait_ready


@pytest.fixture(scope="module")
def keyed_gateway(stack):
    port = free_port()
    stack.procs.start("gateway-keys", "gateway", *FAST, "--port", str(port), "--zmq-port", "0",
                      "--api-key", "sk-one,sk-two")
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, 60)
    yield base
    stack.procs.kill("gateway-keys")


def test_api_key_required(stack, keyed_gateway):
    for key in ("wrong", ""):
        client = stack.openai(api_key=key or "x", base_url=keyed_gateway)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    for path, body in (("/v1/completions", {"model": stack.model_name, "prompt": "hi"}),
                       ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(keyed_gateway + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    r = httpx.post(keyed_gateway + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-two"})
    assert r.status_code == 200 and r.json()["count"] > 0
    # probes stay open
    assert httpx.get(keyed_gateway + "/health").status_code == 200
    assert httpx.get(keyed_gateway + "/ready").status_code == 200
    for key in ("sk-one", "sk-two"):
        client = stack.openai(api_key=key, base_url=keyed_gateway)
        r = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
        assert r.choices[0].message.content is not None
