"""GrammarCompilerPool: compiles a request's StructuredOutput into an xgrammar CompiledGrammar on
a few threads shared fairly across tenants, so the engine thread never compiles.

The xgrammar GrammarCompiler (over the model's tokenizer, with the model's vocabulary size
including padding rows) is built once per engine, lazily, on the pool's first compile: an engine
that never sees a constrained request never reads its tokenizer. Compiled grammars are cached by
the pool under `cache_limit_bytes` (grammar_cache.py, an LRU by memory_size_bytes): thousands of
distinct schemas evict one another instead of growing memory.

Tenants: a compile runs on `max_workers` threads fed by a FairQueue (fair_queue.py): per tenant
(the API key the gateway salted the request with: `split_salt(cache_salt)`), the thread that
frees up serves the tenant with the fewest compiles running, so one key's flood of slow schemas
delays another key's constraint by at most one compile. A tenant may have at most
`max_per_tenant` compiles queued or running here; beyond, `admit` raises CompileBusy (the worker
answers 429). The unsalted tenant "" (no API keys; offline LLM) is not capped: it is the only
tenant there, with no one to starve.

Time limit: xgrammar's compile is C++ and cannot be interrupted. A compile is bounded by the
gateway's limits on what reaches it (sizes, enum entries, nesting depth: services/gateway/
structured.py) and by a deadline: a request whose grammar is not ready `time_limit_s` after a
thread started its compile fails (the engine finds the job settled with that error: compiling.py);
time queued does not count. The compile itself runs on to its end on its thread, and at most
`max_workers` such compiles run at once. Time queued has its own bound for a keyed tenant's new
request (`limit_queue_wait`, `queue_wait_limit_s`): a job no thread started by then is cancelled
and fails busy (the worker answers 429, like the cap; a retry later may find a thread). `compile` is the seam that runs on the threads (tests
replace it to make a compile slow).

Cache hits: a constraint in the cache gets a job settled at submission (expect_cached): it takes
no thread and waits behind nothing, so the engine does not hold the request's first draw
(compiling.py) and its first token comes in the same step as an unconstrained one's.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, Sequence

import msgspec

from gpu_worker.structured.fair_queue import FairQueue
from gpu_worker.structured.grammar_cache import GrammarCache
from gpu_worker.structured.matchers import GrammarError, GrammarJob
from services.protocol.sampling import StructuredOutput

log = logging.getLogger(__name__)

DEFAULT_CACHE_LIMIT_BYTES = 512 * 1024 * 1024
DEFAULT_TIME_LIMIT_S = 10.0
# compiles of one tenant queued or running on one worker: a burst of distinct schemas fits; a flood
# is answered 429 rather than holding the worker's request slots (scheduler capacity) for minutes
DEFAULT_MAX_PER_TENANT = 64
# longest a keyed tenant's new request waits for a compile thread (behind its own compiles, or one
# running compile of each other tenant) before it fails busy: twice the time limit, so a burst of
# typical schemas (0.3-1.5 s each) compiles whole, and a flood's tail is answered 429 within
# seconds instead of holding its requests (and their prompts' KV blocks) for minutes
DEFAULT_QUEUE_WAIT_LIMIT_S = 2 * DEFAULT_TIME_LIMIT_S
# transformers resolves its classes by lazy imports, which two threads must not run at once (one
# GPU bench run failed its first compile with "Could not import module 'AutoTokenizer'"): every
# pool of a process imports xgrammar (which imports transformers) and loads its tokenizer under
# this one lock
_TOKENIZER_LOAD = threading.Lock()


class CompileBusy(Exception):
    """The tenant has max_per_tenant compiles queued or running here; the message is safe to show."""


class GrammarCompilerPool:
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int], *,
                 cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S, max_workers: int = 2,
                 max_per_tenant: int = DEFAULT_MAX_PER_TENANT,
                 queue_wait_limit_s: float = DEFAULT_QUEUE_WAIT_LIMIT_S) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.time_limit_s = time_limit_s
        self.max_per_tenant = max_per_tenant
        self.queue_wait_limit_s = queue_wait_limit_s
        self.cache = GrammarCache(cache_limit_bytes)
        self._queue = FairQueue(max_workers, "grammar-compile")
        self._compiler: Any = None
        self._lock = threading.Lock()

    def admit(self, spec: StructuredOutput, tenant: str) -> None:
        """Raises CompileBusy when submitting spec for tenant now would pass its cap (a cached
        constraint never does: it takes no thread)."""
        if not tenant or self._queue.pending(tenant) < self.max_per_tenant:
            return
        if self.cache.get(_digest(spec)) is None:
            raise CompileBusy(f"too many output constraints of this API key are compiling on this worker "
                              f"(at most {self.max_per_tenant}); retry later or reuse schemas")

    def submit(self, spec: StructuredOutput, tenant: str = "") -> GrammarJob:
        """Start compiling `spec` for tenant (fairly against other tenants' compiles); the job's
        wait() gives the grammar or raises GrammarError. Never refuses: call admit first."""
        key = _digest(spec)
        future: Future = Future()
        cached = self.cache.get(key)
        if cached is not None:
            future.set_result(cached)
            return GrammarJob(future, _field_of(spec), expect_cached=True)
        job = GrammarJob(future, _field_of(spec))
        self._queue.put(tenant, future, lambda: self._compile_and_keep(job, spec, key))
        return job

    def limit_queue_wait(self, job: GrammarJob, tenant: str) -> None:
        """A new request's job (one admit let in): no thread started within queue_wait_limit_s, it
        fails busy. Like the cap, not for the unsalted tenant (no one to wait behind but itself)."""
        if tenant and not job.expect_cached:
            job.limit_queue_wait(self.queue_wait_limit_s)

    def _compile_and_keep(self, job: GrammarJob, spec: StructuredOutput, key: bytes) -> Any:
        job.begin(self.time_limit_s)
        compiled = self.compile(spec)
        self.cache.put(key, compiled)
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
        return self.cache.size_bytes

    def close(self) -> None:
        self._queue.close()

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
                # no xgrammar cache: the pool's (grammar_cache.py) is the one that knows its hits
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
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
