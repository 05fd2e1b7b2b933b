"""The compiled-grammar cache stays under its byte bound over thousands of distinct schemas.

xgrammar evicts least-recently-used grammars once an insertion passed the bound: the cache
holds at most the bound plus the one grammar just inserted."""
from __future__ import annotations

import json
import time

from gpu_worker.structured import GrammarCompilerPool, GrammarError
from services.protocol.sampling import StructuredOutput

LIMIT = 256 * 1024
NUM_SCHEMAS = 2_000


def test_thousands_of_distinct_schemas_stay_under_the_cache_bound(tiny_llama):
    pool = GrammarCompilerPool(tiny_llama, 1024, [1], cache_limit_bytes=LIMIT)
    t = time.monotonic()
    peak = largest = 0
    for i in range(NUM_SCHEMAS):
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer", "minimum": 0, "maximum": i}},
                  "required": [f"field_{i}"], "additionalProperties": False}
        job = pool.submit(StructuredOutput(json_schema=json.dumps(schema)))
        largest = max(largest, job.wait().memory_size_bytes)
        peak = max(peak, pool.cache_size_bytes())
        assert time.monotonic() - t < 60.0, f"only {i} compiles in 60 s"
    assert 0 < peak <= LIMIT + largest
    assert largest * 10 < LIMIT            # the bound, not the entries' size, is what is measured
    pool.close()


def test_a_cached_schema_compiles_once(tiny_llama):
    pool = GrammarCompilerPool(tiny_llama, 1024, [1], cache_limit_bytes=LIMIT)
    spec = StructuredOutput(json_schema=json.dumps({"type": "array", "items": {"type": "boolean"}}))
    first = pool.submit(spec).wait()
    size = pool.cache_size_bytes()
    assert pool.submit(spec).wait().memory_size_bytes == first.memory_size_bytes
    assert pool.cache_size_bytes() == size       # a hit: nothing new cached
    pool.close()


def test_a_model_without_a_tokenizer_fails_constrained_requests_plainly(tmp_path):
    pool = GrammarCompilerPool(str(tmp_path), 1024, [1])
    job = pool.submit(StructuredOutput(regex="a"))
    try:
        job.wait()
    except GrammarError as exc:
        assert str(exc) == ("constrained output is not available for this model: its tokenizer could not be "
                            "loaded")
        assert str(tmp_path) not in str(exc)
    else:
        raise AssertionError("a compile without a tokenizer succeeded")
    pool.close()
