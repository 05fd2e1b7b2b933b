"""One streamed request to an OpenAI-compatible endpoint -> one RequestResult.

Timing follows `vllm bench serve`:
- the clock starts right before the POST is sent;
- TTFT is the time to the first SSE chunk that carries non-empty content (completions: `text`;
  chat: `delta.content` or `delta.reasoning_content`); role-only and usage-only chunks don't count;
- each later content chunk appends one ITL entry: the gap since the previous content chunk. A chunk
  that carries several tokens still gives one entry (vLLM's convention), so ITL is per chunk;
- E2EL (latency) ends at the last content chunk.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True)
class RequestInput:
    api_url: str
    model: str
    prompt: str | list[int] | list[dict]  # completions: text or ids; chat: the messages list
    prompt_len: int
    output_len: int | None
    chat: bool
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict | None = None
    user: str | None = None  # OpenAI's `user`: a conversation's turns name one, so the server may keep them together


@dataclass
class RequestResult:
    prompt_len: int = 0  # from the dataset (tokenizer count or estimate)
    success: bool = False
    reason: str = ""  # failure group, e.g. "HTTP 500", "timeout"; "" on success
    error: str = ""  # reason plus the server's message, cut short
    start_time: float = 0.0  # perf_counter() when sent
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per content chunk after the first
    latency: float = 0.0  # E2EL, seconds
    end_time: float = 0.0  # perf_counter() when the request finished or failed
    generated_text: str = ""
    num_chunks: int = 0  # content chunks received
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    cached_tokens: int | None = None
    turn: int | None = None  # multi-turn: the turn's index in its conversation (0 = first)


def build_payload(req: RequestInput) -> dict:
    body: dict = {"model": req.model, "temperature": req.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    body["messages" if req.chat else "prompt"] = req.prompt
    if req.output_len is not None:
        body["max_tokens"] = req.output_len
    if req.ignore_eos:
        body["ignore_eos"] = True  # vLLM / SGLang / kvmesh extension
    if req.user is not None:
        body["user"] = req.user
    body.update(req.extra_body or {})
    return body


def chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _record_usage(res: RequestResult, usage: dict) -> None:
    res.usage_prompt_tokens = usage.get("prompt_tokens", res.usage_prompt_tokens)
    res.usage_output_tokens = usage.get("completion_tokens", res.usage_output_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = details["cached_tokens"]


def _fail(res: RequestResult, reason: str, detail: str = "") -> RequestResult:
    res.success = False
    res.reason = reason
    res.error = f"{reason}: {detail[:200]}" if detail else reason
    return res


async def send_request(session: aiohttp.ClientSession, req: RequestInput, headers: dict) -> RequestResult:
    res = await _stream_request(session, req, headers)
    res.end_time = time.perf_counter()
    return res


async def _stream_request(session: aiohttp.ClientSession, req: RequestInput, headers: dict) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    pieces: list[str] = []
    res.start_time = last = time.perf_counter()
    try:
        async with session.post(req.api_url, json=build_payload(req), headers=headers) as resp:
            if resp.status != 200:
                return _fail(res, f"HTTP {resp.status}", (await resp.text()).strip())
            async for raw in resp.content:  # one SSE line at a time
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, ": keep-alive" comments, "event:" lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return _fail(res, "stream error", json.dumps(chunk["error"]))
                if text := chunk_text(chunk, req.chat):
                    if res.num_chunks == 0:
                        res.ttft = now - res.start_time
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.num_chunks += 1
                    pieces.append(text)
                if chunk.get("usage"):
                    _record_usage(res, chunk["usage"])
    except asyncio.TimeoutError:
        return _fail(res, "timeout", f"no complete answer within the client timeout ({len(pieces)} chunks read)")
    except aiohttp.ClientError as exc:
        return _fail(res, "connection error", f"{type(exc).__name__}: {exc}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _fail(res, "bad stream", f"unparseable SSE data: {exc}")
    res.generated_text = "".join(pieces)
    if res.num_chunks == 0:
        return _fail(res, "empty response", "the stream ended without any content")
    res.latency = last - res.start_time
    res.success = True
    return res
