"""FP8 weights (`quantization="fp8"`, vLLM's dynamic FP8): every linear layer of the decoder
blocks is quantized once at load time to e4m3 with one fp32 scale per output channel; each
forward quantizes its activations per token and runs an fp8 x fp8 GEMM (fp32 accumulation).

    W (N, K) bf16  ->  W8 (N, K) e4m3,  s_w (N,) fp32      s_w[n] = max_k |W[n, k]| / 448
    y = x @ W.T    ~=  s_x[m] * s_w[n] * (x8 @ W8.T)[m, n]  (gpu_worker/kernels/fp8_linear.py)

Half the weight bytes of bf16 and Hopper's fp8 tensor cores: prefill GEMMs run up to twice
the bf16 rate (measured on the H200: prefill +33-56%). At M=1 cuBLASLt's fp8 GEMM reads its
weights at only 1.0-2.4 TB/s, which made batch-1 decode slower than bf16, so batches of up to
`gemv_max_m` rows take the weight-only split-K GEMV instead (below): batch-1 decode is then 1.49x
bf16's speed on the H200 (BENCHMARKS.md). The embeddings and
the lm_head stay in the model dtype (as in vLLM): they hold the vocabulary's precision and
the head is one GEMM per step. `quantization="fp8_lm_head"` quantizes the lm_head the same way
(`quantize_lm_head_fp8`: a tied head gets a quantized copy of the embeddings, which stay as they
are): at batch 1 the head is the biggest single read of a decode step (1.05 GB of Llama-8B's
bf16 head, 0.25 ms at the H200's copy rate), halved, for logits off by the e4m3 rounding of
its weights (3.4-3.6% relative on the tiny test models, hidden size 64, same argmax). On the
CPU the same maths runs in torch ops (the kernel module's reference), so tests can check
accuracy without a GPU.
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels.fp8_gemv import MAX_M as GEMV_MAX_ROWS, w8_gemv
from gpu_worker.kernels.fp8_linear import Fp8Weight, fp8_linear, fp8_linear_ref, quantize_weight_fp8
from gpu_worker.tuning import KernelTuning

QUANTIZATIONS = ("fp8", "fp8_lm_head")

GemvOperands = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]   # weight, scale, bias


class Fp8Linear(nn.Module):
    """Drop-in for a bias-optional nn.Linear: e4m3 `weight` (N, K) + fp32 `weight_scale` (N,).
    On CUDA the activations are quantized per token and cuBLASLt's fp8 GEMM runs (fp8_linear);
    inputs of 1..`gemv_max_m` rows (at most fp8_gemv.MAX_M) take the weight-only split-K GEMV
    of fp8_gemv.py instead (x unquantized, weights read once): on the H200 it reads the four
    Llama-8B layers in 68.9 us at M=1 and 87 us at M=4, against 132-135 us for cuBLASLt's fp8
    GEMM and 115 us for bf16 cuBLAS (H200), hence 4 by default (KernelTuning.fp8_gemv_max_m,
    given at construction)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 gemv_max_m: int = KernelTuning().fp8_gemv_max_m):
        super().__init__()
        self.gemv_max_m = gemv_max_m
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)                 # (N, K) float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale)     # (N,) float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, gemv_max_m: int = KernelTuning().fp8_gemv_max_m) -> "Fp8Linear":
        q = quantize_weight_fp8(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q.weight, q.scale, bias, gemv_max_m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (T, K) -> (T, N) in x's dtype
        w = Fp8Weight(self.weight, self.weight_scale)
        if x.is_cuda:
            if x.dim() == 2 and 0 < x.shape[0] <= min(self.gemv_max_m, GEMV_MAX_ROWS) and x.stride(1) == 1:
                return w8_gemv(x, self.weight, self.weight_scale, self.bias)
            return fp8_linear(x, w, self.bias)
        return fp8_linear_ref(x, w, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3"


def gemv_operands(linear: nn.Module) -> GemvOperands | None:
    """What w8_gemv needs of a linear layer: (weight, scale or None, bias or None); None for
    anything but a plain nn.Linear or an Fp8Linear (e.g. a tensor-parallel shard)."""
    if type(linear) is nn.Linear:
        return linear.weight, None, linear.bias
    if type(linear) is Fp8Linear:
        return linear.weight, linear.weight_scale, linear.bias
    return None


def quantize_linears_fp8(model: nn.Module, gemv_max_m: int = KernelTuning().fp8_gemv_max_m) -> int:
    """Replace every plain nn.Linear inside the decoder layers (`model.model.layers`: q/k/v,
    o_proj, gate_up, down) by an Fp8Linear, in place; returns how many were replaced. Sharded
    (tensor-parallel) or expert layers are not plain nn.Linear and stay as they are."""
    replaced = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, Fp8Linear.from_linear(child, gemv_max_m))
                    replaced += 1
    return replaced


def quantize_lm_head_fp8(model: nn.Module, gemv_max_m: int = KernelTuning().fp8_gemv_max_m) -> None:
    """Give the model's head an e4m3 copy of its weights (`model.head_fp8`, which compute_logits
    then uses): the lm_head's, or the embeddings' for a tied head. The bf16 lm_head is freed."""
    head = model.lm_head
    weight = (head.weight if head is not None else model.model.embed_tokens.weight).detach()
    q = quantize_weight_fp8(weight)
    model.head_fp8 = Fp8Linear(q.weight, q.scale, None, gemv_max_m)
    if head is not None:
        head.weight = nn.Parameter(torch.empty(0, weight.shape[1], dtype=weight.dtype, device=weight.device),
                                   requires_grad=False)                 # 1 GB of Llama-8B's back
