"""The trust material a service process uses, from its configuration.

    trust = service_trust.load(cfg, "tokenizer")   # None: the planes run without authentication

`--insecure-internal-planes` wins over `--trust-dir` (plaintext gRPC, no Redis password: tests and
debugging); otherwise the trust directory's material of `role` is loaded (bundle.load refuses
missing or world-readable secrets). A service with neither is refused at start by the config check.
"""
from __future__ import annotations

from typing import Any

from services.security import bundle


def load(cfg: Any, role: str) -> bundle.Trust | None:
    if cfg.insecure_internal_planes or not cfg.trust_dir:
        return None
    return bundle.load(cfg.trust_dir, role)
