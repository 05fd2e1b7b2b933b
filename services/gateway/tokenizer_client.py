"""The gateway's one client of the tokenizer services (gRPC kvmesh.Tokenizer, mutual TLS): Tokenize
and Detokenize over the same channels, round-robin over the replicas, their errors as ApiErrors.

    client.set_targets(["10.0.0.5:50051", ...])    # from discovery (or --tokenizer-addr)
    reply = await client.call("Tokenize", req)      # TokenizeReply
    reply = await client.call("Detokenize", req)    # DetokenizeReply
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

import grpc

from services.gateway.schemas import ApiError
from services.protocol.messages import DetokenizeReply, TokenizeReply
from services.security.bundle import Trust
from services.transport import grpc_channel, unary_stub

log = logging.getLogger("kvmesh.gateway")
TOKENIZER_SERVICE = "kvmesh.Tokenizer"
REPLY_TYPES = {"Tokenize": TokenizeReply, "Detokenize": DetokenizeReply}
CALL_TIMEOUT_S = 30.0


class TokenizerRefused(Exception):
    """The service refused the input: `status` is OUT_OF_RANGE (too long) or INVALID_ARGUMENT."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


def unavailable(message: str = "no tokenizer service is available; retry later") -> ApiError:
    return ApiError(503, message, type_="server_error", code="tokenizer_unavailable", retry_after=1)


class TokenizerClient:
    def __init__(self, trust: Trust | None) -> None:
        self.trust = trust
        self.stubs: dict[str, dict[str, Callable]] = {}   # target -> method -> stub
        self._rr = itertools.count()

    def set_targets(self, targets: list[str]) -> None:
        for t in targets:
            if t not in self.stubs:
                channel = grpc_channel(t, self.trust, "tokenizer")
                self.stubs[t] = {m: unary_stub(channel, TOKENIZER_SERVICE, m, r) for m, r in REPLY_TYPES.items()}
        for t in [t for t in self.stubs if t not in targets]:
            del self.stubs[t]

    async def call(self, method: str, req: Any) -> Any:
        """One replica's answer. Raises TokenizerRefused (the input) or ApiError 503 (no replica)."""
        if not self.stubs:
            raise unavailable()
        targets = list(self.stubs)
        stub = self.stubs[targets[next(self._rr) % len(targets)]][method]
        try:
            return await stub(req, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT):
                raise TokenizerRefused(exc.code(), exc.details() or "invalid input") from None
            log.warning("%s failed: %s %s", method, exc.code(), exc.details())
            raise unavailable("the tokenizer service is unavailable; retry later") from None
