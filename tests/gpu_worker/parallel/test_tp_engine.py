"""The engine with EngineConfig(tensor_parallel_size=2) gives the same greedy tokens as over one rank: chunked prefill, prefix hits, n=2 samples
(copy-on-write block copies reach every rank) and a shared prompt prefix; dense qwen3 with
tensor parallelism, and Mixtral with its experts split over the 2 ranks (expert parallel)."""
from __future__ import annotations

import pytest

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.make_model import make_model
from services.protocol.sampling import SamplingParams

PREFIX = [7, 300, 12, 900, 45, 6, 77, 120, 33, 2, 610, 58, 19, 404, 8, 71, 5]
PROMPTS = {"a": PREFIX + [1, 2, 3], "b": PREFIX + [9, 9], "c": [500, 3, 17, 88, 61, 4, 4, 4, 250, 13]}


def _generate(model_dir: str, tp: int, ep: bool = False) -> dict[tuple[str, int], list[int]]:
    eng = Engine(EngineConfig(model=model_dir, device="cpu", num_gpu_blocks=48, block_size=4,
                              max_num_batched_tokens=12, max_num_seqs=8,
                              tensor_parallel_size=tp, enable_expert_parallel=ep))
    try:
        for rid, prompt in PROMPTS.items():
            n = 2 if rid == "c" else 1
            eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6, n=n, ignore_eos=True))
        out: dict[tuple[str, int], list[int]] = {}
        while eng.has_unfinished_requests():
            for d in eng.step():
                out.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
        eng.block_manager.check_integrity()
        return out
    finally:
        eng.close()


@pytest.mark.parametrize("arch,ep", [("qwen3", False), ("mixtral", True)])
def test_engine_tp2_matches_tp1(tmp_path, arch, ep):
    model_dir = str(make_model(tmp_path / "m", arch, "tiny", seed=7, progress=False))
    ref = _generate(model_dir, 1)
    assert len(ref) == 4 and all(len(v) == 6 for v in ref.values())
    assert _generate(model_dir, 2, ep) == ref
