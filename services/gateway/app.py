"""HTTP routes of the OpenAI-compatible API (FastAPI on uvicorn).

    POST /v1/chat/completions   POST /v1/completions   (API key when configured)
    GET  /v1/models             GET  /v1/models/{id}   (API key when configured)
    POST /tokenize              POST /detokenize       (vLLM's; API key when configured)
    GET  /health (liveness)     GET  /ready (the scheduler, a worker and, without --text-in-gateway, a tokenizer are live)
    GET  /metrics (Prometheus)

Every error, unknown routes (404) and wrong methods (405) included, is OpenAI's
`{"error": {"message", "type", "param", "code"}}`. A client's X-Request-Id is echoed back
(bounded; the completion's id when none is sent); internal request ids are always the gateway's.

Streaming answers are SSE: `data: {chunk}` ... `data: [DONE]`; an error after the stream began
is sent as an error chunk, then [DONE]. A client that disconnects has its request aborted in
every process (gateway -> scheduler -> worker -> detokenizer).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from services import metrics
from services.config import GatewayConfig
from services.gateway.backend import Backend, Job
from services.gateway.conversation import conversation_key
from services.gateway.chat_output import PLAIN
from services.gateway.render import Accumulator, ChunkWriter, PromptEcho
from services.protocol.kv_events import cache_salt_for
from services.gateway.schemas import (
    ApiError, ChatRequest, CompletionRequest, DetokenizeBody, TokenizeBody, chat_echo, chat_prompt,
    check_request_constraint, client_request_id, completion_prompts, decode, echo_ids, echo_only, thinking,
    tokenize_request)
from services.gateway.tools import check_tools, served_formats, tool_plan, with_plan
from services.protocol.messages import DetokenizeRequest

_json = msgspec.json.Encoder()


def error_response(err: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else {}
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def http_error(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's own 404 / 405 (no such route, wrong method) as an OpenAI error."""
    where = f"{request.method} {request.url.path[:200]}"
    if exc.status_code == 404:
        return ApiError(404, f"no such route: {where}", code="not_found")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return ApiError(405, f"method not allowed: {where} (allowed: {allowed})", code="method_not_allowed")
    return ApiError(exc.status_code, str(exc.detail)[:200], type_=_error_type(exc.status_code))


def _error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def create_app(cfg: GatewayConfig, backend: Backend) -> FastAPI:
    app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None, openapi_url=None)
    keys = [k.encode() for k in cfg.api_key]

    def tenant_of(request: Request) -> str:
        """The server-side tenant name of the caller ("key<N>"), or ApiError 401."""
        if not keys:
            return "anonymous"
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        found = -1
        for i, key in enumerate(keys):   # compare against every key: timing does not reveal which
            if hmac.compare_digest(token, key):
                found = i
        if found < 0:
            raise ApiError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                           type_="authentication_error", code="invalid_api_key")
        return f"key{found}"

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > cfg.max_body_bytes):
            raise ApiError(413, f"the request body is larger than {cfg.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise ApiError(413, f"the request body is larger than {cfg.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(model: str | None) -> str:
        """The name responses carry for `model` (a served name or the --model path)."""
        catalog = backend.catalog
        if model is None:
            raise ApiError(400, "model is required", param="model")
        if not catalog.names:   # no worker yet: admission answers 503
            return model
        if (name := catalog.resolve(model)) is None:
            raise ApiError(404, f"the model `{model[:200]}` does not exist; see GET /v1/models",
                           param="model", code="model_not_found")
        return name

    def salt(tenant: str, cache_salt: str | None) -> str:
        # Tenants never share prefix-cache blocks unless they share a key (docs/kv_events.md); the
        # packing is the one the prefix-cache index uses to verify matches.
        return cache_salt_for("" if tenant == "anonymous" else tenant, cache_salt or "")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        response = error_response(http_error(request, exc))
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # the traceback goes to the log (Starlette re-raises it there), never to the client
        return error_response(ApiError(500, "internal server error", type_="server_error", code="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/ready")
    async def ready() -> Response:
        reason = backend.not_ready_reason
        if reason is None:
            return Response(b'{"status":"ready"}', media_type="application/json")
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def prom() -> Response:
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh"}

    async def models_answer(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return {"object": "list", "data": [model_card(m) for m in backend.catalog.names]}

    async def model_answer(request: Request) -> dict[str, Any]:
        tenant_of(request)
        model_id = request.path_params["model_id"]
        if not model_id:   # /v1/models/: the list, not a redirect
            return await models_answer(request)
        if backend.catalog.resolve(model_id) is None:
            raise ApiError(404, f"the model `{model_id[:200]}` does not exist; see GET /v1/models",
                           param="model", code="model_not_found")
        return model_card(model_id)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await json_route(request, "models", models_answer)

    @app.get("/v1/models/{model_id:path}")   # ids may hold slashes: org/name, or the --model path
    async def model(request: Request) -> Response:
        return await json_route(request, "models", model_answer)

    async def serve(request: Request, kind: str) -> Response:
        arrival = time.monotonic()
        route = "chat" if kind == "chat" else "completions"
        echo = None
        try:
            echo = client_request_id(request.headers.get("x-request-id"))
            tenant = tenant_of(request)
            body = await read_body(request)
            parsing, echo_text, schema_parts, prompt_echo = PLAIN, "", (), PromptEcho()
            if kind == "chat":
                req: Any = decode(ChatRequest, body)
                prompt, params = chat_prompt(req, cfg.max_messages)
                formats = served_formats(cfg.tool_call_parser, cfg.reasoning_parser, backend.text.formats())
                # a constrained answer follows its grammar from the first token: it opens no block
                # unless it writes one (deepseek_r1 would read all of it as reasoning)
                plan = tool_plan(req.tools, req.tool_choice, formats, thinking(req) and params.structured is None,
                                 max_calls=None if req.parallel_tool_calls else 1)
                params, parsing, schema_parts = with_plan(params, plan), plan.parsing, plan.schema_parts
                if not req.include_reasoning:
                    parsing = dataclasses.replace(parsing, include_reasoning=False)
                prompts, echo_text = [prompt], chat_echo(req)
                prompt_echo = PromptEcho(prompt_logprobs=req.prompt_logprobs is not None)
            else:
                req = decode(CompletionRequest, body)
                prompts, params = completion_prompts(req, cfg.max_prompts)
                prompt_echo = PromptEcho(await echo_texts(req), echo_only(req), req.prompt_logprobs is not None)
            model = check_model(req.model)
            backend.check_vocab(model, params)
            await check_request_constraint(req, params, schema_parts)
            conversation = conversation_key(tenant, req.user, req.conversation_id)
            job, prompt_lens = await backend.start(prompts, params, model=model, tenant=tenant,
                                                   priority=req.priority, cache_salt=salt(tenant, req.cache_salt),
                                                   conversation=conversation,
                                                   prompt_logprobs_copies=1 if kind == "chat" else params.n)
        except ApiError as err:
            metrics.REQUESTS.labels(route, str(err.status)).inc()
            return error_response(err, echo)
        metrics.REQUESTS.labels(route, "200").inc()
        metrics.GATEWAY_SUBMIT.observe(job.submitted - arrival)
        options = req.stream_options
        acc = Accumulator(kind, model, params.n, len(prompts), prompt_lens, params.logprobs is not None, parsing,
                          echo_text, prompt_echo)
        request_id = echo or acc.id
        if req.stream:
            writer = ChunkWriter(acc, bool(options and options.include_usage),
                                 bool(options and options.continuous_usage_stats))
            return StreamingResponse(_stream(job, writer, arrival), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": request_id})
        response = await _complete(request, job, acc, arrival)
        response.headers["X-Request-Id"] = request_id
        return response

    async def echo_texts(req: CompletionRequest) -> list[str] | None:
        """An echoing completion's prompts as text: as sent, or the detokenizer's of token ids."""
        if not req.echo:
            return None
        ids = echo_ids(req)
        if ids is None:
            return [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        return [(await backend.detokenize(DetokenizeRequest(token_ids=x))).text for x in ids]

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions")

    def served_model(model: str | None) -> str:
        """/tokenize and /detokenize may leave the model out when one is served (vLLM's)."""
        if model is None and len(backend.catalog.vocab_sizes) == 1:
            return next(iter(backend.catalog.vocab_sizes))
        return check_model(model)

    async def tokenize_answer(request: Request) -> dict[str, Any]:
        tenant_of(request)
        body = decode(TokenizeBody, await read_body(request))
        check_tools(body.tools)   # the bounds and shape a chat request's tools have
        model = served_model(body.model)
        # bounded like a completion's prompt: /tokenize never answers more ids than the model takes
        ids = await backend.token_ids(backend.bounded(tokenize_request(body, cfg.max_messages), model))
        strs = None
        if body.return_token_strs:
            strs = (await backend.detokenize(DetokenizeRequest(token_ids=ids, token_strs=True))).token_strs
        return {"count": len(ids), "max_model_len": backend.catalog.max_model_lens.get(model, 0), "tokens": ids,
                "token_strs": strs}

    async def detokenize_answer(request: Request) -> dict[str, Any]:
        tenant_of(request)
        body = decode(DetokenizeBody, await read_body(request))
        served_model(body.model)
        return {"prompt": (await backend.detokenize(DetokenizeRequest(token_ids=body.tokens))).text}

    async def json_route(request: Request, route: str, answer) -> Response:
        echo = None
        try:
            echo = client_request_id(request.headers.get("x-request-id"))
            out = await answer(request)
        except ApiError as err:
            metrics.REQUESTS.labels(route, str(err.status)).inc()
            return error_response(err, echo)
        metrics.REQUESTS.labels(route, "200").inc()
        return Response(_json.encode(out), media_type="application/json",
                        headers={"X-Request-Id": echo} if echo else None)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await json_route(request, "tokenize", tokenize_answer)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await json_route(request, "detokenize", detokenize_answer)

    return app


class _Timing:
    def __init__(self, arrival: float) -> None:
        self.arrival, self.first, self.last, self.tokens = arrival, 0.0, 0.0, 0

    def on_delta(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.monotonic()
        if not self.first:
            self.first = now
            metrics.TTFT.observe(now - self.arrival)
        elif self.last:
            metrics.ITL.observe(now - self.last)
        self.last = now
        self.tokens += num_tokens

    def done(self, acc: Accumulator) -> None:
        now = time.monotonic()
        metrics.E2E.observe(now - self.arrival)
        if self.tokens > 1 and self.first:
            metrics.TPOT.observe((now - self.first) / (self.tokens - 1))
        usage = acc.usage()
        metrics.PROMPT_TOKENS.inc(usage["prompt_tokens"])
        metrics.GENERATION_TOKENS.inc(usage["completion_tokens"])
        metrics.CACHED_PROMPT_TOKENS.inc(usage["prompt_tokens_details"]["cached_tokens"])


async def _stream(job: Job, writer: ChunkWriter, arrival: float) -> AsyncIterator[bytes]:
    timing = _Timing(arrival)
    metrics.INFLIGHT.inc()
    first_written = False
    try:
        yield writer.start()
        async for batch in job.batches():
            chunks = []
            for prompt_index, delta in batch:
                timing.on_delta(delta.num_new_tokens)
                chunks.append(writer.delta(prompt_index, delta))
            data = b"".join(chunks)
            if data:
                yield data   # resumes once the server took the bytes (Starlette awaits its send)
            if timing.first and not first_written:
                first_written = True
                metrics.GATEWAY_FIRST_WRITE.observe(time.monotonic() - job.first_read)
        yield writer.finish()
        timing.done(writer.acc)
    except ApiError as err:
        yield b"data: " + _json.encode(err.body()) + b"\n\n"
    finally:
        metrics.INFLIGHT.dec()
        job.close()   # a disconnect lands here too (generator closed): aborts what is unfinished
    yield b"data: [DONE]\n\n"


async def _complete(request: Request, job: Job, acc: Accumulator, arrival: float) -> Response:
    timing = _Timing(arrival)

    async def collect() -> None:
        async for batch in job.batches():
            for prompt_index, delta in batch:
                timing.on_delta(delta.num_new_tokens)
                acc.add(prompt_index, delta)

    metrics.INFLIGHT.inc()
    work = asyncio.create_task(collect())
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():   # the client left: abort everywhere
            work.cancel()
            return Response(status_code=499)
        err = work.exception()
        if isinstance(err, ApiError):
            return error_response(err)
        if err is not None:
            raise err
        timing.done(acc)
        return Response(_json.encode(acc.response()), media_type="application/json")
    finally:
        gone.cancel()
        metrics.INFLIGHT.dec()
        job.close()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

