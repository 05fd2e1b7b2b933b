"""Prometheus metrics of every service (one process = one service).

Every process imports this module, so every metric exists in each process's default registry;
each service's /metrics shows only its own families (`service_registry`), plus the process, GC
and platform ones. A worker's scrape with the gateway's request counters at zero beside its own
would skew any fleet-wide avg() or min() over the pods.

Labels carry only server-assigned values (route names, worker ids, reasons); nothing a client
sends ever becomes a label.
"""
from __future__ import annotations

import logging

from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, start_http_server)

log = logging.getLogger("kvmesh.metrics")

SERVICES = ("gateway", "scheduler", "worker", "tokenizer", "prefix-cache", "planner")
_FAMILIES: dict[str, set[str]] = {s: set() for s in SERVICES}   # service -> the family names it shows


def shown_by(*services: str):
    """Tags a metric as one of these services' families: `X = shown_by("worker")(Counter(...))`.
    A family no service claims is shown by every service."""
    unknown = set(services) - set(SERVICES)
    assert not unknown, f"unknown services {unknown}"

    def tag(metric):
        for family in metric.describe():
            for service in services:
                _FAMILIES[service].add(family.name)
        return metric
    return tag


_gateway, _scheduler, _worker, _tokenizer = (shown_by(s) for s in ("gateway", "scheduler", "worker", "tokenizer"))
_detokenizer = shown_by("tokenizer", "gateway")   # a gateway with --text-in-gateway detokenizes too

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOK = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_HOP = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)

# ---- where a streamed request's first token spends its time, stage by stage
#
#   gateway    arrival ─submit─► Submit sent ────────────── upstream ──────────────► first delta read ─write─► chunk written
#   scheduler               Submit read ─dispatch─► Dispatch sent
#   worker                                  Dispatch read ─admit─► in engine ─queue─► ─prefill─► first token ─send─► sent
#   detok                                                                                StepOutput read ─detok─► TextBatch sent
#
# Every duration is measured inside one process with its own monotonic clock (no clocks of two
# processes are ever subtracted), so what the stages do not cover is the hops between processes:
#   upstream - (dispatch + worker TTFT + send + detok) = the ZMQ hops' wake-ups and transfers:
#   gateway -> scheduler -> worker -> detokenizer -> gateway, or three when the gateway is the
#   detokenizer (--text-in-gateway: its detok stage is observed in the gateway).
# The gateway's TTFT (arrival -> first delta taken up by the response stream) = submit +
# upstream + the start of write. bench/serve_bench.py and bench/control_plane.py print the means.

# ---- gateway
REQUESTS = _gateway(Counter("kvmesh_requests", "HTTP API requests by route and status", ["route", "status"]))
INFLIGHT = _gateway(Gauge("kvmesh_requests_inflight", "Requests being served by this gateway"))
TTFT = _gateway(Histogram("kvmesh_time_to_first_token_seconds", "Arrival to first token", buckets=_LAT))
TPOT = _gateway(Histogram("kvmesh_time_per_output_token_seconds", "Mean time per output token after the first",
                          buckets=_TOK))
ITL = _gateway(Histogram("kvmesh_inter_token_latency_seconds", "Gap between streamed chunks", buckets=_TOK))
E2E = _gateway(Histogram("kvmesh_e2e_request_latency_seconds", "Arrival to last token", buckets=_LAT))
PROMPT_TOKENS = _gateway(Counter("kvmesh_prompt_tokens", "Prompt tokens of finished requests"))
GENERATION_TOKENS = _gateway(Counter("kvmesh_generation_tokens", "Generated tokens of finished requests"))
CACHED_PROMPT_TOKENS = _gateway(Counter("kvmesh_cached_prompt_tokens", "Prompt tokens served from a prefix cache"))
GATEWAY_SUBMIT = _gateway(Histogram("kvmesh_gateway_submit_seconds",
                                    "Request arrival to its last Submit handed to the scheduler's socket (body read, "
                                    "JSON decode, validation, tokenization, encoding)", buckets=_HOP))
GATEWAY_TOKENIZE = _gateway(Histogram("kvmesh_gateway_tokenize_seconds",
                                      "Tokenizing one request's prompts (in the gateway, or the tokenizer service's "
                                      "gRPC Tokenize)", buckets=_HOP))
GATEWAY_UPSTREAM = _gateway(Histogram("kvmesh_gateway_upstream_first_token_seconds",
                                      "Submit sent to the request's first text delta read off the gateway's inbox "
                                      "(scheduler, worker, detokenizer and the hops between them)", buckets=_HOP))
GATEWAY_FIRST_WRITE = _gateway(Histogram("kvmesh_gateway_first_chunk_write_seconds",
                                         "Streamed requests: first text delta read off the inbox to its SSE chunk "
                                         "handed to the HTTP server", buckets=_HOP))
GATEWAY_RESUBMIT_WAIT = _gateway(Histogram(
    "kvmesh_gateway_resubmit_wait_seconds", "A request this gateway sent again to a restarted scheduler before its "
    "first token, or one the scheduler moved off a stopped worker before that worker opened its stream: the "
    "client's wait from its Submit to that first token (one that had streamed is timed by its detokenizer: "
    "kvmesh_detok_migration_stall_seconds)", buckets=_LAT))

# ---- scheduler
QUEUE_DEPTH = _scheduler(Gauge("kvmesh_scheduler_queue_depth", "Requests waiting in the global queue"))
SCHED_RUNNING = _scheduler(Gauge("kvmesh_scheduler_inflight", "Requests dispatched to workers and not finished"))
REJECTED = _scheduler(Counter("kvmesh_scheduler_rejected", "Requests refused at admission", ["reason"]))
WORKERS = _scheduler(Gauge("kvmesh_scheduler_workers", "Live workers known to the scheduler"))
WORKER_FAILURES = _scheduler(Counter("kvmesh_scheduler_worker_failures", "Workers lost (lease expired or replaced)"))
WORKER_RUNNING = _scheduler(Gauge("kvmesh_worker_running_requests", "Running sequences per worker", ["worker"]))
WORKER_WAITING = _scheduler(Gauge("kvmesh_worker_waiting_requests", "Waiting sequences per worker", ["worker"]))
WORKER_KV_USAGE = _scheduler(Gauge("kvmesh_worker_kv_usage_ratio", "Fraction of KV blocks in use per worker",
                                   ["worker"]))
WORKER_DISPATCHED = _scheduler(Counter("kvmesh_scheduler_dispatched", "Requests dispatched per worker", ["worker"]))
WORKER_PREFIX_HIT = _scheduler(Gauge("kvmesh_worker_prefix_hit_ratio",
                                     "Per worker: prompt tokens found in its prefix cache / prompt tokens looked up "
                                     "(engine counters since the worker started)", ["worker"]))
CLUSTER_PREFIX_HIT = _scheduler(Gauge("kvmesh_cluster_prefix_hit_ratio",
                                      "All live workers: prompt tokens found in a prefix cache / prompt tokens "
                                      "looked up"))
PREFIX_MATCHES = _scheduler(Counter("kvmesh_scheduler_prefix_matches",
                                    "Prefix-index Match calls by outcome (hit, miss, unavailable: routed by load)",
                                    ["outcome"]))
SCHED_DISPATCH = _scheduler(Histogram("kvmesh_scheduler_dispatch_seconds",
                                      "Submit read off the scheduler's socket to its Dispatch handed to the worker's "
                                      "socket (admission, prefix match, routing, and any wait for a worker with room)",
                                      buckets=_HOP))
CONVERSATION_ROUTES = _scheduler(Counter(
    "kvmesh_scheduler_conversation_routes", "Requests carrying a conversation key (the OpenAI `user` field or "
    "`conversation_id`), by outcome: kept (sent to the worker of its last turn), moved (that worker was gone, "
    "draining or overloaded: routed by the policy), new (no turn within --route-conversation-ttl-s)",
    ["outcome"]))
PD_ROUTES = _scheduler(Counter("kvmesh_scheduler_pd_routes", "Requests routed while prefill and decode pools "
                               "exist, by route: pd (prefill worker then decode worker), decode_short (prompt under "
                               "--pd-min-prefill-tokens), decode_cached (the decode worker holds all but that many "
                               "tokens), decode_unpaired (no prefill worker with room and D's KV layout), mixed "
                               "(a mixed worker), rerun (its prefill worker died: re-run on its decode worker)",
                               ["route"]))
# why a request moved to another worker mid-stream, and how it ended: the label sets are fixed
MIGRATION_REASONS = ("worker_died", "drain")
MIGRATION_OUTCOMES = ("moved", "failed")
MIGRATIONS = _scheduler(Counter("kvmesh_scheduler_migrations", "In-flight requests whose worker stopped, by reason "
                                "(worker_died: lease lapsed or replaced; drain: handed back by a draining worker; "
                                "resubmitted: sent again by its gateway after a scheduler restart, held by no worker) "
                                "and outcome (moved: continued on another worker from the tokens already streamed; "
                                "failed: --max-migrations reached, or no worker joined within --migration-wait-s; "
                                "the client got an error)",
                                ["reason", "outcome"]))
DRAIN_MOVES = _scheduler(Counter("kvmesh_scheduler_drain_moves", "Requests a draining worker handed back, by how "
                                 "they were dispatched again (peer: with their KV, which the draining worker sends "
                                 "to the new one, kvmesh_worker_kv_moves_total there says whether it came; "
                                 "recompute: without, no peer of the worker's role and KV layout took them, or "
                                 "their KV was not held)", ["path"]))
SCHED_PREFIX_MATCH = _scheduler(Histogram("kvmesh_scheduler_prefix_match_seconds",
                                          "cache_aware routing over several workers: one submission's Match at the "
                                          "prefix-cache index plus its block hashing", buckets=_HOP))

# ---- worker
ENGINE_RUNNING = _worker(Gauge("kvmesh_engine_running", "Sequences running in the engine"))
ENGINE_WAITING = _worker(Gauge("kvmesh_engine_waiting", "Sequences waiting in the engine"))
KV_FREE_BLOCKS = _worker(Gauge("kvmesh_kv_free_blocks", "Free KV blocks"))
KV_USAGE = _worker(Gauge("kvmesh_kv_usage_ratio", "Fraction of KV blocks in use"))
PENDING_PROMPT_TOKENS = _worker(Gauge("kvmesh_worker_pending_prompt_tokens",
                                      "Prompt tokens of the requests held by this worker that have no first token "
                                      "yet (the prefill backlog; prefix-cache hits included)"))
PREFIX_QUERY_TOKENS = _worker(Gauge("kvmesh_prefix_cache_query_tokens",
                                    "Prompt tokens looked up in the prefix cache (cumulative)"))
PREFIX_HIT_TOKENS = _worker(Gauge("kvmesh_prefix_cache_hit_tokens",
                                  "Prompt tokens found in the prefix cache (cumulative)"))
# the engine's KV tiers (gpu_worker/kv_tiers; EngineStats.extra["kv_tiers"]), set every heartbeat
KV_TIER_BLOCKS = _worker(Gauge("kvmesh_kv_tier_blocks", "KV blocks held in a lower tier (shared: the node's "
                                "shared directory, every worker's blocks)", ["tier"]))
KV_TIER_OFFLOADED = _worker(Gauge("kvmesh_kv_tier_offloaded_blocks",
                                  "KV blocks copied down into a lower tier (cumulative)", ["tier"]))
KV_TIER_LOADED = _worker(Gauge("kvmesh_kv_tier_loaded_blocks",
                               "KV blocks loaded back from a lower tier instead of recomputed (cumulative)", ["tier"]))
KV_TIER_DECISIONS = _worker(Gauge("kvmesh_kv_tier_load_decisions",
                                  "Admissions whose prefix continued in a lower tier, by choice: load, recompute, "
                                  "split (cumulative)", ["decision"]))
KV_TIER_BANDWIDTH = _worker(Gauge("kvmesh_kv_tier_bandwidth_bytes_per_second",
                                  "The load policy's bandwidth estimate of a tier (cpu: host <-> device)", ["tier"]))
KV_TIER_PREFILL_RATE = _worker(Gauge("kvmesh_kv_tier_prefill_tokens_per_second",
                                     "The load policy's recent prefill rate estimate"))
KV_TIER_CORRUPT = _worker(Gauge("kvmesh_kv_tier_corrupt_files",
                                "Disk- and shared-tier files dropped because they did not verify (cumulative)"))
KV_TIER_DISK_ENABLED = _worker(Gauge("kvmesh_kv_tier_disk_enabled",
                                     "1 while the disk tier takes writes; 0 for a back-off after persistent write "
                                     "failures (its blocks on disk are still loaded; writes are retried)"))


def publish_kv_tiers(stats: dict) -> None:
    """An engine's KV-tier stats (EngineStats.extra["kv_tiers"]) -> the worker's gauges."""
    for tier in ("cpu", "disk", "shared"):     # shared: the whole directory's files at the last scan
        KV_TIER_BLOCKS.labels(tier).set(stats[f"{tier}_blocks"])
        KV_TIER_OFFLOADED.labels(tier).set(stats["offloaded_blocks"][tier])
        KV_TIER_LOADED.labels(tier).set(stats["loaded_blocks"][tier])
        KV_TIER_BANDWIDTH.labels(tier).set(stats["bandwidth_bytes_per_s"].get(tier, 0.0))
    for decision, count in stats["decisions"].items():
        KV_TIER_DECISIONS.labels(decision).set(count)
    KV_TIER_PREFILL_RATE.set(stats["prefill_tokens_per_s"])
    KV_TIER_CORRUPT.set(stats["disk_corrupt_files"] + stats["shared_corrupt_files"])
    KV_TIER_DISK_ENABLED.set(int(stats["disk_enabled"]))


STEP_SECONDS = _worker(Histogram("kvmesh_engine_step_seconds", "Duration of one engine step", buckets=_TOK))
TOKENS_OUT = _worker(Counter("kvmesh_worker_generated_tokens", "Tokens generated by this worker"))
# ---- prefill/decode hand-off (gpu_worker/service/handoff.py; outcomes are fixed names)
HANDOFFS = _worker(Counter("kvmesh_worker_kv_handoffs", "KV hand-offs this prefill worker ran, by outcome "
                           "(ack: the decode worker took the request; fail, refused, timeout: it did not, and the "
                           "prefill worker decodes the request itself from the KV it holds; abort: the request "
                           "was aborted on the prefill worker mid-send)", ["outcome"]))
# a drained worker's request moved here with its KV (Dispatch.kv_from): how it went on (fixed names)
PEER_MOVES = _worker(Counter("kvmesh_worker_kv_moves", "Requests a draining worker moved to this one with their KV, "
                             "by outcome (peer: the KV arrived and the request decodes on from it; recompute: it "
                             "did not, refused, failed or late, and this worker recomputes the request from the "
                             "tokens already streamed)", ["outcome"]))
DRAIN_WAYS = _worker(Counter("kvmesh_worker_drain_moves", "Running requests this draining worker handed back, by "
                             "way (kv: held for a peer, which it sends their KV to; recompute: the peer recomputes "
                             "them, as the predicted KV transfer took longer than the recompute, or their KV could "
                             "not be held or moved)", ["way"]))
KV_SEND_RATE = _worker(Gauge("kvmesh_worker_kv_send_bytes_per_second", "The measured rate of this worker's whole "
                             "KV sends (hand-offs and drain moves: Offer to Ack), by path (cache: the peer read "
                             "this worker's cache; shm: frames through shared memory; frames: ZMQ frames)",
                             ["path"]))
HANDOFF_BYTES = _worker(Counter("kvmesh_worker_kv_handoff_bytes", "KV bytes this prefill worker sent to decode workers"))
HANDOFF_SECONDS = _worker(Histogram("kvmesh_worker_kv_handoff_seconds", "One hand-off on the prefill worker: "
                                    "first token drawn (Offer sent) to the decode worker's Ack (or the failure)",
                                    buckets=_LAT))
HANDOFF_STREAMED_BLOCKS = _worker(Counter("kvmesh_worker_kv_handoff_streamed_blocks", "KV blocks this prefill "
                                          "worker sent while their prompt was still prefilling (the rest go "
                                          "after the first token)"))
HANDOFF_SHM_FRAMES = _worker(Counter("kvmesh_worker_kv_handoff_shm_frames", "KV frames this prefill worker sent "
                                     "with their payload in shared memory (decode workers on this host)"))
HANDOFF_EXPIRIES = _worker(Counter("kvmesh_worker_kv_handoff_expiries", "Hand-offs whose lease lapsed "
                                   "(--handoff-lease-ms without progress): the decode worker freed the blocks it held for "
                                   "them; the prefill worker decodes the request itself"))
WORKER_REJOINS = _worker(Counter("kvmesh_worker_lease_rejoins", "Times this worker's lease lapsed (a pause or "
                                 "Redis outage past --lease-ms) and it rejoined with a new epoch, dropping "
                                 "every request of the old one"))
# Speculative decoding (vLLM's names): counted from the engine's running totals at each heartbeat.
# Labels are server-side: the configured method, and draft positions 0..num_speculative_tokens-1.
SPEC_DRAFTS = _worker(Counter("kvmesh_spec_decode_num_drafts", "Speculative verifications: sequence-steps that "
                              "verified at least one draft token", ["method"]))
SPEC_DRAFT_TOKENS = _worker(Counter("kvmesh_spec_decode_num_draft_tokens", "Draft tokens verified", ["method"]))
SPEC_ACCEPTED_TOKENS = _worker(Counter("kvmesh_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       ["method"]))
SPEC_ACCEPTED_PER_POS = _worker(Counter("kvmesh_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0: the first draft)",
                                        ["method", "position"]))


class SpecDecodePublisher:
    """An engine's speculation totals (EngineStats.extra["spec_decode"]) -> the counters, by the
    increase since the last call."""

    def __init__(self) -> None:
        self._last: dict = {}

    def publish(self, stats: dict) -> None:
        method, last = stats["method"], self._last
        SPEC_DRAFTS.labels(method).inc(stats["verify_steps"] - last.get("verify_steps", 0))
        SPEC_DRAFT_TOKENS.labels(method).inc(stats["proposed"] - last.get("proposed", 0))
        SPEC_ACCEPTED_TOKENS.labels(method).inc(stats["accepted"] - last.get("accepted", 0))
        before = last.get("accepted_per_pos", [])
        for pos, total in enumerate(stats["accepted_per_pos"]):
            SPEC_ACCEPTED_PER_POS.labels(method, str(pos)).inc(total - (before[pos] if pos < len(before) else 0))
        self._last = stats


# per request, where the worker's share of TTFT goes (vLLM's vllm:request_*_time_seconds); the
# stages and their boundaries are drawn in gpu_worker/service/core.py
WORKER_QUEUE = _worker(Histogram("kvmesh_worker_request_queue_seconds",
                                 "Dispatch received by the worker to the engine first scheduling any of its prompt "
                                 "tokens",
                                 buckets=_LAT))
WORKER_PREFILL = _worker(Histogram("kvmesh_worker_request_prefill_seconds",
                                   "First scheduled to the engine step that produced its first token", buckets=_LAT))
WORKER_DECODE = _worker(Histogram("kvmesh_worker_request_decode_seconds",
                                  "First token to last token of a finished (not aborted) request", buckets=_LAT))
WORKER_TTFT = _worker(Histogram("kvmesh_worker_time_to_first_token_seconds",
                                "Dispatch received by the worker to its first token in a StepOutput", buckets=_LAT))
WORKER_ADMIT = _worker(Histogram("kvmesh_worker_request_admit_seconds",
                                 "Dispatch read off the worker's socket to the engine holding the request (decode, "
                                 "validation; part of the queue stage)", buckets=_HOP))
WORKER_FIRST_SEND = _worker(Histogram("kvmesh_worker_first_token_send_seconds",
                                      "End of the engine step that produced a request's first token to its StepOutput "
                                      "handed to the detokenizer's socket", buckets=_HOP))
WORKER_FIRST_SYNC = _worker(Histogram("kvmesh_worker_first_token_sync_seconds",
                                      "The engine step that produced a request's first token: time it waited for the "
                                      "device's sampled tokens (near 0: the token was on the host before the engine "
                                      "looked, so the host, not the GPU, set the pace)", buckets=_HOP))

# ---- tokenizer
TOKENIZE_SECONDS = _tokenizer(Histogram("kvmesh_tokenize_seconds", "Tokenize call duration", buckets=_TOK))
TOKENS_IN = _tokenizer(Counter("kvmesh_tokenized_tokens", "Prompt tokens produced by Tokenize"))
DETOK_STREAMS = _tokenizer(Gauge("kvmesh_detok_streams", "Requests being detokenized"))
STOP_HITS = _tokenizer(Counter("kvmesh_stop_string_hits", "Samples ended by a stop string"))
DROPPED_FRAMES = shown_by(*SERVICES)(Counter(   # every service has internal sockets
    "kvmesh_dropped_frames", "Frames an internal ZeroMQ socket dropped, by socket and reason: malformed (not "
    "one message of the socket's types), version (another protocol version), role (a kind the sender's role "
    "may not send there)", ["socket", "reason"]))
DETOK_DROPPED_TOKENS = _detokenizer(Counter(
    "kvmesh_detok_dropped_tokens", "Generated tokens a detokenizer received but dropped, by reason: "
    "stale_epoch (from a worker incarnation older than one already seen), no_stream (for a request it "
    "does not hold: ended, failed or aborted), moved (from a worker its request has moved away from)", ["reason"]))
DETOK_FIRST_TOKEN = _detokenizer(Histogram("kvmesh_detok_first_token_seconds",
                                           "A StepOutput carrying some request's first tokens, read off the "
                                           "detokenizer's socket, to its TextBatches handed to the gateways' sockets "
                                           "(a gateway with --text-in-gateway: to its requests)", buckets=_HOP))
# a moved stream's outcome at its detokenizer, once known (a fixed set: never a client's value)
DETOK_MIGRATION_OUTCOMES = ("resumed", "aborted", "not_held", "resent")
DETOK_MIGRATIONS = _detokenizer(Counter(
    "kvmesh_detok_migrations", "Streams the scheduler moved to another worker (Migrate), by outcome once "
    "known: resumed (its new worker's first tokens came: kvmesh_detok_migration_stall_seconds observed the "
    "wait), aborted (aborted, failed or expired before them: nothing observed), not_held (no such stream here: "
    "it had ended, failed or never opened; one never opened is timed by its gateway, "
    "kvmesh_gateway_resubmit_wait_seconds), resent (moved by a restarted scheduler before it passed on any token: "
    "its gateway times that client's wait, kvmesh_gateway_resubmit_wait_seconds). A stream moved again before its "
    "new worker's first tokens counts once", ["outcome"]))
DETOK_MIGRATION_STALL = _detokenizer(Histogram(
    "kvmesh_detok_migration_stall_seconds", "A moved stream's added latency, as its detokenizer reads it: "
    "from the last tokens it passed on before the move (the Migrate itself when none) to the first tokens "
    "from its new worker", buckets=_LAT))


# ---- planner (services/planner; pool names are fixed: prefill, decode)
_planner = shown_by("planner")
PLANNER_REPLICAS = _planner(Gauge("kvmesh_planner_replicas", "Replicas of a pool's Deployment as last read",
                                  ["pool"]))
PLANNER_DESIRED = _planner(Gauge("kvmesh_planner_desired_replicas", "Replicas the planner last decided for a "
                                 "pool (also in --dry-run, where nothing is changed)", ["pool"]))
PLANNER_SIGNAL = _planner(Gauge("kvmesh_planner_signal", "The SLO signals a decision read, by pool and signal "
                                "(ttft_p90_s, pending_prompt_tokens, itl_p90_s, kv_usage); NaN: not available",
                                ["pool", "signal"]))
PLANNER_SCALES = _planner(Counter("kvmesh_planner_scale_events", "Replica changes decided, by pool and direction "
                                  "(up, down)", ["pool", "direction"]))
PLANNER_ERRORS = _planner(Counter("kvmesh_planner_errors", "Failed reads or patches, by stage (signals, "
                                  "kubernetes)", ["stage"]))


class _ServiceView:
    """The default registry as one service shows it: every family but the other services' own."""

    def __init__(self, service: str) -> None:
        assert service in SERVICES, f"unknown service {service!r}"
        self.hidden = set().union(*_FAMILIES.values()) - _FAMILIES[service]

    def describe(self):
        return []     # nothing to reserve: the families are registered (and checked) in REGISTRY

    def collect(self):
        for family in REGISTRY.collect():
            if family.name not in self.hidden:
                yield family


def service_registry(service: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServiceView(service))
    return registry


def serve_metrics(host: str, port: int, service: str) -> int:
    """Start `service`'s /metrics on its own port: -1 off (returns -1), 0 any free port. Returns the
    bound port."""
    if port < 0:
        return -1
    server, _thread = start_http_server(port, addr=host, registry=service_registry(service))
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


_GATEWAY_REGISTRY: CollectorRegistry | None = None


def render() -> tuple[bytes, str]:
    """The gateway's /metrics page (it serves them on its HTTP port)."""
    global _GATEWAY_REGISTRY
    if _GATEWAY_REGISTRY is None:
        _GATEWAY_REGISTRY = service_registry("gateway")
    return generate_latest(_GATEWAY_REGISTRY), CONTENT_TYPE_LATEST
