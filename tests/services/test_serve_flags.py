"""`kvmesh serve` hands its engine settings to every worker it starts, under the worker's own
flag names, and its routing to the scheduler; a worker's refused setting is serve's exit 2."""
import sys
import time

from services.config import SchedulerConfig, ServeConfig, WorkerConfig, parse_config
from services.launcher import Stack, _disk_tier_flags, _engine_flags, _pool_flags, _prefix_cache_flags, _scheduler_flags

ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "dtype", "gpu_memory_utilization",
                 "quantization", "kv_cache_dtype", "async_scheduling", "attention_backend")


def test_engine_settings_reach_the_worker_unchanged():
    serve = parse_config(ServeConfig, ["--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.45",
                                       "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                                       "--no-async-scheduling", "--max-num-seqs", "64",
                                       "--attention-backend", "torch"], "serve", env={})
    worker = parse_config(WorkerConfig, _engine_flags(serve), "worker", env={})
    for name in ENGINE_FIELDS:
        assert getattr(worker, name) == getattr(serve, name), name


def test_defaults_match_the_worker_defaults():
    serve, worker = ServeConfig(), WorkerConfig()
    for name in ENGINE_FIELDS:
        assert getattr(serve, name) == getattr(worker, name), name
    assert parse_config(WorkerConfig, _engine_flags(serve), "worker", env={}) == worker


def test_serve_routing_matches_the_scheduler_choices():
    serve = parse_config(ServeConfig, ["--routing", "round_robin"], "serve", env={})
    assert parse_config(SchedulerConfig, ["--routing", serve.routing], "scheduler", env={}).routing == "round_robin"
    assert ServeConfig().routing == SchedulerConfig().routing


def test_serve_routing_fields_reach_the_scheduler():
    serve = parse_config(ServeConfig, ["--routing", "least_loaded", "--pd-min-prefill-tokens", "32",
                                       "--route-conversation-ttl-s", "0"], "serve", env={})
    scheduler = parse_config(SchedulerConfig, _scheduler_flags(serve), "scheduler", env={})
    assert (scheduler.routing, scheduler.pd_min_prefill_tokens, scheduler.route_conversation_ttl_s) == (
        "least_loaded", 32, 0.0)
    assert ServeConfig().route_conversation_ttl_s == SchedulerConfig().route_conversation_ttl_s


def test_serve_kv_transport_reaches_every_worker():
    for transport in ("auto", "zmq", "shm", "cuda_ipc"):
        serve = parse_config(ServeConfig, ["--kv-transport", transport], "serve", env={})
        worker = parse_config(WorkerConfig, [*_pool_flags(serve), *_engine_flags(serve)], "worker", env={})
        assert worker.kv_transport == transport


def test_each_worker_gets_a_disk_tier_directory_of_its_own():
    serve = parse_config(ServeConfig, ["--kv-offload-dir", "/var/kv", "--kv-offload-disk-gb", "4"], "serve", env={})
    dirs = [parse_config(WorkerConfig, [*_engine_flags(serve), *_disk_tier_flags(serve, w)], "worker",
                         env={}).kv_offload_dir for w in ("worker-0", "worker-1")]
    assert dirs == ["/var/kv/worker-0", "/var/kv/worker-1"]
    assert _disk_tier_flags(ServeConfig(), "worker-0") == []


def test_a_worker_refusing_its_settings_at_start_up_makes_serve_exit_2():
    """A tier setting only the worker can check (its directories overlap, a size below one block)
    exits that worker with 2 during start-up; serve then stops with 2 too (a refused setting),
    not 1 (a crash), and another start-up failure stays 1."""
    stack = Stack(ServeConfig())
    try:
        for code, expected in ((2, 2), (3, 1)):
            stack.sup.children.clear()
            stack.sup.spawn("worker-0", [sys.executable, "-c", f"raise SystemExit({code})"], time.monotonic(),
                            pooled=True)
            assert not stack.wait_ready("http://127.0.0.1:9", 30, [])
            assert stack.startup_exit_code() == expected
    finally:
        stack.stop()


def test_the_prefix_cache_index_gets_the_workers_block_size():
    """The index ignores a worker whose block size is not its own: serve's --block-size must
    reach the prefix-cache service too, or cache-aware routing runs without the index."""
    from prefix_cache_svc.config import PrefixCacheConfig
    for argv in ([], ["--block-size", "32"]):
        serve = parse_config(ServeConfig, argv, "serve", env={})
        worker = parse_config(WorkerConfig, _engine_flags(serve), "worker", env={})
        index = parse_config(PrefixCacheConfig, _prefix_cache_flags(serve), "prefix-cache", env={})
        assert index.block_size == worker.block_size == serve.block_size


def test_the_banner_names_the_model_as_clients_send_it():
    """With --served-model-name, the banner's name is the one /v1/models lists (the directory's
    name is a 404 to a client that copies it)."""
    from services.launcher import served_name
    named = parse_config(ServeConfig, ["--served-model-name", "prod-llm,alias"], "serve", env={})
    assert served_name(named, "/models/llama-tiny") == "prod-llm"
    assert served_name(ServeConfig(), "/models/llama-tiny") == "llama-tiny"


def test_serve_takes_a_trust_directory_checks_it_and_keeps_it(tmp_path):
    """--trust-dir: every service gets the operator's keys (a shared KV tier's files, MAC'd under
    the worker key, stay readable next run); a directory a role cannot load from is refused up front."""
    from services.launcher import trust_dir_problem
    from services.security import bundle
    trust = tmp_path / "trust"
    assert "is missing" in trust_dir_problem(str(trust))
    bundle.generate(trust)
    assert trust_dir_problem(str(trust)) is None and trust_dir_problem("") is None
    (trust / "curve" / "worker.secret").chmod(0o644)
    assert "readable by other users" in trust_dir_problem(str(trust))
    (trust / "curve" / "worker.secret").chmod(0o600)

    stack = Stack(parse_config(ServeConfig, ["--trust-dir", str(trust)], "serve", env={}))
    assert stack.trust.root == trust
    stack.stop()
    assert bundle.load(trust, "worker")
