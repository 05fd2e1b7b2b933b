"""Counters and histograms of the KV tiers, published through EngineStats.extra["kv_tiers"].

No label is a user value: tiers and decisions are fixed sets.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# seconds: 10 us .. 10 s, for the predicted load and recompute times of one admission
SECONDS_BUCKETS = (1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 10.0)
DECISIONS = ("load", "recompute", "split")
TIERS = ("cpu", "disk", "shared")


@dataclass
class Histogram:
    buckets: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(SECONDS_BUCKETS) + 1))   # last: +Inf
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def as_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total}


@dataclass
class TierStats:
    offloaded_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    loaded_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECISIONS, 0))
    recomputed_tier_tokens: int = 0      # tokens in a lower tier that the policy recomputed instead
    load_shortfall_blocks: int = 0       # planned loads that were gone or corrupt at load time
    predicted_load_s: Histogram = field(default_factory=Histogram)
    predicted_recompute_s: Histogram = field(default_factory=Histogram)
