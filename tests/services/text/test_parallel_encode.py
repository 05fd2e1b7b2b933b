"""A prompt cut into pieces (parallel_encode.py) encodes to exactly the whole prompt's ids, with
the tokenizers kvmesh builds (Llama 3 and Qwen 2 patterns) and a GPT-2 style one; tokenizers whose
steps are not known to be cut-safe are never cut."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from text_fixtures import CORPUS, build_sentencepiece_style, build_tokenizer_dir
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from services.text import parallel_encode
from services.text.parallel_encode import ParallelEncoder, cut_points, cut_safe
from services.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def family(request, tmp_path_factory):
    """(name, model directory) of one tokenizer family."""
    if request.param == "gpt2":
        return request.param, build_tokenizer_dir(tmp_path_factory.mktemp("gpt2") / "m")
    from gpu_worker.make_model import tokenizer_files
    root = tmp_path_factory.mktemp(request.param)
    tok_json, tok_cfg = tokenizer_files("llama" if request.param == "llama" else "qwen2", 128256)
    (root / "tokenizer.json").write_text(json.dumps(tok_json))
    (root / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return request.param, root


def _texts(root) -> list[str]:
    """Random-vocabulary prompts (what `bench serve --dataset-name random` sends), prose, code,
    scripts without spaces, digits, odd whitespace and special tokens inside the text."""
    from services.bench.tokens import TokenCounter
    rng = np.random.default_rng(0)
    counter = TokenCounter(str(root))
    texts = [counter.random_text(n, rng) for n in (64, 300, 512, 700)]
    prose = ("It's the user's turn: they'll say what we've done, I'm sure. Dr. Smith's 3rd "
             "report (2024-05-17) lists 1,234,567 items at $8.99 each... Ünïcödé café naïve façade. ")
    texts += [prose * 8, " ".join(CORPUS) * 4, "x = [1, 2, 3]\n\tif a  and   b:\n\n  return 'ok'\r\n" * 12,
              "机器学习 是 人工智能 的 一个 分支 " * 30, "한국어 문장도 조금 있습니다 " * 30,
              "word  \n  word\t\tword \u00a0 word\u2003word " * 30,
              "<|begin_of_text|>Hello <|eot_id|> there<|im_end|> you " * 25]
    return texts


def _fuzz_texts(n: int, seed: int = 1) -> list[str]:
    """Random strings over an alphabet that exercises every branch of the split patterns."""
    alphabet = (list("abcXYZéßΩжあ漢") * 3 + [" "] * 12 + ["  ", "\n", "\t", "\r\n", "\u00a0"]
                + list("0123456789") + list(".,!?'\"()-_$") + ["'s", "'ll", "'D", "<|im_end|>"])
    r = random.Random(seed)
    return ["".join(r.choice(alphabet) for _ in range(r.randrange(1, 120))) for _ in range(n)]


def test_the_families_we_build_are_cut_safe(family):
    name, root = family
    tok = load_tokenizer(root)
    assert tok.parallel_encode_off is None, f"{name}: {tok.parallel_encode_off}"


def test_every_cut_point_gives_the_whole_texts_ids(family):
    """Not only the cuts cut_points picks: every space between two letters, in varied and fuzzed
    text, splits the ids exactly where the whole text's ids split."""
    _, root = family
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    checked = 0
    for text in _texts(root)[4:] + _fuzz_texts(400):
        whole = tok.encode(text, add_special_tokens=False).ids
        points = [i for i in range(1, len(text) - 1)
                  if text[i] == " " and text[i - 1].isalpha() and text[i + 1].isalpha()]
        for i in points[:40]:
            left = tok.encode(text[:i], add_special_tokens=False).ids
            right = tok.encode(text[i:], add_special_tokens=False).ids
            assert left + right == whole, (text[:i][-20:], text[i:][:20])
            checked += 1
    assert checked > 900


@pytest.mark.parametrize("pieces", [2, 3, 8])
def test_parallel_encoder_matches_whole_encode(family, pieces, monkeypatch):
    """With and without special tokens (the post-processor adds bos once, in front)."""
    _, root = family
    monkeypatch.setattr(parallel_encode, "MIN_PIECE_CHARS", 32)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    enc = ParallelEncoder(tok, max_pieces=pieces)
    cut = 0
    for text in _texts(root) + _fuzz_texts(100, seed=2):
        cut += bool(cut_points(text, enc.pieces_for(text)))
        for special in (True, False):
            assert enc.encode(text, special) == tok.encode(text, add_special_tokens=special).ids
    assert cut >= 10


def test_text_tokenizer_encode_and_chat_agree_with_the_whole_text(family):
    _, root = family
    tok = load_tokenizer(root)
    plain = Tokenizer.from_file(str(root / "tokenizer.json"))
    text = _texts(root)[3]
    assert len(text) >= 2 * parallel_encode.MIN_PIECE_CHARS
    assert tok.encode(text) == plain.encode(text).ids
    messages = [{"role": "user", "content": text}]
    if tok.chat_template:
        assert tok.encode_chat(messages) == plain.encode(tok.apply_chat_template(messages),
                                                         add_special_tokens=False).ids


def test_cut_points_sit_between_words_near_even_splits():
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 20
    points = cut_points(text, 4)
    assert len(points) == 3 and points == sorted(set(points))
    for i, p in enumerate(points, 1):
        assert text[p] == " " and text[p - 1].isalpha() and text[p + 1].isalpha()
        assert 0 <= p - i * len(text) // 4 < 12
    assert cut_points("1234 5678 " * 50, 4) == []          # no letters: no safe cut
    assert cut_points("abc def", 1) == []


def test_tokenizers_not_known_to_be_cut_safe_encode_whole(tmp_path, monkeypatch):
    sp = build_sentencepiece_style()
    assert "pre-tokenizer" in cut_safe(sp)                   # Metaspace: the first word differs
    gpt2 = Tokenizer.from_file(str(build_tokenizer_dir(tmp_path / "g") / "tokenizer.json"))
    assert cut_safe(gpt2) is None
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)   # every piece would get one
    assert cut_safe(gpt2) is not None
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.normalizer = normalizers.Lowercase()
    assert "normalizer" in cut_safe(gpt2)
    gpt2.normalizer = normalizers.NFC()
    assert cut_safe(gpt2) is None
    gpt2.enable_truncation(64)
    assert "truncation" in cut_safe(gpt2)
    gpt2.no_truncation()
    from tokenizers import AddedToken
    gpt2.add_tokens([AddedToken("Hello", lstrip=True)])     # would take the space before it
    assert "added token" in cut_safe(gpt2)
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert "model" in cut_safe(wordpiece)


def test_parallelism_off_means_one_piece(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert parallel_encode.default_pieces() == 1
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert 1 <= parallel_encode.default_pieces() <= parallel_encode.MAX_PIECES
