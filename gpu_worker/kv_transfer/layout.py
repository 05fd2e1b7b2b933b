"""The KV layout of an engine: two engines exchange KV blocks only when theirs are equal.

Equal shapes are not enough: KV is a function of the weights, so the layout carries their content
digest (gpu_worker/weights_digest.py). A fine-tune or a new revision served under the same name,
with the same shapes, then neither restores an older engine's disk-tier files nor takes a hand-off
from a worker still on the old weights (a rolling upgrade)."""
from __future__ import annotations

from typing import Annotated

import msgspec


class KVLayout(msgspec.Struct, frozen=True):
    model_id: str
    block_size: int
    kv_dtype: str           # torch dtype name, e.g. "float32", "bfloat16", "float8_e4m3fn"
    num_layers: int         # the target model's layers
    num_kv_heads: int
    head_dim: int
    tp_size: int
    # Layers of paged KV a hand-off moves after the target's: the multi-token-prediction layer's
    # (1 when the engine speculates with method mtp: spec_decode/mtp.py), else 0.
    mtp_layers: int = 0
    # xxh3-128 of the checkpoint's bytes and config.json; "" for an engine whose runner was given
    # in-process (tests): no files, so nothing to identify
    weights_digest: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # what the weights compute in: the dtype, and the quantization when one is applied at load
    # ("bfloat16", "bfloat16/fp8"): the same checkpoint run another way writes other KV
    weights_numerics: Annotated[str, msgspec.Meta(max_length=64)] = ""

    @property
    def layers(self) -> int:
        """The (K, V) pairs a hand-off moves per block: the target's layers, then the MTP layer's."""
        return self.num_layers + self.mtp_layers


WEIGHTS_HINT = ("the two engines load different weights (a rolling upgrade, or another fine-tune under the "
                "same model name) or run them in another dtype or quantization: KV moves only between engines "
                "that compute it alike")


class KVLayoutMismatch(ValueError):
    """The two engines' KV layouts differ: their blocks cannot be exchanged."""


def layout_of(engine) -> KVLayout:
    """The layout of an engine's own KV cache (gpu_worker.engine.Engine): the target's layers
    only (what a KV tier stores)."""
    k_cache = engine.runner.kv_caches[0][0]          # (num_blocks, block_size, n_kv, head_dim)
    return KVLayout(model_id=engine.setup.model_id, block_size=engine.config.block_size,
                    kv_dtype=str(k_cache.dtype).removeprefix("torch."),
                    num_layers=len(engine.runner.kv_caches), num_kv_heads=int(k_cache.shape[2]),
                    head_dim=int(k_cache.shape[3]), tp_size=engine.config.tensor_parallel_size,
                    weights_digest=engine.setup.weights_digest, weights_numerics=numerics_of(engine))


def numerics_of(engine) -> str:
    """KVLayout.weights_numerics of an engine: its compute dtype, and its load-time quantization."""
    dtype = str(engine.setup.dtype).removeprefix("torch.")
    quantization = getattr(engine.config, "quantization", None)
    return f"{dtype}/{quantization}" if quantization else dtype


def handoff_caches(engine) -> list:
    """The (K, V) caches a P/D hand-off moves, in layout order: the target's layers, then the MTP
    layer's (same block ids; the decode engine proposes from it at once: spec_decode/mtp.py)."""
    extra = engine.speculator.handoff_caches() if engine.speculator is not None else []
    return list(engine.runner.kv_caches) + extra


def handoff_layout(engine) -> KVLayout:
    """The layout a P/D hand-off moves (handoff_caches): both engines must carry the same."""
    extra = engine.speculator.handoff_caches() if engine.speculator is not None else []
    return msgspec.structs.replace(layout_of(engine), mtp_layers=len(extra))


def check_compatible(mine: KVLayout, theirs: KVLayout) -> None:
    """Raises KVLayoutMismatch naming every field that differs."""
    diffs = [f"{f}: {getattr(mine, f)!r} here, {getattr(theirs, f)!r} there"
             for f in mine.__struct_fields__ if getattr(mine, f) != getattr(theirs, f)]
    if mine.mtp_layers != theirs.mtp_layers:
        diffs.append("the MTP layer's KV rides with the target's only when both engines run "
                     'speculative_config {"method": "mtp"}: give the prefill and decode workers the same one')
    if mine.weights_digest != theirs.weights_digest or mine.weights_numerics != theirs.weights_numerics:
        diffs.append(WEIGHTS_HINT)
    if diffs:
        raise KVLayoutMismatch("KV layouts differ, refusing the transfer (" + "; ".join(diffs) + ")")
