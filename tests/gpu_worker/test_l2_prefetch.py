"""L2 prefetch (gpu_worker/kernels/l2_prefetch.py): the KVMESH_L2_PREFETCH value is checked, and on
an sm_90 GPU every mode compiles, runs, and leaves the decode attention's output bit for bit as it
is without it (the prefetch is a hint: no values may change)."""
import os
import subprocess
import sys

import pytest
import torch

from gpu_worker.kernels import l2_prefetch as l2


@pytest.mark.parametrize("value, ok", [("off", True), ("line", True), ("evict_last", True), ("bulk", True),
                                       ("1", False), ("", False)])
def test_env_value_is_checked(value, ok):
    code = "import gpu_worker.kernels.l2_prefetch as p; print(p.MODE)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "KVMESH_L2_PREFETCH": value}, timeout=120)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == str(l2.MODES[value]), proc.stderr
    else:
        assert proc.returncode != 0 and "KVMESH_L2_PREFETCH" in proc.stderr


def test_off_on_the_cpu_without_the_interpreter(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter turns every mode into the dry one")
    monkeypatch.setattr(l2, "MODE", l2.MODES["bulk"])
    assert l2.mode_for(torch.zeros(4)) == 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the prefetch modes need an sm_90+ GPU")
@pytest.mark.parametrize("mode", ["line", "evict_last", "bulk"])
def test_prefetch_changes_no_value(monkeypatch, mode):
    from gpu_worker.kernels.paged_decode_attention import paged_decode_attention
    monkeypatch.setattr(l2, "MODE", l2.MODES[mode])
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    k_cache = torch.randn(64, 16, 8, 128, device=dev, dtype=bf, generator=g)
    v_cache = torch.randn(64, 16, 8, 128, device=dev, dtype=bf, generator=g)
    tables = torch.randperm(64, device=dev, generator=g).to(torch.int32).view(2, 32)
    lens = torch.tensor([300, 17], dtype=torch.int32, device=dev)
    q = torch.randn(2, 32, 128, device=dev, dtype=bf, generator=g)
    weight = torch.randn(4096, 1000, device=dev, dtype=bf, generator=g)     # not a multiple of a span
    before = weight.clone()
    for splits in (1, 8):
        plain = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.088, max_context_len=512,
                                       num_splits=splits)
        warmed = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.088, max_context_len=512,
                                        num_splits=splits, l2_prefetch=weight)
        assert torch.equal(plain, warmed)
    for programs in (1, 132, 1000):
        l2.l2_prefetch(weight, programs)
    torch.cuda.synchronize()
    assert torch.equal(weight, before)
