"""A free TCP port for a process that binds it later (the gateway's --port, an embedded Redis).

A port taken by bind(0) and released comes from the kernel's ephemeral range, the same range
every other bind(0) draws from, so it can be handed to another socket before its owner binds it:
a test's gateway port once went to the tokenizer's gRPC server started a moment earlier. Ports
picked here lie below that range, where bind(0) never lands.
"""
from __future__ import annotations

import random
import socket

LOWEST = 20000   # above the usual service ports


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default lower bound


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port on `host` that nothing is bound to now, outside the ephemeral range when the
    range leaves room below it (else any free port)."""
    high = _ephemeral_low() - 1
    for _ in range(attempts if high > LOWEST else 0):
        port = random.randint(LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
