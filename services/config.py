"""One typed configuration tree for every kvmesh service.

Each service has one frozen dataclass; all of them live under `KvmeshConfig`. A field `foo_bar`
is set, in order of precedence, by the flag `--foo-bar`, the environment variable
`KVMESH_FOO_BAR`, or its default. The field's `help` metadata is its `--help` text.

    kvmesh worker --model /m --max-num-seqs 64      # flag
    KVMESH_MAX_NUM_SEQS=64 kvmesh worker --model /m  # same thing through the environment

Unknown flags, unknown `KVMESH_*` variables (typos), unparsable values and values outside a field's
bounds (opt's min / max / above / pattern) fail loudly, before the process starts anything, with a
message naming the flag or variable. Helm values map onto the same names (docs/services.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Mapping, NamedTuple, TypeVar, Union

from services.engine_args import ENGINE_FIELDS, ServedEngineArgs
from services.options import choices_text, opt, out_of_bounds  # opt: re-exported, every service declares its fields with it

ENV_PREFIX = "KVMESH_"
# KVMESH_* variables read outside this config tree (left alone by the unknown-name check), each
# read by code: KVMESH_CACHE_DIR by services/launcher.py (where the built-in model is made), and
# the kernel-tuning overrides (gpu_worker/config.py's TUNING_ENV, read by its tuning_from_env
# when an EngineConfig is built) that benchmarks use to A/B a serving stack.
TUNING_ENV = frozenset({"KVMESH_DECODE_ATTENTION", "KVMESH_DECODE_GEMV_MAX_M", "KVMESH_DECODE_GEMV_WEIGHTS",
                        "KVMESH_DECODE_GEMV_FUSE", "KVMESH_FP8_GEMV_MAX_M", "KVMESH_PDL"})
EXTERNAL_ENV = frozenset({"KVMESH_CACHE_DIR"}) | TUNING_ENV


_WILDCARDS = ("0.0.0.0", "::", "")


def reachable_host(host: str, advertise_host: str = "") -> str:
    """The address peers should dial: the advertised one, else the bound one, with a wildcard
    bind (all interfaces) mapped to loopback."""
    if advertise_host:
        return advertise_host
    return "127.0.0.1" if host in _WILDCARDS else host


class ConfigError(ValueError):
    """A flag or KVMESH_* variable is unknown or has a bad value; the message names it."""


def check_bind_host(host: str) -> None:
    """Every socket binds `host`: an empty value would silently mean all interfaces, so it is an
    error; all interfaces must be asked for by name (0.0.0.0)."""
    if not host.strip():
        raise ConfigError("--host / KVMESH_HOST is empty: give the address to bind (127.0.0.1 by "
                          "default; the pod IP on Kubernetes; 0.0.0.0 only to listen on every interface)")


def check_lease(cfg: Any) -> None:
    """A lease renewed by every heartbeat must outlive two lost ones, or a busy process is
    forgotten (and its requests moved) while it is alive."""
    if cfg.lease_ms < 3 * cfg.heartbeat_ms:
        raise ConfigError(f"--lease-ms={cfg.lease_ms} must be at least 3 x --heartbeat-ms ({cfg.heartbeat_ms})")


class Deprecated(NamedTuple):
    """An old field name still accepted as a flag and a KVMESH_* variable; each use logs one
    warning naming what replaces it."""

    name: str                                         # the old field name: --old-name, KVMESH_OLD_NAME
    takes_value: bool                                 # False: a switch (--old-name / --no-old-name)
    means: Callable[[str], dict[str, str]]            # its value ("true"/"false" for a switch) -> new fields


# redis-py reads these schemes only (any other raises inside the process); "": not given. The URL
# may hold the Redis password: an error names the flag but does not echo the value (secret=).
REDIS_URL = {"pattern": r"((redis|rediss|unix)://[^\s]{0,2000})?", "expected": "a redis://, rediss:// or unix:// URL",
             "secret": True}
PORT = {"min": 1, "max": 65535}
ANY_PORT = {"min": 0, "max": 65535}           # 0: any free port
METRICS_PORT = {"min": -1, "max": 65535}      # 0: any free port, -1: off
# the gateway's answer parsers (services/gateway/tool_parsers/, services/gateway/reasoning.py)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "none")
# An API key list given empty (`--api-key ''`, `--api-key "$UNSET"`, KVMESH_API_KEY=,) is refused,
# not read as "no key": the gateway would serve anyone while its operator believed it locked. Keys
# are secrets: errors name the flag, never the value.
API_KEYS = {"nonempty": "an empty key is no key, and the gateway would serve anyone", "secret": True}
SERVED_NAMES = {"unique": True}   # a name twice is a typo in the list, not a second name
HEALTH_PORT_HELP = ("Plaintext gRPC port answering only grpc.health.v1, for Kubernetes probes (they hold no "
                    "client certificate for the mutual-TLS --port); -1: none, 0: any free port.")


def check_bounds(cfg: Any) -> None:
    """Every field's choices / min / max / above / pattern (opt's metadata), so that a bad value
    fails when the config is made, naming its flag, not later inside the process it configures."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        why = out_of_bounds(value, f.metadata)
        if why:
            shown = "" if f.metadata.get("secret") else f"={value!r}"
            raise ConfigError(f"{flag_name(f.name)}{shown} {why}")


# ----------------------------------------------------------------------------- service configs


@dataclass(frozen=True)
class ServiceConfig:
    """Fields every service shares."""

    redis_url: str = opt("", "Redis URL (redis://host:port/db) holding leases and the registry; required.",
                         **REDIS_URL)
    host: str = opt("127.0.0.1", "Address every socket of this process binds to (0.0.0.0 only on purpose).")
    advertise_host: str = opt("", "Address other processes use to reach this one (pod IP); default: --host, "
                                  "or 127.0.0.1 when --host is 0.0.0.0.")
    log_level: str = opt("info", "Log level.", choices=("debug", "info", "warning", "error"))
    lease_ms: int = opt(3000, "Registry lease in ms: a process whose heartbeat stops is forgotten after this.", min=1)
    heartbeat_ms: int = opt(500, "Heartbeat period in ms (renews the lease, publishes load).", min=1)
    trust_dir: str = opt("", "Trust directory (`kvmesh keys generate DIR`; a Secret on Kubernetes): this role's CURVE "
                             "and TLS keys, every role's public keys and the Redis password. Required unless "
                             "--insecure-internal-planes.")
    insecure_internal_planes: bool = opt(False, "Run the internal ZeroMQ, gRPC and Redis planes without "
                                                "authentication or encryption: any local process can then "
                                                "inject, abort or read requests. Tests and debugging only.")

    def reachable_host(self) -> str:
        return reachable_host(self.host, self.advertise_host)

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        check_bounds(self)
        check_lease(self)


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """`kvmesh gateway`: the OpenAI-compatible HTTP API (authentication, bounds, SSE streaming)."""

    port: int = opt(8000, "HTTP port of the OpenAI-compatible API.", **PORT)
    zmq_port: int = opt(5560, "ZMQ port receiving text deltas and scheduler replies (0: any free port).", **ANY_PORT)
    api_key: list = opt([], "Comma-separated API keys; when set, every route except /health, /ready and "
                            "/metrics needs `Authorization: Bearer <key>`; given empty: an error.", **API_KEYS)
    max_body_bytes: int = opt(8 << 20, "Largest accepted request body in bytes.", min=1)
    max_prompts: int = opt(64, "Most prompts in one /v1/completions request.", min=1)
    max_messages: int = opt(1024, "Most messages in one chat request.", min=1)
    admission_timeout_s: float = opt(15.0, "Seconds to wait for the scheduler to accept a request before a 503.",
                                     above=0)
    request_timeout_s: float = opt(600.0, "Seconds a request may go without any progress before it fails.", above=0)
    header_timeout_s: float = opt(10.0, "Seconds a connection may take to send a request's headers (from "
                                        "connecting, or from a keep-alive request's first byte); beyond: 408, "
                                        "closed.", above=0)
    body_timeout_s: float = opt(60.0, "Seconds a request's whole body may take to arrive after its headers; "
                                      "beyond: 408, closed.", above=0)
    max_connections: int = opt(4096, "Most open HTTP connections; a request on one beyond it gets a 503 and its "
                                     "connection is closed.", min=1)
    keep_alive_timeout_s: float = opt(75.0, "Seconds an idle keep-alive connection stays open. Longer than the "
                                            "idle expiry of clients (openai/httpx 5 s) and of load balancers in "
                                            "front (AWS ALB 60 s; a GCP load balancer needs more than 600), so "
                                            "none reuses a connection the gateway is closing.", above=0)
    shutdown_grace_s: float = opt(30.0, "On SIGTERM: /ready answers 503 at once, new requests get a 503, and the "
                                        "requests in flight get this many seconds to finish before those left "
                                        "end with an error.", min=0)
    tokenize_threads: int = opt(4, "Threads tokenizing long prompts (and detokenizing long id lists) off the event "
                                   "loop; more wait their turn.", min=1)
    tokenizer_addr: str = opt("", "host:port of tokenizer gRPC servers, comma-separated (default: from Redis).")
    text_in_gateway: bool = opt(False, "Make text in this process: tokenize prompts and turn the workers' tokens "
                                       "into text (one hop less per request and per token; needs --model); "
                                       "--no-text-in-gateway: the tokenizer services do both.")
    model: str = opt("", "Model directory holding tokenizer.json (and its chat template), for --text-in-gateway.")
    scheduler_addr: str = opt("", "tcp://host:port of the scheduler (default: from Redis).")
    tool_call_parser: str = opt("auto", "How chat answers' tool calls are read into `tool_calls`: hermes "
                                        "(<tool_call>, Qwen), llama3_json (Llama 3.1/3.2), mistral ([TOOL_CALLS]), "
                                        "none (answers stay text); auto: the model's, from its chat template and "
                                        "model type.", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str = opt("auto", "How chat answers' <think> block becomes `reasoning_content`: qwen3 (when "
                                        "the answer opens it), deepseek_r1 (the answer starts in it), none; auto: "
                                        "from the chat template (none when it writes no <think>).",
                                choices=REASONING_PARSERS)

    DEPRECATED: ClassVar[tuple[Deprecated, ...]] = (
        Deprecated("local_tokenizer", True, lambda v: {"text_in_gateway": "true", "model": v} if v else {}),
        Deprecated("local_detokenizer", False, lambda v: {}),   # implied by --text-in-gateway
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.text_in_gateway and not self.model:
            raise ConfigError("--text-in-gateway needs --model DIR (or KVMESH_MODEL): the model's tokenizer files")


@dataclass(frozen=True)
class TokenizerConfig(ServiceConfig):
    """`kvmesh tokenizer`: gRPC Tokenize (chat template + encode) and the streaming detokenizer."""

    model: str = opt("", "Model directory holding tokenizer.json (and its chat template).")
    port: int = opt(50051, "gRPC port (Tokenize + grpc.health.v1).", **ANY_PORT)
    health_port: int = opt(-1, HEALTH_PORT_HELP, **METRICS_PORT)
    zmq_port: int = opt(5558, "ZMQ port receiving workers' token batches for detokenization (0: any).", **ANY_PORT)
    metrics_port: int = opt(9101, "Prometheus /metrics port (0: any free port, -1: off).", **METRICS_PORT)


@dataclass(frozen=True)
class SchedulerConfig(ServiceConfig):
    """`kvmesh scheduler`: admission, priority queue, worker choice, cancellation and failover."""

    port: int = opt(50052, "gRPC port (grpc.health.v1).", **ANY_PORT)
    health_port: int = opt(-1, HEALTH_PORT_HELP, **METRICS_PORT)
    zmq_port: int = opt(5557, "ZMQ port receiving submissions, aborts and worker status (0: any).", **ANY_PORT)
    metrics_port: int = opt(9102, "Prometheus /metrics port (0: any free port, -1: off).", **METRICS_PORT)
    max_queue: int = opt(4096, "Most requests waiting in the global queue; beyond it: 429.", min=1)
    max_tenant_inflight: int = opt(1024, "Most queued + running requests of one tenant (API key); beyond: 429.", min=1)
    worker_capacity_factor: float = opt(2.0, "A worker gets at most factor x its max_num_seqs requests at once.",
                                        above=0)
    retry_after_s: int = opt(1, "Retry-After seconds sent with 429/503 answers.", min=0)
    routing: str = opt("cache_aware", "How a worker is chosen: cache_aware (prefix hits from the prefix-cache "
                                      "index against load), least_loaded, or round_robin.",
                       choices=("cache_aware", "least_loaded", "round_robin"))
    prefix_match_timeout_ms: float = opt(50.0, "cache_aware: deadline of the prefix-cache index's Match; "
                                               "no answer in time routes by load alone.", above=0)
    route_hit_weight: float = opt(1.0, "cache_aware: weight of the prompt fraction already cached on a worker.", min=0)
    route_queue_weight: float = opt(1.0, "cache_aware: weight of waiting requests / max_num_seqs.", min=0)
    route_running_weight: float = opt(0.3, "cache_aware: weight of running requests / max_num_seqs.", min=0)
    route_kv_weight: float = opt(0.3, "cache_aware: weight of the KV fraction in use after the prompt's new blocks.",
                                 min=0)
    route_overflow_penalty: float = opt(10.0, "cache_aware: added when the prompt's new blocks do not fit "
                                              "in the worker's free and evictable KV.", min=0)
    route_cpu_credit: float = opt(0.8, "cache_aware: a CPU-tier block counts as this fraction of a GPU hit.",
                                  min=0, max=1)
    route_disk_credit: float = opt(0.5, "cache_aware: a disk-tier block counts as this fraction of a GPU hit.",
                                   min=0, max=1)
    route_shared_credit: float = opt(0.3, "cache_aware: a block in the node's shared KV tier "
                                          "(--kv-offload-shared-dir) counts as this fraction of a GPU hit for "
                                          "every worker reading that tier; below the disk tier's: each read "
                                          "is also MAC-checked, and another worker may delete the file first.",
                                     min=0, max=1)
    route_conversation_ttl_s: float = opt(600.0, "A request naming a conversation (OpenAI `user`, or the "
                                                 "`conversation_id` extension) goes to the worker that ran its last "
                                                 "turn within this many seconds, which holds its history's KV; "
                                                 "0: off. Not with round_robin.", min=0)
    route_conversation_max_load: float = opt(1.0, "A conversation leaves its worker for the routing policy's choice "
                                                  "when that worker has this many x max_num_seqs requests in "
                                                  "flight (or is gone, draining or full).", above=0)
    pd_min_prefill_tokens: int = opt(256, "Prefill/decode pools: a prompt runs on a decode worker alone when fewer "
                                          "than this many of its tokens are not already cached there (short "
                                          "prompts, or conversations whose history the decode worker holds); "
                                          "longer ones prefill on a prefill worker and hand their KV over.", min=0)
    max_migrations: int = opt(3, "Times one request may move to another worker mid-stream (its worker died or "
                                 "drained) and continue from the tokens already streamed; past it the client "
                                 "gets an error. 0: never move.", min=0)
    migration_wait_s: float = opt(60.0, "A request moving off a stopped worker that finds no worker left waits "
                                        "this long for one to join (the last one restarting: its stream pauses, "
                                        "then goes on) before its client gets an error; 0: at once.", min=0)


@dataclass(frozen=True)
class WorkerConfig(ServedEngineArgs, ServiceConfig):
    """`kvmesh worker`: one engine (one GPU or tensor-parallel group) serving dispatched requests.
    Its engine fields are services/engine_args.py's, with the served defaults."""

    served_model_name: list = opt([], "Comma-separated names clients use in `model`; the first is listed first "
                                      "by /v1/models and carried by responses (default: the model directory's "
                                      "name). The --model path is accepted too.", **SERVED_NAMES)
    role: str = opt("mixed", "Pool of this worker: mixed runs whole requests; prefill computes prompts and hands "
                             "their KV to a decode worker; decode binds a KV-transfer socket and decodes what "
                             "prefill workers hand it (and runs short prompts whole).",
                    choices=("mixed", "prefill", "decode"))
    worker_id: str = opt("", "Stable id (e.g. the pod name); default: host-pid-random.")
    port: int = opt(50053, "gRPC port (grpc.health.v1).", **ANY_PORT)
    health_port: int = opt(-1, HEALTH_PORT_HELP, **METRICS_PORT)
    zmq_port: int = opt(5559, "ZMQ port receiving dispatches and aborts (0: any free port).", **ANY_PORT)
    metrics_port: int = opt(9103, "Prometheus /metrics port (0: any free port, -1: off).", **METRICS_PORT)
    kv_events: bool = opt(True, "Publish KV-cache events (PUB) and serve snapshots for the prefix-cache index.")
    kv_events_port: int = opt(0, "Port of the KV-event PUB socket the prefix-cache index subscribes to (0: any free "
                                 "port; fix it where a firewall or NetworkPolicy names ports).", **ANY_PORT)
    kv_snapshot_port: int = opt(0, "Port answering the prefix-cache index's snapshot requests (0: any free port).",
                                **ANY_PORT)
    kv_transfer_port: int = opt(0, "Decode and mixed roles: port of the KV-transfer socket prefill workers, and "
                                   "draining workers moving requests with their KV, send KV to (CURVE, worker role "
                                   "only; 0: any free port).", **ANY_PORT)
    kv_transport: str = opt("auto", "Prefill/decode roles, and a drain's moves to peers: how KV moves between "
                                    "workers: zmq (checked frames over the "
                                    "CURVE socket), shm (the same frames, their payload in POSIX shared memory when "
                                    "the other worker runs on this host; zmq frames otherwise), cuda_ipc (a decode "
                                    "worker, or a drained worker's peer, on this host copies the blocks out of the "
                                    "sender's cache: CUDA "
                                    "IPC, device to device; a CPU cache through shared memory; shm/zmq frames "
                                    "otherwise; opt-in until checked on a GPU), auto (shm where both allow it, else "
                                    "zmq; a decode worker also reads a cuda_ipc prefill worker's cache) or nixl (the decode worker reads the prefill worker's "
                                    "blocks through NIXL/UCX; needs the `nixl` package); nixl workers are paired "
                                    "only with nixl workers.", choices=("auto", "zmq", "shm", "cuda_ipc", "nixl"))
    handoff_lease_ms: int = opt(5000, "Prefill/decode roles: a hand-off's lease in ms, renewed by each KV frame the "
                                      "decode worker takes; lapsed, the prefill worker frees the request's blocks "
                                      "and the decode worker forgets it.", min=100, max=600000)
    drain_grace_s: float = opt(30.0, "On SIGTERM: no new requests are routed here and the running ones get this "
                                     "many seconds to finish; the scheduler moves those left to other workers, "
                                     "where they continue from the tokens already streamed.", min=0)
    drain_kv_to_peers: bool = opt(True, "Mixed and decode roles: a drain moves each running request to another "
                                        "worker with its KV (sent like a prefill/decode hand-off, within "
                                        "--handoff-lease-ms) when the KV is predicted to arrive sooner than the "
                                        "request would be recomputed there (measured transfer and prefill "
                                        "rates), else has it recomputed; off: always recomputed.")
    null_model: bool = opt(False, "Skip the model: emit deterministic fake tokens (control-plane benchmarks only).")
    null_step_ms: float = opt(0.0, "Null model: sleep per engine step in ms (sets the token rate).", min=0)
    null_vocab_size: int = opt(32000, "Null model: vocabulary size of the fake tokens.", min=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.role != "mixed" and self.tensor_parallel_size > 1:
            raise ConfigError(f"--role={self.role} with --tensor-parallel-size={self.tensor_parallel_size}: a "
                              "hand-off moves KV out of and into one process's cache, a single GPU's; run "
                              "prefill and decode workers with --tensor-parallel-size 1 (a mixed worker shards)")


@dataclass(frozen=True)
class ServeConfig(ServedEngineArgs):
    """`kvmesh serve`: the whole stack on one machine (each service its own process). Its engine
    fields (services/engine_args.py, served defaults) go to every worker it starts."""

    model: str = opt("", "Model directory; default: a small built-in random model made on first use.")
    workers: int = opt(1, "Number of mixed-role GPU worker processes (0 only with --prefill-workers and "
                          "--decode-workers: then the pools serve alone).", min=0)
    prefill_workers: int = opt(0, "Prefill-role worker processes (disaggregated serving; needs --decode-workers).",
                               min=0)
    decode_workers: int = opt(0, "Decode-role worker processes (disaggregated serving; needs --prefill-workers).",
                              min=0)
    redis_url: str = opt("", "Use this Redis instead of starting an embedded one.", **REDIS_URL)
    trust_dir: str = opt("", "Trust directory of the internal planes (`kvmesh keys generate DIR`) for every "
                             "service; default: fresh keys each run, so the files a --kv-offload-shared-dir "
                             "holds (each MAC'd under the worker key) are readable only by the run that wrote "
                             "them.")
    host: str = opt("127.0.0.1", "Bind address of the gateway (internal services always use loopback).")
    port: int = opt(8000, "HTTP port of the gateway.", **PORT)
    api_key: list = opt([], "Comma-separated API keys required by the gateway; given empty: an error.", **API_KEYS)
    served_model_name: list = opt([], "Comma-separated names clients use in `model`; the first is listed first "
                                      "by /v1/models and carried by responses (default: the model directory's "
                                      "name). The --model path is accepted too.", **SERVED_NAMES)
    routing: str = opt("cache_aware", "Scheduler: how a worker is chosen (kvmesh scheduler --routing).",
                       choices=("cache_aware", "least_loaded", "round_robin"))
    kv_transport: str = opt("auto", "Workers: how KV moves from prefill to decode workers, and a draining "
                                    "worker's requests to their peers (kvmesh worker --kv-transport).",
                            choices=("auto", "zmq", "shm", "cuda_ipc", "nixl"))
    pd_min_prefill_tokens: int = opt(256, "Scheduler: prompts with fewer uncached tokens skip the prefill pool "
                                          "(kvmesh scheduler --pd-min-prefill-tokens).", min=0)
    route_conversation_ttl_s: float = opt(600.0, "Scheduler: a conversation's next turn goes to the worker of its "
                                                 "last one within this many seconds; 0: off (kvmesh scheduler "
                                                 "--route-conversation-ttl-s).", min=0)
    null_model: bool = opt(False, "Workers skip the model and emit fake tokens (control-plane benchmarks).")
    null_step_ms: float = opt(0.0, "Null model: sleep per engine step in ms.", min=0)
    prefix_cache: bool = opt(True, "Start the prefix-cache index service (when installed) where the scheduler asks "
                                   "it: cache_aware routing with more than one worker.")
    tool_call_parser: str = opt("auto", "Gateway: how chat answers' tool calls are read (kvmesh gateway "
                                        "--tool-call-parser).", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str = opt("auto", "Gateway: how chat answers' <think> block becomes reasoning_content "
                                        "(kvmesh gateway --reasoning-parser).", choices=REASONING_PARSERS)
    text_in_gateway: bool = opt(True, "The gateway makes the text itself (tokenizes prompts, turns tokens into "
                                      "text: one hop less per request and per token) and no tokenizer service "
                                      "is started; --no-text-in-gateway starts one and routes both through it.")
    log_level: str = opt("info", "Log level of every service.", choices=("debug", "info", "warning", "error"))
    lease_ms: int = opt(3000, "Registry lease in ms (how fast a dead worker is noticed).", min=1)
    heartbeat_ms: int = opt(500, "Heartbeat period in ms.", min=1)
    ready_timeout_s: float = opt(300.0, "Seconds to wait for the stack to become ready.", above=0)
    fleet_metrics_port: int = opt(0, "Port of the one page showing every local service's /metrics, each series "
                                     "labelled with its service (and worker); on 127.0.0.1. 0: any free port "
                                     "(printed once ready), -1: off.", **METRICS_PORT)

    DEPRECATED: ClassVar[tuple[Deprecated, ...]] = (
        Deprecated("tokenize_in_gateway", False, lambda v: {"text_in_gateway": v}),
        Deprecated("detokenize_in_gateway", False, lambda v: {} if v == "true" else {"text_in_gateway": v}),
    )

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        check_bounds(self)
        check_lease(self)        # serve hands both to every service: a bad pair fails here, not in a child
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ConfigError("--prefill-workers and --decode-workers go together: a prefill worker hands its "
                              "KV to a decode worker (give both, or neither)")
        if self.prefill_workers and self.tensor_parallel_size > 1:
            raise ConfigError(f"--prefill-workers with --tensor-parallel-size={self.tensor_parallel_size}: a hand-off "
                              "moves KV out of and into one process's cache, a single GPU's; disaggregated workers "
                              "run with --tensor-parallel-size 1 (mixed --workers shard)")
        if not self.workers and not self.prefill_workers:
            raise ConfigError("--workers=0 needs --prefill-workers and --decode-workers (some worker must serve)")
        if self.fleet_metrics_port == self.port:
            raise ConfigError(f"--fleet-metrics-port={self.port} is also --port (the gateway's): give it another "
                              "port, 0 for any free one, or -1 for none")


_SELECTOR = {"pattern": r'[^{}\n]{0,512}', "expected": "label matchers without braces, at most 512 characters"}
_WORKLOAD = {"pattern": r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)?",
             "expected": "a Deployment or StatefulSet name"}
_HTTP_URL = {"pattern": r"(https?://[^\s]{1,2000})?", "expected": "an http:// or https:// URL"}


@dataclass(frozen=True)
class PlannerConfig:
    """`kvmesh planner`: scales the prefill and decode pools (Deployments or StatefulSets) from SLO
    signals (services/planner).
    An up-threshold is passed when any signal is above it; a pool scales down only when every
    signal has stayed under its down-threshold for --stabilization-window-s."""

    prometheus_url: str = opt("", "Prometheus to query (its HTTP API, e.g. http://prometheus-operated:9090); "
                                  "empty: scrape the --*-metrics-urls pages directly.", **_HTTP_URL)
    prefill_selector: str = opt("", "PromQL label matchers of the prefill pool's series, e.g. "
                                    "namespace=\"llm\",service=\"prod-kvmesh-prefill\".", **_SELECTOR)
    decode_selector: str = opt("", "PromQL label matchers of the decode pool's series.", **_SELECTOR)
    gateway_selector: str = opt("", "PromQL label matchers of the gateways' series (inter-token latency).",
                                **_SELECTOR)
    prefill_metrics_urls: list = opt([], "Without --prometheus-url: the prefill workers' /metrics URLs "
                                         "(comma-separated).")
    decode_metrics_urls: list = opt([], "Without --prometheus-url: the decode workers' /metrics URLs.")
    gateway_metrics_urls: list = opt([], "Without --prometheus-url: the gateways' /metrics URLs.")
    kube_namespace: str = opt("default", "Namespace of the pools' Deployments or StatefulSets.",
                              pattern=r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", expected="a namespace name")
    kubeconfig: str = opt("", "Kubeconfig file; empty: the pod's ServiceAccount inside a cluster, else "
                              "~/.kube/config.")
    prefill_deployment: str = opt("", "The prefill pool's Deployment; empty: the prefill pool is not scaled "
                                      "(unless --prefill-statefulset names it).", **_WORKLOAD)
    decode_deployment: str = opt("", "The decode pool's Deployment; empty: the decode pool is not scaled "
                                     "(unless --decode-statefulset names it).", **_WORKLOAD)
    prefill_statefulset: str = opt("", "The prefill pool's StatefulSet (a pool with a persistent disk KV tier), "
                                       "instead of --prefill-deployment.", **_WORKLOAD)
    decode_statefulset: str = opt("", "The decode pool's StatefulSet, instead of --decode-deployment.",
                                  **_WORKLOAD)
    prefill_min_replicas: int = opt(1, "Fewest prefill pods.", min=0, max=1000)
    prefill_max_replicas: int = opt(8, "Most prefill pods.", min=1, max=1000)
    decode_min_replicas: int = opt(1, "Fewest decode pods.", min=0, max=1000)
    decode_max_replicas: int = opt(8, "Most decode pods.", min=1, max=1000)
    ttft_p90_up_s: float = opt(2.0, "Prefill: scale up while the prefill workers' TTFT p90 is above this.", above=0)
    ttft_p90_down_s: float = opt(0.5, "Prefill: TTFT p90 under which the pool may shrink.", above=0)
    pending_tokens_up: float = opt(16384.0, "Prefill: scale up while the prompt tokens per prefill pod with no "
                                            "first token yet are above this.", above=0)
    pending_tokens_down: float = opt(2048.0, "Prefill: pending prompt tokens per pod under which the pool may "
                                             "shrink.", min=0)
    itl_p90_up_s: float = opt(0.1, "Decode: scale up while the inter-token latency p90 is above this.", above=0)
    itl_p90_down_s: float = opt(0.03, "Decode: inter-token latency p90 under which the pool may shrink.", above=0)
    kv_usage_up: float = opt(0.85, "Decode: scale up while the decode pods' mean KV-cache usage is above this.",
                             above=0, max=1)
    kv_usage_down: float = opt(0.4, "Decode: mean KV usage under which the pool may shrink.", min=0, max=1)
    interval_s: float = opt(15.0, "Seconds between two decisions.", min=0.05, max=3600)
    stabilization_window_s: float = opt(300.0, "A pool shrinks only after its signals stayed low this long, and "
                                               "no sooner than this after its last change.", min=0, max=86400)
    scale_up_cooldown_s: float = opt(60.0, "Seconds between two scale-ups of a pool (new pods need time to load "
                                           "and take load).", min=0, max=86400)
    max_step: int = opt(2, "Most pods added at once (a scale-down removes one).", min=1, max=100)
    dry_run: bool = opt(False, "Log what would be scaled; change nothing.")
    query_timeout_s: float = opt(5.0, "Timeout of one Prometheus query, /metrics scrape or Kubernetes call.",
                                 above=0, max=120)
    host: str = opt("127.0.0.1", "Address the planner's own /metrics binds to.")
    metrics_port: int = opt(9105, "Prometheus /metrics port of the planner (0: any free port, -1: off).",
                            **METRICS_PORT)
    log_level: str = opt("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        check_bounds(self)
        for pool in ("prefill", "decode"):
            if getattr(self, f"{pool}_deployment") and getattr(self, f"{pool}_statefulset"):
                raise ConfigError(f"--{pool}-deployment and --{pool}-statefulset both name the {pool} pool: "
                                  "give the one its workers run as")
            lo, hi = getattr(self, f"{pool}_min_replicas"), getattr(self, f"{pool}_max_replicas")
            if lo > hi:
                raise ConfigError(f"--{pool}-min-replicas ({lo}) is above --{pool}-max-replicas ({hi})")
        for up, down in (("ttft_p90_up_s", "ttft_p90_down_s"), ("pending_tokens_up", "pending_tokens_down"),
                         ("itl_p90_up_s", "itl_p90_down_s"), ("kv_usage_up", "kv_usage_down")):
            if getattr(self, down) >= getattr(self, up):
                raise ConfigError(f"{flag_name(down)} ({getattr(self, down)}) must be below {flag_name(up)} "
                                  f"({getattr(self, up)}): the gap between them keeps the pool from flapping")


@dataclass(frozen=True)
class KvmeshConfig:
    """The root: one section per service (the Helm chart's values mirror it)."""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)


SECTIONS: tuple[type, ...] = tuple(f.default_factory for f in dataclasses.fields(KvmeshConfig))  # type: ignore[misc]
_extra_sections: list[type] = []


def register_section(cls: type) -> type:
    """Let another package (e.g. prefix_cache_svc) add its config class to the env-name check."""
    _extra_sections.append(cls)
    return cls


def known_env_names() -> set[str]:
    names = set(EXTERNAL_ENV)
    for cls in (*SECTIONS, *_extra_sections):
        names |= {env_name(f.name) for f in dataclasses.fields(cls)}
        names |= {env_name(d.name) for d in getattr(cls, "DEPRECATED", ())}
    return names


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def engine_error_text(message: str) -> str:
    """The engine's "invalid engine argument FIELD: why" as a command line says it,
    "--field: why"; any other message unchanged."""
    match = re.match(r"invalid engine argument (\w+): (.*)", message, re.S)
    return f"{flag_name(match[1])}: {match[2]}" if match else message


# ----------------------------------------------------------------------------- parsing

C = TypeVar("C")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of an annotation such as `int`, `int | None`, `list`."""
    if isinstance(tp, str):
        tp = eval(tp, {**vars(typing), "list": list})  # annotations are strings (from __future__)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])[0], True
    if origin is list or tp is list:
        return list, False
    if origin is Literal:
        return str, False
    return tp, False


def _convert(f: dataclasses.Field, raw: str, source: str) -> Any:
    tp, optional = _base_type(f.type)
    if tp is list:
        return _convert_list(f, raw, source)
    try:
        if optional and raw.strip().lower() in ("", "none"):
            return None
        if tp is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected true/false")
        value = tp(raw)
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r} is not a valid {tp.__name__}: {exc}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{source}={raw!r} must be one of: {choices_text(choices)}")
    return value


def _convert_list(f: dataclasses.Field, raw: str, source: str) -> list[str]:
    """Comma-separated items, blanks dropped. A nonempty= field given with no item at all is an
    error: such a value is a mistake (an unset shell variable), never a request for the default."""
    items = [part.strip() for part in raw.split(",") if part.strip()]
    if not items and f.metadata.get("nonempty"):
        raise ConfigError(f"{source}={raw!r} holds no item: give {flag_name(f.name)} / {env_name(f.name)} at "
                          f"least one non-empty value, or leave both unset ({f.metadata['nonempty']})")
    return items


def check_env(env: Mapping[str, str]) -> None:
    """Fail on KVMESH_* variables that no service knows (typos must not be silently ignored)."""
    known = known_env_names()
    for name in env:
        if name.startswith(ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown environment variable {name}{hint}")


def add_flags(parser: Any, fields: tuple[dataclasses.Field, ...], env: bool = True) -> None:
    """One flag per field on `parser` (or an argument group): its help, its default and, with
    `env`, the KVMESH_* variable that sets it too. Every flag parses to None when not given, so
    the caller knows what was set (convert_flag turns the text into the field's type)."""
    for f in fields:
        tp, _ = _base_type(f.type)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_ = f.metadata.get("help", "") + (f" [env {env_name(f.name)}]" if env else "")
        if tp is bool:
            parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_ + f" (default: {default})")
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, metavar=f.name.upper(), default=None,
                                help=help_ + f" (default: {default!r})")


def build_parser(cls: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """`cls`'s flags; the engine's (services/engine_args.py) in a group of their own."""
    parser = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip())
    fields = dataclasses.fields(cls)
    add_flags(parser, tuple(f for f in fields if f.name not in ENGINE_FIELDS))
    engine = tuple(f for f in fields if f.name in ENGINE_FIELDS)
    if engine:
        add_flags(parser.add_argument_group("engine", "The engine's fields (docs/services.md, \"The engine\")."), engine)
    return parser


def convert_flag(f: dataclasses.Field, given: Any) -> Any:
    """A flag's parsed value (text, or a bool from --x / --no-x) as field `f`'s type."""
    return given if isinstance(given, bool) else _convert(f, given, flag_name(f.name))


def parse_config(cls: type[C], argv: list[str], prog: str, env: Mapping[str, str] | None = None) -> C:
    """Flags > KVMESH_* env > defaults. Raises ConfigError (or exits 2 for bad flags / --help)."""
    env = os.environ if env is None else env
    check_env(env)
    argv, env = apply_deprecated(cls, argv, env)
    args = build_parser(cls, prog).parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        given = getattr(args, f.name)
        if given is not None:
            values[f.name] = convert_flag(f, given)
        elif env_name(f.name) in env:
            values[f.name] = _convert(f, env[env_name(f.name)], env_name(f.name))
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def apply_deprecated(cls: type, argv: list[str], env: Mapping[str, str]) -> tuple[list[str], Mapping[str, str]]:
    """`cls.DEPRECATED`'s old flags and variables rewritten into the fields they mean now; a
    variable never overrides the new one when both are set. One warning per old name used."""
    deprecated: tuple[Deprecated, ...] = getattr(cls, "DEPRECATED", ())
    if not deprecated:
        return argv, env
    out: list[str] = []
    new_env = dict(env)
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        name, _, inline = arg.partition("=")
        d = next((d for d in deprecated if name in (flag_name(d.name), "--no-" + d.name.replace("_", "-"))), None)
        if d is None:
            out.append(arg)
            continue
        if d.takes_value:
            if not inline and i < len(argv):
                inline, i = argv[i], i + 1
            value = inline
        else:
            value = "false" if name.startswith("--no-") else "true"
        new = _as_flags(cls, d.means(value))
        _warn_deprecated(name, " ".join(new))
        out += new
    for d in deprecated:
        old = env_name(d.name)
        if old in env:
            raw = env[old]
            value = raw if d.takes_value else ("true" if raw.strip().lower() in _TRUE else "false")
            _warn_deprecated(old, " ".join(f"{env_name(k)}={v}" for k, v in d.means(value).items()))
            for field_name, v in d.means(value).items():
                new_env.setdefault(env_name(field_name), v)
            del new_env[old]
    return out, new_env


def _as_flags(cls: type, values: dict[str, str]) -> list[str]:
    bools = {f.name for f in dataclasses.fields(cls) if _base_type(f.type)[0] is bool}
    flags: list[str] = []
    for name, value in values.items():
        if name in bools:
            flags.append(flag_name(name) if value == "true" else "--no-" + name.replace("_", "-"))
        else:
            flags += [flag_name(name), value]
    return flags


def _warn_deprecated(old: str, now: str) -> None:
    logging.getLogger("kvmesh.config").warning("%s is deprecated and will be removed; it means %s", old,
                                               now or "nothing more (it is implied)")


def to_argv(cfg: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that reproduce `cfg` (non-default fields only), e.g. for a child process."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if f.name in skip or value == default:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, list):
            argv += [flag_name(f.name), ",".join(value)]
        else:
            argv += [flag_name(f.name), str(value)]
    return argv


def load_or_exit(cls: type[C], argv: list[str], prog: str) -> C:
    """parse_config for a service's main(): a ConfigError prints one line and exits 2.
    Services (ServiceConfig) also need a Redis URL: it is where they find each other."""
    try:
        cfg = parse_config(cls, argv, prog)
        if isinstance(cfg, ServiceConfig) and not cfg.redis_url:
            raise ConfigError("--redis-url (or KVMESH_REDIS_URL) is required; `kvmesh serve` starts "
                              "a whole stack with its own Redis")
        return cfg
    except ConfigError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _bounds_text(meta: Mapping[str, Any]) -> str:
    lo, hi, above = meta.get("min"), meta.get("max"), meta.get("above")
    if lo is not None and hi is not None:
        return f" From {lo} to {hi}."
    if above is not None:
        return f" Greater than {above}" + (f", at most {hi}." if hi is not None else ".")
    if lo is not None:
        return f" At least {lo}."
    return ""


def flags_markdown(cls: type, without: type | tuple[type, ...] = ()) -> str:
    """The Markdown table of `cls`'s flags (docs/services.md holds these; a test keeps them true):
    flag, environment variable, default, help. `without`: leave out the fields `cls` takes
    unchanged from these bases (a field it declares again, with its own help, stays)."""
    bases = without if isinstance(without, tuple) else (without,) if without else ()
    inherited = {(f.name, f.metadata.get("help")) for base in bases for f in dataclasses.fields(base)}
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if (f.name, f.metadata.get("help")) in inherited:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if isinstance(default, list):
            default = ",".join(map(str, default))
        text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            text += " One of: " + choices_text(f.metadata["choices"]) + "."
        text += _bounds_text(f.metadata)
        rows.append(f"| `{flag_name(f.name)}` | `{env_name(f.name)}` | `{default}` | {text} |")
    return "\n".join(rows)
