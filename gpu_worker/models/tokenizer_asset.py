"""The byte-level BPE tokenizer that `kvmesh make-model` ships with every random model.

One tokenizer is trained once (`python -m gpu_worker.models.tokenizer_asset`) and committed as
`gpu_worker/assets/bpe_tokenizer.json`; make-model cuts it down to any smaller vocabulary. That
works because BPE training is greedy: token ids are assigned in merge order, so the first N ids
and the merges that produce them are exactly a tokenizer with vocabulary N.

    ids: [ special tokens | 256 byte symbols | merge 1, merge 2, ... merge M ]
         |<----------------- keep ids < N ------------------>|

A model vocabulary larger than the asset's (Llama-3's 128,256) gets filler tokens for the ids
beyond it: " t32768", " t32769", ... No merge produces them, so encoding is unchanged, but every
id a random model samples decodes to visible text, as in a real tokenizer of that size (a
serving benchmark times the first chunk that carries text).

The training corpus is text already on every machine: the Python standard library's own
sources (docstrings and comments make it mostly English) read in a fixed order.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
ASSET_PATH = ASSETS / "bpe_tokenizer.json"
ASSET_VOCAB_SIZE = 32768

# Both chat families' control tokens live in one vocabulary (ids 0..8), so every arch shares it.
SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>",
)


def _corpus_files(limit_bytes: int = 24_000_000) -> list[str]:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if any(p in ("site-packages", "test", "tests", "idlelib", "lib2to3") for p in rel):
            continue
        files.append(str(path))
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return files


def train(vocab_size: int = ASSET_VOCAB_SIZE, out: Path = ASSET_PATH) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=24,
        show_progress=True,
    )
    tok.train(_corpus_files(), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))


def truncated_tokenizer_json(vocab_size: int) -> dict:
    """The committed tokenizer cut down to its first `vocab_size` ids, or padded with filler
    tokens up to it (see module docstring)."""
    data = json.loads(ASSET_PATH.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    if vocab_size >= len(vocab):
        # "Ġ" is the byte-level symbol of a space: filler id i decodes to " t{i}"
        vocab.update({f"\u0120t{i}": i for i in range(len(vocab), vocab_size)})
        return data
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"tokenizer vocab must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    data["model"]["vocab"] = {t: i for t, i in vocab.items() if i < vocab_size}
    kept = []
    for merge in data["model"]["merges"]:
        a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
        if vocab.get(a + b, vocab_size) < vocab_size:
            kept.append(merge)
    data["model"]["merges"] = kept
    return data


if __name__ == "__main__":
    train(int(sys.argv[1]) if len(sys.argv) > 1 else ASSET_VOCAB_SIZE)
