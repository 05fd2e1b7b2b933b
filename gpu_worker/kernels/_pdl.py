"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a small decode step.

A batch-1 decode step is ~250 kernels of 2-60 us each; between two of them the GPU drains the
first grid, then launches and ramps up the next (a few us, also inside a CUDA graph). With PDL
the next kernel is launched while the previous one still runs: its programs start, do what does
not depend on the previous kernel's output (the GEMV can prefetch weight tiles into L2:
fp8_gemv.PDL_PREFETCH_TILES, 0 by default), then block in `griddepcontrol.wait` until the
previous grid has finished and its writes are visible.

Rules every PDL kernel here follows (each kernel may be followed by any other):
  - `pdl_wait` runs in every program before its first load of another kernel's output, its first
    store, and any early return: a kernel that could finish before its predecessor would let the
    kernel after it read that predecessor's output too early;
  - the next kernel may launch (griddepcontrol.launch_dependents) once every program of this one
    has passed its wait (`pdl_wait` issues it): one kernel waits ahead at a time. Letting it
    launch at each kernel's start instead stacked a chain of waiting kernels on the SMs while
    the kernel in front ran: 5% slower at 8k context on the H200.
Kernels launched without PDL (cuBLAS, torch ops) wait for their predecessor to finish as usual.

On: kernels launched inside `for_cuda_graph(True)` (a CUDA graph's warm-up calls and its capture:
cuda_graphs.capture_graph, given the engine's KernelTuning.pdl), on CUDA devices of compute
capability >= 9 when Triton supports it. Eager steps never use it (pdl_on says why). Which launches
are inside is a context variable, set and reset by for_cuda_graph: no process-wide counter.
Under TRITON_INTERPRET=1 (the CPU tests) it is always off: the PDL constexpr is 0 there.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

from gpu_worker.kernels._utils import hopper_or_newer, interpreting


def _triton_supports_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")
    except Exception:          # no CUDA backend in this Triton build
        return False


_SUPPORTED = _triton_supports_pdl()      # a property of the installed Triton, fixed per process
_IN_PDL_GRAPH: ContextVar[bool] = ContextVar("kvmesh_in_pdl_graph", default=False)


@contextlib.contextmanager
def for_cuda_graph(enabled: bool = True):
    """Kernels launched inside use PDL where `enabled` (KernelTuning.pdl) and the device has it.
    Wrap a graph's eager warm-up calls as well as its capture: the PDL variants then compile and
    load before the capture starts."""
    token = _IN_PDL_GRAPH.set(enabled and _SUPPORTED)
    try:
        yield
    finally:
        _IN_PDL_GRAPH.reset(token)


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device launch with PDL: only for CUDA graphs (for_cuda_graph).
    Triton's PDL launch costs the host far more than a plain one (an eager 513-token prefill
    launched in 23.8 ms instead of 18.1 on the H200), which a graph pays once, at capture."""
    if not (_IN_PDL_GRAPH.get() and t.is_cuda) or interpreting():
        return False
    return hopper_or_newer(t.device)


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keywords of a PDL-aware kernel: its PDL constexpr (1 on, 0 off), plus launch_pdl
    when on (never passed off the GPU, where older interpreters reject unknown launch options)."""
    return dict(PDL=1, launch_pdl=True) if pdl_on(t) else dict(PDL=0)


@triton.jit
def pdl_wait(PDL: tl.constexpr, LAUNCH: tl.constexpr = True):
    """Block until the previous kernel has finished and its memory writes are visible; then let
    the next kernel launch (LAUNCH False: the kernel calls pdl_launch itself, later)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if LAUNCH:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_launch(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has got here (or exited): a
    kernel of several waves of programs calls it near its end, so that the next kernel's programs
    do not take SM slots its own last wave still needs."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Start loading the 128-byte line of every pointer into L2 (no registers, no result): a
    weight tile fetched while the previous kernel still runs. GPU only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
