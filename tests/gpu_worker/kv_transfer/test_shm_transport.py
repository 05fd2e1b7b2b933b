"""Same-host hand-offs through shared memory (kv_transfer/shm.py): P's sender thread and D's
receiver (the worker shells' code) over a real loopback socket, the payloads in /dev/shm. Tokens
are one engine's; no KV block and no segment outlives a hand-off, whether it ends in an Ack, an
abort mid-transfer, or a segment D never takes; a decode worker without shm gets inline frames."""
from __future__ import annotations

import glob
import os
import time

import pytest

from gpu_worker.kv_transfer import shm
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver, PrefillSender
from services.protocol.messages import Abort, AwaitKV, Dispatch
from services.security.curve import Plane
from tests.gpu_worker.kv_transfer.conftest import engine, greedy, prompt, run_single
from tests.gpu_worker.service.test_prefill_sender import hand_off_round, llama  # noqa: F401  (fixture)
from tests.gpu_worker.service.test_worker_core_handoff import clean

pytestmark = pytest.mark.skipif(not shm.host_identity(), reason="needs /dev/shm and a boot id")


def segments() -> set[str]:
    return set(glob.glob(os.path.join(shm.SHM_DIR, shm.PREFIX + "*")))


def run_pair(llama, ids: dict, *, d_shm: bool, abort: str = "", max_tokens: int = 8, writer=None):
    """Hand each prompt from P to D (abort `abort` while its KV arrives); (tokens, writer, p, d)."""
    p = WorkerCore(engine(llama, max_num_batched_tokens=64), "p", 1)
    p.hands_off = True
    d = WorkerCore(engine(llama), "d", 1)
    receiver = DecodeReceiver(d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s=10.0, shm=d_shm)
    d.imports = receiver.imports
    writer = writer or shm.SegmentWriter()
    sender = PrefillSender(p.engine, Plane.insecure(), lease_s=10.0, shm_writer=writer)
    sender.producer.max_frame_bytes = 4096          # several frames (segments) per hand-off
    d_addr = receiver.endpoint.address + "#worker"
    out: list = []
    try:
        for rid, toks in ids.items():
            out += d.run([AwaitKV(request_id=rid, epoch=1, n=1, reply_addr="gw", detok_addr="dt")])
            out += p.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=toks, params=greedy(max_tokens),
                                   reply_addr="gw", detok_addr="dt", handoff_to=d_addr)])
        aborted = not abort
        deadline = time.monotonic() + 120
        while (p.requests or p._sending or d.requests or d.awaiting) and time.monotonic() < deadline:
            inbox: list = []
            if not aborted and d.engine.is_importing(abort):
                inbox, aborted = [Abort(request_id=abort)], True
            out += p.run(inbox)
            hand_off_round(p, sender, out)
            receiver.poll()
            d.adopt_imports()
            out += d.run(inbox)
            time.sleep(0.001)
        assert aborted, "the aborted request's transfer was never seen in flight"
    finally:
        sender.close()
        receiver.close()
    tokens: dict = {}
    for env in out:
        for s in getattr(env.msg, "seqs", None) or []:
            tokens.setdefault(s.request_id, []).extend(s.token_ids)
    return tokens, writer, p, d


def test_same_host_handoffs_go_through_shared_memory_and_leave_nothing(llama):
    before = segments()
    ids = {"a": prompt(150, 40), "b": prompt(90, 41)}
    tokens, writer, p, d = run_pair(llama, ids, d_shm=True)
    want = run_single(engine(llama), [(rid, t, greedy(8)) for rid, t in ids.items()])
    assert {rid: tokens[rid] for rid in ids} == {rid: want[(rid, 0)] for rid in ids}
    assert writer.segments_written > 2 and writer.frames_inline == 0
    assert segments() == before                      # D unlinked each one it mapped
    assert clean(p) and clean(d)


def test_an_abort_mid_transfer_leaks_no_segment_and_no_block(llama):
    before = segments()
    ids = {"a": prompt(200, 42), "b": prompt(200, 43)}
    tokens, writer, p, d = run_pair(llama, ids, d_shm=True, abort="a", max_tokens=12)
    assert tokens["b"] == run_single(engine(llama), [("b", ids["b"], greedy(12))])[("b", 0)]
    assert len(tokens.get("a", [])) < 12
    assert segments() == before
    assert clean(p) and clean(d)


def test_a_decode_worker_without_shm_gets_inline_frames(llama):
    ids = {"a": prompt(70, 44)}
    tokens, writer, p, d = run_pair(llama, ids, d_shm=False)
    assert tokens["a"] == run_single(engine(llama), [("a", ids["a"], greedy(8))])[("a", 0)]
    assert writer.segments_written == 0
    assert clean(p) and clean(d)


class HostileWriter(shm.SegmentWriter):
    """Names, for request "evil", a path outside /dev/shm, then a segment of the wrong size."""

    def write(self, request_id: str, payload: memoryview) -> str | None:
        if request_id != "evil":
            return super().write(request_id, payload)
        self.evil = getattr(self, "evil", 0) + 1
        return "../../etc/passwd" if self.evil == 1 else super().write(request_id, payload[:-8])


@pytest.mark.parametrize("attempts", [1, 2], ids=["path", "short-segment"])
def test_a_frame_naming_a_bad_segment_fails_only_its_request(llama, attempts):
    before = segments()
    writer = HostileWriter()
    writer.evil = attempts - 1                       # its next frame: the path (1) or the short segment (2)
    ids = {"evil": prompt(60, 45), "good": prompt(60, 46)}
    tokens, writer, p, d = run_pair(llama, ids, d_shm=True, writer=writer)
    assert tokens["good"] == run_single(engine(llama), [("good", ids["good"], greedy(8))])[("good", 0)]
    assert len(tokens.get("evil", [])) < 8           # P's first token at most: D failed it
    assert segments() == before                      # the short one unlinked by D, the rest by P
    assert clean(p) and clean(d)


def test_segments_past_the_bound_go_inline_and_untaken_ones_are_unlinked_at_the_end():
    writer = shm.SegmentWriter(max_bytes=3000)
    first = writer.write("r", memoryview(b"x" * 2000))
    assert first and os.path.exists(os.path.join(shm.SHM_DIR, first))
    assert os.stat(os.path.join(shm.SHM_DIR, first)).st_mode & 0o777 == 0o600
    assert writer.write("r", memoryview(b"y" * 2000)) is None and writer.frames_inline == 1
    writer.release("r")                              # the hand-off ended, D never took it
    assert not os.path.exists(os.path.join(shm.SHM_DIR, first))


def test_d_reads_only_its_own_segments_of_the_announced_size(tmp_path):
    writer = shm.SegmentWriter()
    name = writer.write("r", memoryview(b"k" * 64))
    with pytest.raises(ValueError, match="expected 32"):
        with shm.read_segment(name, 32):
            pass
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))     # unlinked even so
    for bad in ("../../etc/passwd", "kvmesh-kv-" + "0" * 31, "kvmesh-kv-" + "g" * 32, ""):
        with pytest.raises(ValueError, match="not a KV segment name"):
            with shm.read_segment(bad, 64):
                pass
    name = writer.write("r", memoryview(b"v" * 64))
    with shm.read_segment(name, 64) as payload:
        assert bytes(payload) == b"v" * 64
    # a segment others could read is refused: one made here by hand with mode 0644
    path = os.path.join(shm.SHM_DIR, shm.PREFIX + "a" * 32)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.fchmod(fd, 0o644)
    os.write(fd, b"z" * 64)
    os.close(fd)
    with pytest.raises(ValueError, match="owner or mode"):
        with shm.read_segment(shm.PREFIX + "a" * 32, 64):
            pass
    assert not os.path.exists(path)
