"""Column- and row-parallel linear layers (Megatron-style), and how a full weight is sliced.

    y = x W^T, W (out, in)

    column parallel: W split by rows (outputs).  rank r: y[:, r-th block] = x W_r^T   no comm
    row parallel:    W split by columns (inputs), x arrives split the same way (the output of
                     a column-parallel layer).      y = sum_r x_r W_r^T  ->  one all-reduce

A transformer block pairs them so each sub-layer costs one all-reduce:
qkv_proj (column, by heads) -> attention on local heads -> o_proj (row);
gate_up_proj (column, gate and up sliced alike) -> SiLU*up -> down_proj (row).
Biases: a column layer's bias is sliced with its rows; a row layer's bias is added once,
after the all-reduce.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.parallel.state import ParallelContext, all_reduce


class Shard(NamedTuple):
    """Rows/columns [start, stop) along `dim` of a full checkpoint tensor that one rank keeps."""
    dim: int
    start: int
    stop: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.stop - self.start)


def even_shard(n: int, ctx: ParallelContext, dim: int, what: str) -> Shard:
    start, stop = ctx.shard(n, what)
    return Shard(dim, start, stop)


def head_shard(num_heads: int, head_dim: int, ctx: ParallelContext, dim: int = 0) -> Shard:
    """Query heads: rank r keeps heads [r*nh/N, (r+1)*nh/N), i.e. those rows of q_proj."""
    start, stop = ctx.shard(num_heads, "num_attention_heads")
    return Shard(dim, start * head_dim, stop * head_dim)


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """KV heads each rank keeps: nkv/N when N divides nkv, else 1 (replicated) when nkv divides N."""
    if num_kv_heads % world_size == 0:
        return num_kv_heads // world_size
    if world_size % num_kv_heads == 0:
        return 1
    raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({world_size}): "
                     "one must divide the other")


def kv_head_shard(num_kv_heads: int, head_dim: int, ctx: ParallelContext, dim: int = 0) -> Shard:
    """KV heads of rank r. With N > nkv, ranks r*nkv//N share KV head r // (N/nkv): each rank's
    query heads [r*nh/N, ...) all map to that one KV head, as GQA requires."""
    per = kv_heads_per_rank(num_kv_heads, ctx.world_size)
    if num_kv_heads >= ctx.world_size:
        first = ctx.rank * per
    else:
        first = ctx.rank // (ctx.world_size // num_kv_heads)
    return Shard(dim, first * head_dim, (first + per) * head_dim)


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of a column-parallel linear: plain x W_r^T (+ b_r), no comm."""

    def __init__(self, in_features: int, out_features_local: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features_local, bias=bias, dtype=dtype)
        self.ctx = ctx


class RowParallelLinear(nn.Module):
    """This rank's input columns of a row-parallel linear; sums the partial products over ranks.

    weight (out, in_local); x (T, in_local) -> (T, out), identical on every rank."""

    def __init__(self, in_features_local: int, out_features: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(out_features, in_features_local, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight), self.ctx)   # (T, out)
        return y if self.bias is None else y + self.bias
