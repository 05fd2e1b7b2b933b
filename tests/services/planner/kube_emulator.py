"""A Kubernetes API emulator and a Prometheus query endpoint for the planner's tests, both on
127.0.0.1 (no API server runs here).

The emulator serves what the official client calls for a Deployment's or a StatefulSet's scale
subresource: GET and PATCH /apis/apps/v1/namespaces/{ns}/{deployments|statefulsets}/{name}/scale
(JSON merge patch or strategic merge patch of spec.replicas), plus /version and the apps/v1
discovery document. A workload asked for under the other kind is not found, as on an API server.
It checks the bearer token the kubeconfig carries and records every PATCH.
"""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import yaml

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([a-z0-9-]+)/(deployments|statefulsets)/([a-z0-9.-]+)/scale$")
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
TOKEN = "planner-test-token"


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _serve(handler: type[BaseHTTPRequestHandler]) -> _Server:
    server = _Server(("127.0.0.1", 0), handler)
    # a short poll: close() (shutdown) waits up to one poll interval
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


class KubeEmulator:
    def __init__(self, namespace: str, replicas: dict[str, int], statefulsets: frozenset[str] = frozenset()) -> None:
        self.namespace = namespace
        self.replicas = dict(replicas)          # workload name -> spec.replicas
        self.statefulsets = statefulsets        # the names of `replicas` that are StatefulSets, not Deployments
        self.patches: list[tuple[float, str, dict, str]] = []   # (time, workload, body, content type)
        self.reads: list[tuple[float, str]] = []                 # (time, workload): GETs of a scale
        self.lock = threading.Lock()
        self.server = _serve(self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "planner", "user": {"token": TOKEN}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "planner",
                                                          "namespace": self.namespace}}]}))
        return path

    def scale(self, name: str) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": "1"},
                "spec": {"replicas": self.replicas[name]},
                "status": {"replicas": self.replicas[name], "selector": f"app={name}"}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        emu = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def status(self, code: int, reason: str, message: str) -> None:
                self.reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                  "reason": reason, "message": message})

            def target(self) -> str | None:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.status(401, "Unauthorized", "Unauthorized")
                    return None
                m = SCALE_PATH.match(self.path.split("?")[0])
                if not m:
                    self.status(404, "NotFound", f"the server could not find the requested resource {self.path}")
                    return None
                ns, resource, name = m.groups()
                kind = "statefulsets" if name in emu.statefulsets else "deployments"
                if ns != emu.namespace or name not in emu.replicas or resource != kind:
                    self.status(404, "NotFound", f'{resource}.apps "{name}" not found')
                    return None
                return name

            def do_GET(self) -> None:
                if self.path == "/version":
                    return self.reply(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0-emulator"})
                if self.path == "/apis/apps/v1":
                    return self.reply(200, {"kind": "APIResourceList", "groupVersion": "apps/v1", "resources": [
                        {"name": "deployments", "namespaced": True, "kind": "Deployment",
                         "verbs": ["get", "list", "patch"]},
                        {"name": "deployments/scale", "namespaced": True, "group": "autoscaling",
                         "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]},
                        {"name": "statefulsets", "namespaced": True, "kind": "StatefulSet",
                         "verbs": ["get", "list", "patch"]},
                        {"name": "statefulsets/scale", "namespaced": True, "group": "autoscaling",
                         "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]}]})
                if (name := self.target()) is not None:
                    with emu.lock:
                        emu.reads.append((time.monotonic(), name))
                        self.reply(200, emu.scale(name))

            def do_PATCH(self) -> None:
                if (name := self.target()) is None:
                    return
                kind = self.headers.get("Content-Type", "")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"null")
                if kind not in PATCH_TYPES:
                    return self.status(415, "UnsupportedMediaType", f"patch type {kind} is not served here")
                replicas = (body or {}).get("spec", {}).get("replicas") if isinstance(body, dict) else None
                if not isinstance(replicas, int) or replicas < 0:
                    return self.status(422, "Invalid", "spec.replicas: must be a non-negative integer")
                with emu.lock:
                    emu.replicas[name] = replicas
                    emu.patches.append((time.monotonic(), name, body, kind))
                    self.reply(200, emu.scale(name))

        return Handler


class FakePrometheus:
    """/api/v1/query: each query is answered by the first `answers` entry whose key is in its text
    (a metric name), with one sample, an empty vector (None) or NaN. Records every query."""

    def __init__(self, answers: Callable[[], dict[str, float | None]]) -> None:
        self.answers = answers
        self.queries: list[str] = []
        self.server = _serve(self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        prom = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                from urllib.parse import parse_qs, urlparse
                url = urlparse(self.path)
                if url.path != "/api/v1/query":
                    self.send_error(404)
                    return
                query = parse_qs(url.query).get("query", [""])[0]
                prom.queries.append(query)
                value = next((v for k, v in prom.answers().items() if k in query), None)
                result = [] if value is None else [{"metric": {}, "value": [time.time(), repr(float(value))]}]
                data = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
