"""Method mtp through the worker shells' hand-off (PrefillSender -> DecodeReceiver over a real
loopback socket): P prefills in chunks and streams its blocks while it computes, the MTP layer's
KV rides as the layer after the target's and P's last prompt hidden state comes with Done. Over
inline ZMQ frames, the shared-memory ring, and D's read of P's (CPU, shared-memory) cache, every
draft D draws equals one computed from scratch, D drafts from its first step, tokens are a mixed
engine's, and no block is left behind."""
from __future__ import annotations

import time

import pytest

from gpu_worker.kv_transfer import cuda_ipc, shm
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
from services.protocol.messages import AwaitKV, Dispatch
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import hand_off_round
from tests.gpu_worker.service.test_worker_core_handoff import clean
from tests.gpu_worker.spec_decode.mtp_models import Recompute, mtp_spec, random_mtp, spy_first_drafts

pytestmark = pytest.mark.skipif(not shm.host_identity(), reason="needs /dev/shm and a boot id")
MAX_TOKENS = 6
IDS = {"a": prompt(50, 31), "b": prompt(21, 32)}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return random_mtp("llama", tmp_path_factory.mktemp("mtp_pd") / "llama")


@pytest.fixture(scope="module")
def mixed(mtp_model) -> dict:
    """IDS' tokens on one engine with the same speculation."""
    return run_single(mtp_engine(mtp_model), [(rid, t, greedy(MAX_TOKENS)) for rid, t in IDS.items()])


def mtp_engine(model_dir: str, **kw):
    return engine(model_dir, speculative_config=mtp_spec(3), **kw)


def run_pair(model_dir: str, ids: dict, transport: str):
    """Each prompt from P (chunks of 16, streamed) to D by `transport`; (tokens, D's first drafts
    (mtp_models.spy_first_drafts), D's receiver, p, d)."""
    p = WorkerCore(mtp_engine(model_dir, max_num_batched_tokens=16), "p", 1)
    p.hands_off = p.streams_kv = True
    d = WorkerCore(mtp_engine(model_dir), "d", 1)
    receiver = DecodeReceiver(d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s=10.0,
                              shm=transport == "shm", cache_reads=transport == "cache_read")
    d.imports = receiver.imports
    drafts = spy_first_drafts(d.engine)
    sender = PrefillSender(p.engine, Plane.insecure(), lease_s=10.0,
                           shm_ring_bytes=64 << 10 if transport == "shm" else 0,
                           cache_source=cuda_ipc.export_cache(p.engine) if transport == "cache_read" else None)
    sender.producer.max_frame_bytes = 4096          # several frames per block group: the MTP layer's apart
    d_addr = receiver.endpoint.address + "#worker"
    out: list = []
    streamed = 0
    try:
        for rid, toks in ids.items():
            out += d.run([AwaitKV(request_id=rid, epoch=1, n=1, reply_addr="gw", detok_addr="dt")])
            out += p.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=toks, params=greedy(MAX_TOKENS),
                                   reply_addr="gw", detok_addr="dt", handoff_to=d_addr)])
        deadline = time.monotonic() + 60
        while (p.requests or p._sending or d.requests or d.awaiting) and time.monotonic() < deadline:
            out += p.run([])
            for rid, to, first, blocks in p.take_stream_blocks():   # as EngineThread._hand_off
                streamed += len(blocks)
                if not sender.stream(rid, to, first, blocks):
                    p.stop_streaming(rid)
            hand_off_round(p, sender, out)
            receiver.poll()
            d.adopt_imports([])
            out += d.run([])
            time.sleep(0.001)
    finally:
        sender.close()
        receiver.close()
    assert streamed > 0 or transport == "cache_read"      # a D that reads P's cache reads it once, at the end
    tokens: dict = {}
    for env in out:
        for s in getattr(env.msg, "seqs", None) or []:
            tokens.setdefault(s.request_id, []).extend(s.token_ids)
    return tokens, drafts, receiver, p, d


@pytest.mark.parametrize("transport", ["frames", "shm", "cache_read"])
def test_mtp_state_crosses_each_transport(mtp_model, mixed, transport):
    tokens, drafts, receiver, p, d = run_pair(mtp_model, IDS, transport)
    assert {rid: tokens[rid] for rid in IDS} == {rid: mixed[(rid, 0)] for rid in IDS}
    ref = Recompute(mtp_model)
    assert drafts and [g for _, g in drafts] == [ref.first_draft(t) for t, _ in drafts]
    for rid, toks in IDS.items():                  # D drafted right after P's first token
        assert any(len(t) == len(toks) + 1 and t[:len(toks)] == toks for t, _ in drafts), rid
    if transport == "shm":
        assert receiver.endpoint.shm_frames > 0
    if transport == "cache_read":
        assert receiver.endpoint.cache_reader.blocks_read > 0
    assert p.engine.speculator.stats.proposed == 0
    assert clean(p) and clean(d)
