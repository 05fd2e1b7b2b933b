"""GPU tests cannot share a pytest process with the kernel tests on a GPU machine:
kernels/conftest.py turns Triton's interpreter on for the whole process, so every kernel would
run interpreted on CPU arrays and fail (seen on the H200: 29 failures). Such tests are skipped
with a reason that says how to run them."""
from __future__ import annotations

import pytest

from gpu_worker.kernels._utils import interpreting

RUN_APART = ("Triton's interpreter is on in this pytest process (tests/gpu_worker/kernels/conftest.py): "
             "run the GPU tests in a process of their own: "
             "pytest -m gpu tests/gpu_worker/engine tests/gpu_worker/models tests/gpu_worker/perf "
             "tests/gpu_worker/kv_transfer tests/gpu_worker/kv_tiers tests/gpu_worker/spec_decode")


def pytest_collection_modifyitems(config, items):
    if not interpreting():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=RUN_APART))
