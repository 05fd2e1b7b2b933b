"""kv_cache_dtype="fp8": the KV cache stored in e4m3 (scale 1.0) on the torch reference backend,
against the same engine with its cache in the model dtype (fp32 on CPU): config, capacity,
logits, prefix-cache hits and n > 1 copy-on-write."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams

BLOCK = 16
# e4m3 keeps 3 mantissa bits: each cached K/V element is off by up to 2^-4 relative (measured
# rms 2.7% on these models, whose K/V are O(1): scale 1.0 saturates nothing). Through the tiny
# random decoders attention amplifies it: measured first-step logits rel. error vs the fp32 cache
# 0.04-0.13 (llama), 0.05-0.07 (qwen3), 0.04-0.12 (mistral) over prompts of 5-150 tokens; the same
# order as fp8 weights in test_perf_fp8.py. A broken scale or layout gives ~1.
LOGITS_TOL = 0.25


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int = 1, steps: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, n=n, logprobs=0)


def engine(model_dir: str, kv_cache_dtype: str, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 64)
    return Engine(EngineConfig(model=model_dir, device="cpu", block_size=BLOCK, attention_backend="torch",
                               kv_cache_dtype=kv_cache_dtype, **kw))


def drain(eng: Engine) -> dict:
    out: dict = {}
    while eng.has_unfinished_requests():
        for d in eng.step():
            rec = out.setdefault((d.request_id, d.index), {"tokens": [], "logprobs": [], "cached": 0})
            rec["tokens"] += d.new_token_ids
            rec["logprobs"] += [lp.logprob for lp in d.new_logprobs or []]
            rec["cached"] = d.num_cached_tokens
    eng.block_manager.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    return out


def first_step_logits(eng: Engine, ids: list[int]) -> torch.Tensor:
    """(V,) float32 logits of the prompt's last position."""
    seen = []
    forward = eng.runner.forward
    eng.runner.forward = lambda batch: seen.append(forward(batch)) or seen[-1]
    eng.add_request("p", ids, greedy(steps=1))
    drain(eng)
    eng.runner.forward = forward
    return seen[0][-1]


def test_kv_cache_dtype_is_validated_and_passed_through(monkeypatch):
    assert EngineConfig(model="m").kv_cache_dtype == "auto"
    assert EngineConfig(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", kv_cache_dtype="fp8", tensor_parallel_size=2)

    from services.config import ConfigError, WorkerConfig, parse_config
    cfg = parse_config(WorkerConfig, ["--kv-cache-dtype", "fp8"], "w", env={})
    assert cfg.kv_cache_dtype == "fp8"
    assert parse_config(WorkerConfig, [], "w", env={}).kv_cache_dtype == "auto"
    with pytest.raises((ConfigError, SystemExit)):
        parse_config(WorkerConfig, ["--kv-cache-dtype", "int8"], "w", env={})

    import gpu_worker.engine
    from gpu_worker.service.main import build_engine
    monkeypatch.setattr(gpu_worker.engine, "Engine", lambda config: config)
    assert build_engine(WorkerConfig(model="/m", kv_cache_dtype="fp8")).kv_cache_dtype == "fp8"


def test_fp8_cache_holds_twice_the_blocks(tiny_llama):
    budget = 256 * 1024
    kw = dict(num_gpu_blocks=None, cpu_kv_cache_bytes=budget, max_num_seqs=256)
    full, fp8 = engine(tiny_llama, "auto", **kw), engine(tiny_llama, "fp8", **kw)
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert full.runner.kv_caches[0][0].dtype == torch.float32
    assert full.runner.block_size_bytes(BLOCK) == 4 * fp8.runner.block_size_bytes(BLOCK)   # fp32 -> 1 byte
    n_full, n_fp8 = full.stats().num_total_blocks, fp8.stats().num_total_blocks
    assert n_fp8 * fp8.runner.block_size_bytes(BLOCK) <= budget
    assert n_fp8 == budget // fp8.runner.block_size_bytes(BLOCK) >= 2 * n_full


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_fp8_logits_close_to_full_precision_cache(model, request):
    model_dir = request.getfixturevalue(model)
    full, fp8 = engine(model_dir, "auto"), engine(model_dir, "fp8")
    errs = [rel_err(first_step_logits(fp8, ids), first_step_logits(full, ids))
            for ids in (prompt(5, 1), prompt(23, 2), prompt(40, 3), prompt(70, 4))]
    assert max(errs) < LOGITS_TOL, errs
    assert max(errs) > 0                                  # the cache really is quantized


def test_fp8_prefix_hit_and_n2_copy_on_write(tiny_llama):
    ids = prompt(37, 5)                                   # 2 full blocks + a partial one
    fresh = engine(tiny_llama, "fp8", enable_prefix_caching=False)
    fresh.add_request("ref", ids, greedy())
    ref = drain(fresh)[("ref", 0)]

    eng = engine(tiny_llama, "fp8")
    eng.add_request("warm", ids, greedy())
    drain(eng)
    eng.add_request("hit", ids, greedy(n=2))              # cached prefix; forked partial block
    out = drain(eng)
    for i in range(2):
        rec = out[("hit", i)]
        assert rec["cached"] >= 2 * BLOCK
        assert rec["tokens"] == ref["tokens"]
        assert torch.allclose(torch.tensor(rec["logprobs"]), torch.tensor(ref["logprobs"]), atol=1e-4)
    assert eng.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn


def test_torch_backend_fp8_is_attention_over_the_dequantized_cache():
    """stored = fp8(x / scale), read = stored * scale, maths in fp32: with scales 2 and 0.5 the
    fp8 backend equals the fp32 backend fed the dequantized K/V. Two sequences, the second over
    a cached prefix of 13 tokens."""
    from gpu_worker.attention.torch_backend import TorchAttentionBackend
    from gpu_worker.forward_batch import ForwardBatch
    g = torch.Generator().manual_seed(0)
    nh, nkv, D, blocks = 4, 2, 32, 4
    T = 5 + 3
    q, k, v = (torch.randn(T, n, D, generator=g) * 3 for n in (nh, nkv, nkv))
    i32 = dict(dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.tensor([0, 1, 2, 3, 4, 13, 14, 15]),
        query_lens=torch.tensor([5, 3], **i32), context_lens=torch.tensor([5, 16], **i32),
        query_start_loc=torch.tensor([0, 5, 8], **i32), block_tables=torch.tensor([[0, 0], [1, 2]], **i32),
        slot_mapping=torch.tensor([0, 1, 2, 3, 4, 21, 22, 23]),   # positions 13..15: block 2, offsets 5..7
        logits_indices=torch.tensor([4, 7]), max_query_len=5, max_context_len=16)
    ks, vs = 2.0, 0.5
    shape = (blocks, 8, nkv, D)                                    # block_size 8
    prefix_k, prefix_v = (torch.randn(2, 8, nkv, D, generator=g) for _ in range(2))
    k8, v8 = torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.zeros(shape, dtype=torch.float8_e4m3fn)
    k8[1:3], v8[1:3] = (prefix_k / ks).to(k8.dtype), (prefix_v / vs).to(v8.dtype)
    kf, vf = k8.float() * ks, v8.float() * vs                      # fp32 caches, the same prefix
    got = TorchAttentionBackend(k_scale=ks, v_scale=vs).forward(q, k, v, k8, v8, batch, 0.2)
    dq = lambda x, s: (x / s).to(torch.float8_e4m3fn).float() * s   # noqa: E731
    want = TorchAttentionBackend().forward(q, dq(k, ks), dq(v, vs), kf, vf, batch, 0.2)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(k8.float() * ks, kf) and torch.equal(v8.float() * vs, vf)   # same cache contents


def test_copy_blocks_copies_fp8_bytes(tiny_llama):
    eng = engine(tiny_llama, "fp8", num_gpu_blocks=4)
    k, v = eng.runner.kv_caches[0]
    k[1] = torch.randn(k.shape[1:]).to(k.dtype)
    v[1] = torch.randn(v.shape[1:]).to(v.dtype)
    eng.runner.copy_blocks([1], [3])
    assert torch.equal(k[3].view(torch.uint8), k[1].view(torch.uint8))
    assert torch.equal(v[3].view(torch.uint8), v[1].view(torch.uint8))
