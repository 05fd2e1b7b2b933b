"""Mutual TLS for the gRPC planes: credentials from a trust directory, and the caller's role.

    server = grpc.aio.server(); server.add_secure_port(addr, server_credentials(trust))
    channel = grpc.aio.secure_channel(target, channel_credentials(trust), channel_options("tokenizer"))
    peer_role(context)   # "gateway": the caller's certificate, signed by the trust CA, names that role

Both ends present a certificate signed by the trust directory's CA: a server refuses a caller
without one (the handshake fails, the call ends UNAVAILABLE), and a caller refuses a server whose
certificate is not for the role it meant to reach. Every role's certificate carries the DNS name
`kvmesh-<role>` (bundle.tls_name), so a client checks that name whatever address it dialled
(pod IPs come from Redis and are in no certificate).
"""
from __future__ import annotations

from typing import Any

import grpc

from services.security.bundle import ROLES, Trust, tls_name

_ROLE_OF_NAME = {tls_name(role): role for role in ROLES}


def server_credentials(trust: Trust) -> grpc.ServerCredentials:
    """This role's certificate; callers must present one signed by the trust CA."""
    return grpc.ssl_server_credentials([(trust.tls_key, trust.tls_cert)], root_certificates=trust.ca_cert,
                                       require_client_auth=True)


def channel_credentials(trust: Trust) -> grpc.ChannelCredentials:
    """Trust only the trust CA; present this role's certificate as the client certificate."""
    return grpc.ssl_channel_credentials(root_certificates=trust.ca_cert, private_key=trust.tls_key,
                                        certificate_chain=trust.tls_cert)


def channel_options(server_role: str) -> list[tuple[str, Any]]:
    """Check the server's certificate against `server_role`'s name rather than the dialled address."""
    if server_role not in ROLES:
        raise ValueError(f"unknown server role {server_role!r}; one of {', '.join(ROLES)}")
    return [("grpc.ssl_target_name_override", tls_name(server_role))]


def peer_role(context: Any) -> str | None:
    """The role named by the caller's verified certificate (DNS SAN, else CN), or None when the call
    carried no certificate (a plaintext port) or one naming no role."""
    auth = context.auth_context()
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        for value in auth.get(key, ()):
            role = _ROLE_OF_NAME.get(value.decode(errors="replace"))
            if role is not None:
                return role
    return None
