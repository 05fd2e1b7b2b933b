"""GrammarCompilerPool: compiles a request's StructuredOutput into an xgrammar CompiledGrammar on
a small thread pool, so the engine thread never compiles.

The xgrammar GrammarCompiler (over the model's tokenizer, with the model's vocabulary size
including padding rows) is built once per engine, lazily, on the pool's first compile: an engine
that never sees a constrained request never reads its tokenizer. Compiled grammars are cached by
xgrammar under `cache_limit_bytes` (an LRU by memory_size_bytes): thousands of distinct schemas
evict one another instead of growing memory.

Time limit: xgrammar's compile is C++ and cannot be interrupted. A compile is bounded by the
gateway's limits on what reaches it (sizes, enum entries, nesting depth: services/gateway/
structured.py) and by a deadline: a request whose grammar is not ready `time_limit_s` after
submission fails (the engine finds the job settled with that error: compiling.py); the compile
itself runs on to its end on its pool thread, and at most `max_workers` such compiles run at
once. `compile` is the seam that runs on the pool (tests replace it to make a compile slow).

Expected cache hits: the pool remembers (bounded) which constraints compiled here. A job for one
of those is `expect_cached`: its compile is a lookup in xgrammar's cache (microseconds), so the
engine does not hold the request's first draw out of the prefill step for it (compiling.py) and
the constrained request's first token comes in the same step as an unconstrained one's; if
xgrammar evicted it meanwhile, the draw waits for the recompile within the time limit.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import msgspec

from gpu_worker.structured.matchers import GrammarError, GrammarJob
from services.protocol.sampling import StructuredOutput

log = logging.getLogger(__name__)

DEFAULT_CACHE_LIMIT_BYTES = 512 * 1024 * 1024
DEFAULT_TIME_LIMIT_S = 10.0
COMPILED_KEYS = 8192        # constraints remembered as compiled here (32-byte digests)
# transformers resolves its classes by lazy imports, which two threads must not run at once (one
# GPU bench run failed its first compile with "Could not import module 'AutoTokenizer'"): every
# pool of a process imports xgrammar (which imports transformers) and loads its tokenizer under
# this one lock
_TOKENIZER_LOAD = threading.Lock()


class GrammarCompilerPool:
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int], *,
                 cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S, max_workers: int = 2) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_limit_bytes = cache_limit_bytes
        self.time_limit_s = time_limit_s
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[bytes, None] = OrderedDict()   # digests of specs compiled here, LRU

    def submit(self, spec: StructuredOutput) -> GrammarJob:
        """Start compiling `spec` now; the job's wait() gives the grammar or raises GrammarError."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar-compile")
        key = _digest(spec)
        with self._lock:
            expect_cached = key in self._compiled
            if expect_cached:
                self._compiled.move_to_end(key)
        future: Future = self._pool.submit(self._compile_and_note, spec, key)
        return GrammarJob(future, time.monotonic() + self.time_limit_s, _field_of(spec), expect_cached=expect_cached)

    def _compile_and_note(self, spec: StructuredOutput, key: bytes) -> Any:
        compiled = self.compile(spec)
        with self._lock:
            self._compiled[key] = None
            self._compiled.move_to_end(key)
            if len(self._compiled) > COMPILED_KEYS:
                self._compiled.popitem(last=False)
        return compiled

    def compile(self, spec: StructuredOutput) -> Any:
        """The CompiledGrammar of spec (on the calling thread); raises what xgrammar raises."""
        compiler = self._get_compiler()
        if spec.json_schema is not None:
            return compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        if spec.json_object:
            # any object, compact: a schema-free object without optional whitespace
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_regex("|".join(_regex_literal(c) for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def cache_size_bytes(self) -> int:
        return 0 if self._compiler is None else int(self._compiler.get_cache_size_bytes())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    with _TOKENIZER_LOAD:
                        import transformers
                        import xgrammar
                        tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
                        info = xgrammar.TokenizerInfo.from_huggingface(
                            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                except Exception:       # the client sees a plain reason, the log has the details
                    log.exception("cannot build the grammar compiler from the model's tokenizer")
                    raise GrammarError("constrained output is not available for this model: its tokenizer "
                                       "could not be loaded") from None
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=min(8, os.cpu_count() or 1), cache_limit_bytes=self.cache_limit_bytes)
            return self._compiler


def _digest(spec: StructuredOutput) -> bytes:
    return hashlib.blake2b(msgspec.msgpack.encode(spec), digest_size=32).digest()


def _field_of(spec: StructuredOutput) -> str:
    """The StructuredOutput field a compile error names."""
    for name in ("json_schema", "regex", "grammar"):
        if getattr(spec, name) is not None:
            return name
    return "json_object" if spec.json_object else "choice"


_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/")


def _regex_literal(text: str) -> str:
    """text as a regex matching exactly it (xgrammar's regex dialect: escape every operator)."""
    return "(" + "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text) + ")"
