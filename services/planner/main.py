"""`kvmesh planner`: every --interval-s, read each pool's SLO signals and the replicas of its
Deployment or StatefulSet, decide (services/planner/decide.py) and patch the scale subresource,
or only log it with --dry-run. A failed read skips that pool for one round; nothing is patched on
a guess.

A scale-down only lowers `replicas`: Kubernetes picks the pods that leave (a StatefulSet its
highest ordinals) and sends them SIGTERM, and each worker drains itself within its grace period
(finishes or migrates its streams, writes its hot blocks to a disk tier). The planner shrinks a
pool by one pod per --stabilization-window-s (300 s by default, longer than a worker's grace
period), so one drain is over before the next begins.

    kvmesh planner --prometheus-url http://prometheus:9090 --kube-namespace llm \\
        --prefill-deployment prod-kvmesh-prefill --prefill-selector 'service="prod-kvmesh-prefill"' \\
        --decode-deployment prod-kvmesh-decode --decode-selector 'service="prod-kvmesh-decode"' \\
        --gateway-selector 'service="prod-kvmesh-gateway"'
"""
from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time

from services import metrics
from services.config import PlannerConfig, load_or_exit
from services.logging import setup as setup_logging
from services.planner.decide import Decision, PoolPolicy, PoolState, Threshold, decide
from services.planner.kube import Workload
from services.planner.signals import POOL_SIGNALS, PrometheusSignals, ScrapedSignals

log = logging.getLogger("kvmesh.planner")


def pool_policies(cfg: PlannerConfig) -> dict[str, tuple[Workload, PoolPolicy]]:
    """pool -> (its Deployment or StatefulSet, its policy), for the pools given one."""
    thresholds = {
        "prefill": (Threshold("ttft_p90_s", cfg.ttft_p90_up_s, cfg.ttft_p90_down_s),
                    Threshold("pending_prompt_tokens", cfg.pending_tokens_up, cfg.pending_tokens_down)),
        "decode": (Threshold("itl_p90_s", cfg.itl_p90_up_s, cfg.itl_p90_down_s),
                   Threshold("kv_usage", cfg.kv_usage_up, cfg.kv_usage_down)),
    }
    out = {}
    for pool in ("prefill", "decode"):
        workload = pool_workload(cfg, pool)
        if workload:
            out[pool] = (workload, PoolPolicy(pool, getattr(cfg, f"{pool}_min_replicas"),
                                                getattr(cfg, f"{pool}_max_replicas"), thresholds[pool],
                                                cfg.max_step, cfg.stabilization_window_s, cfg.scale_up_cooldown_s))
    return out


def pool_workload(cfg: PlannerConfig, pool: str) -> Workload | None:
    """The config refuses both names for one pool, so at most one is set."""
    for kind in ("deployment", "statefulset"):
        if name := getattr(cfg, f"{pool}_{kind}"):
            return Workload(kind, name)
    return None


def signal_source(cfg: PlannerConfig) -> PrometheusSignals | ScrapedSignals:
    if cfg.prometheus_url:
        selectors = {"prefill": cfg.prefill_selector, "decode": cfg.decode_selector, "gateway": cfg.gateway_selector}
        return PrometheusSignals(cfg.prometheus_url, selectors, cfg.query_timeout_s)
    pages = {"prefill": cfg.prefill_metrics_urls, "decode": cfg.decode_metrics_urls,
             "gateway": cfg.gateway_metrics_urls}
    return ScrapedSignals(pages, cfg.query_timeout_s)


class Planner:
    """One round per `tick`: the shell around `decide` (the Kubernetes client and the signal
    source come in, so a test can hand its own emulator's)."""

    def __init__(self, cfg: PlannerConfig, source, scale) -> None:
        self.cfg = cfg
        self.source = source
        self.scale = scale
        self.pools = pool_policies(cfg)
        self.states = {pool: PoolState() for pool in self.pools}

    def tick(self, now: float) -> list[Decision]:
        wanted = [s for pool in self.pools for s in POOL_SIGNALS[pool]]
        signals = self.source.read_all(wanted)
        decisions = []
        for pool, (workload, policy) in self.pools.items():
            for name in POOL_SIGNALS[pool]:
                value = signals.get(name)
                metrics.PLANNER_SIGNAL.labels(pool, name).set(math.nan if value is None else value)
            if any(signals.get(name) is None for name in POOL_SIGNALS[pool]):
                metrics.PLANNER_ERRORS.labels("signals").inc()
            try:
                current = self.scale.replicas(self.cfg.kube_namespace, workload)
            except Exception as exc:   # the API server's answer, a timeout, a refused connection
                metrics.PLANNER_ERRORS.labels("kubernetes").inc()
                log.warning("%s: cannot read the scale of %s: %s", pool, workload, _short(exc))
                continue
            metrics.PLANNER_REPLICAS.labels(pool).set(current)
            decision = decide(policy, self.states[pool], now, current, signals)
            metrics.PLANNER_DESIRED.labels(pool).set(decision.desired)
            self.carry_out(workload, decision)
            decisions.append(decision)
        return decisions

    def carry_out(self, workload: Workload, d: Decision) -> None:
        if d.direction == "hold":
            log.debug("%s: %d replicas, %s", d.pool, d.current, d.reason)
            return
        metrics.PLANNER_SCALES.labels(d.pool, d.direction).inc()
        if self.cfg.dry_run:
            log.info("%s: dry run: would scale %s from %d to %d (%s)", d.pool, workload, d.current, d.desired,
                     d.reason)
            return
        try:
            self.scale.set_replicas(self.cfg.kube_namespace, workload, d.desired)
            log.info("%s: scaled %s from %d to %d (%s)", d.pool, workload, d.current, d.desired, d.reason)
        except Exception as exc:
            metrics.PLANNER_ERRORS.labels("kubernetes").inc()
            log.warning("%s: cannot scale %s to %d: %s", d.pool, workload, d.desired, _short(exc))


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def main(argv: list[str]) -> int:
    cfg = load_or_exit(PlannerConfig, argv, "kvmesh planner")
    if not pool_policies(cfg):
        print("kvmesh planner: give --prefill-deployment (or --prefill-statefulset), --decode-deployment (or "
              "--decode-statefulset) or both: it scales nothing", file=sys.stderr)
        return 2
    setup_logging("planner", cfg.log_level)
    from kubernetes.config import ConfigException

    from services.planner.kube import apps_api
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        scale = apps_api(cfg.kubeconfig, cfg.query_timeout_s)
    except (ConfigException, OSError) as exc:
        print(f"kvmesh planner: cannot load Kubernetes credentials ({_short(exc)}): give --kubeconfig, or run "
              "in a pod with a ServiceAccount token", file=sys.stderr)
        return 2
    port = metrics.serve_metrics(cfg.host, cfg.metrics_port, "planner")
    source = signal_source(cfg)
    planner = Planner(cfg, source, scale)
    log.info("planner: scaling %s in namespace %s every %.3g s%s; metrics port %d",
             ", ".join(f"{pool} ({w})" for pool, (w, _) in planner.pools.items()), cfg.kube_namespace,
             cfg.interval_s, " (dry run)" if cfg.dry_run else "", port)
    try:
        while not stop.is_set():
            planner.tick(time.monotonic())
            stop.wait(cfg.interval_s)
    finally:
        source.close()
    log.info("planner stopped")
    return 0
