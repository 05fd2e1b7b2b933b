"""`kvmesh prefix-cache` configuration (flags, KVMESH_* variables and Helm values share the names)."""
from __future__ import annotations

from dataclasses import dataclass

from services.config import ANY_PORT, HEALTH_PORT_HELP, METRICS_PORT, ConfigError, ServiceConfig, opt, register_section
from services.engine_args import BLOCK_SIZES


@register_section
@dataclass(frozen=True)
class PrefixCacheConfig(ServiceConfig):
    """The cluster prefix-cache index: KV events in, longest-prefix Match answers out."""

    port: int = opt(50054, "gRPC port (Match + grpc.health.v1).", **ANY_PORT)
    health_port: int = opt(-1, HEALTH_PORT_HELP, **METRICS_PORT)
    metrics_port: int = opt(9104, "Prometheus /metrics port (0: any free port, -1: off).", **METRICS_PORT)
    block_size: int = opt(16, "Tokens per KV block; must equal the workers' block size.", choices=BLOCK_SIZES)
    max_blocks: int = opt(0, "Most blocks kept in memory (0: no limit); beyond it the oldest leaves "
                             "are dropped from the index, not from Redis.", min=0)
    snapshot_timeout_s: float = opt(2.0, "Seconds to wait for a worker's snapshot before asking again.", above=0)
    consistency_check_s: float = opt(60.0, "Seconds between consistency checks of a worker against its "
                                           "snapshot (0: off).", min=0)
    store_check_s: float = opt(5.0, "Seconds between checks that Redis still holds the ownership records "
                                     "(rewritten from memory when Redis restarted empty).", min=0)
    discovery_interval_s: float = opt(1.0, "Seconds between reads of the worker registry (joins, "
                                           "expired leases).", above=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_blocks < 0:
            raise ConfigError(f"max_blocks must be 0 (no limit) or positive, got {self.max_blocks}")
