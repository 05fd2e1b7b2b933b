"""Many streams at once, and client disconnects freeing KV blocks on the worker."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai

from tests.integration.stack import wait_for


def _used_blocks(rec) -> int:
    load = rec.load
    return load["total_blocks"] - load["free_blocks"] - load["cached_blocks"]


def test_64_concurrent_streams(stack):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model=stack.model_name, messages=[{"role": "user", "content": f"story number {i}"}],
            max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def main():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", timeout=120, max_retries=0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(usage is not None and usage.completion_tokens == 12 for _, usage in results)
    # same prompt -> same greedy text, whatever the batch it ran in
    solo = stack.openai().chat.completions.create(
        model=stack.model_name, messages=[{"role": "user", "content": "story number 5"}], max_tokens=12,
        temperature=0, extra_body={"ignore_eos": True})
    assert results[5][0] == solo.choices[0].message.content


def test_disconnect_mid_stream_frees_kv_blocks(stack):
    wait_for(lambda: (w := stack.worker("worker-0")) and w.load.get("requests") == 0, 20, "idle worker")
    body = {"model": stack.model_name, "prompt": "a long story " * 20, "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", stack.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                if got >= 3:
                    break
            busy = wait_for(lambda: (w := stack.worker("worker-0")) and w.load["requests"] == 1 and w, 10,
                            "the request to be running")
            assert _used_blocks(busy) > 0
        # leaving the block closed the connection mid-stream
    t0 = time.monotonic()
    idle = wait_for(lambda: (w := stack.worker("worker-0")) and w.load["requests"] == 0
                    and _used_blocks(w) == 0 and w, 15, "KV blocks back to free after the disconnect")
    assert idle.load["running"] == 0 and idle.load["waiting"] == 0
    assert time.monotonic() - t0 < 15
    # and the stack still serves
    r = stack.openai().completions.create(model=stack.model_name, prompt="hi", max_tokens=2)
    assert r.choices[0].text is not None


def test_disconnect_non_streaming_aborts(stack):
    body = {"model": stack.model_name, "prompt": "x " * 10, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    try:
        httpx.post(stack.base_url + "/v1/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    wait_for(lambda: (w := stack.worker("worker-0")) and w.load["requests"] == 0 and _used_blocks(w) == 0, 15,
             "the abandoned non-streaming request to be aborted")
