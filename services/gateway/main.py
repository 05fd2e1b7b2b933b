"""`kvmesh gateway`: the OpenAI-compatible HTTP API (uvicorn) over the stack's backend."""
from __future__ import annotations

import logging

import uvicorn

from services.config import GatewayConfig, load_or_exit
from services.gateway.app import create_app
from services.gateway.backend import Backend
from services.logging import setup as setup_logging
from services.security.bundle import TrustError
from services.security.curve import Plane, plane_for
from services.transport import run_async

log = logging.getLogger("kvmesh.gateway")


async def serve(cfg: GatewayConfig, plane: Plane) -> int:
    backend = Backend(cfg, plane)
    await backend.start_background()
    app = create_app(cfg, backend)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, loop="none", lifespan="off")
    server = uvicorn.Server(config)
    log.info("gateway on http://%s:%d (inbox %s)", cfg.host, cfg.port, backend.reply_addr)
    try:
        await server.serve()
    finally:
        await backend.stop()
    return 0


def main(argv: list[str]) -> int:
    cfg = load_or_exit(GatewayConfig, argv, "kvmesh gateway")
    setup_logging("gateway", cfg.log_level)
    if cfg.local_detokenizer and not cfg.local_tokenizer:
        log.error("--local-detokenizer needs --local-tokenizer DIR (the model's tokenizer, to turn tokens into text)")
        return 2
    try:
        plane = plane_for(cfg, "gateway")
    except TrustError as exc:
        log.error("%s", exc)
        return 2
    return run_async(serve(cfg, plane))


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
