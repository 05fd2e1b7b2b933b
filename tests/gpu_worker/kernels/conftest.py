"""Kernel tests run on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton
is imported). Inputs are fp32 tensors holding bf16-representable values: the kernels load them
and compute in fp32, as they do with bf16 on the GPU.

The variable holds for the whole pytest process and every kernel module imported after it: on a
GPU machine the GPU tests collected beside this folder are skipped (tests/gpu_worker/conftest.py
says how to run them apart)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402,F401
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    _why = f"triton cannot be imported: {exc}"


def pytest_collection_modifyitems(config, items):
    if triton is None:
        skip = pytest.mark.skip(reason=_why)
        for item in items:
            if "tests/gpu_worker/kernels" in str(item.fspath):
                item.add_marker(skip)


def _bf16_randn(*shape, scale: float = 1.0) -> torch.Tensor:
    """fp32 tensor of bf16-representable values."""
    return (torch.randn(*shape) * scale).to(torch.bfloat16).float()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture
def randn():
    return _bf16_randn


@pytest.fixture
def rel_err():
    return _rel_err


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
