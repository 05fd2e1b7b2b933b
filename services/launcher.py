"""`kvmesh serve`: the whole stack on this machine, each service its own process, supervised.

    embedded Redis (unless --redis-url) -> [tokenizer], scheduler, [prefix-cache], N workers -> gateway

Only services that requests reach are started: the gateway makes its own text by default
(--text-in-gateway), so the tokenizer service runs only with --no-text-in-gateway, and only then
does the gateway's /ready wait for it; the prefix-cache index runs only where the scheduler asks it
(cache_aware routing with more than one worker).

Workers: --workers mixed ones (worker-0..), --prefill-workers (prefill-0..) and --decode-workers
(decode-0..) of the disaggregated pools.

Refuses a busy --port, and a --redis-url that does not answer a PING, before starting anything.
Waits until the gateway's /ready answers and every worker is registered, then prints the URL, each service's /metrics page, and the one page that
shows them all (--fleet-metrics-port, on loopback: services/fleet_metrics.py). A failure during
start-up stops the stack (a bad model or flag would only fail again; serve exits 2 when the
child refused its settings, 1 otherwise). From then on a service that
exits on its own, whatever its code, is reported in one line and restarted with back-off, with the
same flags (services.supervisor, services.restart_policy); a required service that crash-loops
stops the stack with the reason, a worker that does is restarted every 10 s while the others
serve. Ctrl-C / SIGTERM stops everything, gateway first and Redis last, each step bounded.
Children get SIGTERM if this process dies (PR_SET_PDEATHSIG on Linux).

What a restart means for requests in flight:
  worker        its requests move to the other workers when the scheduler sees its lease lapse
                or its id come back under a new epoch, and go on from the tokens their clients
                have (one stream, no token twice or missing), waiting for it to come back when it
                was the last one (--migration-wait-s); one that cannot move ends with a
                `worker_failed` error chunk. The
                restarted one (same --worker-id) takes new requests once registered.
  scheduler     no request fails: the gateway sends every live one to the restarted scheduler
                (within --admission-timeout-s for one not yet admitted), which adopts those on a
                worker and runs or moves the rest; requests already on a worker stream on (their
                tokens do not pass through it); until the gateway has found the new one, new
                requests get a retryable 503 `scheduler_unavailable`.
  tokenizer     (--no-text-in-gateway only) the streams whose text it makes fail with
                `tokenizer_failed`; new requests wait for the restarted one.
  prefix-cache  optional: routing falls back to load alone until it is back; nothing fails.
                A crash loop drops it instead of stopping the stack.
  gateway       its client connections drop (clients see a closed connection, no error body);
                it binds the same --port again.
  Redis         (embedded) restarted on the same port, empty; requests in flight go on (the data
                path does not use Redis); /ready answers 503 until it is back, and every service
                registers again on its next heartbeat.
"""
from __future__ import annotations

import asyncio
import errno
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from services.config import ServeConfig, engine_error_text, load_or_exit, reachable_host, to_argv
from services.engine_args import ServedEngineArgs, engine_args_of
from services.embedded_redis import EmbeddedRedis
from services.fleet_metrics import Page, serve_fleet_metrics
from services.redis_client import RedisAuth, connect as redis_connect
from services.registry import ServiceRecord, list_records
from services.restart_policy import describe_exit
from services.supervisor import CONFIG_REFUSED, Supervisor
from services.security import bundle
from services.logging import setup as setup_logging

log = logging.getLogger("kvmesh.serve")
DEFAULT_MODEL_SIZE = "tiny"
REDIS_CHECK_TIMEOUT_S = 3.0      # one PING of a --redis-url before anything starts


def default_model_dir() -> Path:
    base = Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")
    return base / "models" / f"llama-{DEFAULT_MODEL_SIZE}"


def model_dir_problem(model: str) -> str | None:
    """Why --model cannot be served (one line naming the flag), or None."""
    if not Path(model).exists():
        return f"--model {model}: the model directory does not exist"
    if not (Path(model) / "config.json").is_file():
        return f"--model {model}: not a model directory (no config.json); give a Hugging Face model directory"
    if not (Path(model) / "tokenizer.json").is_file():
        # the gateway (or the tokenizer service) loads it; refused here, not by a child at start-up
        return (f"--model {model}: no tokenizer.json; kvmesh needs the model's fast tokenizer (convert a slow one "
                "with transformers' AutoTokenizer(...).save_pretrained())")
    return None


def engine_settings_problem(cfg: ServeConfig) -> str | None:
    """Why the workers would refuse serve's engine fields (one line naming the flag), from the
    engine's checks that need no model: speculative_config's JSON, the tier flags that go together.
    Run before anything starts; what needs the model or the machine (max_model_len, the tiers'
    directories and sizes) the workers still check, and serve exits 2 when one refuses."""
    if cfg.null_model:
        return None                      # null-model workers build no engine
    from gpu_worker.config import EngineConfig
    fields = engine_args_of(cfg) | {"model": cfg.model or str(default_model_dir())}
    if cfg.kv_offload_dir:      # as a worker gets it (_disk_tier_flags), for the overlap check
        fields["kv_offload_dir"] = str(Path(cfg.kv_offload_dir) / "worker-0")
    # the workers derive the shared tier's key from the trust directory; any key passes the check
    key = secrets.token_bytes(32) if cfg.kv_offload_shared_dir else None
    try:
        EngineConfig(**fields, kv_offload_shared_key=key)
    except ValueError as exc:
        return engine_error_text(str(exc))
    return None


def _redis_place(url: str) -> str:
    """Where a Redis URL points, without its password: host:port, or the socket path."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


def redis_url_problem(url: str, auth: RedisAuth) -> str | None:
    """Why the services could not use the Redis at --redis-url (one line naming the flag), or
    None: one PING within REDIS_CHECK_TIMEOUT_S, authenticated as the services will be. Without
    it, each child logs that Redis is unreachable and serve waits out --ready-timeout-s."""
    import redis.exceptions as rex

    async def ping() -> None:
        client = redis_connect(url, auth, REDIS_CHECK_TIMEOUT_S)
        try:
            await client.ping()
        finally:
            await client.aclose()
    place = _redis_place(url)
    try:
        asyncio.run(ping())
    except (rex.AuthenticationError, rex.AuthorizationError, rex.ResponseError) as exc:
        return (f"--redis-url: the Redis at {place} refused this stack ({exc}); give its password in the URL "
                "(redis://:PASSWORD@host:port/0) or through --trust-dir's redis.password")
    except (rex.ConnectionError, rex.TimeoutError, OSError) as exc:
        return (f"--redis-url: cannot reach Redis at {place} within {REDIS_CHECK_TIMEOUT_S:.0f} s ({exc}); "
                "start it or fix the URL, or leave --redis-url out to run an embedded Redis")
    return None


def ensure_model(model: str) -> str:
    """The model directory to serve (main has checked a given one); makes the built-in random
    model on first use."""
    if model:
        return model
    path = default_model_dir()
    if not (path / "config.json").is_file():
        log.info("no --model given: making a small random-weight model in %s (first run only)", path)
        from gpu_worker.make_model import main as make_model
        if make_model(["--arch", "llama", "--size", DEFAULT_MODEL_SIZE, str(path)]):
            raise SystemExit("kvmesh serve: could not make the built-in model")
    return str(path)


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _engine_flags(cfg: ServeConfig) -> list[str]:
    """The worker flags that reproduce serve's engine fields (defaults are left out: the workers
    have the same served defaults); the model and the device are given per worker."""
    return to_argv(ServedEngineArgs(**engine_args_of(cfg)), skip=("model", "device", "kv_offload_dir"))


def _pool_flags(cfg: ServeConfig) -> list[str]:
    """The worker flags of serve's worker-only fields (how KV moves between workers)."""
    return ["--kv-transport", cfg.kv_transport]


def _disk_tier_flags(cfg: ServeConfig, worker: str) -> list[str]:
    """A directory of its own under --kv-offload-dir for each worker (one engine per directory),
    named by its stable id, so a restarted worker finds the blocks it left."""
    return ["--kv-offload-dir", str(Path(cfg.kv_offload_dir) / worker)] if cfg.kv_offload_dir else []


def _prefix_cache_flags(cfg: ServeConfig) -> list[str]:
    """The prefix-cache flags of serve's engine fields: the index ignores a worker whose blocks
    are another size than its own."""
    return ["--block-size", str(cfg.block_size)]


def _scheduler_flags(cfg: ServeConfig) -> list[str]:
    """The scheduler flags of serve's routing fields."""
    return ["--routing", cfg.routing, "--pd-min-prefill-tokens", str(cfg.pd_min_prefill_tokens),
            "--route-conversation-ttl-s", str(cfg.route_conversation_ttl_s)]


class Stack:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.sup = Supervisor()
        self.redis_url = ""
        # Fresh keys for this stack's internal planes, in a private folder removed at stop: a
        # process of another user (or one started before this stack) holds none of them. With
        # --trust-dir, the operator's (kept: a shared KV tier's files stay readable next run).
        self.trust_dir: Path | None = None      # ours to remove at stop
        if cfg.trust_dir:
            self.trust = bundle.Paths(Path(cfg.trust_dir).resolve())
        else:
            self.trust_dir = Path(tempfile.mkdtemp(prefix="kvmesh-trust-"))
            self.trust = bundle.generate(self.trust_dir / "trust")
        self.redis_auth = RedisAuth.from_dir(self.trust.root)
        self._startup_exit: int | None = None     # the code of the child whose exit ended start-up

    def spawn(self, name: str, service: str, args: list[str], optional: bool = False) -> None:
        # the Redis URL through the environment, not argv: it may carry a password, and any local
        # user can read a process's argv (its environment only the same user)
        env = {**os.environ, "KVMESH_REDIS_URL": self.redis_url}
        self.sup.spawn(name, [sys.executable, "-m", "services.cli", service, *args], time.monotonic(), optional, env,
                       pooled=service == "worker")

    def start(self, model: str) -> None:
        cfg = self.cfg
        if cfg.redis_url:
            redis_url = cfg.redis_url
        else:
            redis = EmbeddedRedis(password=self.redis_auth.password).start()
            self.sup.watch_redis(redis, time.monotonic())
            redis_url = redis.url
        self.redis_url = redis_url
        common = ["--log-level", cfg.log_level, "--lease-ms", str(cfg.lease_ms),
                  "--heartbeat-ms", str(cfg.heartbeat_ms), "--trust-dir", str(self.trust.root)]
        internal = ["--host", "127.0.0.1", "--port", "0", "--zmq-port", "0"]
        if not cfg.text_in_gateway:
            self.spawn("tokenizer", "tokenizer", [*common, *internal, "--metrics-port", "0", "--model", model])
        self.spawn("scheduler", "scheduler", [*common, *internal, "--metrics-port", "0", *_scheduler_flags(cfg)])
        # the scheduler asks the prefix index only where it has a choice to make (several workers,
        # or prefill beside decode-only), so one worker runs without it
        index_asked = cfg.routing == "cache_aware" and cfg.workers + cfg.prefill_workers + cfg.decode_workers > 1
        if cfg.prefix_cache and index_asked and importlib.util.find_spec("prefix_cache_svc.main") is not None:
            self.spawn("prefix-cache", "prefix-cache", [*common, "--host", "127.0.0.1", "--port", "0",
                                                        "--metrics-port", "0", *_prefix_cache_flags(cfg)],
                       optional=True)
        elif cfg.prefix_cache and index_asked:
            log.info("prefix-cache service not installed; running without the cluster prefix index")
        gpus = _gpu_count() if cfg.device in ("auto", "cuda") and not cfg.null_model else 0
        pools = [("worker", "mixed", cfg.workers), ("prefill", "prefill", cfg.prefill_workers),
                 ("decode", "decode", cfg.decode_workers)]
        i = 0
        for prefix, role, count in pools:
            for k in range(count):
                device = f"cuda:{i % gpus}" if gpus > 1 else cfg.device
                # a restarted worker keeps its --worker-id: it registers again under a new epoch
                args = [*common, *internal, "--metrics-port", "0", "--model", model, "--device", device,
                        "--worker-id", f"{prefix}-{k}", "--role", role, *_pool_flags(cfg), *_engine_flags(cfg),
                        *_disk_tier_flags(cfg, f"{prefix}-{k}")]
                if cfg.served_model_name:
                    args += ["--served-model-name", ",".join(cfg.served_model_name)]
                if cfg.null_model:
                    args += ["--null-model", "--null-step-ms", str(cfg.null_step_ms)]
                self.spawn(f"{prefix}-{k}", "worker", args)
                i += 1
        gw = [*common, "--host", cfg.host, "--port", str(cfg.port), "--zmq-port", "0"]
        if cfg.text_in_gateway:
            gw += ["--text-in-gateway", "--model", model]
        if cfg.api_key:
            gw += ["--api-key", ",".join(cfg.api_key)]
        gw += ["--tool-call-parser", cfg.tool_call_parser, "--reasoning-parser", cfg.reasoning_parser]
        self.spawn("gateway", "gateway", gw)

    def wait_ready(self, url: str, timeout_s: float, stop: list[bool]) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop:
            if (exited := self.sup.exited_during_startup()) is not None:
                child, code = exited
                log.error("%s exited with %s during start-up", child.name, describe_exit(code))
                self._startup_exit = code
                return False
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                    # /ready needs one worker; the stack is ready when all of them are registered
                    if r.status == 200 and len(self.records("worker")) >= self.num_workers:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        if not stop:
            log.error("the stack was not ready within %.0f s", timeout_s)
        return False

    def startup_exit_code(self) -> int:
        """serve's exit code for a start-up that failed: 2 when a child refused its settings (a
        worker's tier directories or sizes, checked only once it knows its model), else 1."""
        return CONFIG_REFUSED if self._startup_exit == CONFIG_REFUSED else 1

    @property
    def num_workers(self) -> int:
        cfg = self.cfg
        return cfg.workers + cfg.prefill_workers + cfg.decode_workers

    def records(self, kind: str) -> list[ServiceRecord]:
        """The live registry records of one kind; none while Redis is busy or restarting."""
        try:
            return list_records(self.redis_url, kind, self.redis_auth)
        except Exception as exc:
            log.debug("could not list %s records: %s", kind, exc)
            return []

    def metrics_sources(self, url: str) -> list[Page]:
        """Every local service's /metrics page, from the registry (a restarted service has a new
        port); the gateway's is on its own port."""
        pages = [Page("gateway", "", f"{url}/metrics")]
        for kind in ("tokenizer", "scheduler", "prefix-cache", "worker"):
            for r in sorted(self.records(kind), key=lambda r: r.id):
                if "metrics" in r.addrs:
                    pages.append(Page(kind, r.id if kind == "worker" else "", r.addrs["metrics"]))
        return pages

    def metrics_pages(self, url: str) -> list[tuple[str, str]]:
        """(service, its /metrics URL) for every local service: a worker by its id."""
        return [(p.worker or p.service, p.url) for p in self.metrics_sources(url)]

    def supervise(self, stop: list[bool]) -> int:
        """Until Ctrl-C / SIGTERM (0) or a service that cannot be kept up (1)."""
        while not stop:
            if (reason := self.sup.tick(time.monotonic())) is not None:
                log.error("%s", reason)
                return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        self.sup.stop()
        if self.trust_dir is not None:
            shutil.rmtree(self.trust_dir, ignore_errors=True)


class BindProblem(NamedTuple):
    """Why host:port could not be bound, and whose fault that is."""

    host_is_bad: bool     # no such name, or not an address of this machine: no port would do
    why: str


def port_taken(host: str, port: int) -> BindProblem | None:
    """Why the gateway could not bind host:port now, or None. Binds the way uvicorn does
    (SO_REUSEADDR), so a port in TIME_WAIT counts as free."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
        return None
    except socket.gaierror as exc:
        return BindProblem(True, exc.strerror or str(exc))
    except OSError as exc:
        return BindProblem(exc.errno == errno.EADDRNOTAVAIL, exc.strerror or str(exc))


def gateway_bind_error(host: str, port: int) -> str | None:
    """One line naming the flag at fault when the gateway cannot listen on host:port, or None."""
    problem = port_taken(host, port)
    if problem is None:
        return None
    if problem.host_is_bad:
        return (f"--host {host}: cannot listen there ({problem.why}); give an address of this machine "
                "(127.0.0.1, or 0.0.0.0 for every interface)")
    return f"--port {port}: cannot listen on {host}:{port} ({problem.why}); stop what uses it or choose another --port"


def trust_dir_problem(trust_dir: str) -> str | None:
    """Why every role cannot load its keys from `trust_dir` (given), else None."""
    for role in bundle.ROLES if trust_dir else ():
        try:
            bundle.load(trust_dir, role)
        except (bundle.TrustError, OSError) as exc:
            return str(exc)
    return None


def served_name(cfg: ServeConfig, model: str) -> str:
    """The name clients send in `model`: the first --served-model-name, else the directory's name."""
    return cfg.served_model_name[0] if cfg.served_model_name else Path(model).name


def print_banner(name: str, url: str, pages: list[tuple[str, str]], fleet_port: int) -> None:
    width = max(len(page_name) for page_name, _ in pages)
    lines = [f"kvmesh is serving {name} at {url}/v1  (Ctrl-C to stop)"]
    if fleet_port > 0:
        lines.append(f"every service's metrics on one page: http://127.0.0.1:{fleet_port}/metrics  "
                     "(labelled service=, worker=)")
    lines += ["metrics (Prometheus; a restarted service logs its new port):",
             *(f"  {name:<{width}}  {page}" for name, page in pages)]
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    cfg = load_or_exit(ServeConfig, argv, "kvmesh serve")
    setup_logging("serve", cfg.log_level)
    if (error := gateway_bind_error(cfg.host, cfg.port)) is not None:
        print(f"kvmesh serve: {error}", file=sys.stderr)
        return 2
    if cfg.fleet_metrics_port > 0 and (taken := port_taken("127.0.0.1", cfg.fleet_metrics_port)) is not None:
        print(f"kvmesh serve: --fleet-metrics-port {cfg.fleet_metrics_port}: cannot listen on 127.0.0.1 "
              f"({taken.why}); choose another port, 0 for any free one, or -1 for none", file=sys.stderr)
        return 2
    if cfg.model and (error := model_dir_problem(cfg.model)) is not None:
        print(f"kvmesh serve: {error}", file=sys.stderr)
        return 2
    if (error := engine_settings_problem(cfg)) is not None:
        print(f"kvmesh serve: {error}", file=sys.stderr)
        return 2
    if (error := trust_dir_problem(cfg.trust_dir)) is not None:
        print(f"kvmesh serve: --trust-dir: {error}", file=sys.stderr)
        return 2
    model = ensure_model(cfg.model) if not (cfg.null_model and not cfg.model) else ensure_model("")
    stop: list[bool] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop.append(True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stack = Stack(cfg)
    url = f"http://{reachable_host(cfg.host)}:{cfg.port}"
    code = 1
    try:
        if cfg.redis_url and (error := redis_url_problem(cfg.redis_url, stack.redis_auth)) is not None:
            print(f"kvmesh serve: {error}", file=sys.stderr)
            return 2
        stack.start(model)
        if stack.wait_ready(url, cfg.ready_timeout_s, stop):
            # loopback only, whatever --host: the page shows every internal service's state
            fleet_port = serve_fleet_metrics("127.0.0.1", cfg.fleet_metrics_port, lambda: stack.metrics_sources(url))
            print_banner(served_name(cfg, model), url, stack.metrics_pages(url), fleet_port)
            code = stack.supervise(stop)
        elif stop:
            code = 0
        else:
            code = stack.startup_exit_code()
    finally:
        stack.stop()
    return code
