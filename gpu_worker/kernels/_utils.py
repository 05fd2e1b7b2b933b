"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import os

import torch


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter used by the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must live on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a fixed 132 on CPU, an H100/H200's count)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_HOPPER: dict[int, bool] = {}


def hopper_or_newer(device: torch.device) -> bool:
    """Whether a CUDA `device` has compute capability >= 9 (PDL, TMA); cached per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _HOPPER[index]
