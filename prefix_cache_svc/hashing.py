"""The engine's chained block hash, as the index needs it.

The one definition lives in `services/prefix_hash.py`, shared by the engine and this index, so
both always agree on a block's identity.
"""
from services.prefix_hash import block_hash

__all__ = ["block_hash"]
