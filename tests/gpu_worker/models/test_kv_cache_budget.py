"""KV cache sizing arithmetic (ModelRunner.profile_num_blocks): gpu_memory_utilization is this
runner's share of the device, whatever else the device or the process holds."""
import pytest

from gpu_worker.model_runner import KV_FREE_MARGIN_BYTES, _DeviceMemory, kv_cache_budget

GIB = 2**30
TOTAL = 140 * GIB


def test_budget_is_share_minus_own_weights_and_peak():
    base = _DeviceMemory(TOTAL, used=1 * GIB, reserved=0, allocated=0)
    # 16 GiB of weights + 2 GiB of activations at the peak; 0.5 GiB of cuBLAS workspace appeared
    now = _DeviceMemory(TOTAL, used=1 * GIB + 16 * GIB + GIB // 2, reserved=16 * GIB, allocated=16 * GIB)
    budget = kv_cache_budget(base, now, peak_allocated=18 * GIB, gpu_memory_utilization=0.9)
    assert budget == int(TOTAL * 0.9) - 18 * GIB - GIB // 2


def test_memory_held_before_the_runner_is_not_charged():
    # Another engine in this process holds 70 GiB (a benchmark that builds a bf16-cache engine and
    # then an fp8-cache one):
    # the new runner still gets its own 0.4 share.
    held = 70 * GIB
    base = _DeviceMemory(TOTAL, used=held + GIB, reserved=held, allocated=held)
    now = _DeviceMemory(TOTAL, used=held + GIB + 3 * GIB, reserved=held + 3 * GIB, allocated=held + 3 * GIB)
    budget = kv_cache_budget(base, now, peak_allocated=held + 4 * GIB, gpu_memory_utilization=0.4)
    assert budget == int(TOTAL * 0.4) - 4 * GIB


def test_two_workers_share_one_device():
    # Worker A (another process) took 0.45 of the device; worker B at 0.45 fits beside it.
    a = int(TOTAL * 0.45)
    base = _DeviceMemory(TOTAL, used=a + GIB, reserved=0, allocated=0)
    now = _DeviceMemory(TOTAL, used=a + GIB + 17 * GIB, reserved=17 * GIB, allocated=16 * GIB)
    budget = kv_cache_budget(base, now, peak_allocated=17 * GIB, gpu_memory_utilization=0.45)
    assert 0 < budget <= now.total - now.used - KV_FREE_MARGIN_BYTES


def test_asking_for_more_than_is_free_names_the_setting():
    base = _DeviceMemory(TOTAL, used=100 * GIB, reserved=0, allocated=0)
    now = _DeviceMemory(TOTAL, used=116 * GIB, reserved=16 * GIB, allocated=16 * GIB)
    with pytest.raises(RuntimeError, match="gpu_memory_utilization=0.9"):
        kv_cache_budget(base, now, peak_allocated=16 * GIB, gpu_memory_utilization=0.9)



def test_dummy_sample_draws_every_row_with_the_costliest_parameters(tiny_models):
    """profile_num_blocks' draw (runs on any device): the head on max_num_seqs rows, then a
    penalized, filtered draw on each with the most logprobs, its logits alive until results()."""
    import torch

    from gpu_worker.model_config import ModelConfig
    from gpu_worker.model_runner import ModelRunner
    from services.protocol.sampling import MAX_LOGPROBS
    runner = ModelRunner(ModelConfig.from_dir(tiny_models["llama"]), tiny_models["llama"])
    pending = runner._dummy_sample(37)
    assert pending.raw is not None and pending.raw.shape == (37, runner.config.vocab_size)
    assert pending.raw.dtype == torch.float32
    results = pending.results()
    assert len(results) == 37
    assert all(0 <= r.token_id < runner.config.vocab_size and len(r.logprob.top) == MAX_LOGPROBS for r in results)


def test_profiling_out_of_memory_names_the_settings(tiny_models, monkeypatch):
    """An out-of-memory error while profiling the largest step (its draw or its forward) becomes
    a message naming max_num_batched_tokens and max_num_seqs, not a bare CUDA error. (The CUDA
    calls around it are stubbed: this runs on the CPU.)"""
    import torch

    from gpu_worker.model_config import ModelConfig
    from gpu_worker.model_runner import ModelRunner
    runner = ModelRunner(ModelConfig.from_dir(tiny_models["llama"]), tiny_models["llama"])
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(runner, "device", torch.device("cuda", 0))

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
    monkeypatch.setattr(runner, "_dummy_sample", oom)
    with pytest.raises(RuntimeError, match="max_num_batched_tokens=512 .*max_num_seqs=4096") as info:
        runner.profile_num_blocks(16, 0.9, 512, 4096)
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
