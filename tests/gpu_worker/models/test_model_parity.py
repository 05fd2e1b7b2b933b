"""The decoder + paged torch attention reproduce Hugging Face transformers' logits.

Each test drives the ModelRunner the way the engine does: a ragged batch of several sequences
through a paged KV cache with scattered (non-contiguous) block tables, over three steps:

    step 1: A prefill 11      | B prefill 7
    step 2: A chunk 5 (on 11) | B decode 1 (on 7) | C prefill 6
    step 3: A decode          | B decode          | C decode

and compares the logits of every new token with HF's full-sequence forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.layers.rope import rope_inv_freq
from gpu_worker.tuning import KernelTuning

BLOCK = 4
NUM_BLOCKS = 40
REL_TOL = 1e-4   # max |ours - HF| must stay below REL_TOL x std(HF logits) (~4): fp32 noise is ~1e-6


@dataclass
class Seq:
    tokens: list[int]
    blocks: list[int]
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # one (V,) per token computed


def build_batch(steps: list[tuple[Seq, int]]) -> ForwardBatch:
    """One ForwardBatch: each (seq, n) schedules seq's next n tokens; every row's logits wanted."""
    ids, pos, slots, qlens, clens = [], [], [], [], []
    for seq, n in steps:
        for p in range(seq.computed, seq.computed + n):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qlens.append(n)
        clens.append(seq.computed + n)
    width = max(len(s.blocks) for s, _ in steps)
    tables = [s.blocks + [0] * (width - len(s.blocks)) for s, _ in steps]
    t = len(ids)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos),
        query_lens=torch.tensor(qlens, dtype=torch.int32), context_lens=torch.tensor(clens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.tensor(slots),
        logits_indices=torch.arange(t), max_query_len=max(qlens), max_context_len=max(clens))


def run_step(runner: ModelRunner, steps: list[tuple[Seq, int]]) -> None:
    logits = runner.forward(build_batch(steps))
    # float32 from a graph holding the head, else the model's dtype (the sampler casts what it must)
    assert logits.dtype in (torch.float32, runner.dtype)
    logits = logits.float().cpu()
    assert logits.shape == (sum(n for _, n in steps), runner.vocab_size)
    row = 0
    for seq, n in steps:
        seq.logits += list(logits[row: row + n])
        seq.computed += n
        row += n


def hf_logits(model_dir: str, token_lists: list[list[int]], device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    with torch.no_grad():
        return [hf(torch.tensor([toks], device=device)).logits[0].float().cpu() for toks in token_lists]


def three_step_run(model_dir: str, vocab: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   backend: str = "torch", tuning: KernelTuning = KernelTuning()) -> tuple[list[Seq], ModelRunner]:
    runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, device=device,
                         dtype=dtype, attention_backend=backend, tuning=tuning)
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()  # noqa: E731
    # Block tables deliberately scattered and out of order.
    a = Seq(tok(17), [9, 2, 31, 5, 17])
    b = Seq(tok(9), [0, 23, 11])
    c = Seq(tok(7), [38, 3])
    run_step(runner, [(a, 11), (b, 7)])
    run_step(runner, [(a, 5), (b, 1), (c, 6)])
    run_step(runner, [(a, 1), (b, 1), (c, 1)])
    return [a, b, c], runner


def long_chunk_run(model_dir: str, vocab: int, device: str, dtype: torch.dtype = torch.float32,
                   tuning: KernelTuning = KernelTuning()) -> list[Seq]:
    """three_step_run's pattern with chunks past 16 tokens on the Triton backend, so prefills run
    through fresh_prefill_attention behind a cached prefix (shorter chunks stay on v2):
        step 1: A prefill 40         | B prefill 24
        step 2: A chunk 33 (on 40)   | B decode 1 (on 24) | C prefill 20
        step 3: A decode             | B decode           | C decode"""
    runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, device=device, dtype=dtype,
                         attention_backend="triton", tuning=tuning)
    runner.allocate_kv_cache(NUM_BLOCKS, BLOCK)
    g = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(10, vocab, (n,), generator=g).tolist()    # noqa: E731
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()               # scattered, out of order
    a, b, c = Seq(tok(74), blocks[:19]), Seq(tok(26), blocks[19:26]), Seq(tok(21), blocks[26:32])
    run_step(runner, [(a, 40), (b, 24)])
    run_step(runner, [(a, 33), (b, 1), (c, 20)])
    run_step(runner, [(a, 1), (b, 1), (c, 1)])
    return [a, b, c]


def assert_close(seqs: list[Seq], refs: list[torch.Tensor], rel_tol: float = REL_TOL) -> None:
    for seq, ref in zip(seqs, refs):
        ours = torch.stack(seq.logits)                 # (len, V)
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < rel_tol * ref.std().item(), f"max |diff| {err:.2e} vs logit std {ref.std():.2f}"
        if rel_tol <= REL_TOL:
            assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_ragged_paged_batches_match_hf(tiny_models, arch):
    model_dir = tiny_models[arch]
    seqs, _ = three_step_run(model_dir, ModelConfig.from_dir(model_dir).vocab_size)
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs]))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_residual_adds_inside_the_gemms_match_hf(tiny_models, monkeypatch, arch):
    """Every step (ragged, chunked, decode) with the residual added in o_proj's and down_proj's
    GEMMs (KernelTuning.residual_gemm_min_rows, normally prefill-sized steps only)."""
    from gpu_worker.models.decoder import DecoderLayer
    calls = []
    real = DecoderLayer._forward_residual_gemm
    monkeypatch.setattr(DecoderLayer, "_forward_residual_gemm", lambda self, *a: calls.append(1) or real(self, *a))
    model_dir = tiny_models[arch]
    seqs, runner = three_step_run(model_dir, ModelConfig.from_dir(model_dir).vocab_size,
                                  tuning=KernelTuning(residual_gemm_min_rows=1))
    assert len(calls) == 3 * runner.config.num_layers
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs]))


def test_copy_blocks_then_decode(tiny_models):
    """A forked sample (copy-on-write of its last, partial block) continues exactly like the
    original would."""
    model_dir = tiny_models["llama"]
    seqs, runner = three_step_run(model_dir, 1024)
    a = seqs[0]                                    # 17 tokens: blocks [9, 2, 31, 5, 17], last partial
    fork = Seq(a.tokens + [42], a.blocks[:4] + [20], computed=a.computed)
    runner.copy_blocks([17], [20])
    a.tokens.append(42)
    run_step(runner, [(a, 1), (fork, 1)])
    assert torch.allclose(a.logits[-1], fork.logits[-1], atol=1e-6)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 2.0},
])
def test_rope_scaling_variants_match_hf(make_tiny, rope_scaling):
    model_dir = make_tiny("llama", rope_scaling=rope_scaling)
    seqs, _ = three_step_run(model_dir, 1024)
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs]))


def test_llama3_inv_freq_equals_hf_for_llama31_8b():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gpu_worker.make_model import SHAPES, config_json

    raw = config_json("llama", SHAPES[("llama", "8b")], "bfloat16")
    ours_cfg = ModelConfig.from_dict(raw)
    ours = rope_inv_freq(ours_cfg.head_dim, ours_cfg.rope_theta, ours_cfg.rope_scaling)
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**raw))
    assert torch.equal(ours, hf)
    assert ours.shape == (64,) and not torch.equal(ours, rope_inv_freq(128, 500000.0, None))


def test_mistral_sliding_window_matches_hf(make_tiny):
    model_dir = make_tiny("mistral", sliding_window=5)
    seqs, _ = three_step_run(model_dir, 1024)
    assert_close(seqs, hf_logits(model_dir, [s.tokens for s in seqs]))


def test_bfloat16_runner_tracks_fp32(tiny_models):
    model_dir = tiny_models["qwen3"]
    cfg = ModelConfig.from_dir(model_dir)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner(cfg, model_dir, dtype=dtype)
        runner.allocate_kv_cache(8, BLOCK)
        seq = Seq(list(range(20, 32)), [3, 6, 1])
        logits[dtype] = runner.forward(build_batch([(seq, 12)]))
    # an eager step's logits come in the model's dtype (the sampler casts what it computes on)
    assert logits[torch.bfloat16].dtype == torch.bfloat16 and logits[torch.float32].dtype == torch.float32
    err = (logits[torch.bfloat16].float() - logits[torch.float32]).abs().max()
    assert err < 0.25 * logits[torch.float32].std()  # bf16 rounding through 2 layers: ~0.3 of ~4


def test_runner_sizes(tiny_models):
    cfg = ModelConfig.from_dir(tiny_models["qwen3"])
    runner = ModelRunner(cfg, tiny_models["qwen3"])
    assert (runner.vocab_size, runner.num_layers) == (1024, 2)
    # K and V x 2 layers x 2 kv heads x head_dim 32 x 4 bytes per token
    assert runner.block_size_bytes(16) == 16 * 2 * 2 * 2 * 32 * 4
    runner.allocate_kv_cache(5, 16)
    assert runner.kv_caches[0][0].shape == (5, 16, 2, 32) and len(runner.kv_caches) == 2
    assert runner.profile_num_blocks(16, 0.9) >= 1


def test_decode_graph_hook_matches_eager(tiny_models):
    """capture_cuda_graphs + forward: pure-decode batches go through gpu_worker.cuda_graphs
    (eager replay on the CPU) and give the same logits as the plain path."""
    pytest.importorskip("gpu_worker.cuda_graphs")
    model_dir = tiny_models["qwen2"]
    seqs, runner = three_step_run(model_dir, 1024)
    a, b, c = seqs
    for s in seqs:
        s.tokens.append(77)
    decode = build_batch([(a, 1), (b, 1), (c, 1)])
    eager = runner.forward(decode)
    runner.capture_cuda_graphs(max_batch_size=4, max_context_len=64)
    assert runner.decode_graphs is not None and runner.decode_graphs.can_run(decode)
    assert torch.allclose(runner.forward(decode), eager, atol=1e-5)
