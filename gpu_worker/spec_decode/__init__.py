"""Speculative decoding: cheap draft tokens that the target model verifies in one forward.

ngram.py proposes (prompt lookup), speculator.py fits the drafts into the scheduler's step and
verifies them against the model's own draws (see its docstring for why that is exact).
"""
from gpu_worker.spec_decode.ngram import propose_ngram
from gpu_worker.spec_decode.speculator import Speculator

__all__ = ["Speculator", "propose_ngram"]
