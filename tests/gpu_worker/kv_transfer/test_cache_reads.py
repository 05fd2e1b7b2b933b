"""Same-host hand-offs in which D reads P's cache itself (kv_transfer/cuda_ipc.py), on the CPU: P's
cache is shared through torch's shared memory, as a CUDA one is through CUDA IPC, and the
protocol (Offer with the source, Accept.reads_cache, Done with P's blocks, Ack) is the services'
code over a real loopback socket. Tokens are one engine's; nothing leaks on either side whether
D reads, falls back to frames (a source it cannot open), or the request is aborted mid-read."""
from __future__ import annotations

import math
import threading
import time

import msgspec
import pytest
import torch

from gpu_worker.kv_transfer import cuda_ipc
from gpu_worker.kv_transfer.messages import Accept, CacheSource, Done, SharedTensor, decode, encode
from gpu_worker.kv_transfer.shm import host_identity
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
from gpu_worker.service.handoff_peer import PeerSender
from services.protocol.messages import Abort, AwaitKV, Dispatch
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import hand_off_round, llama  # noqa: F401  (fixture)
from tests.gpu_worker.service.test_worker_core_handoff import clean

pytestmark = pytest.mark.skipif(not host_identity(), reason="needs /dev/shm and a boot id")


def run_pair(llama, ids: dict, *, source=None, abort: str = "", max_tokens: int = 8, p_engine=None):
    """Hand each prompt from P (cache exported, or `source` offered instead) to D; abort `abort`
    once D accepted it. (tokens, D's receiver, p, d)."""
    p = WorkerCore(p_engine or engine(llama, max_num_batched_tokens=64), "p", 1)
    p.hands_off = p.streams_kv = True
    d = WorkerCore(engine(llama), "d", 1)
    receiver = DecodeReceiver(d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s=10.0, cache_reads=True)
    d.imports = receiver.imports
    sender = PrefillSender(p.engine, Plane.insecure(), lease_s=10.0,
                           cache_source=source or cuda_ipc.export_cache(p.engine))
    sender.producer.max_frame_bytes = 4096
    d_addr = receiver.endpoint.address + "#worker"
    out: list = []
    # P's sender thread sends the aborted request's Done only once the Abort is in: else D could
    # take Accept and Done in one poll and the abort would come after the read, not during it
    abort_sent, read_by_d = threading.Event(), PeerSender._read_by_d

    def held_read_by_d(self, rid, *args):
        if rid == abort:
            abort_sent.wait(timeout=60)
        return read_by_d(self, rid, *args)
    PeerSender._read_by_d = held_read_by_d
    try:
        for rid, toks in ids.items():
            out += d.run([AwaitKV(request_id=rid, epoch=1, n=1, reply_addr="gw", detok_addr="dt")])
            out += p.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=toks, params=greedy(max_tokens),
                                   reply_addr="gw", detok_addr="dt", handoff_to=d_addr)])
        aborted = not abort
        deadline = time.monotonic() + 120
        while (p.requests or p._sending or d.requests or d.awaiting) and time.monotonic() < deadline:
            inbox: list = []
            if not aborted and receiver.endpoint.cache_reader.reading(abort):
                inbox, aborted = [Abort(request_id=abort)], True
            out += p.run(inbox)
            hand_off_round(p, sender, out)
            receiver.poll()
            d.adopt_imports([])
            out += d.run(inbox)
            if inbox:
                abort_sent.set()
            time.sleep(0.001)
        assert aborted, "the aborted request was never accepted for a read"
    finally:
        abort_sent.set()
        PeerSender._read_by_d = read_by_d
        sender.close()
        receiver.close()
    tokens: dict = {}
    for env in out:
        for s in getattr(env.msg, "seqs", None) or []:
            tokens.setdefault(s.request_id, []).extend(s.token_ids)
    return tokens, receiver, p, d


def test_d_reads_p_cache_once_opened_and_tokens_match_one_engine(llama):
    ids = {"a": prompt(150, 60), "b": prompt(90, 61), "c": prompt(40, 62)}
    tokens, receiver, p, d = run_pair(llama, ids)
    want = run_single(engine(llama), [(rid, t, greedy(8)) for rid, t in ids.items()])
    assert {rid: tokens[rid] for rid in ids} == {rid: want[(rid, 0)] for rid in ids}
    reader = receiver.endpoint.cache_reader
    assert reader.blocks_read == sum(-(-len(t) // 16) for t in ids.values())   # every block, none framed
    assert receiver.imports.frames_dropped == 0 and receiver.endpoint.shm_frames == 0
    assert reader.sources_opened == 1                  # opened once for every request
    assert clean(p) and clean(d)


def _mutated(source: CacheSource, how: str) -> CacheSource:
    if how == "host":
        return msgspec.structs.replace(source, host="elsewhere/0")
    if how == "kind":
        return msgspec.structs.replace(source, kind="cuda_ipc")
    if how == "layout":
        return msgspec.structs.replace(source, layout=msgspec.structs.replace(source.layout, block_size=32))
    if how == "tensors":
        return msgspec.structs.replace(source, tensors=source.tensors[:-1])
    bad = [msgspec.structs.replace(t, handle=b"/../../etc/passwd") for t in source.tensors]
    return msgspec.structs.replace(source, tensors=bad)


@pytest.mark.parametrize("how", ["host", "kind", "layout", "tensors", "handle"])
def test_a_source_d_cannot_read_is_refused_with_its_reason_and_frames_go_instead(llama, how):
    p_engine = engine(llama, max_num_batched_tokens=64)
    source = _mutated(cuda_ipc.export_cache(p_engine), how)
    reader = cuda_ipc.CacheReader(DecodeReceiver(engine(llama), Plane.insecure(), "127.0.0.1", 0, 10.0).imports)
    why = reader.open(source)
    assert why and reader.sources() == []
    assert {"host": "another host", "kind": "shared as", "layout": "block_size", "tensors": "do not match",
            "handle": "not a shared cache file"}[how] in why
    if how == "host":                                  # end to end: frames, same tokens
        ids = {"a": prompt(70, 63)}
        tokens, receiver, p, d = run_pair(llama, ids, source=source, p_engine=p_engine)
        assert tokens["a"] == run_single(engine(llama), [("a", ids["a"], greedy(8))])[("a", 0)]
        assert receiver.endpoint.cache_reader.blocks_read == 0
        assert clean(p) and clean(d)


def test_an_abort_mid_read_frees_both_sides(llama):
    ids = {"a": prompt(200, 64), "b": prompt(120, 65)}
    tokens, receiver, p, d = run_pair(llama, ids, abort="a", max_tokens=12)
    assert tokens["b"] == run_single(engine(llama), [("b", ids["b"], greedy(12))])[("b", 0)]
    assert len(tokens.get("a", [])) < 12
    assert not receiver.endpoint.cache_reader.reading("a")
    assert clean(p) and clean(d)


def test_blocks_land_where_accept_mapped_them_and_a_lapsed_hold_is_refused(llama):
    """P's blocks src[i] -> D's dst[i], every layer, K and V; a Done whose hold has passed (P may
    reuse its blocks), that names other blocks or no finite hold fails the request on D, freeing its
    blocks."""
    p_eng, d_eng = engine(llama), engine(llama)
    for k, v in p_eng.runner.kv_caches:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    source = cuda_ipc.export_cache(p_eng)
    rx = DecodeReceiver(d_eng, Plane.insecure(), "127.0.0.1", 0, 10.0, cache_reads=True)
    reader = rx.endpoint.cache_reader
    assert reader.open(source) == ""
    p_eng.add_request("r", prompt(50, 66), greedy(4), export_kv=True)
    for _ in range(100):
        if "r" in p_eng.exported:
            break
        p_eng.step()
    from gpu_worker.kv_transfer.connector import EngineKVProducer
    producer = EngineKVProducer(p_eng)
    outcomes = []
    for i, (hold, src_len) in enumerate(((-1.0, 0), (10.0, -1), (math.nan, 0), (10.0, 0))):
        rid = f"r{i}"                                 # D's request: P's offer under another id
        rx.imports.await_request(rid)
        accept = rx.imports.accept(msgspec.structs.replace(producer.offer("r"), request_id=rid))
        assert isinstance(accept, Accept)
        reader.expect(rid, source.source_id)
        table = producer.block_table("r")
        src = table[accept.first_block:len(table) + src_len]
        outcomes.append(reader.read(Done(rid, 0, src_block_ids=src, hold_until=time.monotonic() + hold)))
    assert [type(o).__name__ for o in outcomes] == ["Fail", "Fail", "Fail", "Ack"]
    assert "hold" in outcomes[0].reason and "do not match" in outcomes[1].reason
    assert "hold_until" in outcomes[2].reason             # NaN: it would pass every lapse check
    assert d_eng.block_manager.num_used_blocks == len(accept.dst_block_ids)     # the failed ones freed
    for (pk, pv), (dk, dv) in zip(p_eng.runner.kv_caches, d_eng.runner.kv_caches):
        assert torch.equal(dk[accept.dst_block_ids], pk[src]) and torch.equal(dv[accept.dst_block_ids], pv[src])
    producer.release("r")
    rx.close()


def test_cache_messages_round_trip_and_are_bounded(llama):
    source = cuda_ipc.export_cache(engine(llama))
    offer_like = Done("r", 0, src_block_ids=[3, 1, 2], hold_until=12.5)
    assert decode(encode(offer_like)) == offer_like
    assert decode(encode(Accept("r", source.layout, 1, [4], reads_cache=True))).reads_cache
    blob = encode(msgspec.structs.replace(source))
    assert msgspec.msgpack.decode(blob, type=CacheSource) == source
    huge = msgspec.structs.replace(source, tensors=[source.tensors[0]] * 1025)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(huge), type=CacheSource)
    long_handle = SharedTensor(b"x" * 513, 1, 0, 0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(long_handle), type=SharedTensor)
