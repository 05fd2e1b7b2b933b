"""Model definitions: one parameterized decoder (decoder.py) for Llama, Mistral, Qwen2 and Qwen3,
built from the small layers in layers/."""
