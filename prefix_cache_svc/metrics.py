"""Prometheus metrics of the prefix-cache service: read from the core at scrape time, so nothing is
counted on the Match path except one histogram observation."""
from __future__ import annotations

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefix_cache_svc.core import PrefixCore
from services.metrics import shown_by

MATCH_SECONDS = shown_by("prefix-cache")(Histogram("kvmesh_prefix_match_seconds", "Match handling time in the index",
                                                   buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                                            0.025, 0.1)))


class CoreCollector:
    """Prometheus metrics read from the core at scrape time (nothing is counted per request here)."""

    def __init__(self, core: PrefixCore) -> None:
        self.core = core

    def describe(self):
        return []

    def collect(self):
        s, idx = self.core.stats, self.core.index.stats()
        yield _gauge("kvmesh_prefix_index_blocks", "Blocks in the index", idx.blocks)
        yield _gauge("kvmesh_prefix_index_ownerships", "Block copies (worker, block) in the index", idx.ownerships)
        yield _gauge("kvmesh_prefix_index_workers", "Workers with blocks in the index", idx.workers)
        for name, help_, value in (
            ("evictions", "Blocks dropped from memory over max_blocks", idx.evictions),
            ("event_batches", "KV event batches applied", s.batches),
            ("events", "KV events applied", s.events),
            ("gaps", "Sequence gaps detected (each asks for a snapshot)", s.gaps),
            ("new_epochs", "Worker restarts detected", s.new_epochs),
            ("snapshots_applied", "Snapshots applied after a gap or restart", s.snapshots_applied),
            ("rejected", "Batches or snapshots refused (version, block size)", s.rejected + idx.rejected),
            ("consistency_checks", "Worker snapshots compared with the index", s.checks),
            ("inconsistent", "Consistency checks that found and repaired a difference", s.inconsistent),
            ("shared_repaired", "Shared-tier credits dropped because a reader found the file missing",
             s.shared_repaired),
            ("match_queries", "Match requests answered", s.queries),
            ("match_query_blocks", "Full blocks in Match requests", s.query_blocks),
            ("match_best_blocks", "Blocks matched on the best worker per Match request", s.best_matched_blocks),
        ):
            counter = CounterMetricFamily(f"kvmesh_prefix_{name}", help_)
            counter.add_metric([], value)
            yield counter
        yield _gauge("kvmesh_prefix_hit_rate", "Cluster hit rate: best-worker matched blocks / query blocks",
                     s.best_matched_blocks / s.query_blocks if s.query_blocks else 0.0)
        per_worker = GaugeMetricFamily("kvmesh_prefix_worker_hit_rate",
                                       "Per worker: matched blocks / query blocks", labels=["worker"])
        blocks = GaugeMetricFamily("kvmesh_prefix_worker_blocks", "Blocks held per worker", labels=["worker"])
        for worker_id in self.core.index.workers():
            matched = s.worker_matched_blocks.get(worker_id, 0)
            per_worker.add_metric([worker_id], matched / s.query_blocks if s.query_blocks else 0.0)
            blocks.add_metric([worker_id], self.core.index.num_blocks_of(worker_id))
        yield per_worker
        yield blocks


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, help_)
    g.add_metric([], value)
    return g
