"""ModelRunner.warmup covers every prefill launch configuration a step can use."""
def test_warmup_reaches_every_prefill_launch_configuration():
    """The engine's warm-up compiles a variant of each prefill kernel per configuration bucket its
    steps can hit, so no step JIT-compiles while serving (warmup runs every length both ways)."""
    from gpu_worker.kernels.fresh_prefill_attention import fresh_config
    from gpu_worker.kernels.paged_prefill_attention import prefill_config
    from gpu_worker.model_runner import _warmup_query_lens
    for max_query_len in (2048, 4096, 4097, 8192, 8193, 16384):
        warmed = _warmup_query_lens(max_query_len)
        for config in (prefill_config, fresh_config):       # chunks behind a prefix, fresh prompts
            reached = {config(n) for n in range(2, max_query_len + 1, 7)} | {config(max_query_len)}
            assert reached <= {config(n) for n in warmed}, (config.__name__, max_query_len)
