#!/usr/bin/env python3
"""How far an fp32 model's logits on the Triton backend are from Hugging Face's fp32, on the GPU:
the parity tests' chunked run (long_chunk_run: chunks behind a cached prefix, ragged decodes)
with the fresh-prompt kernel and with v2, for llama and qwen3. Prints max |diff| / std of the
reference logits per sequence, and whether the greedy tokens are identical (1).

    python3 bench/fp32_attention_precision.py

The attention dots' fp32 precision is kernels/_paged_kv.F32_DOTS (tf32x3); to see another, set it
there ("tf32", "ieee"). Before F32_DOTS the dots took Triton's global default, which the
nineteenth session moved with TRITON_F32_DEFAULT (BENCHMARKS.md); that variable no longer
reaches them."""
import sys
import tempfile

import torch

sys.path.insert(0, "tests/gpu_worker/models")
from test_model_parity import hf_logits, long_chunk_run  # noqa: E402

import gpu_worker.attention.triton_backend as tb  # noqa: E402
from gpu_worker.make_model import make_model  # noqa: E402

root = tempfile.mkdtemp()
for arch in ["llama", "qwen3"]:
    model_dir = str(make_model(f"{root}/{arch}", arch, "tiny", seed=1, progress=False))
    for fresh in (True, False):
        tb.TritonAttentionBackend.fresh_prefix = fresh
        seqs = long_chunk_run(model_dir, 1024, "cuda", torch.float32)
        refs = hf_logits(model_dir, [s.tokens for s in seqs], device="cuda")
        errs = []
        for s, ref in zip(seqs, refs):
            ours = torch.stack(s.logits)
            same = int(torch.equal(ours.argmax(-1), ref.argmax(-1)))
            errs.append(f"{(ours - ref).abs().max().item() / ref.std().item():.4f}/{same}")
        print(f"RESULT {arch} fresh={fresh} long_chunk err/std per seq: {errs}", flush=True)
    tb.TritonAttentionBackend.fresh_prefix = True
