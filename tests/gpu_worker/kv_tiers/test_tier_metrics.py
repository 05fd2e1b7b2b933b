"""The tiers' decision and its inputs reach the worker's Prometheus gauges from the engine stats."""
from __future__ import annotations

from prometheus_client import REGISTRY

from tests.gpu_worker.kv_tiers.conftest import chat, run, tier_stats, tiered_engine, tokens
from services import metrics


def test_tier_stats_become_worker_gauges(llama, tmp_path):
    model_dir, _ = llama
    eng = tiered_engine(model_dir, kv_offload_cpu_gb=6e-6, kv_offload_dir=str(tmp_path / "kv"),
                        kv_offload_disk_gb=0.001)
    run(eng, "long", tokens(64, 99))   # a prefill step followed by decodes: the prefill rate's sample
    chat(eng, 3)
    stats = tier_stats(eng)
    metrics.publish_kv_tiers(stats)

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels)

    assert value("kvmesh_kv_tier_loaded_blocks", tier="cpu") == stats["loaded_blocks"]["cpu"] > 0
    assert value("kvmesh_kv_tier_offloaded_blocks", tier="disk") == stats["offloaded_blocks"]["disk"] > 0
    assert value("kvmesh_kv_tier_blocks", tier="disk") == stats["disk_blocks"] > 0
    assert value("kvmesh_kv_tier_load_decisions", decision="load") == stats["decisions"]["load"] > 0
    assert value("kvmesh_kv_tier_bandwidth_bytes_per_second", tier="disk") > 0
    assert value("kvmesh_kv_tier_prefill_tokens_per_second") > 0
    assert value("kvmesh_kv_tier_disk_enabled") == 1


def test_only_prefill_steps_measure_the_prefill_rate(llama):
    """A decode step computes few tokens in a whole pass: counting it would make recomputing look
    far slower than it is and tilt auto towards loading."""
    model_dir, _ = llama
    eng = tiered_engine(model_dir, kv_offload_cpu_gb=0.001)
    meter = eng.scheduler.prefill_rate      # the scheduler times the steps the policy prices
    assert meter is eng.kv_tiers.policy.prefill
    for _ in range(3):                      # decode-only steps of a batch of 64, each read
        meter.step_began()
        meter.read(meter.step_scheduled(64, 0))
    assert eng.kv_tiers.policy.prefill_rate is None
    meter.step_began()
    chunk = meter.step_scheduled(64, 64)    # a prompt chunk that draws nothing: read with the next
    meter.step_began()
    meter.read(meter.step_scheduled(64, 60))    # mostly prefill
    assert eng.kv_tiers.policy.prefill_rate > 0 and chunk > 0
