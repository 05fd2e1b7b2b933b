"""Triton kernels, one op per file, each with a plain-torch reference (`<op>_ref`) beside it.

    paged_decode_attention   one query token per sequence over the paged KV cache; GQA-aware
                             (a KV head read once for its query heads), split-K + reduce
    paged_prefill_attention  prefill / extend / mixed batches: ragged, causal behind a cached
                             prefix, online softmax, FlashAttention-style tiles
    kv_cache_write           scatter this step's K/V into cache slots (fp8 caches with scales)
    rope / rope_kv_write     rotary embedding on q, k in place (HF rotate_half, any scaling
                             folded into the cos/sin table); fused with the KV write
    rmsnorm                  RMSNorm with the residual add fused -> (out, new_residual)
    swiglu                   silu(gate) * up on the fused gate_up output
    sampling                 penalties, top-k / top-p / min-p, seeded Gumbel-max draw
    fp8_linear               e4m3 weights (per-channel scales), per-token activation quantization,
                             torch._scaled_mm

Every kernel loads its inputs in their storage dtype (bf16/fp16/fp32/fp8) and does its maths in
fp32; the CPU tests run them under TRITON_INTERPRET=1 on fp32 tensors holding bf16-representable
values (the interpreter's bf16 and fp8 rounding is not trustworthy), and bench/gpu_bench.py
checks them on the GPU in bf16. Modules are imported lazily by their users: importing this
package does not import triton.
"""
