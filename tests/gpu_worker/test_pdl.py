"""Programmatic dependent launch (gpu_worker/kernels/_pdl.py): when it is on (CUDA-graph capture
only), and on the GPU that a chain of PDL kernels replayed from a CUDA graph computes bit for bit
what the same kernels give launched one after another without it (a kernel reading its predecessor's output too early would
show as a difference, or as replays that disagree)."""
import pytest
import torch

from gpu_worker.kernels import _pdl


def test_off_for_cpu_tensors_eager_launches_and_when_disabled():
    with _pdl.for_cuda_graph():
        assert not _pdl.pdl_on(torch.zeros(1))
        assert _pdl.pdl_kwargs(torch.zeros(1)) == {"PDL": 0}      # no launch_pdl off the GPU
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        assert not _pdl.pdl_on(x)                               # eager: never (its host cost)
        with _pdl.for_cuda_graph(False):                        # KernelTuning.pdl off
            assert not _pdl.pdl_on(x)
            with _pdl.for_cuda_graph(True):                     # nested: the inner one rules
                assert _pdl.pdl_on(x) == (_pdl._SUPPORTED and torch.cuda.get_device_capability()[0] >= 9)
            assert not _pdl.pdl_on(x)                           # and the outer one again after it
        assert not _pdl.pdl_on(x)


def test_graph_scope_is_per_thread():
    """Which launches are inside a graph capture is a context variable: a capture on one thread
    does not turn PDL on for another thread's launches (a process-wide counter did)."""
    import threading
    with _pdl.for_cuda_graph():
        inside = _pdl._IN_PDL_GRAPH.get()
        seen = []
        t = threading.Thread(target=lambda: seen.append(_pdl._IN_PDL_GRAPH.get()))
        t.start()
        t.join(timeout=30)
    assert seen == [False] and inside == _pdl._SUPPORTED and _pdl._IN_PDL_GRAPH.get() is False


@pytest.mark.parametrize("value, ok", [("0", True), ("1", True), ("yes", False), ("", False)])
def test_env_value_is_checked(value, ok):
    """KVMESH_PDL is read when the engine config is built (tuning_from_env), not at import."""
    from gpu_worker.config import tuning_from_env
    if ok:
        assert tuning_from_env({"KVMESH_PDL": value}).pdl == (value == "1")
    else:
        with pytest.raises(ValueError, match="KVMESH_PDL"):
            tuning_from_env({"KVMESH_PDL": value})


def _chain(x, layers):
    """A decode layer's kernel sequence at batch 1, each kernel reading the one before's output:
    GEMV with RMSNorm prologue, GEMV with residual epilogue, norm + residual, GEMV, SwiGLU,
    GEMV with SwiGLU prologue and residual, the same writing its output's RMSNorm (norm_out
    epilogue), GEMV writing its SwiGLU (swiglu_out), GEMV writing its RMSNorm, GEMV (both split-K
    reductions and the single pass)."""
    from gpu_worker.kernels.fp8_gemv import w8_gemv
    from gpu_worker.kernels.rmsnorm import rmsnorm
    from gpu_worker.kernels.swiglu import swiglu
    h = x
    for g, a, b, up_w, down in layers:            # each weight: (weight, scale or None)
        y = w8_gemv(h, *a, norm_weight=g)
        h = w8_gemv(y, *b, residual=h)
        n, h = rmsnorm(h, g, 1e-5, residual=x)
        up = w8_gemv(n, *up_w)
        h = w8_gemv(swiglu(up), *down, residual=h)
        h = w8_gemv(up, *down, swiglu=True, residual=h)
        n, h = w8_gemv(up, *down, swiglu=True, residual=h, norm_out=(g, 1e-5))
        act = w8_gemv(n, *up_w, swiglu_out=True)
        n, h = w8_gemv(act, *down, residual=h, norm_out=(g, 1e-5))
        h = w8_gemv(n, *b, residual=h)
    return h


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs an sm_90+ GPU")
@pytest.mark.parametrize("launch_late", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_pdl_graph_replays_match_plain_launches(monkeypatch, dtype, launch_late):
    from gpu_worker.kernels import fp8_gemv
    monkeypatch.setattr(fp8_gemv, "PDL_LAUNCH_LATE", launch_late)   # GEMVs' next kernel launched late
    torch.manual_seed(0)
    H, I, dev = 1024, 2816, "cuda"

    def weight(n, k):
        w = torch.randn(n, k, device=dev) / k ** 0.5
        if dtype == torch.bfloat16:
            return w.to(dtype), None
        return (w * 64).to(dtype), torch.full((n,), 1 / 64, device=dev)

    layers = [(torch.rand(H, device=dev, dtype=torch.bfloat16) + 0.5, weight(H, H), weight(H, H),
               weight(2 * I, H), weight(H, I)) for _ in range(6)]
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)

    ref = _chain(x, layers)                  # eager, outside a graph: no PDL
    torch.cuda.synchronize()

    with _pdl.for_cuda_graph():            # as cuda_graphs.capture_graph: warm-up, then capture
        assert _pdl.pdl_on(x)
        eager = _chain(x, layers)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, layers)
    assert torch.equal(eager, ref)
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs an sm_90+ GPU")
@pytest.mark.parametrize("num_splits,block_n,ctx,hpp", [(8, 16, 128, None), (8, 16, 512, None), (32, 128, 8192, None),
                                                        (1, 64, 128, 1), (2, 32, 512, 2)])
def test_decode_attention_merged_in_launch_under_pdl_graphs(num_splits, block_n, ctx, hpp):
    """Split decode attention with RoPE + KV write fused in, each layer's output the next one's
    query: the in-launch merge (the last program of each head block merges) replayed from a PDL
    graph equals the two-kernel merge launched plainly, bit for bit, replay after replay (a
    program merging before the others' partials are visible would show as a difference); with
    blocks of fewer query heads (hpp) too, where one program of each KV head writes its key."""
    from gpu_worker.kernels.paged_decode_attention import FusedRopeKV, paged_decode_attention
    from gpu_worker.tuning import DecodeAttentionTuning
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_inv_freq
    torch.manual_seed(0)
    dev, n_kv, group, D, page, B = "cuda", 8, 4, 128, 16, 2
    per_seq = ctx // page
    nb = B * per_seq + 3
    lens = torch.tensor([ctx, ctx - 37], dtype=torch.int32, device=dev)
    tables = torch.randperm(nb, device=dev)[: B * per_seq].view(B, per_seq).int()
    slots = torch.stack([tables[b, (n - 1) // page].long() * page + (n - 1) % page
                         for b, n in enumerate(lens.tolist())])
    cs = build_cos_sin_cache(rope_inv_freq(D, 500000.0), ctx + 1).to(dev)
    bf = dict(device=dev, dtype=torch.bfloat16)
    layers = [(torch.randn(nb, page, n_kv, D, **bf), torch.randn(nb, page, n_kv, D, **bf),
               torch.randn(B, n_kv, D, **bf), torch.randn(B, n_kv, D, **bf)) for _ in range(6)]
    q0 = torch.randn(B, n_kv * group, D, **bf)

    def chain(merge):
        q = q0
        for kc, vc, k, v in layers:
            q = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, max_context_len=ctx,
                                       num_splits=num_splits, block_n=block_n, merge=merge, heads_per_program=hpp,
                                       rope=FusedRopeKV(lens.long() - 1, cs, k, v, slots), tuning=tuning)
        return q

    # bit-equal only when both merges reduce over the splits with the same warps: the merge kernel
    # runs with merge_num_warps (1 by default), the in-launch merge with the attention kernel's 4
    tuning = DecodeAttentionTuning(merge_num_warps=4)
    ref = chain("two_pass")                  # eager, outside a graph: no PDL
    torch.cuda.synchronize()
    with _pdl.for_cuda_graph():
        eager = chain("last")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain("last")
    assert torch.equal(eager, ref)
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
