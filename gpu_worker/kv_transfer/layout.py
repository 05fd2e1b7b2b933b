"""The KV layout of an engine: two engines exchange KV blocks only when theirs are equal."""
from __future__ import annotations

import msgspec


class KVLayout(msgspec.Struct, frozen=True):
    model_id: str
    block_size: int
    kv_dtype: str           # torch dtype name, e.g. "float32", "bfloat16", "float8_e4m3fn"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int


class KVLayoutMismatch(ValueError):
    """The two engines' KV layouts differ: their blocks cannot be exchanged."""


def layout_of(engine) -> KVLayout:
    """The layout of an engine's KV cache (gpu_worker.engine.Engine)."""
    k_cache = engine.runner.kv_caches[0][0]          # (num_blocks, block_size, n_kv, head_dim)
    return KVLayout(model_id=engine.setup.model_id, block_size=engine.config.block_size,
                    kv_dtype=str(k_cache.dtype).removeprefix("torch."),
                    num_layers=len(engine.runner.kv_caches), num_kv_heads=int(k_cache.shape[2]),
                    head_dim=int(k_cache.shape[3]), tp_size=engine.config.tensor_parallel_size)


def check_compatible(mine: KVLayout, theirs: KVLayout) -> None:
    """Raises KVLayoutMismatch naming every field that differs."""
    diffs = [f"{f}: {getattr(mine, f)!r} here, {getattr(theirs, f)!r} there"
             for f in mine.__struct_fields__ if getattr(mine, f) != getattr(theirs, f)]
    if diffs:
        raise KVLayoutMismatch("KV layouts differ, refusing the transfer (" + "; ".join(diffs) + ")")
