"""Saturated admission: waiting requests join a full batch in groups, not one per freed slot."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams


class NullRunner:
    vocab_size, num_layers = 32, 1

    def block_size_bytes(self, block_size):
        return block_size * 8

    def allocate_kv_cache(self, num_blocks, block_size):
        pass

    def copy_blocks(self, src, dst):
        pass

    def forward(self, batch):
        return torch.zeros(batch.logits_indices.shape[0], self.vocab_size)   # greedy: token 0


def engine(max_num_seqs: int) -> Engine:
    cfg = EngineConfig(model="null", device="cpu", max_num_seqs=max_num_seqs, num_gpu_blocks=1024, model_id="null")
    return Engine(cfg, runner=NullRunner(),
                  model_config=SimpleNamespace(max_position_embeddings=256, eos_token_ids=(1,), torch_dtype="float32"))


def test_full_batch_admits_in_groups_of_an_eighth():
    eng = engine(16)                                   # admit_group = 2
    for i in range(16):                                # request i finishes after i + 2 tokens
        eng.add_request(f"run{i}", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=i + 2, ignore_eos=True))
    for i in range(3):
        eng.add_request(f"wait{i}", [5, 6], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    eng.step()                                         # 16 prefills; 3 wait
    assert len(eng.scheduler.running) == 16 and len(eng.scheduler.waiting) == 3
    eng.step()                                         # run0 finishes at the end of this step
    assert len(eng.scheduler.running) == 15 and len(eng.scheduler.waiting) == 3
    eng.step()                                         # 1 free slot < 2: nobody joins; run1 ends
    assert len(eng.scheduler.running) == 14 and len(eng.scheduler.waiting) == 3
    eng.step()                                         # 2 free slots: two join
    assert len(eng.scheduler.running) == 15 and len(eng.scheduler.waiting) == 1
    while eng.has_unfinished_requests():
        eng.step()
    eng.block_manager.check_integrity()


def test_engine_with_room_admits_at_once():
    eng = engine(16)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()
    eng.add_request("b", [5, 6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    eng.step()
    assert len(eng.scheduler.running) == 2 and not eng.scheduler.waiting
