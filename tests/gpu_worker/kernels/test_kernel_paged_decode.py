"""Paged decode attention vs its torch reference: GQA 1/4/8, holes, shared prefixes, split-K."""
import pytest
import torch

from gpu_worker.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref


def make_paged(randn, context_lens, n_kv, head_dim, page, extra_blocks=3, share_prefix=False):
    """A cache whose blocks are scattered (a permutation with unused holes); optionally sequence 1
    shares sequence 0's first blocks (a prefix hit)."""
    need = [(n + page - 1) // page for n in context_lens]
    total = sum(need) + extra_blocks
    perm = torch.randperm(total)
    max_blocks = max(need) + 1
    tables = torch.zeros((len(context_lens), max_blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used: used + nb].int()
        used += nb
    if share_prefix and len(context_lens) > 1:
        shared = min(need[0], need[1]) - 1
        tables[1, :shared] = tables[0, :shared]
    k_cache = randn(total, page, n_kv, head_dim)
    v_cache = randn(total, page, n_kv, head_dim)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("context_lens,num_splits", [([1, 17, 257], 1), ([257, 200, 5], 3), ([1, 17], 4)])
def test_decode_matches_reference(randn, rel_err, group, context_lens, num_splits):
    n_kv, head_dim, page = 2, 64, 16
    k_cache, v_cache, tables = make_paged(randn, context_lens, n_kv, head_dim, page, share_prefix=True)
    B = len(context_lens)
    q = randn(B, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                 max_context_len=max(context_lens), num_splits=num_splits, block_n=32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    assert rel_err(out, ref) < 1e-5


def test_decode_head_dim_128_page_32_and_auto_splits(randn, rel_err):
    n_kv, group, head_dim, page = 1, 4, 128, 32
    k_cache, v_cache, tables = make_paged(randn, [100, 33], n_kv, head_dim, page)
    q = randn(2, n_kv * group, head_dim)
    lens = torch.tensor([100, 33], dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, max_context_len=100)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.1)
    assert rel_err(out, ref) < 1e-5


def test_decode_mixed_rows_and_padding(randn, rel_err):
    """With query_start_loc, only query_len == 1 rows are written; context 0 (padding) gives zeros."""
    n_kv, group, head_dim, page = 2, 4, 64, 16
    context_lens = [20, 9, 40, 0]
    query_lens = [1, 5, 1, 1]
    k_cache, v_cache, tables = make_paged(randn, [max(n, 1) for n in context_lens], n_kv, head_dim, page)
    qsl = torch.tensor([0, 1, 6, 7, 8], dtype=torch.int32)
    T = sum(query_lens)
    q = randn(T, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    for splits in (1, 2):
        out = torch.full_like(q, 7.0)
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, max_context_len=40,
                               query_start_loc=qsl, out=out, num_splits=splits, block_n=16)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, query_start_loc=qsl)
        decode_rows = [0, 6]
        assert rel_err(out[decode_rows], ref[decode_rows]) < 1e-5
        assert torch.all(out[1:6] == 7.0)          # the prefill rows are left alone
        assert torch.all(out[7] == 0.0)            # a zero-length (padding) row is zeros


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sliding_window(randn, rel_err, num_splits):
    n_kv, group, head_dim, page = 2, 4, 64, 16
    context_lens = [257, 17, 40]
    k_cache, v_cache, tables = make_paged(randn, context_lens, n_kv, head_dim, page)
    q = randn(3, n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, max_context_len=257,
                                 num_splits=num_splits, sliding_window=33, block_n=16)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, sliding_window=33)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("group,num_splits,block_n,cache_dtype", [
    (4, 1, 32, torch.float32), (8, 3, 32, torch.float32), (1, 2, 32, torch.float8_e4m3fn),
    (4, 8, 16, torch.float32), (4, 8, 16, torch.float8_e4m3fn)])    # the short graphs' split
def test_decode_with_fused_rope_kv_write(randn, rel_err, group, num_splits, block_n, cache_dtype):
    """rope=FusedRopeKV: the output and the cache of rope_kv_write followed by decode attention;
    q and k stay unrotated in memory; only the partition holding a sequence's new key writes it,
    and a padding row (context 0, slot -1) writes nothing."""
    from gpu_worker.kernels.paged_decode_attention import FusedRopeKV
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_inv_freq
    from gpu_worker.kernels.rope_kv_write import rope_kv_write, rope_kv_write_ref
    n_kv, head_dim, page = 2, 64, 16
    context_lens = [1, 17, 257, 0]
    k_cache, v_cache, tables = make_paged(randn, [max(n, 1) for n in context_lens], n_kv, head_dim, page)
    scales = dict(k_scale=0.5, v_scale=0.25) if cache_dtype != torch.float32 else {}
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    slots = torch.tensor([int(tables[b, (n - 1) // page]) * page + (n - 1) % page if n else -1
                          for b, n in enumerate(context_lens)])
    positions = torch.tensor([max(n - 1, 0) + 100 for n in context_lens])    # any positions: RoPE's
    B = len(context_lens)
    q, k, v = randn(B, n_kv * group, head_dim), randn(B, n_kv, head_dim), randn(B, n_kv, head_dim)
    cos_sin = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0), 1024)

    q2, k2, kc2, vc2 = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    # fp8: against the unfused kernel (the interpreter's fp32 -> e4m3 rounding is not torch's)
    write = rope_kv_write_ref if cache_dtype == torch.float32 else rope_kv_write
    write(positions, q2, k2, v, cos_sin, kc2, vc2, slots, **scales)
    ref = paged_decode_attention_ref(q2, kc2, vc2, tables, lens, head_dim ** -0.5, **scales)
    q0, k0 = q.clone(), k.clone()
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, max_context_len=257,
                                 num_splits=num_splits, block_n=block_n,
                                 rope=FusedRopeKV(positions, cos_sin, k, v, slots), **scales)
    assert torch.equal(q, q0) and torch.equal(k, k0)             # rotated in registers only
    assert rel_err(out, ref) < (1e-5 if cache_dtype == torch.float32 else 1e-3)   # fp8: fp16 dots
    assert torch.allclose(k_cache.float(), kc2.float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache.float(), vc2.float())
    assert torch.all(out[3] == 0)                                 # the padding row


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits,block_n", [(2, 64), (8, 16), (5, 32)])
def test_split_merge_in_launch_equals_two_pass(randn, rel_err, group, num_splits, block_n):
    """merge="last" (the last program of each (sequence, head block) merges, one launch) gives the
    two-pass kernels' output bit for bit, on contexts shorter than one partition, a padding row
    and a prefill row in a mixed batch, and leaves its arrival counters at zero."""
    from gpu_worker.kernels import _arrivals
    n_kv, head_dim, page = 2, 64, 16
    context_lens = [1, 17, 257, 0, 40]
    query_lens = [1, 1, 1, 1, 6]
    k_cache, v_cache, tables = make_paged(randn, [max(n, 1) for n in context_lens], n_kv, head_dim, page,
                                          share_prefix=True)
    qsl = torch.tensor([0, 1, 2, 3, 4, 10], dtype=torch.int32)
    q = randn(sum(query_lens), n_kv * group, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    outs = {}
    for merge in ("two_pass", "last"):
        out = torch.full_like(q, 7.0)
        paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, max_context_len=257,
                               query_start_loc=qsl, out=out, num_splits=num_splits, block_n=block_n,
                               merge=merge)
        outs[merge] = out
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, query_start_loc=qsl)
    assert torch.equal(outs["last"], outs["two_pass"])
    assert rel_err(outs["last"][:3], ref[:3]) < 1e-5
    assert torch.all(outs["last"][3] == 0.0)           # context 0: zeros
    assert torch.all(outs["last"][4:] == 7.0)          # the prefill row's rows are left alone
    counters = _arrivals._BUFFERS[("decode_attention", torch.device("cpu"))]
    assert int(counters.abs().sum()) == 0


def test_merge_name_is_checked(randn):
    k_cache, v_cache, tables = make_paged(randn, [5], 1, 64, 16)
    with pytest.raises(ValueError, match="merge must be one of"):
        paged_decode_attention(randn(1, 1, 64), k_cache, v_cache, tables, torch.tensor([5], dtype=torch.int32),
                               0.1, max_context_len=5, num_splits=2, merge="atomic")


def test_short_split_policy():
    """Short contexts split into partitions of short_block_n-key tiles while that keeps <= 2
    programs per SM, optionally in blocks of short_heads_per_program query heads; long ones keep
    choose_num_splits' 128-key tiles; short_max_splits 1 without head blocks is off."""
    from dataclasses import replace

    from gpu_worker.kernels import paged_decode_attention as pda
    from gpu_worker.kernels.paged_decode_attention import DecodeSplit
    from gpu_worker.tuning import DecodeAttentionTuning
    cpu = torch.device("cpu")                        # num_sms: 132 off the GPU

    def split(t, *shape):
        return pda.choose_decode_split(*shape[:3], cpu, shape[3], tuning=t)

    t = DecodeAttentionTuning(short_max_splits=1)
    assert split(t, 1, 8, 512, 4) == DecodeSplit(1) and not DecodeSplit(1).fine
    t = replace(t, short_max_splits=8, short_block_n=16)
    assert split(t, 1, 8, 512, 4) == DecodeSplit(8, 16)
    assert split(t, 32, 8, 512, 4) == DecodeSplit(2, 16)       # 256 programs
    assert split(t, 64, 8, 512, 4) == DecodeSplit(1)           # fills the GPU
    assert split(t, 1, 8, 10, 4) == DecodeSplit(1)             # one tile
    assert split(t, 1, 8, 16384, 4) == DecodeSplit(pda.choose_num_splits(1, 8, 16384, cpu, t),
                                                   None, None, t.long_num_warps)
    t = replace(t, short_heads_per_program=1)                  # 32 programs at batch 1
    assert split(t, 1, 8, 512, 4) == DecodeSplit(8, 16, 1)
    assert split(t, 16, 8, 512, 4) == DecodeSplit(1, 16, 1)    # 512 programs: no split
    assert DecodeSplit(1, 16, 1).fine
    assert split(t, 1, 8, 512, 1) == DecodeSplit(8, 16)        # MHA: the group is 1 head
    t = replace(t, short_heads_per_program=3)                  # not a divisor of 4
    assert split(t, 1, 8, 512, 4) == DecodeSplit(8, 16)
    t = replace(t, short_num_warps=2)                          # fine programs only
    assert split(t, 1, 8, 512, 4) == DecodeSplit(8, 16, None, 2)
    t = replace(t, short_max_splits=1, short_heads_per_program=None)
    assert split(t, 1, 8, 512, 4) == DecodeSplit(1)
    with pytest.raises(AssertionError):
        pda.choose_short_split(1, 8, pda.SHORT_SPLIT_CONTEXT + 1, cpu)


@pytest.mark.parametrize("hpp,num_splits,merge", [(1, 1, "last"), (2, 3, "last"), (1, 4, "two_pass")])
def test_blocks_of_query_heads(randn, rel_err, hpp, num_splits, merge):
    """heads_per_program < G: G / hpp programs per KV head (each reads the KV head's tiles), with
    RoPE + KV write fused in: the reference's output, and the cache as rope_kv_write leaves it."""
    from gpu_worker.kernels.paged_decode_attention import FusedRopeKV
    from gpu_worker.kernels.rope import build_cos_sin_cache, rope_inv_freq
    from gpu_worker.kernels.rope_kv_write import rope_kv_write_ref
    n_kv, group, head_dim, page = 2, 4, 64, 16
    context_lens = [1, 17, 100, 0]
    k_cache, v_cache, tables = make_paged(randn, [max(n, 1) for n in context_lens], n_kv, head_dim, page)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    slots = torch.tensor([int(tables[b, (n - 1) // page]) * page + (n - 1) % page if n else -1
                          for b, n in enumerate(context_lens)])
    positions = torch.tensor([max(n - 1, 0) for n in context_lens])
    B = len(context_lens)
    q, k, v = randn(B, n_kv * group, head_dim), randn(B, n_kv, head_dim), randn(B, n_kv, head_dim)
    cos_sin = build_cos_sin_cache(rope_inv_freq(head_dim, 10000.0), 256)
    q2, k2, kc2, vc2 = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    rope_kv_write_ref(positions, q2, k2, v, cos_sin, kc2, vc2, slots)
    ref = paged_decode_attention_ref(q2, kc2, vc2, tables, lens, head_dim ** -0.5)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, max_context_len=100,
                                 num_splits=num_splits, block_n=16, merge=merge, heads_per_program=hpp,
                                 rope=FusedRopeKV(positions, cos_sin, k, v, slots))
    assert rel_err(out, ref) < 1e-5 and torch.all(out[3] == 0)
    assert torch.allclose(k_cache, kc2, atol=1e-6) and torch.equal(v_cache, vc2)
    plain = paged_decode_attention(q2, kc2, vc2, tables, lens, head_dim ** -0.5, max_context_len=100,
                                   num_splits=num_splits, block_n=16, merge=merge, heads_per_program=hpp)
    assert rel_err(plain, ref) < 1e-5
    with pytest.raises(AssertionError, match="heads_per_program"):
        paged_decode_attention(q2, kc2, vc2, tables, lens, 0.1, max_context_len=100, heads_per_program=3)


@pytest.mark.parametrize("bad", ["", "s8", "s0x16", "s8x12", "s8x8", "s4x32h0", "s8x16w3", "s8x16w0", "s8x16w2h1",
                                 "u+3p", "S8x16", "s16x16+2p3", "u+2p0", "s16x16l0x128+2p1", "s16x16l64x0p4",
                                 "s16x16l64x128p0", "s16x16l64+2p", "l64x128p4", "s16x16l32x512p2b48",
                                 "s16x16l32x512p2w3"])
def test_attention_config_strings(bad):
    """DecodeAttentionTuning.parse / spec round-trip the A/B strings; a bad one is refused with the
    expected forms named."""
    from gpu_worker.kernels import paged_decode_attention as pda
    from gpu_worker.kernels.paged_decode_attention import DecodeSplit
    from gpu_worker.tuning import DecodeAttentionTuning
    parse = DecodeAttentionTuning.parse
    for cfg in ("u+2p", "u", "s8x16", "s2x32h1+2p", "s1x64h1", "s8x16w2", "s1x64h1w2+2p", "s16x16+2p1", "u+2p2",
                "s16x16l64x128p4+2p1", "ul8x256p1", "s16x16l32x512p2b64+2p1", "s16x16l64x128p4b64w4+2p1",
                "s16x16l32x512p2w4+2p1"):
        assert parse(cfg).spec() == cfg
    t = parse("s8x16h2w8")
    assert (t.short_max_splits, t.short_block_n, t.short_heads_per_program, t.short_num_warps,
            t.merge) == (8, 16, 2, 8, "last")
    t = parse("s16x16l64x128p4+2p1")                 # long contexts: 64 splits at batch 1, 8 KV heads
    assert (t.long_max_splits, t.long_min_tokens, t.long_programs_per_sm) == (64, 128, 4)
    cpu = torch.device("cpu")
    assert pda.choose_num_splits(1, 8, 16384, cpu, t) == 64 and pda.choose_num_splits(1, 8, 4096, cpu, t) == 32
    t = parse("s16x16l32x512p2b64w4+2p1")            # long split programs' tiles
    assert pda.choose_decode_split(1, 8, 16384, cpu, 4, tuning=t) == DecodeSplit(32, 64, None, 4)
    assert pda.choose_decode_split(64, 8, 16384, cpu, 4, tuning=t) == DecodeSplit(1)   # unsplit: the kernel's tiles
    t = parse("s16x16+2p1")
    assert (t.long_max_splits, t.long_min_tokens, t.long_programs_per_sm) == (32, 512, 2)
    assert pda.choose_decode_split(1, 8, 16384, cpu, 4, tuning=t) == DecodeSplit(32, None, None, 8)   # 8 warps
    # an fp8 cache's long split programs take long_num_warps_fp8 (None: the kernel's 4), any config
    for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert pda.choose_decode_split(1, 8, 16384, cpu, 4, kv, t) == DecodeSplit(32, None, None, t.long_num_warps_fp8)
    assert pda.choose_decode_split(1, 8, 16384, cpu, 4, torch.bfloat16, t) == DecodeSplit(32, None, None, 8)
    assert pda.choose_decode_split(1, 8, 512, cpu, 4, torch.float8_e4m3fn, t) == DecodeSplit(16, 16)   # short: as bf16
    with pytest.raises(ValueError, match="expected u, sNxB, sNxBhH"):
        parse(bad)


def test_attention_config_from_the_environment():
    """KVMESH_DECODE_ATTENTION is read when an engine config is built (tuning_from_env), not at
    import; a bad value is refused naming the variable."""
    from gpu_worker.config import tuning_from_env
    for value in ("s8x16", "u+2p"):
        assert tuning_from_env({"KVMESH_DECODE_ATTENTION": value}).decode_attention.spec() == value
    assert tuning_from_env({}).decode_attention.spec() == "s16x16+2p1"
    with pytest.raises(ValueError, match="KVMESH_DECODE_ATTENTION"):
        tuning_from_env({"KVMESH_DECODE_ATTENTION": "fast"})
