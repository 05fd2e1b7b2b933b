"""SparseMoE against transformers' Mixtral and Qwen3-MoE blocks, and the grouped GEMM against
its loop reference."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.models.grouped_gemm import grouped_linear, grouped_linear_ref
from gpu_worker.models.moe import SparseMoE, route


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 9], [0, 0, 0, 0], [1, 1, 1, 1]])
def test_grouped_linear_matches_loop(counts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 24, generator=g)
    w = torch.randn(len(counts), 40, 24, generator=g)
    c = torch.tensor(counts)
    ref = grouped_linear_ref(x, w, c)
    assert torch.allclose(grouped_linear(x, w, c), ref, atol=1e-5)
    if sum(counts):
        assert torch.allclose(ref[: counts[0]], x[: counts[0]] @ w[0].t()) if counts[0] else True


def _hf_block(arch: str, hidden: int, inter: int, experts: int, top_k: int, norm_topk: bool):
    if arch == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                            num_experts_per_tok=top_k)
        return MixtralSparseMoeBlock(cfg)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=norm_topk)
    return Qwen3MoeSparseMoeBlock(cfg)


@pytest.mark.parametrize("arch,norm_topk,top_k", [("mixtral", True, 2), ("qwen3_moe", True, 4),
                                                   ("qwen3_moe", False, 3)])
def test_sparse_moe_matches_transformers(arch, norm_topk, top_k):
    torch.manual_seed(0)
    hidden, inter, experts = 32, 48, 8
    hf = _hf_block(arch, hidden, inter, experts, top_k, norm_topk).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoE(hidden, inter, experts, top_k, renormalize=(arch == "mixtral" or norm_topk))
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)       # (E, 2I, H): gate rows, then up rows
        ours.w2.copy_(hf.experts.down_proj)           # (E, H, I)
    x = torch.randn(1, 13, hidden)
    with torch.no_grad():
        ref = hf(x)[0]
        got = ours(x[0])
    assert got.shape == (13, hidden)
    assert (got - ref).abs().max() < 1e-5


def test_route_renormalizes_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, e = route(logits, 2, renormalize=True)
    assert e.tolist() == [[3, 2]] and torch.allclose(w.sum(-1), torch.ones(1))
    w2, _ = route(logits, 2, renormalize=False)
    assert w2.sum() < 1
