"""The devices of tests that run on the CPU and on a GPU: the CUDA case is marked `gpu` and is
skipped where no CUDA GPU is present."""
from __future__ import annotations

import pytest
import torch

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU")])
CPU_AND_CUDA = [pytest.param("cpu"), CUDA]
