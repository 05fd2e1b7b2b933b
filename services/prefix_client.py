"""PrefixClient: a caller's view of the prefix-cache index (gRPC Match with a short deadline).

In services/ because the scheduler uses it and a service imports only services/ and itself.

    client = PrefixClient("127.0.0.1:50054", trust, timeout_s=0.05)   # trust None: plaintext
    match = await client.match(model_id, prompt_token_ids, tenant_salt=..., cache_salt=...)
    match.available   # False: the index was down or slow; the answer is "no match" (fail open)

A failed call opens a breaker for `cooldown_s`: meanwhile calls answer "no match" at once, so an
index outage costs each request nothing instead of a timeout.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.protocol.kv_events import PREFIX_GRPC_SERVICE, MatchRequest, MatchResponse, pack_token_ids
from services.security.bundle import Trust
from services.transport import grpc_channel, unary_stub

log = logging.getLogger("kvmesh.prefix_client")

UNAVAILABLE = MatchResponse(block_size=0, query_blocks=0, available=False)


class PrefixClient:
    def __init__(self, target: str, trust: Trust | None, timeout_s: float = 0.05, cooldown_s: float = 1.0) -> None:
        self.target = target
        self.trust = trust
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self._channel: grpc.aio.Channel | None = None
        self._stub = None
        self._open_until = 0.0
        self.failures = 0

    def _call(self):
        if self._stub is None:
            self._channel = grpc_channel(self.target, self.trust, "prefix-cache")
            self._stub = unary_stub(self._channel, PREFIX_GRPC_SERVICE, "Match", MatchResponse)
        return self._stub

    async def connect(self, timeout_s: float = 10.0) -> bool:
        """Open the channel (TCP and TLS) ahead of the first Match, whose short deadline would
        otherwise have to cover the handshake too; False when the index did not answer in time."""
        self._call()
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
            return True
        except (asyncio.TimeoutError, grpc.RpcError) as exc:
            log.warning("prefix index %s: no connection in %.0fs (%s)", self.target, timeout_s, type(exc).__name__)
            return False

    async def match(self, model_id: str, token_ids, *, tenant_salt: str = "", cache_salt: str = "",
                    block_hashes: list[bytes] | None = None) -> MatchResponse:
        """Workers holding the longest prefix of token_ids (a list of ints, or packed bytes)."""
        if time.monotonic() < self._open_until:
            return UNAVAILABLE
        tokens = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
        req = MatchRequest(model_id=model_id, tokens=tokens, tenant_salt=tenant_salt,
                           cache_salt=cache_salt, block_hashes=block_hashes)
        try:
            return await self._call()(req, timeout=self.timeout_s)
        except Exception as exc:  # fail open: any error means "no prefix information"
            self.failures += 1
            self._open_until = time.monotonic() + self.cooldown_s
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            log.warning("prefix index %s unavailable (%s); routing without prefix hits for %.1fs",
                        self.target, why, self.cooldown_s)
            return UNAVAILABLE

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None
