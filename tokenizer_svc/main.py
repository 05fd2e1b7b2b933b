"""`kvmesh tokenizer`: gRPC Tokenize + the streaming detokenizer, in one process per replica.

Handlers (everything this process accepts):

    gRPC kvmesh.Tokenizer/Tokenize  TokenizeRequest -> TokenizeReply (carries this detok's address)
    gRPC kvmesh.Tokenizer/Detokenize  DetokenizeRequest -> DetokenizeReply (the gateway's /detokenize)
    ZMQ  StreamOpen                 -> DetokCore.open    (from workers, before a request's tokens)
    ZMQ  StepOutput                 -> DetokCore.step    (from workers, one per engine step)
    ZMQ  Abort                      -> DetokCore.abort   (from workers / the scheduler)

SENDERS names the roles (CURVE keys) each ZMQ message may come from; the inbox drops the rest.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from services import metrics
from services.config import TokenizerConfig, load_or_exit
from services.logging import setup as setup_logging
from services.protocol.messages import (Abort, DetokenizeReply, DetokenizeRequest, DetokInbox, StepOutput, StreamOpen,
                                       TokenizeReply, TokenizeRequest)
from services.redis_client import RedisAuth
from services.registry import Registry
from services.security.curve import Plane, plane_or_exit, with_role
from services.shell import run_until_signal
from services.tokenize import PromptTooLong, TokenizeError, detokenize_off_loop, tokenize_off_loop
from services.transport import (
    Method, Receiver, SenderPool, add_health, grpc_server, run_async, set_serving, tcp_addr, unary_handler)
from tokenizer_svc.detok import SCHEDULER, STREAM_MAX_AGE_S, DetokCore, Envelope

GRPC_SERVICE = "kvmesh.Tokenizer"
GATEWAY_ONLY = frozenset({"gateway"})   # prompts and token ids are users' text: only the gateway asks
log = logging.getLogger("kvmesh.tokenizer")
# message -> the roles that may send it (the scheduler aborts the streams of a worker that died)
SENDERS = {StreamOpen: ("worker",), StepOutput: ("worker",), Abort: ("worker", "scheduler")}


class TokenizerService:
    def __init__(self, cfg: TokenizerConfig, plane: Plane) -> None:
        from services.text.tokenizer import load_tokenizer
        self.cfg = cfg
        self.plane = plane
        self.tok = load_tokenizer(cfg.model)
        self.core = DetokCore(self.tok)
        self.senders: SenderPool = SenderPool(plane)
        self.scheduler_addrs: list[str] = []
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.handlers = {StreamOpen: self.core.open, StepOutput: self.core.step, Abort: self.core.abort}

    async def tokenize(self, req: TokenizeRequest, context: grpc.aio.ServicerContext) -> TokenizeReply:
        t0 = time.perf_counter()
        try:
            ids = await tokenize_off_loop(self.tok, req, self.pool)
        except PromptTooLong as exc:   # the gateway answers it as context_length_exceeded
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except TokenizeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.TOKENIZE_SECONDS.observe(time.perf_counter() - t0)
        metrics.TOKENS_IN.inc(len(ids))
        return TokenizeReply(prompt_token_ids=ids, detok_addr=self.detok_addr, vocab_size=self.tok.vocab_size)

    async def detokenize(self, req: DetokenizeRequest, context: grpc.aio.ServicerContext) -> DetokenizeReply:
        try:
            return await detokenize_off_loop(self.tok, req, self.pool)
        except TokenizeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def run(self) -> int:
        cfg = self.cfg
        trust = self.plane.trust     # gRPC and Redis use the same trust material as ZeroMQ
        server, grpc_port = grpc_server(cfg.host, cfg.port, trust)
        server.add_generic_rpc_handlers([unary_handler(GRPC_SERVICE, {
            "Tokenize": Method(self.tokenize, TokenizeRequest, GATEWAY_ONLY),
            "Detokenize": Method(self.detokenize, DetokenizeRequest, GATEWAY_ONLY)}, trust)])
        health = await add_health(server, cfg.host, cfg.health_port)
        self.receiver: Receiver = Receiver(DetokInbox, cfg.host, cfg.zmq_port, name="detokenizer",
                                           plane=self.plane, senders=SENDERS)
        host = cfg.reachable_host()
        self.detok_addr = with_role(tcp_addr(host, self.receiver.port), "tokenizer")
        await server.start()
        metrics_port = metrics.serve_metrics(cfg.host, cfg.metrics_port, "tokenizer")
        addrs = {"zmq": self.detok_addr, "grpc": f"{host}:{grpc_port}"}
        if metrics_port > 0:
            addrs["metrics"] = f"http://{host}:{metrics_port}/metrics"
        self.registry = Registry(cfg.redis_url, RedisAuth.of(trust))
        # max_token_chars: gateways refuse a prompt that cannot fit before sending it (prompt_bounds.py)
        info = {"vocab_size": self.tok.vocab_size, "max_token_chars": self.tok.max_token_chars or 0}
        self.lease = await self.registry.register("tokenizer", self.id, addrs=addrs, info=info, lease_ms=cfg.lease_ms)
        await self._refresh_schedulers()
        await set_serving(health, True)
        log.info("tokenizer ready: grpc %s, detok %s", addrs["grpc"], self.detok_addr)
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]
        code = await run_until_signal(tasks, "tokenizer", log)
        await set_serving(health, False)
        await self.lease.release()
        await self.registry.close()
        await server.stop(0.5)
        await health.stop()
        self.receiver.close()
        self.senders.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        return code

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.receiver.recv()
            read_at, started = time.perf_counter(), self.core.samples_started
            try:
                out = self.handlers[type(msg)](msg)
            except Exception:  # one bad stream must not stop the others
                log.exception("detokenizer failed on a %s", type(msg).__name__)
                continue
            self._send(out)
            if self.core.samples_started != started:   # it carried some request's first tokens
                metrics.DETOK_FIRST_TOKEN.observe(time.perf_counter() - read_at)

    def _send(self, out: list[Envelope]) -> None:
        for env in out:
            if env.dest == SCHEDULER:
                metrics.STOP_HITS.inc()
                for addr in self.scheduler_addrs:
                    self.senders.send(addr, env.msg)
            else:
                self.senders.send(env.dest, env.msg)

    async def _refresh_schedulers(self) -> None:
        self.scheduler_addrs = [r.addrs["zmq"] for r in await self.registry.list("scheduler") if "zmq" in r.addrs]

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ms / 1000)
            metrics.DETOK_STREAMS.set(len(self.core.streams))
            self.core.expire(STREAM_MAX_AGE_S)
            try:
                await self.lease.renew({"streams": len(self.core.streams)})
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
    return run_async(TokenizerService(cfg, plane).run())
