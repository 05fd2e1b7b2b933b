"""The identity of a model's weights: what KV computed by two engines must share beyond its shape.

    digest = xxh3-128, as 32 hex digits, over
        "kvmesh-weights-v1"
        then for config.json and each checkpoint file the loader reads (loader.checkpoint_files),
        in name order:  u32 len(name) | name utf-8 | u64 size | the file's bytes

Content only, never paths or mtimes: two pods that downloaded the same model agree, wherever they
keep it; a fine-tune of the same shape, a new revision or a merged LoRA that changed one tensor
differ. A model written by `kvmesh make-model` is digested the same way.

It runs in a thread of its own beside the weight load (file reads and xxhash release the GIL), in
the loader's file order, so each page comes from the disk once and the other reader finds it in
the page cache; from the page cache it hashes at several GB/s, a small part of a load.

Not cached in a sidecar file: model directories are often read-only (a hub cache, an image layer,
a read-only volume), and a cache keyed by names, sizes and mtimes is fooled by `cp -p`/`rsync -a`
of other bytes or a copied stale sidecar: a wrong digest is the silent wrong output this exists to
prevent, while the hash itself costs little beside the load it overlaps.
"""
from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import xxhash

from gpu_worker.loader import checkpoint_files
from gpu_worker.model_config import ModelLoadError

CONFIG_NAME = "config.json"
CHUNK_BYTES = 16 << 20       # large reads: syscall overhead stays far below the hash's cost
_DOMAIN = b"kvmesh-weights-v1"


class DigestCancelled(Exception):
    """The `stop` event was set: the load failed, nobody waits for the digest."""


def weights_files(model_dir: str | Path) -> list[str]:
    """config.json then the checkpoint's files, in the digest's order (names within the directory)."""
    return [CONFIG_NAME] + sorted(checkpoint_files(model_dir))


def weights_digest(model_dir: str | Path, stop: threading.Event | None = None) -> str:
    """The digest of the model in `model_dir`; raises ModelLoadError when a file cannot be read."""
    model_dir = Path(model_dir)
    h = xxhash.xxh3_128(_DOMAIN)
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    for name in weights_files(model_dir):
        path = model_dir / name
        encoded = name.encode()
        try:
            with path.open("rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                h.update(struct.pack("<I", len(encoded)) + encoded + struct.pack("<Q", size))
                read = 0
                while n := f.readinto(view):
                    if stop is not None and stop.is_set():
                        raise DigestCancelled
                    h.update(view[:n])
                    read += n
        except OSError as e:
            raise ModelLoadError(f"cannot read {path} to identify the model's weights ({e})") from e
        if read != size:
            raise ModelLoadError(f"{path} changed size while it was read; is the model being rewritten?")
    return h.hexdigest()


class DigestJob:
    """weights_digest in a daemon thread, started now; result() waits for it. A load that fails
    cancel()s it, so a failing worker does not first read the whole model again."""

    def __init__(self, model_dir: str | Path) -> None:
        self._stop = threading.Event()
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(model_dir,), name="kvmesh-weights-digest",
                                        daemon=True)
        self._thread.start()

    def _run(self, model_dir: str | Path) -> None:
        try:
            self._digest = weights_digest(model_dir, self._stop)
        except DigestCancelled:
            pass
        except BaseException as e:      # handed to result(): the caller's thread raises it
            self._error = e

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._digest is not None, "result() after cancel()"
        return self._digest

    def cancel(self) -> None:
        self._stop.set()
