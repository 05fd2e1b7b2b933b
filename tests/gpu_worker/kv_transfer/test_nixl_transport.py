"""The NIXL path (UCX, host memory on this machine): D reads the blocks it lacks from P's
registered KV cache; tokens are those of one engine and only the missing blocks move."""
from __future__ import annotations

import pytest

from gpu_worker.kv_transfer.connector import EngineKVConsumer, EngineKVProducer
from gpu_worker.kv_transfer.layout import KVLayoutMismatch
from gpu_worker.kv_transfer.messages import Accept, Ack, Fail
from tests.gpu_worker.kv_transfer.conftest import MAX_STEPS, check_clean, collect, engine, greedy, prompt, run_single

nixl_transport = pytest.importorskip("gpu_worker.kv_transfer.nixl_transport")
pytest.importorskip("nixl", reason="the nixl extra is not installed")


def prefill(p, rid, ids, params) -> None:
    p.add_request(rid, ids, params, export_kv=True)
    for _ in range(MAX_STEPS):
        if rid in p.exported:
            return
        p.step()
    raise AssertionError("the prefill did not end")


def test_d_reads_the_missing_blocks_from_p(llama):
    p, d = engine(llama, enable_prefix_caching=False), engine(llama)
    producer, consumer = EngineKVProducer(p), EngineKVConsumer(d)
    source = nixl_transport.NixlKVAgent(p, "p0")
    reader = nixl_transport.NixlKVReader(consumer, nixl_transport.NixlKVAgent(d, "d0"))
    reader.connect(source.peer())
    shared = prompt(48, 1)
    requests = [("first", shared + prompt(5, 2), greedy(10)), ("second", shared + prompt(7, 3), greedy(10, n=2))]
    out: dict = {}
    for rid, ids, params in requests:
        prefill(p, rid, ids, params)
        first = {s.index: s.token_ids[-1] for s in p.exported[rid].seqs}
        for index, token in first.items():
            out[(rid, index)] = [token]
        offer = producer.offer(rid)
        accept = consumer.accept(offer)
        assert isinstance(accept, Accept)
        assert accept.first_block == (0 if rid == "first" else 3)       # D's prefix hit: 3 blocks stay
        assert isinstance(reader.pull("p0", offer, accept), Ack)
        producer.release(rid)
        for _ in range(MAX_STEPS):
            if not d.has_unfinished_requests():
                break
            collect(out, d.step())
    assert consumer.blocks_received == 4 + 1
    assert producer.bytes_sent == 0                                     # no frame was sent
    assert out == run_single(engine(llama), requests)
    check_clean(p)
    check_clean(d)


def test_a_mismatched_or_bogus_source_moves_nothing(llama):
    p, d = engine(llama), engine(llama)
    producer, consumer = EngineKVProducer(p), EngineKVConsumer(d)
    reader = nixl_transport.NixlKVReader(consumer, nixl_transport.NixlKVAgent(d, "d1"))
    with pytest.raises(KVLayoutMismatch, match="block_size"):
        reader.connect(nixl_transport.NixlKVAgent(engine(llama, block_size=32), "p_wrong").peer())
    source = nixl_transport.NixlKVAgent(p, "p1")        # alive while D reads from it
    reader.connect(source.peer())
    prefill(p, "r", prompt(40, 4), greedy(10))
    offer = producer.offer("r")
    accept = consumer.accept(offer)
    bogus = type(offer)(**{**{f: getattr(offer, f) for f in offer.__struct_fields__}, "src_block_ids": [10**6] * 3})
    assert isinstance(reader.pull("p1", bogus, accept), Fail)
    producer.release("r")
    check_clean(p)
    check_clean(d)


def _listening_addresses() -> set[str]:
    """IPv4 addresses this process listens on (LISTEN sockets among its own file descriptors)."""
    import os
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = set()
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:            # TCP_LISTEN
                ip = bytes.fromhex(cols[1].split(":")[0])[::-1]
                addresses.add(".".join(map(str, ip)))
    return addresses


def test_the_agent_listens_on_loopback_only(llama):
    agent = nixl_transport.NixlKVAgent(engine(llama), "p_lo")
    try:
        addresses = _listening_addresses()
        assert addresses and addresses <= {"127.0.0.1"}, addresses
    finally:
        agent.close()
