"""ModelRunner.warmup covers every prefill launch configuration a step can use."""
def test_warmup_reaches_every_prefill_launch_configuration():
    """The engine's warm-up compiles a variant of each prefill kernel per configuration bucket its
    steps can hit, so no step JIT-compiles while serving (warmup runs every length both ways)."""
    from gpu_worker.kernels.fresh_prefill_attention import fresh_config
    from gpu_worker.kernels.paged_prefill_attention import prefill_config
    from gpu_worker.model_runner import _warmup_query_lens
    for max_query_len in (2048, 4096, 4097, 8192, 8193, 16384):
        warmed = _warmup_query_lens(max_query_len)
        lens = list(range(2, max_query_len + 1, 7)) + [max_query_len]
        reached = {prefill_config(n) for n in lens}                   # v2: its buckets by query length
        assert reached <= {prefill_config(n) for n in warmed}, ("prefill_config", max_query_len)
        # the fresh kernel: fresh prompts, chunks behind a short prefix, and behind a long one (the
        # warm-up's cached_prefix = the chunk's length)
        reached = {fresh_config(n, c) for n in lens for c in (0, n + 1, 2 * n, 10 * n)}
        assert reached <= {fresh_config(n, c) for n in warmed for c in (0, 2 * n)}, ("fresh_config", max_query_len)
