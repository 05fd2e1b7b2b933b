"""The processes of `kvmesh serve`: start them, restart the ones that exit, stop them in order.

    sup = Supervisor()
    sup.spawn("worker-0", ["python", "-m", "services.cli", "worker", ...])
    sup.spawn("prefix-cache", [...], optional=True)
    reason = sup.tick(time.monotonic())   # every ~0.2 s: restarts what is due; a reason to stop, or None
    sup.stop()                            # gateway first, then workers, then the rest; bounded

A child that exits on its own (any code, 0 included: nothing but `kvmesh serve` asks a child to
stop) is reported in one line and started again with the same command after the back-off of
services.restart_policy. Exit code 2 is the services' "configuration refused" (a flag, or an engine
setting the model cannot take): that will not heal, so it is never restarted. A crash loop or a
refused configuration stops the stack with the reason, or, for an optional child, goes on without it.
A worker (`pooled`: one of a pool the others keep serving) is never given up on for a crash loop: it
is restarted every MAX_DELAY_S while it lasts, as Kubernetes backs off a crash-looping pod, so a
request that kills its worker, or a burst of OOM kills, cannot stop the stack; its refused
configuration stops the stack like any other's.

The embedded Redis is watched the same way (`watch_redis`) and restarted on its own port.
"""
from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field, fields

from services.config import GatewayConfig
from services.embedded_redis import EmbeddedRedis, die_with_parent
from services.restart_policy import MAX_DELAY_S, GiveUp, RestartPolicy, describe_exit

log = logging.getLogger("kvmesh.serve")
CONFIG_REFUSED = 2        # load_or_exit's and the worker's exit code for a refused setting
# the gateway lets its streams finish for up to --shutdown-grace-s (default), then ends those left
GATEWAY_STOP_S = next(f.default for f in fields(GatewayConfig) if f.name == "shutdown_grace_s") + 2.0
STOP_TIMEOUT_S = 10.0     # then everything else, together


@dataclass
class Child:
    name: str
    cmd: list[str]
    optional: bool = False
    env: dict[str, str] | None = None     # the child's whole environment (None: this process's)
    pooled: bool = False                  # a worker: a crash loop restarts it every MAX_DELAY_S
    proc: subprocess.Popen | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restart_at: float | None = None       # set while the child waits out its back-off

    @property
    def stop_rank(self) -> int:
        """Stop order: the gateway first (no new requests), then the workers, then what they use."""
        return 0 if self.name == "gateway" else 1 if self.pooled else 2


@dataclass
class RedisWatch:
    server: EmbeddedRedis
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restart_at: float | None = None


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.redis: RedisWatch | None = None

    def spawn(self, name: str, cmd: list[str], now: float, optional: bool = False,
              env: dict[str, str] | None = None, pooled: bool = False) -> Child:
        child = Child(name, cmd, optional, env, pooled)
        self.children.append(child)
        self._launch(child, now)
        return child

    def watch_redis(self, server: EmbeddedRedis, now: float) -> None:
        self.redis = RedisWatch(server)
        self.redis.policy.started(now)

    def _launch(self, child: Child, now: float) -> None:
        child.proc = subprocess.Popen(child.cmd, preexec_fn=die_with_parent, env=child.env)
        child.policy.started(now)
        child.restart_at = None
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def exited_during_startup(self) -> tuple[Child, int] | None:
        """Start-up is not retried: the first required child to exit, with its code. An optional one
        that exits is dropped."""
        for child in list(self.children):
            code = child.proc.poll() if child.proc else None
            if code is None:
                continue
            if child.optional:
                log.warning("%s exited with %s; continuing without it", child.name, describe_exit(code))
                self.children.remove(child)
                continue
            return child, code
        return None

    def tick(self, now: float) -> str | None:
        """Restart what is due, schedule restarts for what exited. Returns why the stack must stop."""
        if (reason := self._tick_redis(now)) is not None:
            return reason
        for child in list(self.children):
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._launch(child, now)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            decision = (GiveUp("its configuration was refused (see its log above)") if code == CONFIG_REFUSED
                        else child.policy.exited(now))
            what = f"{child.name} (pid {child.proc.pid}) exited with {describe_exit(code)}"
            if isinstance(decision, GiveUp) and child.pooled and code != CONFIG_REFUSED:
                log.error("%s: %s; restarting it every %.0f s while it lasts (the other workers serve meanwhile)",
                          what, decision.reason, MAX_DELAY_S)
                child.restart_at = now + MAX_DELAY_S
                continue
            if isinstance(decision, GiveUp):
                if not child.optional:
                    return f"{what}: {decision.reason}; stopping the stack"
                log.error("%s: %s; continuing without it", what, decision.reason)
                self.children.remove(child)
                continue
            log.warning("%s; restarting it in %.1f s", what, decision.delay_s)
            child.restart_at = now + decision.delay_s
        return None

    def _tick_redis(self, now: float) -> str | None:
        watch = self.redis
        if watch is None:
            return None
        if watch.restart_at is not None:
            if now < watch.restart_at:
                return None
            watch.restart_at = None
            try:
                watch.server.start()      # the same object: same port, same settings
                watch.policy.started(now)
                log.warning("embedded Redis restarted on %s; the services register again on their next heartbeat",
                            watch.server.url)
                return None
            except RuntimeError as exc:
                log.error("embedded Redis did not restart: %s", exc)
        elif watch.server.alive():
            return None
        else:
            log.warning("embedded Redis (pid %s) exited", watch.server.pid)
        watch.server.stop()               # reap it and drop its folder; start() makes a fresh one
        decision = watch.policy.exited(now)
        if isinstance(decision, GiveUp):
            return f"the embedded Redis on {watch.server.url} could not be kept up: {decision.reason}; stopping the stack"
        log.warning("restarting the embedded Redis in %.1f s", decision.delay_s)
        watch.restart_at = now + decision.delay_s
        return None

    def stop(self) -> None:
        """SIGTERM in order, each group bounded; whatever is still up at its deadline is killed."""
        running = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        first = [c for c in running if c.stop_rank == 0]
        rest = sorted((c for c in running if c.stop_rank > 0), key=lambda c: c.stop_rank)
        for group, timeout_s in ((first, GATEWAY_STOP_S), (rest, STOP_TIMEOUT_S)):
            for child in group:
                child.proc.terminate()
            deadline = time.monotonic() + timeout_s
            for child in group:
                try:
                    child.proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", child.name)
                    child.proc.kill()
                    child.proc.wait()
        if self.redis is not None:
            self.redis.server.stop()
