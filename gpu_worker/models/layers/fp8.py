"""FP8 weights (`quantization="fp8"`, vLLM's dynamic FP8): every linear layer of the decoder
blocks is quantized once at load time to e4m3 with one fp32 scale per output channel; each
forward quantizes its activations per token and runs an fp8 x fp8 GEMM (fp32 accumulation).

    W (N, K) bf16  ->  W8 (N, K) e4m3,  s_w (N,) fp32      s_w[n] = max_k |W[n, k]| / 448
    y = x @ W.T    ~=  s_x[m] * s_w[n] * (x8 @ W8.T)[m, n]  (gpu_worker/kernels/fp8_linear.py)

Half the weight bytes of bf16 and Hopper's fp8 tensor cores: prefill GEMMs run up to twice
the bf16 rate (measured on the H200: prefill +33-56%). Small-batch decode does NOT gain yet:
at M=1 cuBLASLt's fp8 GEMM reads its weights at only 1.0-2.4 TB/s (bf16 GEMV: 2.6-4.2), so
batch-1 decode is ~10% slower than bf16 (bench/engine_perf_notes.md, run 2). The embeddings and
the lm_head stay in the model dtype (as in vLLM): they hold the vocabulary's precision and
the head is one GEMM per step. On the CPU the same maths runs in torch ops (the kernel
module's reference), so tests can check accuracy without a GPU.
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels.fp8_linear import Fp8Weight, fp8_linear, fp8_linear_ref, quantize_weight_fp8

QUANTIZATIONS = ("fp8",)


class Fp8Linear(nn.Module):
    """Drop-in for a bias-optional nn.Linear: e4m3 `weight` (N, K) + fp32 `weight_scale` (N,).
    On CUDA the activations are quantized per token and cuBLASLt's fp8 GEMM runs (fp8_linear);
    inputs of at most `gemv_max_m` rows can take the weight-only GEMV of fp8_gemv.py instead.
    Off (0) by default: on the
    H200 it reached only 1.1-2.0 TB/s at M=1 and 0.2 TB/s at M=4, slower than _scaled_mm
    (bench/engine_perf_notes.md, run 2); it waits for a split-K design."""
    gemv_max_m = 0

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)                 # (N, K) float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale)     # (N,) float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        q = quantize_weight_fp8(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q.weight, q.scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (T, K) -> (T, N) in x's dtype
        w = Fp8Weight(self.weight, self.weight_scale)
        if x.is_cuda:
            if x.dim() == 2 and 0 < x.shape[0] <= self.gemv_max_m and x.stride(1) == 1:
                from gpu_worker.kernels.fp8_gemv import MAX_M, w8_gemv
                if x.shape[0] <= MAX_M:
                    return w8_gemv(x, self.weight, self.weight_scale, self.bias)
            return fp8_linear(x, w, self.bias)
        return fp8_linear_ref(x, w, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3"


def quantize_linears_fp8(model: nn.Module) -> int:
    """Replace every plain nn.Linear inside the decoder layers (`model.model.layers`: q/k/v,
    o_proj, gate_up, down) by an Fp8Linear, in place; returns how many were replaced. Sharded
    (tensor-parallel) or expert layers are not plain nn.Linear and stay as they are."""
    replaced = 0
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, Fp8Linear.from_linear(child))
                    replaced += 1
    return replaced
