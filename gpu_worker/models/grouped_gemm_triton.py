"""Triton grouped GEMM for MoE experts: out[rows of g] = x[rows of g] @ w[g]^T, all groups in one launch.

    x (A, K) rows sorted by group;  w (G, N, K);  counts (G,)   ->  out (A, N)

Each program computes one BLOCK_M x BLOCK_N output tile of one group. The tile -> (group, first
row) map is built on the device with torch (cumsum + searchsorted), so the launch needs no host
sync and can be captured in a CUDA graph; the grid is an upper bound (ceil(A/BM) + G tiles) and
programs past the last real tile exit at once.

    group g's rows: [off[g], off[g+1])  ->  tiles t_g .. t_g + ceil(count_g / BM) - 1
    tile t of group g covers rows off[g] + (t - t_g) * BM ... (masked at off[g+1])

fp32 accumulation, one rounding to x's dtype at the store. Used where torch's grouped_mm cannot
run (fp16/fp32 on CUDA, pre-SM80 GPUs); `grouped_gemm.grouped_linear_ref` is its reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_group_ptr, tile_row_ptr, group_end_ptr,
                         N, K, num_groups,
                         stride_xm, stride_wg, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.load(tile_group_ptr + pid_m)
    if g < num_groups:
        row0 = tl.load(tile_row_ptr + pid_m).to(tl.int64)
        row_end = tl.load(group_end_ptr + g).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < row_end
        cmask = cols < N
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)          # (BM, BK)
            b = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                        mask=kmask[:, None] & cmask[None, :], other=0.0)          # (BK, BN)
            acc += tl.dot(a, b, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def _block_m(rows: int, groups: int) -> int:
    per_group = rows / max(1, groups)
    return 16 if per_group <= 16 else 32 if per_group <= 32 else 64


def grouped_gemm_triton(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(A, K) sorted rows, (G, N, K) weights, (G,) counts -> (A, N) in x's dtype."""
    assert x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[2], (x.shape, w.shape)
    assert x.stride(1) == 1 and w.stride(2) == 1, "x and w need a contiguous K dimension"
    a, k = x.shape
    g, n = w.shape[0], w.shape[1]
    out = torch.empty(a, n, dtype=x.dtype, device=x.device)
    if a == 0:
        return out
    bm, bn, bk = _block_m(a, g), 64 if n <= 64 else 128, 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    counts = counts.to(x.device, torch.int64)
    group_end = counts.cumsum(0)                                    # (G,) last row + 1 of each group
    group_start = group_end - counts
    tiles = (counts + bm - 1) // bm                                 # (G,) tiles per group
    tile_end = tiles.cumsum(0)
    max_tiles = -(-a // bm) + g                                     # an upper bound: no host sync
    tile_ids = torch.arange(max_tiles, device=x.device)
    tile_group = torch.searchsorted(tile_end, tile_ids, right=True)  # (max_tiles,) G = past the end
    gi = tile_group.clamp(max=g - 1)
    tile_row = group_start[gi] + (tile_ids - (tile_end[gi] - tiles[gi])) * bm
    grid = (max_tiles, triton.cdiv(n, bn))
    _grouped_gemm_kernel[grid](x, w, out, tile_group.to(torch.int32), tile_row, group_end, n, k, g,
                               x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               PRECISION="ieee" if x.dtype == torch.float32 else "tf32",   # fp32 stays fp32
                               num_warps=4, num_stages=3)
    return out
