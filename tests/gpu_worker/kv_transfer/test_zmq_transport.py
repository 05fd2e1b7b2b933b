"""The hand-off over real sockets between two processes: P here, D in decode_process.py. Tokens
are those of one engine; garbage on D's socket is dropped and D serves on; a frame corrupted in
flight fails only its request (P is told, both free the blocks); P whose D is gone gives up
within its timeout and frees its blocks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from gpu_worker.kv_transfer.connector import EngineKVConsumer, EngineKVProducer
from gpu_worker.kv_transfer.messages import Ack, BlockFrame, Done, Fail, Offer, encode
from gpu_worker.kv_transfer.zmq_transport import KVSenderEndpoint
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, check_clean, engine, greedy, prompt, run_single

ROOT = Path(__file__).resolve().parents[3]
HELPER = Path(__file__).with_name("decode_process.py")


class CorruptingProducer(EngineKVProducer):
    """Flips one byte of the second frame of the requests named in `corrupt`."""

    def __init__(self, engine, corrupt: set[str], **kw) -> None:
        super().__init__(engine, **kw)
        self.corrupt = corrupt

    def frames(self, accept):
        for frame, payload in super().frames(accept):
            if accept.request_id in self.corrupt and frame.seq_no == 1:
                data = bytearray(payload)
                data[0] ^= 0xFF
                payload = memoryview(bytes(data))
            yield frame, payload


def prefill(p, rid, ids, params) -> None:
    p.add_request(rid, ids, params, export_kv=True)
    for _ in range(MAX_STEPS):
        if rid in p.exported:
            return
        p.step()
    raise AssertionError("the prefill did not end")


@pytest.fixture
def decode_process(llama):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(HELPER), llama, "2", "120"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


def send_garbage(address: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    frame = BlockFrame("ghost", 0, 0, 1, 0, [1], [1], "float32", [1, 2, 1, 16, 2, 16], b"\0" * 16)
    for parts in ([b"\x00not msgpack"], [b"\x92\x01"], [encode(frame)],      # no payload
                  [encode(frame), b"x" * 100],                                # unknown request
                  [encode(Done("ghost", 3)), b"extra"], [b""] * 3):
        sock.send_multipart(parts)
    sock.close()


def test_hand_off_between_two_processes(llama, decode_process):
    port = json.loads(decode_process.stdout.readline())["port"]
    address = f"tcp://127.0.0.1:{port}"
    send_garbage(address)
    requests = [("short", prompt(9, 1), greedy(10)), ("long", prompt(120, 2), greedy(10, n=2))]
    broken = ("broken", prompt(50, 3), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    p = engine(llama)
    producer = CorruptingProducer(p, corrupt={"broken"}, max_frame_bytes=4096)   # many frames
    sender = KVSenderEndpoint(producer, address)
    first_tokens: dict = {}
    try:
        for rid, ids, params in [broken] + requests:
            prefill(p, rid, ids, params)
            first_tokens[rid] = {s.index: s.token_ids[-1] for s in p.exported[rid].seqs}
            answer = sender.send(rid, timeout_s=60)
            assert isinstance(answer, Fail if rid == "broken" else Ack), answer
            assert "checksum" in answer.reason if rid == "broken" else True
            check_clean(p)                               # released on D's answer
        result = json.loads(decode_process.stdout.readline())
        assert decode_process.wait(timeout=60) == 0
    finally:
        sender.close()
    want = run_single(engine(llama), requests)
    for rid, ids, params in requests:
        for index in range(params.n):
            got = [first_tokens[rid][index]] + result["tokens"][rid][str(index)]
            assert got == want[(rid, index)], (rid, index)
    assert "broken" not in result["tokens"]
    assert result["used_blocks"] == 0
    assert result["messages_dropped"] >= 4 and result["frames_dropped"] >= 2
    assert result["blocks_received"] == 1 + 8


def test_p_gives_up_on_a_silent_d_and_frees_its_blocks(llama):
    sock = zmq.Context.instance().socket(zmq.ROUTER)     # a D that never answers
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    p = engine(llama)
    sender = KVSenderEndpoint(EngineKVProducer(p), f"tcp://127.0.0.1:{port}")
    try:
        prefill(p, "r", prompt(40, 4), greedy(10))
        assert p.block_manager.num_used_blocks == 3
        assert sender.send("r", timeout_s=1.0) is None
        check_clean(p)
        assert sock.poll(1000)                           # the Offer, then the Abort it was sent
        kinds = [msgspec.msgpack.decode(sock.recv_multipart()[1])["type"] for _ in range(2)]
        assert kinds == ["offer", "abort"]
    finally:
        sender.close()
        sock.close(0)


def test_p_gives_up_on_a_d_that_stops_reading_mid_stream(tmp_path):
    """A D that accepted, then stopped reading (hung, or killed): P's sends would block once the
    socket's queue and the kernel's buffers are full (12 MB here is more than they hold); P gives
    up at its deadline and frees its blocks."""
    from gpu_worker.make_model import make_model
    small = str(make_model(tmp_path / "small", arch="llama", size="small", progress=False))
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 1)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    p, d = engine(small, num_gpu_blocks=100), engine(small, num_gpu_blocks=100)
    consumer = EngineKVConsumer(d)
    sender = KVSenderEndpoint(EngineKVProducer(p, max_frame_bytes=1 << 20), f"tcp://127.0.0.1:{port}")
    try:
        prefill(p, "r", prompt(1500, 5), greedy(4))       # 94 blocks: 12.3 MB in 13 frames
        answered = threading.Event()

        def accept_then_stop():                           # a D that answers the Offer, reads no more
            peer, offer = sock.recv_multipart()
            sock.send_multipart([peer, encode(consumer.accept(msgspec.msgpack.decode(offer, type=Offer)))])
            answered.set()
        t = threading.Thread(target=accept_then_stop)
        t.start()
        start = time.monotonic()
        assert sender.send("r", timeout_s=3.0) is None
        assert answered.is_set() and time.monotonic() - start < 20
        t.join(timeout=10)
        check_clean(p)
    finally:
        sender.close()
        sock.close(0)
