"""A free TCP port for a process that binds it later (the gateway's --port, an embedded Redis).

A port taken by bind(0) and released comes from the kernel's ephemeral range, the same range
every other bind(0) draws from, so it can be handed to another socket before its owner binds it:
a test's gateway port once went to the tokenizer's gRPC server started a moment earlier. Ports
picked here lie below that range, where bind(0) never lands.

Between the pick and the bind, another free_port() call, in this process or another one on the
machine (a second bench, a parallel test worker), could pick the same port: each pick is also
claimed with a file per port in a per-user directory (`kvmesh-ports-<uid>` under the temporary
directory), which other callers skip while it is younger than CLAIM_S. A process never hands out
one port twice.
"""
from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

LOWEST = 20000   # above the usual service ports
CLAIM_S = 120.0  # a picked port is left to its picker this long (it binds it within seconds)

_handed: set[int] = set()   # this process's picks: never handed out twice


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default lower bound


def _claims_dir() -> Path | None:
    """The per-user claims directory (0700), or None when it cannot be made ours."""
    path = Path(tempfile.gettempdir()) / f"kvmesh-ports-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError:
        return None
    # someone else's directory (or a link planted there) is not trusted: claims are then in-process only
    return path if st.st_uid == os.getuid() and (st.st_mode & 0o077) == 0 and path.is_dir() \
        and not path.is_symlink() else None


def _claim(claims: Path | None, port: int) -> bool:
    """Claim `port` for CLAIM_S across processes; False when another caller holds a fresh claim."""
    if claims is None:
        return True
    path, now = claims / str(port), time.time()
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
            return True
        except FileExistsError:
            try:
                if now - path.lstat().st_mtime < CLAIM_S:
                    return False
                path.unlink()          # a stale claim: take it over
            except FileNotFoundError:
                pass                   # released meanwhile: try again
        except OSError:
            return True                # a full or read-only disk: the bind test below still runs
    return False


def _prune(claims: Path | None) -> None:
    """Now and then, drop claims past CLAIM_S so the directory stays small."""
    if claims is None or random.random() > 1 / 32:
        return
    cutoff = time.time() - CLAIM_S
    for entry in os.scandir(claims):
        try:
            if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
        except OSError:
            pass


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port on `host` that nothing is bound to now and no other free_port() caller picked in
    the last CLAIM_S seconds, outside the ephemeral range when the range leaves room below it
    (else any free port)."""
    high = _ephemeral_low() - 1
    claims = _claims_dir()
    _prune(claims)
    for _ in range(attempts if high > LOWEST else 0):
        port = random.randint(LOWEST, high)
        if port in _handed or not _claim(claims, port):
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
