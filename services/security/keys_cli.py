"""`kvmesh keys`: make the trust material of the internal planes (services/security/bundle.py).

    kvmesh keys generate DIR                          a trust directory on disk (every role's keys)
    kvmesh keys k8s-secrets --namespace NS --prefix P one Kubernetes Secret per role, `P-trust-<role>`,
                                                      plus `P-trust-redis` for the Redis server

A role's Secret holds only what a pod of that role needs: its own CURVE secret key and TLS key,
every role's CURVE public key, the CA certificate and the Redis password. Secret keys are flat
(`curve-worker.secret`); the chart's volume `items:` map them back to the bundle's sub-paths
(`curve/worker.secret`), so a mounted Secret is a trust directory as it is.

k8s-secrets never replaces a Secret: when all of them exist it changes nothing (a re-run or a
`helm upgrade` keeps the keys); when only some exist it refuses, since a new bundle's keys would
not match the old ones.
"""
from __future__ import annotations

import argparse
import base64
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from services.security import bundle

# Every service keeps its membership in Redis (the gateway registers itself and finds tokenizers
# and schedulers there), so every role's Secret carries the Redis password.
REDIS_ROLES = bundle.ROLES
REDIS_SERVER = "redis"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 253


class SecretSpec(NamedTuple):
    name: str
    data: dict[str, bytes]      # flat Secret key -> file content


def flat_key(relative_path: str) -> str:
    """A bundle path as a Secret key: `curve/worker.secret` -> `curve-worker.secret`."""
    return relative_path.replace("/", "-")


def role_files(paths: bundle.Paths, role: str) -> list[Path]:
    """The bundle files a pod of `role` needs, and no other role's secret."""
    files = [paths.curve_public(r) for r in bundle.ROLES]
    files += [paths.curve_secret(role), paths.ca_cert, paths.tls_cert(role), paths.tls_key(role)]
    if role in REDIS_ROLES:
        files.append(paths.redis_password)
    return files


def redis_server_conf(password: bytes) -> bytes:
    """The redis.conf fragment the bundled Redis includes: the password stays off its argv."""
    if re.search(rb'["\\\s]', password):
        raise ValueError("the Redis password must not contain quotes, backslashes or spaces")
    return b'requirepass "' + password + b'"\n'


def secret_specs(paths: bundle.Paths, prefix: str) -> list[SecretSpec]:
    specs = []
    for role in bundle.ROLES:
        data = {flat_key(str(f.relative_to(paths.root))): f.read_bytes() for f in role_files(paths, role)}
        specs.append(SecretSpec(f"{prefix}-trust-{role}", data))
    password = paths.redis_password.read_bytes().strip()
    specs.append(SecretSpec(f"{prefix}-trust-{REDIS_SERVER}",
                            {"redis.password": password, "redis.conf": redis_server_conf(password)}))
    return specs


def manifest(spec: SecretSpec, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": spec.name, "namespace": namespace, "labels": labels},
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(spec.data.items())},
    }


def fresh_manifests(prefix: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """A new bundle, made in a private temporary directory that is gone when this returns."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-keys-") as tmp:
        paths = bundle.generate(Path(tmp) / "trust")
        return [manifest(s, namespace, labels) for s in secret_specs(paths, prefix)]


# ----------------------------------------------------------------------------- Kubernetes


def core_api() -> Any:
    """CoreV1Api with the pod's service-account token, or the kubeconfig outside a cluster."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


def secret_exists(api: Any, namespace: str, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        api.read_namespaced_secret(name, namespace)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


def create_secrets(api: Any, namespace: str, manifests: list[dict[str, Any]]) -> int:
    names = [m["metadata"]["name"] for m in manifests]
    present = [n for n in names if secret_exists(api, namespace, n)]
    if len(present) == len(names):
        print(f"kvmesh keys: all {len(names)} trust Secrets exist in namespace {namespace}; keys kept")
        return 0
    if present:
        print(f"kvmesh keys: only some trust Secrets exist in namespace {namespace} ({', '.join(present)}); "
              f"new keys would not match them. Delete all of them to make a new set:\n"
              f"  kubectl -n {namespace} delete secret {' '.join(names)}", file=sys.stderr)
        return 1
    from kubernetes.client.exceptions import ApiException

    for m in manifests:
        try:
            api.create_namespaced_secret(namespace, m)
        except ApiException as exc:
            if exc.status != 409:
                raise
            print(f"kvmesh keys: Secret {namespace}/{m['metadata']['name']} appeared while this run created the "
                  f"set (another run at the same time?); run again to check the set", file=sys.stderr)
            return 1
        print(f"kvmesh keys: created Secret {namespace}/{m['metadata']['name']}")
    return 0


# ----------------------------------------------------------------------------- command line


def _dns_label(flag: str, max_len: int):
    def check(value: str) -> str:
        if not DNS_LABEL.fullmatch(value) or len(value) > max_len:
            raise argparse.ArgumentTypeError(
                f"{flag} {value!r}: lowercase letters, digits and '-', starting and ending with a letter "
                f"or digit, at most {max_len} characters")
        return value
    return check


def _label(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label {value!r}: expected KEY=VALUE")
    return key, val


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh keys", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write a new trust directory (every role's keys) to DIR")
    gen.add_argument("dir", metavar="DIR", help="directory to create (0700)")
    gen.add_argument("--force", action="store_true",
                     help="replace the keys of an existing directory (other files in it are left alone)")
    k8s = sub.add_parser("k8s-secrets", help="create one Secret per role through the Kubernetes API")
    k8s.add_argument("--namespace", required=True, type=_dns_label("--namespace", 63), help="namespace of the Secrets")
    k8s.add_argument("--prefix", required=True, type=_dns_label("--prefix", MAX_NAME - len("-trust-prefix-cache")),
                     help="Secret names are PREFIX-trust-<role> (the chart passes its fullname)")
    k8s.add_argument("--label", action="append", default=[], type=_label, metavar="KEY=VALUE",
                     help="label on every Secret (repeatable)")
    k8s.add_argument("--dry-run", action="store_true", help="print the Secret manifests as YAML; create nothing")
    return p


def generate_dir(target: Path, force: bool) -> int:
    if target.exists() and not force:
        print(f"kvmesh keys generate: {target} exists; pass --force to replace its keys", file=sys.stderr)
        return 2
    try:
        paths = bundle.generate(target)
    except OSError as exc:       # a parent that is a file, a read-only filesystem, no permission
        print(f"kvmesh keys generate: DIR {target} cannot be written ({exc.strerror or exc}); "
              "give a directory this user can create", file=sys.stderr)
        return 2
    print(f"kvmesh keys: wrote a trust directory for {', '.join(bundle.ROLES)} to {paths.root}")
    return 0


def k8s_secrets(args: argparse.Namespace) -> int:
    labels = {"app.kubernetes.io/managed-by": "kvmesh-keys", **dict(args.label)}
    manifests = fresh_manifests(args.prefix, args.namespace, labels)
    if args.dry_run:
        import yaml

        sys.stdout.write(yaml.safe_dump_all(manifests, sort_keys=False))
        return 0
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        return create_secrets(core_api(), args.namespace, manifests)
    except ConfigException as exc:
        print(f"kvmesh keys: no Kubernetes credentials (not in a pod, no kubeconfig): {exc}", file=sys.stderr)
    except ApiException as exc:
        print(f"kvmesh keys: the Kubernetes API refused ({exc.status} {exc.reason}); the service account "
              f"needs get and create on secrets in namespace {args.namespace}", file=sys.stderr)
    except (HTTPError, OSError) as exc:
        print(f"kvmesh keys: cannot reach the Kubernetes API: {exc}", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "generate":
        return generate_dir(Path(args.dir), args.force)
    return k8s_secrets(args)
