"""Prefill/decode disaggregation end to end: a prefill worker and a decode worker (real processes,
CURVE planes, a real Redis) serve what one engine serves, token for token, and leave no KV block held."""
from __future__ import annotations

import glob
import time

import pytest

from tests.integration.pd_stack import CHUNK, PD_MIN_PREFILL_TOKENS, pd_stack
from tests.integration.stack import wait_for

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    with pd_stack(tiny_model, tmp_path_factory.mktemp("pd-logs")) as stack:
        yield stack


def offline(model: str, prompt: list[int], **params) -> list[list[int]]:
    """What one (mixed) engine generates: every sample's tokens."""
    from gpu_worker.config import EngineConfig
    from gpu_worker.engine import Engine
    from services.protocol.sampling import SamplingParams

    eng = Engine(EngineConfig(model=model, device="cpu", num_gpu_blocks=256))
    sp = SamplingParams(ignore_eos=True, **params)
    eng.add_request("r", prompt, sp)
    tokens: dict[int, list[int]] = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            tokens.setdefault(d.index, []).extend(d.new_token_ids)
    eng.close()
    return [tokens[i] for i in range(sp.n)]


def served(pd, prompt: list[int], **params) -> list[str]:
    r = pd.openai().completions.create(model=pd.model.rsplit("/", 1)[-1], prompt=prompt,
                                       extra_body={"ignore_eos": True}, **params)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def texts(model: str, samples: list[list[int]]) -> list[str]:
    from services.text.tokenizer import load_tokenizer
    tok = load_tokenizer(model)
    return [tok.decode(s) for s in samples]


LONG = [(7 * i + 3) % 1000 + 5 for i in range(4 * CHUNK + 5)]     # several prefill chunks on P


@pytest.mark.parametrize("prompt", [LONG[:PD_MIN_PREFILL_TOKENS + 3], LONG], ids=["one-chunk-plus", "chunked"])
def test_greedy_through_prefill_and_decode_matches_one_engine(pd, prompt):
    before, segments = pd.route_count("pd"), set(glob.glob("/dev/shm/kvmesh-kv-*"))
    got = served(pd, prompt, max_tokens=12, temperature=0)
    assert got == texts(pd.model, offline(pd.model, prompt, max_tokens=12, temperature=0))
    assert pd.route_count("pd") == before + 1
    assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoffs_total", 'outcome="ack"') >= 1
    if len(prompt) > 2 * CHUNK:       # the first chunks' full blocks went to D while P prefilled the rest
        assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoff_streamed_blocks_total") >= 2
    # one host: the default --kv-transport auto put the payloads in shared memory, and D unlinked them
    assert pd.worker_metric("prefill-0", "kvmesh_worker_kv_handoff_shm_frames_total") >= 1
    assert set(glob.glob("/dev/shm/kvmesh-kv-*")) <= segments


def test_short_prompt_runs_on_the_decode_worker_alone(pd):
    before = pd.route_count("decode_short")
    prompt = [11, 12, 13, 14, 15]
    assert served(pd, prompt, max_tokens=8, temperature=0) == texts(
        pd.model, offline(pd.model, prompt, max_tokens=8, temperature=0))
    assert pd.route_count("decode_short") == before + 1


def test_n_samples_and_seeded_sampling_match_one_engine(pd):
    prompt = [(5 * i + 1) % 900 + 3 for i in range(PD_MIN_PREFILL_TOKENS + 20)]
    params = dict(max_tokens=10, temperature=0.9, top_p=0.95, n=3, seed=1234)
    assert served(pd, prompt, **params) == texts(pd.model, offline(pd.model, prompt, **params))


def test_prefix_held_by_the_decode_worker_skips_prefill(pd):
    """The first run moves the KV to D, whose imported blocks are published as its own: the same
    conversation's next turn is routed to D alone (decode_cached) and still matches one engine."""
    prompt = [(3 * i + 2) % 800 + 9 for i in range(3 * CHUNK)]
    expected = texts(pd.model, offline(pd.model, prompt, max_tokens=6, temperature=0))
    assert served(pd, prompt, max_tokens=6, temperature=0) == expected
    before = pd.route_count("decode_cached")

    def routed_to_d_alone() -> bool:
        assert served(pd, prompt, max_tokens=6, temperature=0) == expected
        return pd.route_count("decode_cached") > before
    wait_for(routed_to_d_alone, 30, "a request routed to the decode worker that holds its prefix", interval=0.5)


def test_prefix_hit_on_the_prefill_worker(pd):
    """A longer turn of a conversation P has prefilled: P reuses its cached blocks, D gets them all."""
    history = [(11 * i + 4) % 700 + 21 for i in range(2 * CHUNK)]
    served(pd, history, max_tokens=2, temperature=0)
    turn = history + [(13 * i + 6) % 500 + 40 for i in range(2 * CHUNK + 3)]
    hits = pd.load("prefill-0")["prefix_hit_tokens"]
    assert served(pd, turn, max_tokens=8, temperature=0) == texts(
        pd.model, offline(pd.model, turn, max_tokens=8, temperature=0))
    wait_for(lambda: pd.load("prefill-0")["prefix_hit_tokens"] > hits, 10, "P's prefix hit counted")


def test_no_block_stays_held_after_requests_end(pd):
    served(pd, LONG, max_tokens=4, temperature=0)
    for worker in ("prefill-0", "decode-0"):
        wait_for(lambda: pd.no_blocks_held(worker), 10, f"{worker} to hold no block")


def test_bad_transfer_messages_are_dropped_and_the_decode_worker_keeps_serving(pd):
    """D's KV socket is a CURVE server for the worker role: a garbage header, a truncated frame, an
    offer D does not await and an oversize message are dropped (answered where the protocol
    answers) and logged; another role's key gets no answer; D then still takes hand-offs."""
    import zmq

    from gpu_worker.kv_transfer.layout import KVLayout
    from gpu_worker.kv_transfer.messages import BlockFrame, Fail, Offer, Refuse, SampleStart, decode, encode
    from services.protocol.sampling import SamplingParams
    from services.security.curve import Plane, split_role

    record = pd.record("decode-0")
    endpoint, role = split_role(record.addrs["kv"])
    assert role == "worker" and endpoint.startswith("tcp://127.0.0.1:")

    def dealer(as_role: str):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        Plane.load(str(pd.procs.trust_dir), as_role).connect(sock, "worker")
        sock.connect(endpoint)
        return sock

    def answer(sock, timeout_ms: int = 5000):
        return decode(sock.recv()) if sock.poll(timeout_ms) else None

    layout = KVLayout(**record.info["kv_layout"])
    offer = Offer(request_id="r-" + "0" * 32, layout=layout, prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                  seed=1, samples=[SampleStart(0, 5, 0.0)], block_hashes=[], num_blocks=1)
    stranger = dealer("gateway")
    try:
        stranger.send(encode(offer))
        assert answer(stranger, 1500) is None             # the handshake fails: nothing reaches D
    finally:
        stranger.close(0)
    sock = dealer("worker")
    try:
        sock.send(b"\x00 not a message")
        frame = BlockFrame(request_id="r-" + "1" * 32, seq_no=0, layer_start=0, layer_end=1, block_start=0,
                           src_block_ids=[0], dst_block_ids=[0], dtype=layout.kv_dtype,
                           shape=[1, 2, 1, layout.block_size, layout.num_kv_heads, layout.head_dim],
                           checksum=b"\x00" * 16)
        sock.send_multipart([encode(frame), b"truncated"])
        reply = answer(sock)
        assert isinstance(reply, Fail) and reply.request_id == frame.request_id
        sock.send(encode(offer))
        reply = answer(sock)
        assert isinstance(reply, Refuse) and "does not await" in reply.reason
        sock.send(b"\x00" * ((64 << 20) + (2 << 20)))      # past the frame bound: D drops the connection
        time.sleep(0.5)
    finally:
        sock.close(0)
    log = (pd.procs.log_dir / "decode-0.log").read_text(errors="replace")
    assert "dropped a malformed message" in log and "no transfer in progress" in log
    fresh = [(17 * i + 9) % 900 + 11 for i in range(3 * CHUNK)]       # cached nowhere: P hands it to D
    test_greedy_through_prefill_and_decode_matches_one_engine(pd, fresh)
