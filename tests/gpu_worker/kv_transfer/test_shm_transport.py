"""Same-host hand-offs through a shared-memory ring (kv_transfer/shm.py): P's sender thread and
D's receiver (the worker shells' code) over a real loopback socket, the payloads in /dev/shm.
Tokens are one engine's; no KV block and no segment outlives the workers, whether a hand-off ends
in an Ack, an abort mid-transfer, or a frame naming a bad ring; a decode worker without shm gets
inline frames; a full ring sends inline instead of waiting."""
from __future__ import annotations

import os
import time

import pytest

from gpu_worker.kv_transfer import shm
from gpu_worker.service import handoff_peer
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
from services.protocol.messages import Abort, AwaitKV, Dispatch
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import hand_off_round, llama  # noqa: F401  (fixture)
from tests.gpu_worker.service.test_worker_core_handoff import clean

pytestmark = pytest.mark.skipif(not shm.host_identity(), reason="needs /dev/shm and a boot id")
RING = 64 << 10          # a few frames of the tiny model: the ring wraps and fills


_MADE: list[str] = []     # the rings this process made (other tests, other processes make theirs)


@pytest.fixture(autouse=True)
def _rings_made_here(monkeypatch):
    make = shm.SegmentRing.__init__

    def recording(self, *args, **kwargs):
        make(self, *args, **kwargs)
        _MADE.append(os.path.join(shm.SHM_DIR, self.name))
    monkeypatch.setattr(shm.SegmentRing, "__init__", recording)


def segments() -> set[str]:
    """This process's rings still in /dev/shm (a parallel test's own are none of its business)."""
    return {path for path in _MADE if os.path.exists(path)}


def run_pair(llama, ids: dict, *, d_shm: bool, abort: str = "", max_tokens: int = 8):
    """Hand each prompt from P to D (abort `abort` while its KV arrives); (tokens, D's receiver, p, d)."""
    p = WorkerCore(engine(llama, max_num_batched_tokens=64), "p", 1)
    p.hands_off = True
    d = WorkerCore(engine(llama), "d", 1)
    receiver = DecodeReceiver(d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s=10.0, shm=d_shm)
    d.imports = receiver.imports
    sender = PrefillSender(p.engine, Plane.insecure(), lease_s=10.0, shm_ring_bytes=RING)
    sender.producer.max_frame_bytes = 4096          # several frames per hand-off
    d_addr = receiver.endpoint.address + "#worker"
    out: list = []
    try:
        for rid, toks in ids.items():
            out += d.run([AwaitKV(request_id=rid, epoch=1, n=1, reply_addr="gw", detok_addr="dt")])
            out += p.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=toks, params=greedy(max_tokens),
                                   reply_addr="gw", detok_addr="dt", handoff_to=d_addr)])
        aborted = not abort
        if abort:   # right after the first message of its transfer D handles (one poll may take them all)
            handle = receiver.endpoint._handle

            def handle_then_abort(parts):
                nonlocal aborted
                handle(parts)
                if not aborted and d.engine.is_importing(abort):
                    aborted = True
                    out.extend(d.run([Abort(request_id=abort)]) + p.run([Abort(request_id=abort)]))
            receiver.endpoint._handle = handle_then_abort
        deadline = time.monotonic() + 120
        while (p.requests or p._sending or d.requests or d.awaiting) and time.monotonic() < deadline:
            out += p.run([])
            hand_off_round(p, sender, out)
            receiver.poll()
            d.adopt_imports([])
            out += d.run([])
            time.sleep(0.001)
        assert aborted, "the aborted request's transfer was never seen in flight"
    finally:
        sender.close()
        receiver.close()
    tokens: dict = {}
    for env in out:
        for s in getattr(env.msg, "seqs", None) or []:
            tokens.setdefault(s.request_id, []).extend(s.token_ids)
    return tokens, receiver.endpoint, p, d


def test_same_host_handoffs_go_through_shared_memory_and_leave_nothing(llama):
    before = segments()
    ids = {"a": prompt(150, 40), "b": prompt(90, 41), "c": prompt(200, 47)}
    tokens, endpoint, p, d = run_pair(llama, ids, d_shm=True)
    want = run_single(engine(llama), [(rid, t, greedy(8)) for rid, t in ids.items()])
    assert {rid: tokens[rid] for rid in ids} == {rid: want[(rid, 0)] for rid in ids}
    assert endpoint.shm_frames > 20                  # more than the ring holds at once: it wrapped
    assert segments() == before                      # D unlinked the ring it mapped
    assert clean(p) and clean(d)


def test_an_abort_mid_transfer_leaks_no_segment_and_no_block(llama):
    before = segments()
    ids = {"a": prompt(200, 42), "b": prompt(200, 43)}
    tokens, endpoint, p, d = run_pair(llama, ids, d_shm=True, abort="a", max_tokens=12)
    assert tokens["b"] == run_single(engine(llama), [("b", ids["b"], greedy(12))])[("b", 0)]
    assert len(tokens.get("a", [])) < 12
    assert endpoint.shm_frames > 0
    assert segments() == before
    assert clean(p) and clean(d)


def test_a_decode_worker_without_shm_gets_inline_frames(llama):
    before = segments()
    ids = {"a": prompt(70, 44)}
    tokens, endpoint, p, d = run_pair(llama, ids, d_shm=False)
    assert tokens["a"] == run_single(engine(llama), [("a", ids["a"], greedy(8))])[("a", 0)]
    assert endpoint.shm_frames == 0
    assert segments() == before                      # no ring was even made
    assert clean(p) and clean(d)


class OutOfRangeRing(shm.SegmentRing):
    """Names offsets past its end."""

    def place(self, payload):
        placed = super().place(payload)
        return placed and shm.Placed(self.capacity - 8, placed.end)


class PathRing(shm.SegmentRing):
    """Names a path outside /dev/shm instead of itself."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.real, self.name = self.name, "../../etc/passwd"

    def close(self) -> None:
        self.name = self.real
        super().close()


@pytest.mark.parametrize("ring", [OutOfRangeRing, PathRing], ids=["offset", "path"])
def test_a_frame_naming_a_bad_ring_is_dropped_and_p_decodes_its_request(llama, monkeypatch, ring):
    before = segments()
    monkeypatch.setattr(handoff_peer, "SegmentRing", ring)
    ids = {"evil": prompt(60, 45)}
    tokens, endpoint, p, d = run_pair(llama, ids, d_shm=True)
    # D refused the frame and P, which still holds the KV, decoded the request: one stream
    assert tokens["evil"] == run_single(engine(llama), [("evil", ids["evil"], greedy(8))])[("evil", 0)]
    assert endpoint.consumer.frames_dropped >= 1 and endpoint.shm_frames == 0
    assert segments() == before
    assert clean(p) and clean(d)


def test_the_ring_wraps_sends_inline_when_full_and_is_unlinked_by_d_at_first_sight():
    ring, reader = shm.SegmentRing(3000), shm.RingReader()
    try:
        assert os.stat(os.path.join(shm.SHM_DIR, ring.name)).st_mode & 0o777 == 0o600
        a = ring.place(memoryview(b"a" * 2000))
        assert a == shm.Placed(0, 2000)
        assert ring.place(memoryview(b"b" * 2000)) is None and ring.frames_inline == 1   # D took nothing yet
        with reader.read(ring.name, a.offset, 2000, a.end) as payload:
            assert bytes(payload) == b"a" * 2000
        assert not os.path.exists(os.path.join(shm.SHM_DIR, ring.name))    # mapped: unlinked
        b = ring.place(memoryview(b"b" * 2000))
        assert b == shm.Placed(0, 5000)              # 2000 + 1000 skipped at the end + 2000
        with reader.read(ring.name, b.offset, 2000, b.end) as payload:
            assert bytes(payload) == b"b" * 2000
        with pytest.raises(ValueError, match="do not fit"):
            with reader.read(ring.name, 2500, 1000, 6000):
                pass
        assert ring.consumed() == 6000               # a bad frame still frees its room
    finally:
        ring.close()
        reader.close()


def test_d_maps_only_rings_of_ours():
    reader = shm.RingReader()
    for bad in ("../../etc/passwd", "kvmesh-kv-" + "0" * 31, "kvmesh-kv-" + "g" * 32, ""):
        with pytest.raises(ValueError, match="not a KV segment name"):
            with reader.read(bad, 0, 8, 8):
                pass
    path = os.path.join(shm.SHM_DIR, shm.PREFIX + "a" * 32)      # one others could read
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.fchmod(fd, 0o644)
    os.write(fd, b"z" * 128)
    os.close(fd)
    with pytest.raises(ValueError, match="owner or mode"):
        with reader.read(shm.PREFIX + "a" * 32, 0, 8, 8):
            pass
    assert not os.path.exists(path)
    ring = shm.SegmentRing(1024)
    ring.close()                                     # D never mapped it: P's close unlinks it
    assert not os.path.exists(os.path.join(shm.SHM_DIR, ring.name))


class NoRoomRing(shm.SegmentRing):
    """/dev/shm without room for a ring (a container's small default)."""

    def __init__(self, capacity: int) -> None:
        raise OSError(28, "No space left on device")


def test_no_room_for_a_ring_sends_the_frames_inline(llama, monkeypatch):
    monkeypatch.setattr(handoff_peer, "SegmentRing", NoRoomRing)
    ids = {"a": prompt(70, 48)}
    tokens, endpoint, p, d = run_pair(llama, ids, d_shm=True)
    assert tokens["a"] == run_single(engine(llama), [("a", ids["a"], greedy(8))])[("a", 0)]
    assert endpoint.shm_frames == 0
    assert clean(p) and clean(d)


def test_a_ring_that_cannot_grow_sends_inline_instead_of_faulting(monkeypatch):
    real = os.posix_fallocate
    ring = shm.SegmentRing(64 << 20)
    try:
        assert ring.place(memoryview(b"a" * 1000)) == shm.Placed(0, 1000)       # the first 16 MiB step

        def full(fd, offset, length):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
        assert ring.place(memoryview(b"b" * (20 << 20))) is None and ring.frames_inline == 1
        assert ring.place(memoryview(b"c" * 1000)) == shm.Placed(1000, 2000)    # within what it has
        monkeypatch.setattr(os, "posix_fallocate", real)
    finally:
        ring.close()
