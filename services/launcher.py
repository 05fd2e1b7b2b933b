"""`kvmesh serve`: the whole stack on this machine, each service its own process.

    embedded Redis (unless --redis-url) -> tokenizer, scheduler, [prefix-cache], N workers -> gateway

Waits until the gateway's /ready answers, prints the URL, then watches: Ctrl-C / SIGTERM stops
everything (gateway first, Redis last); a service that exits on its own is reported and the
stack stops with a nonzero code (never hangs). The optional prefix-cache index may fail alone.
Children get SIGTERM if this process dies (PR_SET_PDEATHSIG on Linux).
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.config import EngineSettings, ServeConfig, load_or_exit, reachable_host, to_argv
from services.embedded_redis import EmbeddedRedis
from services.redis_client import RedisAuth
from services.registry import Registry
from services.security import bundle
from services.logging import setup as setup_logging

log = logging.getLogger("kvmesh.serve")
DEFAULT_MODEL_SIZE = "tiny"
STOP_TIMEOUT_S = 10.0


def default_model_dir() -> Path:
    base = Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")
    return base / "models" / f"llama-{DEFAULT_MODEL_SIZE}"


def ensure_model(model: str) -> str:
    """The model directory to serve; makes the built-in random model on first use."""
    if model:
        if not (Path(model) / "config.json").is_file():
            raise SystemExit(f"kvmesh serve: {model} is not a model directory (no config.json)")
        return model
    path = default_model_dir()
    if not (path / "config.json").is_file():
        log.info("no --model given: making a small random-weight model in %s (first run only)", path)
        from gpu_worker.make_model import main as make_model
        if make_model(["--arch", "llama", "--size", DEFAULT_MODEL_SIZE, str(path)]):
            raise SystemExit("kvmesh serve: could not make the built-in model")
    return str(path)


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    optional: bool = False


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _engine_flags(cfg: ServeConfig) -> list[str]:
    """The worker flags that reproduce serve's engine settings (EngineSettings, the fields both
    configs share; defaults are left out, as the workers have the same ones)."""
    return to_argv(EngineSettings(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(EngineSettings)}))


class Stack:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self.redis: EmbeddedRedis | None = None
        self.redis_url = ""
        # Fresh keys for this stack's internal planes, in a private folder removed at stop: a
        # process of another user (or one started before this stack) holds none of them.
        self.trust_dir = Path(tempfile.mkdtemp(prefix="kvmesh-trust-"))
        self.trust = bundle.generate(self.trust_dir / "trust")
        self.redis_auth = RedisAuth.from_dir(self.trust.root)

    def spawn(self, name: str, service: str, args: list[str], optional: bool = False) -> None:
        cmd = [sys.executable, "-m", "services.cli", service, *args]
        # the Redis URL through the environment, not argv: it may carry a password, and any local
        # user can read a process's argv (its environment only the same user)
        env = {**os.environ, "KVMESH_REDIS_URL": self.redis_url}
        proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=env)
        self.children.append(Child(name, proc, optional))
        log.info("started %s (pid %d)", name, proc.pid)

    def start(self, model: str) -> None:
        cfg = self.cfg
        if cfg.redis_url:
            redis_url = cfg.redis_url
        else:
            self.redis = EmbeddedRedis(password=self.redis_auth.password).start()
            redis_url = self.redis.url
        self.redis_url = redis_url
        common = ["--log-level", cfg.log_level, "--lease-ms", str(cfg.lease_ms),
                  "--heartbeat-ms", str(cfg.heartbeat_ms), "--trust-dir", str(self.trust.root)]
        internal = ["--host", "127.0.0.1", "--port", "0", "--zmq-port", "0"]
        self.spawn("tokenizer", "tokenizer", [*common, *internal, "--metrics-port", "0", "--model", model])
        self.spawn("scheduler", "scheduler", [*common, *internal, "--metrics-port", "0", "--routing", cfg.routing])
        if cfg.prefix_cache and importlib.util.find_spec("prefix_cache_svc.main") is not None:
            self.spawn("prefix-cache", "prefix-cache", [*common, "--host", "127.0.0.1", "--port", "0",
                                                        "--metrics-port", "0"], optional=True)
        elif cfg.prefix_cache:
            log.info("prefix-cache service not installed; running without the cluster prefix index")
        gpus = _gpu_count() if cfg.device in ("auto", "cuda") and not cfg.null_model else 0
        for i in range(cfg.workers):
            device = f"cuda:{i % gpus}" if gpus > 1 else cfg.device
            args = [*common, *internal, "--metrics-port", "0", "--model", model, "--device", device,
                    "--worker-id", f"worker-{i}", *_engine_flags(cfg)]
            if cfg.served_model_name:
                args += ["--served-model-name", ",".join(cfg.served_model_name)]
            if cfg.null_model:
                args += ["--null-model", "--null-step-ms", str(cfg.null_step_ms)]
            self.spawn(f"worker-{i}", "worker", args)
        gw = [*common, "--host", cfg.host, "--port", str(cfg.port), "--zmq-port", "0"]
        if cfg.tokenize_in_gateway:
            gw += ["--local-tokenizer", model]
            if cfg.detokenize_in_gateway:
                gw += ["--local-detokenizer"]
        if cfg.api_key:
            gw += ["--api-key", ",".join(cfg.api_key)]
        self.spawn("gateway", "gateway", gw)

    def crashed(self) -> Child | None:
        for child in list(self.children):
            if child.proc.poll() is not None:
                if child.optional:
                    log.warning("%s exited with code %s; continuing without it", child.name, child.proc.returncode)
                    self.children.remove(child)
                    continue
                return child
        return None

    def wait_ready(self, url: str, timeout_s: float, stop: list[bool]) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop:
            if (child := self.crashed()) is not None:
                log.error("%s exited with code %s during start-up", child.name, child.proc.returncode)
                return False
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                    # /ready needs one worker; the stack is ready when all of them are registered
                    if r.status == 200 and self.workers_registered() >= self.cfg.workers:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        if not stop:
            log.error("the stack was not ready within %.0f s", timeout_s)
        return False

    def workers_registered(self) -> int:
        """Workers holding a live lease in Redis now."""
        async def count() -> int:
            registry = Registry(self.redis_url, self.redis_auth)
            try:
                return len(await registry.list("worker"))
            finally:
                await registry.close()
        try:
            return asyncio.run(count())
        except Exception as exc:   # Redis busy or restarting: not ready yet
            log.debug("could not count workers: %s", exc)
            return 0

    def stop(self) -> None:
        order = sorted(self.children, key=lambda c: 0 if c.name == "gateway" else 1 if c.name.startswith("worker") else 2)
        for child in order:
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in order:
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
                child.proc.kill()
                child.proc.wait()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.trust_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    cfg = load_or_exit(ServeConfig, argv, "kvmesh serve")
    setup_logging("serve", cfg.log_level)
    model = ensure_model(cfg.model) if not (cfg.null_model and not cfg.model) else ensure_model("")
    stop: list[bool] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop.append(True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stack = Stack(cfg)
    host = reachable_host(cfg.host)
    url = f"http://{host}:{cfg.port}"
    code = 1
    try:
        stack.start(model)
        if stack.wait_ready(url, cfg.ready_timeout_s, stop):
            print(f"kvmesh is serving {Path(model).name} at {url}/v1  (Ctrl-C to stop)", flush=True)
            code = 0
            while not stop:
                if (child := stack.crashed()) is not None:
                    log.error("%s exited with code %s; stopping the stack", child.name, child.proc.returncode)
                    code = 1
                    break
                time.sleep(0.2)
        elif stop:
            code = 0
    finally:
        stack.stop()
    return code
