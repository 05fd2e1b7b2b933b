"""The tokenizer service's pieces on real sockets, without its process shell: the gRPC methods
(tokenizer_svc/rpc.py) called through the gateway's one client (services/gateway/text_path.py's
RemoteText), and the detokenizer streams (tokenizer_svc/streams.py) fed by a worker's PUSH socket.
Plaintext planes (Plane.insecure()): the CURVE and TLS checks have their own tests."""
from __future__ import annotations

import asyncio

import pytest

from gpu_worker.make_model import make_model
from services.gateway.backend import inbox_senders
from services.gateway.schemas import ApiError
from services.gateway.text_path import RemoteText
from services.protocol.messages import (
    Abort, DetokenizeRequest, DetokInbox, GatewayInbox, SchedulerInbox, SeqTokens, StepOutput, StreamOpen,
    TextBatch, TokenizeRequest)
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane, with_role
from services.text.requests import bad_words_token_ids
from services.text.tokenizer import load_tokenizer
from services.transport import Receiver, Sender, SenderPool, grpc_server, tcp_addr
from tokenizer_svc.rpc import TokenizerRpc
from tokenizer_svc.streams import SENDERS, DetokStreams

INSECURE = Plane.insecure()
WAIT_S = 10


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_model(tmp_path_factory.mktemp("m") / "tiny", arch="llama", size="tiny",
                                     progress=False))


async def test_tokenize_and_detokenize_over_grpc_with_their_errors_as_400s(tok):
    rpc = TokenizerRpc(tok)
    rpc.detok_addr = "tcp://127.0.0.1:9#tokenizer"
    server, port = grpc_server("127.0.0.1", 0, None)
    rpc.add_to(server, None)
    await server.start()
    text = RemoteText(None, [f"127.0.0.1:{port}"])
    try:
        reply = await text.tokenize(TokenizeRequest(prompt="Hello world"))
        assert reply.prompt_token_ids == tok.encode("Hello world", add_special_tokens=True)
        assert reply.detok_addr == rpc.detok_addr and reply.bad_words_token_ids == []
        reply = await text.tokenize(TokenizeRequest(prompt="Hello world", bad_words=["world"]))
        assert reply.bad_words_token_ids == bad_words_token_ids(tok, ["world"]) != []
        back = await text.detokenize(DetokenizeRequest(token_ids=reply.prompt_token_ids, skip_special_tokens=True))
        assert back.text == "Hello world"
        with pytest.raises(ApiError) as info:
            await text.tokenize(TokenizeRequest(prompt="word " * 50, max_prompt_tokens=5))
        assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", "prompt")
        with pytest.raises(ApiError) as info:
            await text.detokenize(DetokenizeRequest(token_ids=[tok.vocab_size + 5]))
        assert (info.value.status, info.value.param) == (400, "tokens")
    finally:
        await server.stop(0)
        rpc.close()
    with pytest.raises(ApiError) as info:   # no replica answers: retryable
        await text.tokenize(TokenizeRequest(prompt="Hello"))
    assert (info.value.status, info.value.code, info.value.retry_after) == (503, "tokenizer_unavailable", 1)


async def test_streams_send_text_to_the_gateway_and_a_stop_to_the_schedulers(tok):
    inbox = Receiver(DetokInbox, "127.0.0.1", 0, name="detokenizer", plane=INSECURE, senders=SENDERS)
    gateway = Receiver(GatewayInbox, "127.0.0.1", 0, name="gateway", plane=INSECURE,
                       senders=inbox_senders(local_text=False))
    scheduler = Receiver(SchedulerInbox, "127.0.0.1", 0, name="scheduler", plane=INSECURE,
                         senders={Abort: ("tokenizer",)})
    pool: SenderPool = SenderPool(INSECURE)
    streams = DetokStreams(tok, pool)
    streams.scheduler_addrs = [with_role(tcp_addr("127.0.0.1", scheduler.port), "scheduler")]
    worker = Sender(with_role(tcp_addr("127.0.0.1", inbox.port), "tokenizer"), plane=INSECURE)
    loop = asyncio.create_task(streams.run(inbox))
    gw_addr = with_role(tcp_addr("127.0.0.1", gateway.port), "gateway")
    hello = tok.encode(" hello world, hello moon", add_special_tokens=False)
    try:
        for rid, stop in (("plain", []), ("stopped", ["world"])):
            worker.send(StreamOpen(request_id=rid, params=SamplingParams(max_tokens=50, stop=stop),
                                   reply_addr=gw_addr, num_prompt_tokens=1))
        worker.send(StepOutput(worker_id="w", epoch=1, step=1, seqs=[
            SeqTokens("plain", 0, hello), SeqTokens("stopped", 0, hello)]))
        async with asyncio.timeout(WAIT_S):
            batch = await gateway.recv()
            stop = await scheduler.recv()
        assert isinstance(batch, TextBatch)
        got = {d.request_id: (d.text, d.finish_reason) for d in batch.deltas}
        assert got["stopped"] == (" hello ", "stop") and got["plain"][1] is None
        assert isinstance(stop, Abort) and (stop.request_id, stop.index, stop.reason) == ("stopped", 0, "stop")
        assert set(streams.core.streams) == {"plain"}
    finally:
        loop.cancel()
        worker.close()
        pool.close()
        for r in (inbox, gateway, scheduler):
            r.close()
