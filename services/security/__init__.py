"""The internal planes' trust material: who may talk to whom inside a kvmesh deployment.

`bundle.py` lays out and makes a trust directory (CURVE keys for ZeroMQ, a CA and certificates for
gRPC, the Redis password); `curve.py` puts CURVE on ZeroMQ sockets and names each peer's role; `tls.py`
makes gRPC servers and channels use mutual TLS.
"""
