"""Constrained decoding with xgrammar: grammars compiled off the engine thread, one matcher per
sequence, a token bitmask applied to the batch's logits before sampling.

    compiler.py   GrammarCompilerPool: the tokenizer's xgrammar compiler, the per-tenant cap,
                  the time limit, the queue-wait limit; admit() (CompileBusy past the cap),
                  submit() -> GrammarJob, limit_queue_wait() (a new request's job fails busy
                  when no thread starts it in time)
    fair_queue.py FairQueue: the compile threads, shared fairly across tenants
    grammar_cache.py  GrammarCache: compiled grammars by digest, bounded in bytes (LRU)
    matchers.py   GrammarJob (a compile in flight) and the per-sequence GrammarMatcher life cycle
    compiling.py  CompilingRequests: the requests whose first draw waits for their compile
                  (vLLM's WAITING_FOR_FSM); the scheduler leaves those draws out of each step
    bitmask.py    GrammarMaskBuilder -> GrammarMask: the host-filled int32 bitmask of a step's
                  constrained rows, and its application to the logits in one op
"""
from gpu_worker.structured.bitmask import GrammarMask, GrammarMaskBuilder, apply_grammar_mask
from gpu_worker.structured.compiler import CompileBusy, GrammarCompilerPool
from gpu_worker.structured.compiling import CompilingRequests
from gpu_worker.structured.matchers import GrammarError, GrammarJob

__all__ = ["CompileBusy", "CompilingRequests", "GrammarCompilerPool", "GrammarError", "GrammarJob", "GrammarMask",
           "GrammarMaskBuilder", "apply_grammar_mask"]
