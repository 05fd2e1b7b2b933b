"""`kvmesh gateway`: the OpenAI-compatible HTTP API (uvicorn) over the stack's backend."""
from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging

import uvicorn

from services.config import GatewayConfig, load_or_exit
from services.gateway.app import create_app
from services.gateway.backend import Backend
from services.gateway.connections import ConnectionLimits, LimitedHttpProtocol, ensure_fd_room
from services.gateway.disconnects import LogDisconnects
from services.logging import setup as setup_logging
from services.security.curve import Plane, plane_or_exit
from services.supervisor import CONFIG_REFUSED
from services.text.tokenizer import TokenizerError
from services.transport import run_async

log = logging.getLogger("kvmesh.gateway")


class _Server(uvicorn.Server):
    """uvicorn that, when it stops, first lets the requests in flight finish (up to
    --shutdown-grace-s, while /ready answers 503 and new requests get a 503), then ends those left
    with an error (streams: an error chunk and [DONE]); its own graceful-shutdown timeout would
    otherwise cut them mid-stream."""

    def __init__(self, config: uvicorn.Config, backend: Backend, grace_s: float) -> None:
        super().__init__(config)
        self.backend, self.grace_s = backend, grace_s

    async def shutdown(self, sockets: list | None = None) -> None:
        if self.backend.jobs:
            log.info("stopping: %d requests in flight get up to %.0f s to finish", len(self.backend.jobs), self.grace_s)
        await self.backend.finish_inflight(self.grace_s)
        self.backend.fail_inflight()
        await super().shutdown(sockets)


async def serve(cfg: GatewayConfig, plane: Plane) -> int:
    backend = Backend(cfg, plane)
    await backend.start_background()
    app = LogDisconnects(create_app(cfg, backend))
    limits = ConnectionLimits(cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_connections)
    ensure_fd_room(cfg.max_connections)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=cfg.keep_alive_timeout_s,
                            loop="none", lifespan="off",
                            http=functools.partial(LimitedHttpProtocol, limits=limits))  # type: ignore[arg-type]
    server = _Server(config, backend, cfg.shutdown_grace_s)
    announce = asyncio.create_task(_announce_once_listening(server, cfg, backend.reply_addr))
    try:
        await server.serve()
    finally:
        announce.cancel()
        await stop_backend(backend)
    return 0


async def stop_backend(backend: Backend) -> None:
    """backend.stop() run to its end though this task is cancelled meanwhile: on Ctrl-C the
    terminal's SIGINT reaches the gateway, uvicorn shuts down and raises it again on its way out,
    and asyncio's runner turns that one into a cancellation of the main task (which, left to
    propagate, would end the gateway with a KeyboardInterrupt traceback and its lease unreleased)."""
    stopping = asyncio.ensure_future(backend.stop())
    while not stopping.done():
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            continue
    stopping.result()


async def _announce_once_listening(server: uvicorn.Server, cfg: GatewayConfig, inbox: str) -> None:
    """The URL is logged only once the port is bound: a busy port must not look like a running gateway."""
    while not server.started:
        await asyncio.sleep(0.05)
    log.info("gateway on http://%s:%d (inbox %s)", cfg.host, cfg.port, inbox)
    if (warning := open_to_the_network(cfg)) is not None:
        log.warning("%s", warning)


def open_to_the_network(cfg: GatewayConfig) -> str | None:
    """A warning when the API is served beyond this machine without --api-key (anyone who reaches
    the port may use it); None on loopback or with keys."""
    if cfg.api_key or _is_loopback(cfg.host):
        return None
    return (f"--host {cfg.host} without --api-key: anyone who can reach port {cfg.port} may send requests; "
            "give --api-key (or KVMESH_API_KEY), or bind 127.0.0.1 behind an authenticating proxy")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str]) -> int:
    cfg = load_or_exit(GatewayConfig, argv, "kvmesh gateway")
    setup_logging("gateway", cfg.log_level)
    plane = plane_or_exit(cfg, "gateway")
    try:
        return run_async(serve(cfg, plane))
    except TokenizerError as exc:
        # only loading --model's tokenizer raises it (--text-in-gateway, before anything is bound):
        # a refused setting, which `kvmesh serve` must not restart as a crash
        log.error("--model %s: %s", cfg.model, exc)
        return CONFIG_REFUSED


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
