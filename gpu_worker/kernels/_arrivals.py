"""Arrival counters for kernels whose last-finishing program does the final step in the same
launch (fp8_gemv's split-K "last" reduction and its epilogues, paged_decode_attention's split
merge): one zeroed int32 buffer per (device, owner), left zeroed by every call.

A program stores its partial result, then bumps its counter with an acq_rel atomic; the program
that reads back count - 1 sees every other program's stores, finishes the work and resets the
counter to 0. Each owner has its own buffer, so two kinds of kernel never share a counter; calls
of one owner must not run concurrently on two streams of one device (the engine uses one stream).
"""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(device: torch.device, owner: str, slots: int) -> torch.Tensor | None:
    """The zeroed (slots,) int32 counters of `owner` on `device` (allocated on first use, never
    replaced: CUDA graphs keep their address), or None while a CUDA graph is being captured and
    they do not exist yet (an allocation then would belong to the graph's pool): the caller then
    falls back to its two-launch form. An owner passes the same `slots` every time."""
    key = (owner, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _BUFFERS[key] = torch.zeros(slots, dtype=torch.int32, device=device)
    assert buf.numel() == slots, f"arrival counters of {owner!r}: {buf.numel()} slots, asked for {slots}"
    return buf
