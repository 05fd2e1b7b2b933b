"""A prefill worker's core in a process of its own that hands its requests to a decode worker by
letting it read its cache (kv_transfer/cuda_ipc.py; for test_cuda_ipc.py): prefills every prompt,
waits for each hand-off's answer, prints {"results": {rid: reason or ""}}, then stays alive (its
cache stays mapped) until stdin closes.

    python prefill_process.py MODEL_DIR DEVICE D_ADDRESS PROMPTS_JSON MAX_TOKENS
"""
from __future__ import annotations

import json
import sys
import time

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.cuda_ipc import export_cache
from gpu_worker.service.core import WorkerCore
from gpu_worker.service.handoff import PrefillSender
from services.protocol.messages import Dispatch
from services.protocol.sampling import SamplingParams
from services.security.curve import Plane

GPU = dict(dtype="float32", attention_backend="triton", cuda_graph_max_bs=16)


def prefill_engine(model_dir: str, device: str) -> Engine:
    return Engine(EngineConfig(model=model_dir, device=device, num_gpu_blocks=64, max_num_batched_tokens=64,
                               **(GPU if device == "cuda" else {})))


def prefill_and_hand_off(eng: Engine, d_addr: str, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """Prefill every prompt, hand each off to D; {"results": {rid: reason or ""}, "clean": bool}."""
    core = WorkerCore(eng, "p", 1)
    core.hands_off = core.streams_kv = True
    sender = PrefillSender(eng, Plane.insecure(), lease_s=10.0, cache_source=export_cache(eng))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: list = core.run([Dispatch(request_id=rid, epoch=1, prompt_token_ids=ids, params=params, reply_addr="gw",
                                   detok_addr="dt", handoff_to=d_addr) for rid, ids in prompts.items()])
    results: dict[str, str] = {}
    deadline = time.monotonic() + 60
    try:
        while len(results) < len(prompts) and time.monotonic() < deadline:
            out += core.run([])
            todo, cancel = core.take_handoffs()
            for rid, to in cancel:
                sender.cancel(rid, to)
            for rid, to in todo:
                sender.submit(rid, to)
            for r in sender.take_results():
                results[r.request_id] = r.reason
                core.handoff_done(r.request_id, r.ok, r.reason, out)
            time.sleep(0.001)
    finally:
        sender.close()
    s = eng.stats()
    return {"results": results, "clean": s.num_free_blocks + s.num_cached_blocks == s.num_total_blocks}


def main(model_dir: str, device: str, d_addr: str, prompts: dict[str, list[int]], max_tokens: int) -> None:
    torch.set_num_threads(1)
    eng = prefill_engine(model_dir, device)
    print(json.dumps(prefill_and_hand_off(eng, d_addr, prompts, max_tokens)), flush=True)
    sys.stdin.read()          # the cache stays mapped until the test lets this process go


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]))
