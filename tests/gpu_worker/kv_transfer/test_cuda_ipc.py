"""A prefill worker and a decode worker in two processes of one host, the decode worker reading
the prefill worker's cache itself (kv_transfer/cuda_ipc.py): on the CPU through torch's shared
memory, on a GPU through CUDA IPC (device to device). Greedy tokens are a mixed worker's; a
prefill worker that goes away leaves no mapping on D, and the next one is read again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.shm import host_identity
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import DecodeReceiver
from services.protocol.messages import AwaitKV
from services.security.curve import Plane
from tests.gpu_worker.devices import CUDA
from tests.gpu_worker.kv_transfer.conftest import greedy, prompt, run_single
from tests.gpu_worker.kv_transfer.prefill_process import prefill_and_hand_off, prefill_engine
from tests.gpu_worker.service.test_prefill_sender import llama  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not host_identity(), reason="needs /dev/shm and a boot id")
ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("prefill_process.py")
GPU = dict(dtype="float32", attention_backend="triton", cuda_graph_max_bs=16)


def make(model: str, device: str) -> Engine:
    return Engine(EngineConfig(model=model, device=device, num_gpu_blocks=64, **(GPU if device == "cuda" else {})))


def decode_until(d: WorkerCore, receiver: DecodeReceiver, want: int, done=lambda: True) -> dict:
    """Serve D until it produced `want` tokens and done() holds (60 s at most); {rid: tokens}."""
    tokens: dict = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (sum(len(t) for t in tokens.values()) >= want and done()):
        receiver.poll()
        d.adopt_imports([])
        for env in d.run([]):
            for s in getattr(env.msg, "seqs", None) or []:
                tokens.setdefault(s.request_id, []).extend(s.token_ids)
        time.sleep(0.001)
    return tokens


def awaiting(d: WorkerCore, prompts: dict) -> None:
    for rid in prompts:
        d.run([AwaitKV(request_id=rid, epoch=1, n=1, reply_addr="gw", detok_addr="dt")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_d_reads_a_prefill_process_cache_and_decodes_what_a_mixed_worker_does(llama, device):
    prompts = {"a": prompt(150, 70), "b": prompt(40, 71)}
    steps = 8
    want = run_single(make(llama, device), [(rid, ids, greedy(steps)) for rid, ids in prompts.items()])
    d = WorkerCore(make(llama, device), "d", 1)
    receiver = DecodeReceiver(d.engine, Plane.insecure(), "127.0.0.1", 0, lease_s=10.0, cache_reads=True)
    d.imports = receiver.imports
    reader = receiver.endpoint.cache_reader
    try:
        awaiting(d, prompts)
        p = subprocess.Popen([sys.executable, str(SCRIPT), llama, device, receiver.endpoint.address + "#worker",
                              json.dumps(prompts), str(steps)], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        tokens = decode_until(d, receiver, len(prompts) * (steps - 1))
        assert json.loads(p.stdout.readline()) == {"results": {rid: "" for rid in prompts}, "clean": True}
        # D decodes from the second token on (P streamed the first)
        assert tokens == {rid: want[(rid, 0)][1:] for rid in prompts}
        assert reader.blocks_read == sum(-(-len(t) // 16) for t in prompts.values())
        assert receiver.imports.frames_dropped == 0 and reader.sources_opened == 1
        p.kill()                                          # P goes away: D drops its mapping once idle
        p.communicate(timeout=30)
        reader.idle_s = 0.0
        receiver.poll()
        assert reader.sources() == []
        again = {"c": prompt(90, 72)}                     # a new P (a thread here): opened and read again
        want = run_single(make(llama, device), [("c", again["c"], greedy(steps))])
        awaiting(d, again)
        report: dict = {}
        p_thread = threading.Thread(target=lambda: report.update(prefill_and_hand_off(
            prefill_engine(llama, device), receiver.endpoint.address + "#worker", again, steps)))
        p_thread.start()
        tokens = decode_until(d, receiver, steps - 1, done=lambda: not p_thread.is_alive())
        p_thread.join(30)
        assert report == {"results": {"c": ""}, "clean": True}
        assert tokens == {"c": want[("c", 0)][1:]} and reader.sources_opened == 2
        s = d.engine.stats()
        assert not d.requests and s.num_free_blocks + s.num_cached_blocks == s.num_total_blocks
    finally:
        receiver.close()
