"""The outermost ASGI layer: a client that leaves before its request body has arrived (or whose
body missed --body-timeout-s, services/gateway/connections.py) is one log line, not an exception.

Starlette raises ClientDisconnect from `request.stream()` when the body's reader sees
http.disconnect; nothing in a route can answer a client that is gone, so the exception would reach
uvicorn, which logs it as a server error with a full traceback (2 MB of log for 500 clients).
"""
from __future__ import annotations

import logging
from typing import Any

from starlette.requests import ClientDisconnect

from services.gateway.connections import BODY_TIMEOUT_KEY

log = logging.getLogger("kvmesh.gateway")


class LogDisconnects:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Any:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting_receive, send)
        except ClientDisconnect:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "a client"
            length = dict(scope["headers"]).get(b"content-length", b"?")[:20].decode("latin-1")
            what = f"{scope['method']} {ascii(scope['path'][:200])}"   # the client's bytes: escaped, one line
            if BODY_TIMEOUT_KEY in scope:
                log.info("closed the connection of %s: %s sent %d of %s body bytes in %g s (408)",
                         who, what, received, length, scope[BODY_TIMEOUT_KEY])
            else:
                log.info("%s disconnected during %s after %d of %s body bytes", who, what, received, length)
