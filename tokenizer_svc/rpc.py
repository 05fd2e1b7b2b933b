"""The tokenizer service's gRPC methods (kvmesh.Tokenizer, mutual TLS, callable by gateways only):

    Tokenize    TokenizeRequest -> TokenizeReply (the prompt's ids, and this replica's detokenizer
                inbox, which will stream the request's text)
    Detokenize  DetokenizeRequest -> DetokenizeReply (the gateway's /detokenize and token strings)

A prompt too long for the model is refused with OUT_OF_RANGE, any other bad input with
INVALID_ARGUMENT; the gateway answers both as 400s naming the request's field.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from services import metrics
from services.protocol.messages import DetokenizeReply, DetokenizeRequest, TokenizeReply, TokenizeRequest
from services.security.bundle import Trust
from services.text.requests import (
    PromptTooLong, TokenizeError, bad_words_token_ids, detokenize_off_loop, tokenize_off_loop)
from services.transport import Method, unary_handler

GRPC_SERVICE = "kvmesh.Tokenizer"
GATEWAY_ONLY = frozenset({"gateway"})   # prompts and token ids are users' text: only the gateway asks


class TokenizerRpc:
    def __init__(self, tok: Any, threads: int = 2) -> None:
        self.tok = tok
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self.detok_addr = ""   # this replica's detokenizer inbox: set once bound

    async def tokenize(self, req: TokenizeRequest, context: grpc.aio.ServicerContext) -> TokenizeReply:
        t0 = time.perf_counter()
        try:
            ids = await tokenize_off_loop(self.tok, req, self.pool)
            bad = bad_words_token_ids(self.tok, req.bad_words) if req.bad_words else []
        except PromptTooLong as exc:   # the gateway answers it as context_length_exceeded
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except TokenizeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.TOKENIZE_SECONDS.observe(time.perf_counter() - t0)
        metrics.TOKENS_IN.inc(len(ids))
        return TokenizeReply(prompt_token_ids=ids, detok_addr=self.detok_addr, vocab_size=self.tok.vocab_size,
                             bad_words_token_ids=bad)

    async def detokenize(self, req: DetokenizeRequest, context: grpc.aio.ServicerContext) -> DetokenizeReply:
        try:
            return await detokenize_off_loop(self.tok, req, self.pool)
        except TokenizeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def add_to(self, server: grpc.aio.Server, trust: Trust | None) -> None:
        server.add_generic_rpc_handlers([unary_handler(GRPC_SERVICE, {
            "Tokenize": Method(self.tokenize, TokenizeRequest, GATEWAY_ONLY),
            "Detokenize": Method(self.detokenize, DetokenizeRequest, GATEWAY_ONLY)}, trust)])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
