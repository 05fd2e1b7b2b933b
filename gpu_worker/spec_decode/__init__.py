"""Speculative decoding: cheap draft tokens that the target model verifies in one forward.

ngram.py proposes by prompt lookup, draft_model.py with a smaller model (its KV cache addressed
by the target's block table), mtp.py with the model's own multi-token-prediction layer
(mtp_runner.py: its weights and KV cache; proposer.py: the hooks both model proposers plug into
the step); speculator.py fits the drafts into the scheduler's step and verifies them against the
model's own draws (see its docstring for why that is exact); rejection.py verifies sampled
drafts of a model proposer by speculative sampling.
"""
from gpu_worker.spec_decode.ngram import propose_ngram
from gpu_worker.spec_decode.speculator import Speculator

__all__ = ["Speculator", "propose_ngram"]
