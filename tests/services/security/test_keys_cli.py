"""`kvmesh keys`: the trust directory on disk, and the per-role Kubernetes Secrets created through
the Kubernetes API. No API server runs here, so the test serves the two Secret endpoints the
command uses (read, create) from a small HTTP emulator on 127.0.0.1 and points a kubeconfig at it;
the command runs as its own process, as it does in the chart's hook Job.
"""
from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
import zmq

from services.security import bundle

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "emulator-token-1"
NAMESPACE = "llm"
PREFIX = "prod-kvmesh"
SECRET_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets(?:/([^/?]+))?(?:\?.*)?$")


class SecretsEmulator:
    """The Secret read/create part of the Kubernetes API, with bearer-token authentication."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.created_elsewhere: set[str] = set()   # names another client creates between our GET and POST
        self.lock = threading.Lock()
        emulator = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str) -> None:
                self._reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "reason": reason, "code": code, "message": reason})

            def _route(self, method: str) -> tuple[str, str | None] | None:
                with emulator.lock:
                    emulator.requests.append((method, self.path))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._status(401, "Unauthorized")
                    return None
                m = SECRET_PATH.match(self.path)
                if not m:
                    self._status(404, "NotFound")
                    return None
                return m.group(1), m.group(2)

            def do_GET(self) -> None:
                route = self._route("GET")
                if route is None:
                    return
                with emulator.lock:
                    found = emulator.secrets.get(route)
                self._reply(200, found) if found else self._status(404, "NotFound")

            def do_POST(self) -> None:
                route = self._route("POST")
                if route is None:
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = (route[0], body["metadata"]["name"])
                with emulator.lock:
                    if key[1] in emulator.created_elsewhere:
                        emulator.secrets[key] = {**body, "data": {}}
                    if key in emulator.secrets:
                        return self._status(409, "AlreadyExists")
                    emulator.secrets[key] = body
                self._reply(201, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def posts(self) -> int:
        return sum(1 for method, _ in self.requests if method == "POST")

    def data(self, name: str) -> dict[str, bytes]:
        secret = self.secrets[(NAMESPACE, name)]
        return {k: base64.b64decode(v) for k, v in secret["data"].items()}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def emulator():
    emu = SecretsEmulator()
    yield emu
    emu.close()


def kubeconfig(tmp_path: Path, server: str, token: str = TOKEN) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": server}}],
        "users": [{"name": "emu", "user": {"token": token}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": NAMESPACE}}],
    }))
    return path


def kvmesh_keys(*args: str, config: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(PYTHONPATH=str(ROOT), NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    if config is not None:
        env["KUBECONFIG"] = str(config)
    return subprocess.run([sys.executable, "-m", "services.cli", "keys", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


def k8s_secrets(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return kvmesh_keys("k8s-secrets", "--namespace", NAMESPACE, "--prefix", PREFIX, *extra, config=config)


def as_trust_dir(data: dict[str, bytes], root: Path) -> Path:
    """Lay a role Secret out as the chart's volume `items:` do: `curve-worker.secret` ->
    `curve/worker.secret`, `tls-ca.crt` -> `tls/ca.crt`."""
    for key, content in data.items():
        head, _, tail = key.partition("-")
        rel = f"{head}/{tail}" if head in ("curve", "tls") else key
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(0o600)
    return root


# ----------------------------------------------------------------------------- generate


def test_generate_writes_a_loadable_directory_and_refuses_to_overwrite(tmp_path):
    target = tmp_path / "trust"
    out = kvmesh_keys("generate", str(target))
    assert out.returncode == 0, out.stderr
    for role in bundle.ROLES:
        trust = bundle.load(target, role)
        assert zmq.curve_public(trust.curve_secret) == trust.curve_public
    assert target.stat().st_mode & 0o077 == 0
    before = (target / "curve" / "worker.secret").read_bytes()

    again = kvmesh_keys("generate", str(target))
    assert again.returncode == 2 and "--force" in again.stderr   # a usage error, as a bad flag
    assert (target / "curve" / "worker.secret").read_bytes() == before

    forced = kvmesh_keys("generate", str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (target / "curve" / "worker.secret").read_bytes() != before
    bundle.load(target, "worker")


def test_generate_force_leaves_no_secret_readable_by_others(tmp_path):
    """--force over a directory whose files and directories were loosened (chmod 644, 777) writes
    the new secrets 0600 under 0700 directories, not into the old modes."""
    target = tmp_path / "trust"
    assert kvmesh_keys("generate", str(target)).returncode == 0
    for path in [target, *target.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o644)

    forced = kvmesh_keys("generate", str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    loose = [str(p) for p in [target, *target.rglob("*")] if p.stat().st_mode & 0o077]
    assert loose == []
    bundle.load(target, "worker")


def test_generate_does_not_write_through_a_planted_symlink(tmp_path):
    target = tmp_path / "trust"
    assert kvmesh_keys("generate", str(target)).returncode == 0
    bait = tmp_path / "bait"
    bait.write_text("")
    (target / "redis.password").unlink()
    (target / "redis.password").symlink_to(bait)

    forced = kvmesh_keys("generate", str(target), "--force")
    assert forced.returncode != 0
    assert bait.read_text() == ""


@pytest.mark.parametrize("where", ["", "curve", "tls"])
def test_load_refuses_a_trust_directory_others_may_write(tmp_path, where):
    """Secrets 0600 are no protection in a directory others may write: they could swap the keys
    (and the Redis password) for their own. A Kubernetes Secret volume (`..data`) is the kubelet's."""
    target = tmp_path / "trust"
    bundle.generate(target)
    (target / where).chmod(0o777 if where else 0o757)
    with pytest.raises(bundle.TrustError, match="writable by other users"):
        bundle.load(target, "worker")
    (target / "..data").mkdir()
    bundle.load(target, "worker")


def test_generate_into_a_dir_that_cannot_be_made_is_one_line_exit_2(tmp_path, capsys):
    from services.security.keys_cli import main
    (tmp_path / "file").write_text("x")
    assert main(["generate", str(tmp_path / "file" / "trust")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvmesh keys generate: DIR {tmp_path / 'file' / 'trust'}") and "\n" not in err


# ----------------------------------------------------------------------------- k8s-secrets


def test_k8s_secrets_one_secret_per_role_with_only_that_roles_keys(emulator, tmp_path):
    out = k8s_secrets(kubeconfig(tmp_path, emulator.url), "--label", "app.kubernetes.io/instance=prod")
    assert out.returncode == 0, out.stderr
    names = {name for (_, name) in emulator.secrets}
    assert names == {f"{PREFIX}-trust-{r}" for r in (*bundle.ROLES, "redis")}
    for (ns, name), secret in emulator.secrets.items():
        assert ns == NAMESPACE and secret["metadata"]["labels"]["app.kubernetes.io/instance"] == "prod"

    publics = {f"curve-{r}.public" for r in bundle.ROLES}
    password = emulator.data(f"{PREFIX}-trust-redis")["redis.password"]
    for role in bundle.ROLES:
        data = emulator.data(f"{PREFIX}-trust-{role}")
        assert set(data) == publics | {f"curve-{role}.secret", "tls-ca.crt", f"tls-{role}.crt", f"tls-{role}.key",
                                       "redis.password"}, role
        assert data["redis.password"] == password
        # What the pod of this role sees, mounted through the chart's items mapping, is a trust
        # directory of that role: its keys pair up and every public key is everyone's.
        trust = bundle.load(as_trust_dir(data, tmp_path / f"mnt-{role}"), role)
        assert zmq.curve_public(trust.curve_secret) == trust.curve_public
        for other in bundle.ROLES:
            if other != role:
                assert not any(k.startswith((f"curve-{other}.secret", f"tls-{other}.")) for k in data), (role, other)
    worker, gateway = emulator.data(f"{PREFIX}-trust-worker"), emulator.data(f"{PREFIX}-trust-gateway")
    assert worker["curve-gateway.public"] == gateway["curve-gateway.public"]
    assert worker["tls-ca.crt"] == gateway["tls-ca.crt"]

    redis = emulator.data(f"{PREFIX}-trust-redis")
    assert set(redis) == {"redis.password", "redis.conf"}
    assert redis["redis.conf"] == b'requirepass "' + password + b'"\n'


def test_k8s_secrets_is_idempotent_and_refuses_a_partial_set(emulator, tmp_path):
    config = kubeconfig(tmp_path, emulator.url)
    assert k8s_secrets(config).returncode == 0
    first = {name: emulator.data(name) for (_, name) in emulator.secrets}
    posts = emulator.posts()

    rerun = k8s_secrets(config)  # a helm upgrade runs the hook again: the keys stay
    assert rerun.returncode == 0, rerun.stderr
    assert "keys kept" in rerun.stdout
    assert emulator.posts() == posts
    assert {name: emulator.data(name) for (_, name) in emulator.secrets} == first

    del emulator.secrets[(NAMESPACE, f"{PREFIX}-trust-worker")]
    partial = k8s_secrets(config)
    assert partial.returncode == 1
    assert "only some trust Secrets exist" in partial.stderr and "kubectl -n llm delete secret" in partial.stderr
    assert emulator.posts() == posts
    assert (NAMESPACE, f"{PREFIX}-trust-worker") not in emulator.secrets


def test_k8s_secrets_stops_when_another_run_creates_the_same_set(emulator, tmp_path):
    emulator.created_elsewhere.add(f"{PREFIX}-trust-tokenizer")
    out = k8s_secrets(kubeconfig(tmp_path, emulator.url))
    assert out.returncode == 1 and "appeared while this run created the set" in out.stderr
    assert "Traceback" not in out.stderr
    created = {name for (_, name) in emulator.secrets}
    assert f"{PREFIX}-trust-prefix-cache" not in created   # it stopped at the conflict


def test_k8s_secrets_reports_a_refusal_clearly(emulator, tmp_path):
    out = k8s_secrets(kubeconfig(tmp_path, emulator.url, token="wrong"))
    assert out.returncode == 1
    assert "refused (401" in out.stderr and "get and create on secrets" in out.stderr
    assert "Traceback" not in out.stderr
    assert not emulator.secrets


def test_k8s_secrets_dry_run_prints_manifests_and_calls_nothing(emulator, tmp_path):
    out = k8s_secrets(kubeconfig(tmp_path, emulator.url), "--dry-run")
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["metadata"]["name"] for d in docs] == [f"{PREFIX}-trust-{r}" for r in (*bundle.ROLES, "redis")]
    assert all(d["kind"] == "Secret" and d["metadata"]["namespace"] == NAMESPACE for d in docs)
    assert not emulator.requests


@pytest.mark.parametrize("flag,value", [("--prefix", "Prod_Kvmesh"), ("--namespace", "Llm"), ("--prefix", "x" * 300)])
def test_k8s_secrets_rejects_bad_names(flag, value, tmp_path):
    args = {"--namespace": NAMESPACE, "--prefix": PREFIX, flag: value}
    out = kvmesh_keys("k8s-secrets", *[x for kv in args.items() for x in kv], "--dry-run")
    assert out.returncode == 2 and flag in out.stderr
