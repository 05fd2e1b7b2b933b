"""The gRPC and Redis planes of a real stack refuse whoever lacks the deployment's keys: Redis
without the password (no reading addresses, no fake worker record), gRPC without a certificate of
the trust CA, or with one of a role the method does not serve. And a gateway that stops ends its
open streams with an error chunk and [DONE]."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import redis.exceptions

from services.protocol.kv_events import PREFIX_GRPC_SERVICE, MatchRequest, MatchResponse, pack_token_ids
from services.protocol.messages import TokenizeReply, TokenizeRequest
from services.security import bundle
from services.transport import grpc_channel, unary_stub
from tests.integration.conftest import free_port
from tests.integration.stack import ROOT, records, wait_for, wait_ready

TOKENIZER = "kvmesh.Tokenizer"
TIMEOUT_S = 10
FAKE_WORKER = json.dumps({"kind": "worker", "id": "evil", "epoch": 1, "addrs": {"zmq": "tcp://127.0.0.1:1"},
                          "info": {"model": "tiny-llama"}})


def assert_refuses_without_password(url: str) -> None:
    plain = redis.Redis.from_url(url, socket_timeout=5)
    try:
        for command in (lambda: plain.keys("*"), lambda: plain.set("kvmesh:svc:worker:evil", FAKE_WORKER),
                        lambda: plain.sadd("kvmesh:svc:worker", "evil")):
            with pytest.raises(redis.exceptions.AuthenticationError, match="(?i)auth"):   # NOAUTH
                command()
    finally:
        plain.close()


def test_the_test_stacks_redis_refuses_a_client_without_the_password(stack):
    assert_refuses_without_password(stack.procs.redis_url)
    assert not [r for r in records(stack.redis_url, "worker") if r.id == "evil"]


def call(target: str, trust, server_role: str, method: str, request, reply_type) -> grpc.StatusCode:
    """The status of one call (OK when it answered)."""
    service = PREFIX_GRPC_SERVICE if server_role == "prefix-cache" else TOKENIZER

    async def go() -> grpc.StatusCode:
        channel = (grpc.aio.insecure_channel(target) if trust is None
                   else grpc_channel(target, trust, server_role))
        async with channel:
            try:
                await unary_stub(channel, service, method, reply_type)(request, timeout=TIMEOUT_S)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()
    return asyncio.run(go())


def test_tokenize_needs_the_gateways_certificate(stack, tmp_path):
    [tok] = records(stack.redis_url, "tokenizer")
    target, req = tok.addrs["grpc"], TokenizeRequest(prompt="hello")
    trust_dir = stack.procs.trust_dir
    other_ca = bundle.load(bundle.generate(tmp_path / "other").root, "gateway")
    # the other deployment's gateway certificate, trusting this deployment's CA: the server refuses it
    foreign = other_ca._replace(ca_cert=bundle.load(trust_dir, "gateway").ca_cert)
    assert call(target, None, "tokenizer", "Tokenize", req, TokenizeReply) == grpc.StatusCode.UNAVAILABLE
    assert call(target, foreign, "tokenizer", "Tokenize", req, TokenizeReply) == grpc.StatusCode.UNAVAILABLE
    for role in ("worker", "scheduler", "prefix-cache"):
        assert call(target, bundle.load(trust_dir, role), "tokenizer", "Detokenize", req,
                    TokenizeReply) == grpc.StatusCode.PERMISSION_DENIED, role
        assert call(target, bundle.load(trust_dir, role), "tokenizer", "Tokenize", req,
                    TokenizeReply) == grpc.StatusCode.PERMISSION_DENIED, role
    assert call(target, bundle.load(trust_dir, "gateway"), "tokenizer", "Tokenize", req,
                TokenizeReply) == grpc.StatusCode.OK


def test_match_needs_the_schedulers_certificate(stack):
    [index] = records(stack.redis_url, "prefix-cache")
    target, trust_dir = index.addrs["grpc"], stack.procs.trust_dir
    req = MatchRequest(model_id="m", tokens=pack_token_ids([1, 2, 3, 4]))
    assert call(target, None, "prefix-cache", "Match", req, MatchResponse) == grpc.StatusCode.UNAVAILABLE
    for role in ("gateway", "worker", "tokenizer"):
        assert call(target, bundle.load(trust_dir, role), "prefix-cache", "Match", req,
                    MatchResponse) == grpc.StatusCode.PERMISSION_DENIED, role
    assert call(target, bundle.load(trust_dir, "scheduler"), "prefix-cache", "Match", req,
                MatchResponse) == grpc.StatusCode.OK


def test_a_malformed_grpc_call_is_invalid_argument_without_a_traceback(stack):
    [tok] = records(stack.redis_url, "tokenizer")
    trust = bundle.load(stack.procs.trust_dir, "gateway")
    log_path = stack.procs.log_dir / "tokenizer.log"
    logged_before = len(log_path.read_text(errors="replace"))   # the session stack: other tests' lines

    async def go() -> list[grpc.StatusCode]:
        async with grpc_channel(tok.addrs["grpc"], trust, "tokenizer") as ch:
            raw = ch.unary_unary(f"/{TOKENIZER}/Tokenize")
            codes = []
            for _ in range(20):   # a small flood: one log line, not one each
                try:
                    await raw(b"\xc1not msgpack", timeout=TIMEOUT_S)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            return codes
    assert set(asyncio.run(go())) == {grpc.StatusCode.INVALID_ARGUMENT}
    log = log_path.read_text(errors="replace")
    assert "Traceback" not in log
    assert log[logged_before:].count("refused a malformed call") == 1
    assert stack.openai().completions.create(model=stack.model_name, prompt="hi", max_tokens=2).choices


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0")]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode(errors="replace").partition("=")[::2] for e in f.read().split(b"\0") if e)


def test_kvmesh_serve_locks_redis_and_ends_streams_when_the_gateway_stops(tiny_model, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["KVMESH_SHUTDOWN_GRACE_S"] = "1"     # the gateway's: streams in flight get 1 s to finish
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model", tiny_model, "--port", str(port),
                             "--null-model", "--null-step-ms", "50", "--heartbeat-ms", "250", "--lease-ms", "1500"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, 120)
        children = {pid: _argv(pid) for pid in _children(proc.pid)}
        gateway = next(pid for pid, argv in children.items() if "gateway" in argv)
        redis_url = _environ(gateway)["KVMESH_REDIS_URL"]
        password = (Path(_flag(children[gateway], "--trust-dir")) / "redis.password").read_text().strip()
        assert_refuses_without_password(redis_url)
        for argv in children.values():   # Redis included: its password is in a 0600 config file
            assert not any(password in a for a in argv)
        assert httpx.post(base + "/v1/completions", json={"model": Path(tiny_model).name, "prompt": "x",
                                                          "max_tokens": 2}, timeout=60).status_code == 200

        # a stream still running past the gateway's shutdown grace ends with an error chunk and [DONE]
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": Path(tiny_model).name, "prompt": "x", "max_tokens": 1000, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()
        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30), "no first chunk"
        os.kill(gateway, signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive(), "the stream did not end"
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutdown" and error["type"] == "server_error" and error["message"]
        wait_ready(base, 60)      # kvmesh serve restarts its gateway (the supervisor's job)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
