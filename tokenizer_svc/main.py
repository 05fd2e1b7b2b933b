"""`kvmesh tokenizer`: gRPC Tokenize / Detokenize (tokenizer_svc/rpc.py) and the streaming
detokenizer (tokenizer_svc/streams.py), in one process per replica. This module is the shell:
sockets, registry lease, heartbeat, signals.

Handlers (everything this process accepts):

    gRPC kvmesh.Tokenizer/Tokenize    TokenizeRequest -> TokenizeReply (carries this detok's address)
    gRPC kvmesh.Tokenizer/Detokenize  DetokenizeRequest -> DetokenizeReply (the gateway's /detokenize)
    ZMQ  StreamOpen                   -> DetokCore.open    (from workers, before a request's tokens)
    ZMQ  StepOutput                   -> DetokCore.step    (from workers, one per engine step)
    ZMQ  Abort                        -> DetokCore.abort   (from workers / the scheduler)

A gateway started with --text-in-gateway (as `kvmesh serve` starts it) needs none of this.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from services import metrics
from services.config import TokenizerConfig, load_or_exit
from services.logging import setup as setup_logging
from services.protocol.messages import DetokInbox
from services.redis_client import RedisAuth
from services.registry import Membership, Registry
from services.security.curve import Plane, plane_or_exit, with_role
from services.shell import run_until_signal
from services.supervisor import CONFIG_REFUSED
from services.text.chat_formats import chat_formats
from services.text.streams import STREAM_MAX_AGE_S
from services.text.tokenizer import TokenizerError
from services.transport import Receiver, SenderPool, add_health, grpc_server, run_async, set_serving, tcp_addr
from tokenizer_svc.rpc import TokenizerRpc
from tokenizer_svc.streams import SENDERS, DetokStreams

log = logging.getLogger("kvmesh.tokenizer")


class TokenizerService:
    def __init__(self, cfg: TokenizerConfig, plane: Plane) -> None:
        from services.text.tokenizer import load_tokenizer
        self.cfg = cfg
        self.plane = plane
        self.tok = load_tokenizer(cfg.model)
        self.rpc = TokenizerRpc(self.tok)
        self.senders: SenderPool = SenderPool(plane)
        self.streams = DetokStreams(self.tok, self.senders)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # kept through a Redis restart, so a stop string's Abort still reaches the schedulers
        self.schedulers = Membership(2 * cfg.heartbeat_ms / 1000, rejoin_s=cfg.lease_ms / 1000)

    async def run(self) -> int:
        cfg = self.cfg
        trust = self.plane.trust     # gRPC and Redis use the same trust material as ZeroMQ
        server, grpc_port = grpc_server(cfg.host, cfg.port, trust)
        self.rpc.add_to(server, trust)
        health = await add_health(server, cfg.host, cfg.health_port)
        self.receiver: Receiver = Receiver(DetokInbox, cfg.host, cfg.zmq_port, name="detokenizer",
                                           plane=self.plane, senders=SENDERS)
        host = cfg.reachable_host()
        self.rpc.detok_addr = with_role(tcp_addr(host, self.receiver.port), "tokenizer")
        await server.start()
        metrics_port = metrics.serve_metrics(cfg.host, cfg.metrics_port, "tokenizer")
        addrs = {"zmq": self.rpc.detok_addr, "grpc": f"{host}:{grpc_port}"}
        if metrics_port > 0:
            addrs["metrics"] = f"http://{host}:{metrics_port}/metrics"
        self.registry = Registry(cfg.redis_url, RedisAuth.of(trust))
        # max_token_chars: gateways refuse a prompt that cannot fit before sending it (prompt_bounds.py)
        # and the model's answer formats, for gateways whose --tool-call-parser / --reasoning-parser is auto
        info = {"vocab_size": self.tok.vocab_size, "max_token_chars": self.tok.max_token_chars or 0,
                **chat_formats(self.tok)._asdict()}
        self.lease = await self.registry.register("tokenizer", self.id, addrs=addrs, info=info, lease_ms=cfg.lease_ms)
        await self._refresh_schedulers()
        await set_serving(health, True)
        log.info("tokenizer ready: grpc %s, detok %s", addrs["grpc"], self.rpc.detok_addr)
        tasks = [asyncio.create_task(self.streams.run(self.receiver)), asyncio.create_task(self._heartbeat_loop())]
        code = await run_until_signal(tasks, "tokenizer", log)
        await set_serving(health, False)
        await self.lease.release()
        await self.registry.close()
        await server.stop(0.5)
        await health.stop()
        self.receiver.close()
        self.senders.close()
        self.rpc.close()
        return code

    async def _refresh_schedulers(self) -> None:
        fresh = await self.registry.list("scheduler")
        records = self.schedulers.update(fresh, time.monotonic(), self.registry.incarnation)
        self.streams.scheduler_addrs = sorted(r.addrs["zmq"] for r in records if "zmq" in r.addrs)

    async def _heartbeat_loop(self) -> None:
        core = self.streams.core
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
            metrics.DETOK_STREAMS.set(len(core.streams))
            core.expire(STREAM_MAX_AGE_S)
            try:
                await self.lease.renew({"streams": len(core.streams)})
                await self._refresh_schedulers()
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)


def main(argv: list[str]) -> int:
    cfg = load_or_exit(TokenizerConfig, argv, "kvmesh tokenizer")
    setup_logging("tokenizer", cfg.log_level)
    if not cfg.model:
        log.error("--model (or KVMESH_MODEL) is required: the directory holding tokenizer.json")
        return 2
    plane = plane_or_exit(cfg, "tokenizer")
    try:
        service = TokenizerService(cfg, plane)
    except TokenizerError as exc:
        log.error("--model %s: %s", cfg.model, exc)
        return CONFIG_REFUSED
    return run_async(service.run())
