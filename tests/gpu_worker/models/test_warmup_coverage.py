"""ModelRunner.warmup covers every prefill launch configuration a step can use."""
def test_warmup_reaches_every_prefill_launch_configuration():
    """The engine's warm-up compiles a prefill variant per configuration bucket its steps can hit,
    so no step JIT-compiles while serving."""
    from gpu_worker.kernels.paged_prefill_attention import prefill_config
    from gpu_worker.model_runner import _warmup_query_lens
    for max_query_len in (2048, 4096, 4097, 16384):
        reached = {prefill_config(n) for n in range(2, max_query_len + 1, 7)} | {prefill_config(max_query_len)}
        assert reached <= {prefill_config(n) for n in _warmup_query_lens(max_query_len)}, max_query_len
