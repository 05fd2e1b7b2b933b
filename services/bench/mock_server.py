"""A scripted OpenAI-compatible server whose timing is known: for testing the benchmark itself.

Every request waits ttft_ms (plus prefill_ms_per_token for each uncached prompt token) before the
first content chunk, then sends a chunk every itl_ms * tokens_per_chunk. Output is one word per
token, so word counts equal token counts. It reports usage (with prompt_tokens_details.cached_tokens
from a block-level prefix cache over the prompt's tokens) when asked via stream_options.include_usage,
and fails scripted requests: --fail 500:5,429:7 answers every 5th request with HTTP 500 and every 7th
with 429. Chat streams send a role-only chunk at once, as real servers do; it must not count as TTFT.
POST /tokenize (vLLM's shape) counts with the same word tokenizer; --no-tokenize leaves it out, as
servers without it do. GET /mock/users answers how many requests named each OpenAI `user` (what a
multi-turn run sends per conversation).

    kvmesh bench mock-server --port 8000 --ttft-ms 50 --itl-ms 10
"""
import argparse
import asyncio
import json
import time
from dataclasses import dataclass

from services.bench.tokens import _TOKEN_RE, _WORDS


@dataclass(frozen=True)
class MockConfig:
    model: str = "mock-model"
    ttft_ms: float = 50.0
    itl_ms: float = 10.0
    default_max_tokens: int = 16
    tokens_per_chunk: int = 1
    eos_after: int | None = None  # without ignore_eos, stop after this many tokens
    prefill_ms_per_token: float = 0.0
    block_size: int = 16  # prefix-cache granularity
    fail: tuple[tuple[int, int], ...] = ()  # (HTTP status, every n-th request)
    api_key: str | None = None
    tokenize: bool = True  # serve POST /tokenize
    max_model_len: int = 0  # /tokenize refuses longer prompts (400, as kvmesh's and vLLM's); 0: any


class PrefixCache:
    """Chained hashes of full blocks of prompt tokens; cached = length of the longest seen prefix."""

    def __init__(self, block_size: int, capacity: int = 1_000_000):
        self.block_size, self.capacity, self.seen = block_size, capacity, set()

    def lookup_and_insert(self, tokens: list) -> int:
        if len(self.seen) > self.capacity:
            self.seen.clear()
        cached, h, bs = 0, None, self.block_size
        for i in range(len(tokens) // bs):
            h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
            if h in self.seen and cached == i * bs:
                cached += bs
            self.seen.add(h)
        return cached


def prompt_tokens(body: dict) -> list:
    if "messages" in body:
        toks: list = []
        for msg in body["messages"]:
            content = msg.get("content") or ""
            if isinstance(content, list):  # [{"type": "text", "text": ...}]
                content = " ".join(p.get("text", "") for p in content)
            toks += [f"<|{msg.get('role', 'user')}|>"] + _TOKEN_RE.findall(content)
        return toks
    prompt = body.get("prompt", "")
    return list(prompt) if isinstance(prompt, list) else _TOKEN_RE.findall(prompt)


def parse_fail(text: str) -> tuple[tuple[int, int], ...]:
    """'500:5,429:7' -> ((500, 5), (429, 7))."""
    rules = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        status, _, every = part.partition(":")
        rules.append((int(status), int(every)))
    return tuple(rules)


def build_app(cfg: MockConfig):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    cache = PrefixCache(cfg.block_size)
    counter = {"n": 0}
    users: dict[str, int] = {}  # the `user` field -> requests naming it

    def error(status: int, message: str):
        return JSONResponse({"error": {"message": message, "type": "mock_error", "code": status}}, status_code=status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model, "object": "model", "owned_by": "kvmesh-bench"}]}

    async def generate(request: Request, chat: bool):
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return error(401, "invalid API key")
        body = await request.json()
        counter["n"] += 1
        if isinstance(body.get("user"), str) and (body["user"] in users or len(users) < 100_000):
            users[body["user"]] = users.get(body["user"], 0) + 1
        for status, every in cfg.fail:
            if counter["n"] % every == 0:
                return error(status, f"scripted failure of request {counter['n']}")
        toks = prompt_tokens(body)
        cached = cache.lookup_and_insert(toks)
        n_out = int(body.get("max_tokens") or body.get("max_completion_tokens") or cfg.default_max_tokens)
        if cfg.eos_after is not None and not body.get("ignore_eos"):
            n_out = min(n_out, cfg.eos_after)
        ttft = (cfg.ttft_ms + cfg.prefill_ms_per_token * (len(toks) - cached)) / 1000.0
        usage = {"prompt_tokens": len(toks), "completion_tokens": n_out, "total_tokens": len(toks) + n_out,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        finish = "length" if n_out == int(body.get("max_tokens") or cfg.default_max_tokens) else "stop"
        if not body.get("stream"):
            await asyncio.sleep(ttft + max(n_out - 1, 0) * cfg.itl_ms / 1000.0)
            text = "".join(" " + _WORDS[i % len(_WORDS)] for i in range(n_out))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "finish_reason": finish})
            return {"id": "mock", "object": "chat.completion" if chat else "text_completion",
                    "model": cfg.model, "choices": [choice], "usage": usage}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(cfg, chat, n_out, ttft, finish, usage if include_usage else None),
                                 media_type="text/event-stream")

    if cfg.tokenize:
        vocab: dict[str, int] = {"<unk>": 0}  # ids in order of first sight: the mock has no fixed vocabulary

        def token_id(tok: str) -> int:
            if tok not in vocab and len(vocab) < 100_000:  # bounded: later new words are <unk>
                vocab[tok] = len(vocab)
            return vocab.get(tok, 0)

        @app.post("/tokenize")
        async def tokenize(request: Request):
            if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
                return error(401, "invalid API key")
            body = await request.json()
            if (body.get("prompt") is None) == (body.get("messages") is None):
                return error(400, "give exactly one of prompt or messages")
            ids = [token_id(tok) for tok in prompt_tokens(body)]
            if cfg.max_model_len and len(ids) > cfg.max_model_len:
                return error(400, f"the prompt has {len(ids)} tokens; this model's maximum context length "
                                  f"is {cfg.max_model_len} tokens")
            return {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids, "token_strs": None}

    @app.get("/mock/users")
    async def user_counts():
        return {"users": users}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


def _chunk(chat: bool, model: str, text: str | None, finish: str | None = None, role: bool = False) -> bytes:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
    obj = {"id": "mock", "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
           "choices": [choice]}
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _stream(cfg: MockConfig, chat: bool, n_out: int, ttft: float, finish: str, usage: dict | None):
    start = time.perf_counter()
    if chat:
        yield _chunk(chat, cfg.model, None, role=True)
    k = max(cfg.tokens_per_chunk, 1)
    for j, first in enumerate(range(0, n_out, k)):
        # Absolute deadlines so that sleep overshoot does not accumulate.
        delay = start + ttft + j * k * cfg.itl_ms / 1000.0 - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        words = "".join(" " + _WORDS[i % len(_WORDS)] for i in range(first, min(first + k, n_out)))
        yield _chunk(chat, cfg.model, words)
    yield _chunk(chat, cfg.model, "", finish=finish)  # empty final chunk: must not count as a token
    if usage is not None:
        yield f"data: {json.dumps({'id': 'mock', 'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="mock-model", help="the id /v1/models reports")
    p.add_argument("--ttft-ms", type=float, default=50.0, help="delay before the first content chunk")
    p.add_argument("--itl-ms", type=float, default=10.0, help="time per output token")
    p.add_argument("--default-max-tokens", type=int, default=16, help="output tokens when max_tokens is absent")
    p.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens carried by each stream chunk")
    p.add_argument("--eos-after", type=int, default=None, help="stop after N tokens unless ignore_eos is set")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0, help="extra TTFT per uncached prompt token")
    p.add_argument("--fail", default="", help="scripted failures STATUS:EVERY_N[,...], e.g. 500:5,429:7")
    p.add_argument("--api-key", default=None, help="require this bearer token")
    p.add_argument("--no-tokenize", action="store_true", help="do not serve POST /tokenize")
    p.add_argument("--max-model-len", type=int, default=0, help="/tokenize refuses longer prompts (0: any)")


def config_from_args(args: argparse.Namespace) -> MockConfig:
    return MockConfig(model=args.model, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                      default_max_tokens=args.default_max_tokens, tokens_per_chunk=args.tokens_per_chunk,
                      eos_after=args.eos_after, prefill_ms_per_token=args.prefill_ms_per_token,
                      fail=parse_fail(args.fail), api_key=args.api_key, tokenize=not args.no_tokenize,
                      max_model_len=args.max_model_len)


def serve(cfg: MockConfig, host: str, port: int) -> None:
    import uvicorn

    print(f"kvmesh bench mock-server: http://{host}:{port} (model {cfg.model})", flush=True)
    uvicorn.run(build_app(cfg), host=host, port=port, log_level="warning", access_log=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench mock-server", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    serve(config_from_args(args), args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
