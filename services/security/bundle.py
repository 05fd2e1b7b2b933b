"""A trust directory: every secret the internal planes need, one file each, owner-only.

    <trust_dir>/
      redis.password               Redis AUTH password (every role that talks to Redis reads it)
      curve/<role>.public          Z85 CURVE public key of each role (every process reads all of them)
      curve/<role>.secret          Z85 CURVE secret key of one role (a pod mounts only its own)
      tls/ca.crt                   the CA that signed every role's certificate (PEM)
      tls/<role>.crt, <role>.key   a role's certificate (CN and DNS SAN `kvmesh-<role>`) and its key

Roles are per service, not per process: every worker holds the worker key. A peer proves its role
by holding the role's secret (the CURVE handshake, the TLS client certificate); what a role may
send is checked by the receiver (services/security/curve.py names the sender's role per message).
The worker secret also keys the MAC of the shared KV tier's files (`shared_kv_key`): every worker
of a deployment, and nothing else, can write a block another worker accepts.

`kvmesh serve` makes a fresh one in a private temporary folder at start (`generate`); on Kubernetes
`kvmesh keys generate` makes one that the chart mounts from Secrets, a role's secret only into
that role's pods. Nothing here is ever sent on a socket.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import secrets
from pathlib import Path
from typing import NamedTuple

import zmq

ROLES = ("gateway", "scheduler", "tokenizer", "prefix-cache", "worker")
CERT_DAYS = 3650


def tls_name(role: str) -> str:
    """The DNS name a role's certificate carries; clients check the server's certificate against it
    (grpc.ssl_target_name_override), so a pod IP from Redis needs no certificate of its own."""
    return f"kvmesh-{role}"


class Paths(NamedTuple):
    root: Path

    @property
    def redis_password(self) -> Path:
        return self.root / "redis.password"

    def curve_public(self, role: str) -> Path:
        return self.root / "curve" / f"{role}.public"

    def curve_secret(self, role: str) -> Path:
        return self.root / "curve" / f"{role}.secret"

    @property
    def ca_cert(self) -> Path:
        return self.root / "tls" / "ca.crt"

    def tls_cert(self, role: str) -> Path:
        return self.root / "tls" / f"{role}.crt"

    def tls_key(self, role: str) -> Path:
        return self.root / "tls" / f"{role}.key"


def _private_dir(path: Path) -> None:
    """Make `path` a directory only its owner may enter; an existing one (`keys generate --force`)
    is tightened too, since others who may write it could swap the files under it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to a file only its owner may read: 0600 even when it replaces an existing file of
    a looser mode (open's mode applies only to new files), never through a symlink planted there."""
    _private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def generate(root: str | os.PathLike, roles: tuple[str, ...] = ROLES) -> Paths:
    """Make a complete trust directory at `root` (0700): a Redis password, a CURVE key pair
    and a CA-signed TLS certificate for every role."""
    paths = Paths(Path(root))
    _private_dir(paths.root)
    _write_private(paths.redis_password, secrets.token_urlsafe(32).encode())
    for role in roles:
        public, secret = zmq.curve_keypair()
        _write_private(paths.curve_public(role), public)
        _write_private(paths.curve_secret(role), secret)
    _generate_tls(paths, roles)
    return paths


def _generate_tls(paths: Paths, roles: tuple[str, ...]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=CERT_DAYS)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh internal CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    _write_private(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        name = tls_name(role)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(not_before).not_valid_after(not_after)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write_private(paths.tls_cert(role), cert.public_bytes(serialization.Encoding.PEM))
        _write_private(paths.tls_key(role), pem_key(key))


class Trust(NamedTuple):
    """What one process of `role` loaded from a trust directory (secrets of its own role only)."""

    role: str
    curve_secret: bytes              # Z85, this role's
    curve_public: bytes              # Z85, this role's
    curve_peers: dict[str, bytes]    # role -> Z85 public key, every role present in the directory
    redis_password: str
    ca_cert: bytes                   # PEM
    tls_cert: bytes                  # PEM, this role's
    tls_key: bytes                   # PEM, this role's

    def peer_key(self, role: str) -> bytes:
        try:
            return self.curve_peers[role]
        except KeyError:
            raise TrustError(f"the trust directory has no CURVE public key for role {role!r}") from None


class TrustError(RuntimeError):
    """A trust directory is missing, incomplete or readable by others; the message says which file."""


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        raise TrustError(f"{path} is missing (make the directory with `kvmesh keys generate DIR`)") from None


def load(root: str | os.PathLike, role: str) -> Trust:
    """The trust material of a process of `role`. Refuses secrets that other users can read."""
    if role not in ROLES:
        raise TrustError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    paths = Paths(Path(root))
    for directory in (paths.root, paths.root / "curve", paths.root / "tls"):
        if _writable_by_others(directory) and not (paths.root / "..data").exists():
            raise TrustError(f"{directory} is writable by other users, who could swap the keys in it: chmod 700 it")
    for secret_path in (paths.curve_secret(role), paths.tls_key(role), paths.redis_password):
        if secret_path.exists() and secret_path.stat().st_mode & 0o077 and not _mounted_secret(secret_path):
            raise TrustError(f"{secret_path} is readable by other users: chmod 600 it")
    peers = {r: _read(paths.curve_public(r)) for r in ROLES if paths.curve_public(r).exists()}
    return Trust(role=role, curve_secret=_read(paths.curve_secret(role)), curve_public=_read(paths.curve_public(role)),
                 curve_peers=peers, redis_password=_read(paths.redis_password).decode(),
                 ca_cert=_read(paths.ca_cert), tls_cert=_read(paths.tls_cert(role)), tls_key=_read(paths.tls_key(role)))


def shared_kv_key(trust: Trust) -> bytes:
    """The key of the shared KV tier's file MAC (gpu_worker/kv_tiers/shared_file.py): keyed BLAKE2b
    (a PRF) of the worker's CURVE secret, personalized so that it is no other use's key and reveals nothing
    of the secret. Every worker of one trust directory derives the same 32 bytes."""
    if trust.role != "worker":
        raise TrustError(f"the shared KV tier's key is the worker role's, not {trust.role!r}'s")
    return hashlib.blake2b(b"shared KV tier files", key=trust.curve_secret, digest_size=32,
                           person=b"kvmesh-shared-kv").digest()


def _writable_by_others(directory: Path) -> bool:
    try:
        return bool(directory.stat().st_mode & 0o022)
    except FileNotFoundError:
        return False    # the missing file under it is named when it is read


def _mounted_secret(path: Path) -> bool:
    """Kubernetes mounts Secret files through `..data` symlinks with the volume's defaultMode; the
    chart sets 0400, but a group bit from fsGroup is normal there and not a leak to other users."""
    return path.is_symlink() or (path.parent / "..data").exists()
