"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing + grouped expert GEMMs.

    router logits = x W_gate^T                 (T, E)
    probs = softmax(logits) in fp32; (w, e) = top-k(probs)     (T, k) each
    w /= sum(w)        when renormalizing (Mixtral always; Qwen3-MoE if norm_topk_prob)
    y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = e[t, j]

Experts run as one grouped pass: the T*k (token, expert) assignments are sorted by expert,
rows gathered in that order, two grouped GEMMs (w13: gate|up fused, w2: down), then the
weighted rows are scattered back with index_add.

Parallel modes (ParallelContext):
    single rank           all experts, whole intermediate size
    tensor parallel       all experts, each expert's intermediate split like a dense MLP;
                          partial outputs all-reduced
    expert parallel       rank r holds experts [r*E/N, (r+1)*E/N); tokens split over ranks,
                          each rank's assignments all-to-all'ed to their expert's rank and the
                          results sent back (dispatch / combine), outputs all-gathered

    expert parallel, 2 ranks, T tokens replicated on both:
    rank 0: rows [0, c)  --route--> assignments for experts 0..E/2-1 stay, E/2..E-1 go to rank 1
    rank 1: rows [c, T)  --route--> ...and the other way round          (all_to_all_single)
    each rank: grouped GEMM over what it received -> send back          (all_to_all_single)
    each rank: weighted sum into its rows -> all-gather rows -> (T, H) on both
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.grouped_gemm import grouped_linear
from gpu_worker.parallel.state import SINGLE, ParallelContext, all_gather_rows, all_reduce, all_to_all_rows


class ExpertNames(NamedTuple):
    """How a checkpoint names one MoE block's tensors, after `model.layers.N.`."""
    block: str      # "block_sparse_moe" (Mixtral) | "mlp" (Qwen3-MoE)
    gate: str       # the gate projection of each expert (w1 | gate_proj)
    up: str         # (w3 | up_proj)
    down: str       # (w2 | down_proj)


# Hugging Face hub layout (what transformers 5 loads, fusing the experts itself, and writes back
# on save_pretrained): {block}.gate.weight (E, H) and {block}.experts.{e}.{gate,up,down}.weight.
EXPERT_NAMES = {"mixtral": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
                "qwen3_moe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")}
_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.(\w+)\.weight$")


class Routing(NamedTuple):
    weights: torch.Tensor   # (T, k) float32
    experts: torch.Tensor   # (T, k) int64


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts in fp32, then top-k (renormalized to sum 1 if asked)."""
    probs = torch.softmax(router_logits.float(), dim=-1)          # (T, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)            # (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts)


def _count(ids: torch.Tensor, n: int) -> torch.Tensor:
    """(A,) ids in [0, n) -> (n,) int64 counts. Unlike bincount on CUDA, no host sync: the
    single-rank path stays capturable in a CUDA graph."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


class SparseMoE(nn.Module):
    """gate: router (E, H), replicated. w13: (E_local, 2*I_local, H) = [gate_proj; up_proj] per
    expert, w2: (E_local, H, I_local) = down_proj per expert."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 dtype: torch.dtype | None = None, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize, self.ctx = num_experts, top_k, renormalize, ctx
        self.expert_parallel = ctx.enabled and ctx.expert_parallel
        if self.expert_parallel:
            self.first_expert, stop = ctx.shard(num_experts, "num_experts")
            self.num_local_experts = stop - self.first_expert
            self.intermediate = intermediate
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.intermediate = intermediate // ctx.world_size if ctx.enabled else intermediate
        inter = self.intermediate
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * inter, hidden, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden, inter, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (T, H) -> (T, H)
        if self.expert_parallel:
            return self._forward_expert_parallel(x)
        routing = route(self.gate(x), self.top_k, self.renormalize)
        out = self._combine(x.shape[0], routing, self._dispatch_local(x, routing))
        return all_reduce(out, self.ctx) if self.ctx.enabled else out

    # ---- checkpoint names ----------------------------------------------------------------------
    def hf_weight_targets(self, prefix: str, names: ExpertNames) -> dict:
        """HF tensor name -> WeightTarget, for the router and this rank's experts; `prefix` is
        "model.layers.N.". Expert e's gate/up rows fill w13[e] rows [0, I) and [I, 2I)."""
        from gpu_worker.models.decoder import WeightTarget   # decoder imports this module
        p, inter = f"{prefix}{names.block}.", self.intermediate
        targets = {p + "gate.weight": WeightTarget(self.gate.weight)}
        for local in range(self.num_local_experts):
            e = p + f"experts.{self.first_expert + local}."
            targets[e + f"{names.gate}.weight"] = WeightTarget(self.w13[local], 0, inter)
            targets[e + f"{names.up}.weight"] = WeightTarget(self.w13[local], inter, 2 * inter)
            targets[e + f"{names.down}.weight"] = WeightTarget(self.w2[local])
        return targets

    def hf_other_experts(self, prefix: str, names: ExpertNames) -> set[str]:
        """Checkpoint tensors of experts other ranks hold (expert parallel): not loaded here."""
        mine = range(self.first_expert, self.first_expert + self.num_local_experts)
        return {f"{prefix}{names.block}.experts.{e}.{w}.weight" for e in range(self.num_experts)
                if e not in mine for w in (names.gate, names.up, names.down)}

    def hf_expert_slice(self, part: str, names: ExpertNames):
        """Tensor parallel: (dim, start, stop) of expert tensor `part` this rank loads (the
        r-th block of the intermediate size), or None when it loads the tensor whole."""
        m = _EXPERT_TENSOR.search(part)
        if m is None or not self.ctx.enabled or self.expert_parallel:
            return None
        start, stop = self.ctx.rank * self.intermediate, (self.ctx.rank + 1) * self.intermediate
        if m.group(1) in (names.gate, names.up):
            return 0, start, stop
        return (1, start, stop) if m.group(1) == names.down else None

    # ---- one rank's experts ------------------------------------------------------------------
    def experts_mlp(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by local expert, (E_local,) counts -> (A, H) expert outputs (unweighted)."""
        gate, up = grouped_linear(xs, self.w13, counts).split(self.intermediate, dim=-1)  # (A, I) x 2
        return grouped_linear(F.silu(gate) * up, self.w2, counts)                        # (A, H)

    def _dispatch_local(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """-> (T*k, H) expert outputs, row i for flat assignment i = token * k + j."""
        flat = routing.experts.reshape(-1)                        # (T*k,)
        order = torch.argsort(flat, stable=True)                  # assignments sorted by expert
        counts = _count(flat, self.num_experts)
        y = self.experts_mlp(x[order // self.top_k], counts)     # (T*k, H), sorted order
        out = torch.empty_like(y)
        out[order] = y
        return out

    def _combine(self, num_tokens: int, routing: Routing, y: torch.Tensor) -> torch.Tensor:
        """(T*k, H) per-assignment outputs -> (T, H): weighted sum over each token's k experts."""
        weighted = y.float() * routing.weights.reshape(-1, 1)     # (T*k, H) fp32
        return weighted.view(num_tokens, self.top_k, y.shape[-1]).sum(dim=1).to(y.dtype)

    # ---- expert parallel ---------------------------------------------------------------------
    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        ctx, k, n = self.ctx, self.top_k, self.ctx.world_size
        t = x.shape[0]
        chunk = -(-t // n)                                        # rows per rank (last may be short)
        lo, hi = min(t, ctx.rank * chunk), min(t, (ctx.rank + 1) * chunk)
        x_mine = x[lo:hi]                                         # (t_l, H)
        routing = route(self.gate(x_mine), k, self.renormalize)
        flat = routing.experts.reshape(-1)                        # (t_l*k,)
        order = torch.argsort(flat, stable=True)                  # by expert, hence by owning rank
        dest = flat[order] // self.num_local_experts
        send_counts = torch.bincount(dest, minlength=n)           # (N,)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        # dispatch: rows and their expert index local to the receiving rank
        rx = all_to_all_rows(x_mine[order // k], send, recv, ctx)                      # (R, H)
        re = all_to_all_rows(flat[order] - dest * self.num_local_experts, send, recv, ctx)  # (R,)
        # local experts over what arrived (from every rank), back in arrival order
        local_order = torch.argsort(re, stable=True)
        counts = torch.bincount(re, minlength=self.num_local_experts)
        ry = torch.empty_like(rx)
        ry[local_order] = self.experts_mlp(rx[local_order], counts)
        # combine: results travel back the way the rows came
        y_sorted = all_to_all_rows(ry, recv, send, ctx)           # (t_l*k, H), `order` order
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        out_mine = self._combine(hi - lo, routing, y)            # (t_l, H)
        padded = x.new_zeros(chunk, x.shape[1])
        padded[: hi - lo] = out_mine
        return all_gather_rows(padded, ctx)[:t]                   # (T, H) on every rank
