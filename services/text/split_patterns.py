"""The pre-tokenizer split patterns of the byte-level BPE families we build and know.

Llama 3 groups digits by three; Qwen 2 splits every digit (transformers 5 rebuilds Qwen
tokenizers with Qwen's own pattern, so `kvmesh make-model` writes this exact one). GPT-2's pattern
is ByteLevel's built-in (use_regex=True). `parallel_encode` cuts prompts only for these.
"""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
