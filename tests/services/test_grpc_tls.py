"""gRPC with mutual TLS (services/security/tls.py through services/transport.py): a caller needs a
certificate from the trust CA, of a role the method allows; a malformed call is INVALID_ARGUMENT
with one log line; Kubernetes probes reach health, and only health, on a plaintext probe port."""
from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.protocol.messages import TokenizeReply, TokenizeRequest
from services.security import bundle
from services.transport import Method, add_health, grpc_channel, grpc_server, set_serving, unary_handler, unary_stub

SERVICE = "kvmesh.T"
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def trust_root(tmp_path_factory):
    return bundle.generate(tmp_path_factory.mktemp("trust") / "trust").root


@pytest.fixture(scope="module")
def other_ca_root(tmp_path_factory):
    """A complete trust directory of another deployment: valid-looking certificates, another CA."""
    return bundle.generate(tmp_path_factory.mktemp("other") / "trust").root


async def tokenize(req: TokenizeRequest, context) -> TokenizeReply:
    return TokenizeReply(prompt_token_ids=[len(req.prompt)], detok_addr="d", vocab_size=5)


@pytest.fixture
async def tls_tokenizer(trust_root):
    """A mutual-TLS server as the tokenizer: Tokenize for the gateway only, health, a probe port."""
    trust = bundle.load(trust_root, "tokenizer")
    server, port = grpc_server("127.0.0.1", 0, trust)
    server.add_generic_rpc_handlers([unary_handler(
        SERVICE, {"Tokenize": Method(tokenize, TokenizeRequest, frozenset({"gateway"}))}, trust)])
    health = await add_health(server, "127.0.0.1", 0)
    await server.start()
    await set_serving(health, True)
    try:
        yield port, health.probe_port
    finally:
        await health.stop()
        await server.stop(0)


async def call_tokenize(channel: grpc.aio.Channel, request=TokenizeRequest(prompt="abc")) -> TokenizeReply:
    return await unary_stub(channel, SERVICE, "Tokenize", TokenizeReply)(request, timeout=TIMEOUT_S)


async def status_of(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code()


async def test_the_allowed_role_is_served(tls_tokenizer, trust_root):
    port, _ = tls_tokenizer
    async with grpc_channel(f"127.0.0.1:{port}", bundle.load(trust_root, "gateway"), "tokenizer") as ch:
        assert (await call_tokenize(ch)).prompt_token_ids == [3]


async def test_a_caller_without_a_certificate_fails_the_handshake(tls_tokenizer, trust_root):
    port, _ = tls_tokenizer
    ca_only = grpc.ssl_channel_credentials(root_certificates=bundle.load(trust_root, "gateway").ca_cert)
    options = [("grpc.ssl_target_name_override", bundle.tls_name("tokenizer"))]
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", ca_only, options=options) as ch:
        assert await status_of(call_tokenize(ch)) == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:   # plaintext to a TLS port
        assert await status_of(call_tokenize(ch)) == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_of_another_ca_fails_the_handshake(tls_tokenizer, trust_root, other_ca_root):
    port, _ = tls_tokenizer
    foreign = bundle.load(other_ca_root, "gateway")._replace(ca_cert=bundle.load(trust_root, "gateway").ca_cert)
    async with grpc_channel(f"127.0.0.1:{port}", foreign, "tokenizer") as ch:
        assert await status_of(call_tokenize(ch)) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_refuses_a_server_of_another_ca(tls_tokenizer, other_ca_root):
    port, _ = tls_tokenizer
    async with grpc_channel(f"127.0.0.1:{port}", bundle.load(other_ca_root, "gateway"), "tokenizer") as ch:
        assert await status_of(call_tokenize(ch)) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_refuses_a_server_of_another_role(tls_tokenizer, trust_root):
    """The scheduler dials an address from Redis expecting the prefix-cache index: a tokenizer's
    certificate there (a stale or forged record) is refused."""
    port, _ = tls_tokenizer
    async with grpc_channel(f"127.0.0.1:{port}", bundle.load(trust_root, "scheduler"), "prefix-cache") as ch:
        assert await status_of(call_tokenize(ch)) == grpc.StatusCode.UNAVAILABLE


async def test_the_wrong_role_is_permission_denied(tls_tokenizer, trust_root):
    port, _ = tls_tokenizer
    for role in ("worker", "scheduler", "prefix-cache", "tokenizer"):
        async with grpc_channel(f"127.0.0.1:{port}", bundle.load(trust_root, role), "tokenizer") as ch:
            assert await status_of(call_tokenize(ch)) == grpc.StatusCode.PERMISSION_DENIED, role
            # health: anyone holding a certificate of the deployment
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_malformed_call_is_invalid_argument_with_one_log_line(tls_tokenizer, trust_root, caplog):
    port, _ = tls_tokenizer
    caplog.set_level(logging.WARNING)
    async with grpc_channel(f"127.0.0.1:{port}", bundle.load(trust_root, "gateway"), "tokenizer") as ch:
        raw = ch.unary_unary(f"/{SERVICE}/Tokenize", request_serializer=None, response_deserializer=None)
        for frame in (b"\xff\x00garbage", b"\x81\xa6prompt\x07", b""):
            assert await status_of(raw(frame, timeout=TIMEOUT_S)) == grpc.StatusCode.INVALID_ARGUMENT
        assert (await call_tokenize(ch)).prompt_token_ids == [3]   # and it still serves
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"


async def test_probes_reach_health_and_nothing_else_on_the_plaintext_probe_port(tls_tokenizer):
    _, probe_port = tls_tokenizer
    async with grpc.aio.insecure_channel(f"127.0.0.1:{probe_port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert await status_of(call_tokenize(ch)) == grpc.StatusCode.UNIMPLEMENTED
