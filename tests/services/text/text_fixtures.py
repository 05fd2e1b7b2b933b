"""Helpers for the text tests: a small byte-level BPE tokenizer trained on the fly (ASCII, CJK, emoji) with ChatML specials."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "机器学习是人工智能的一个分支。今天天气很好，我们去公园散步吧。",
    "東京は日本の首都です。こんにちは、世界！",
    "한국어 문장도 조금 있습니다.",
    "Emoji time 😀🎉🚀👍🏽 and flags 🇯🇵 and family 👨‍👩‍👧",
    "Ünïcödé àccents: café, naïve, façade, jalapeño — “quotes” ‘single’ …",
    "Numbers 1234567890 and symbols !@#$%^&*()_+-=[]{};:,./<>?",
]


def build_tokenizer_dir(root: Path, *, chat_template=CHATML, extra_config: dict | None = None) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template,
        "model_max_length": 4096,
        **(extra_config or {}),
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return root




def build_sentencepiece_style() -> Tokenizer:
    """A Llama-2-like tokenizer: Metaspace (▁) words, byte fallback <0xNN> tokens, SP decoders."""
    import json as _json
    import tempfile

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    ascii_only = [line.encode("ascii", "ignore").decode().replace("\n", " ") for line in CORPUS]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    base.train_from_iterator(ascii_only * 20, trainer=trainer)
    with tempfile.TemporaryDirectory() as d:
        vocab_file, merges_file = base.model.save(d)
        vocab = _json.loads(Path(vocab_file).read_text())
        merges = [tuple(line.split(" ")) for line in Path(merges_file).read_text().splitlines()
                  if line and not line.startswith("#")]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok
