"""load_tokenizer reads a Hugging Face directory with `tokenizers` and agrees with transformers."""
from __future__ import annotations

import json

import pytest
from text_fixtures import CORPUS, build_tokenizer_dir

from services.text.chat_template import ChatTemplateError
from services.text.tokenizer import TokenizerError, load_tokenizer


def test_encode_decode_match_transformers(tok, tok_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    for text in CORPUS + ["<|im_start|>user\nhi<|im_end|>", "", "  spaces  "]:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_encode_is_the_tokenizers_encode(tok, tok_dir):
    """encode() takes encode_batch_fast (no offsets): the same ids as Tokenizer.encode, with and
    without special tokens, on every script of the corpus, special-token text and odd spacing."""
    from tokenizers import Tokenizer
    plain = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    texts = CORPUS + ["<|im_start|>user\nhi<|im_end|>", "", "  spaces  ", "\n\n\t x", " ".join(CORPUS) * 3]
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == plain.encode(text, add_special_tokens=special).ids


def test_special_tokens_and_eos(tok):
    assert tok.vocab_size == 420
    assert tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == {tok.eos_token_id, 0, 2}  # tokenizer eos + generation_config ids
    assert tok.special_token_ids == {0, 1, 2, 3}
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.id_to_token(tok.eos_token_id) == "<|im_end|>"


def test_add_bos_token_flag(tmp_path):
    d = build_tokenizer_dir(tmp_path / "m", extra_config={"add_bos_token": True})
    t = load_tokenizer(d)
    assert t.encode("hi")[0] == t.bos_token_id
    assert t.encode("hi", add_special_tokens=False)[0] != t.bos_token_id
    assert t.encode_chat([{"role": "user", "content": "x"}])[0] == t.token_to_id("<|im_start|>")


def test_template_file_wins_and_named_templates(tmp_path):
    d = build_tokenizer_dir(tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert load_tokenizer(d).apply_chat_template([{"role": "user", "content": "a"}]) == "a!"
    d2 = build_tokenizer_dir(tmp_path / "n", chat_template=[{"name": "tool_use", "template": "T"},
                                                            {"name": "other", "template": "O"}])
    t = load_tokenizer(d2)
    assert t.apply_chat_template([{"role": "user", "content": "a"}], tools=[{"name": "f"}]) == "T"
    with pytest.raises(ChatTemplateError, match="none is 'default'"):
        t.apply_chat_template([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="no chat template named"):
        t.apply_chat_template([{"role": "user", "content": "a"}], template_name="nope")


def test_no_template(tmp_path):
    d = build_tokenizer_dir(tmp_path / "m", chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(d).apply_chat_template([{"role": "user", "content": "a"}])


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        load_tokenizer(tmp_path)
    d = build_tokenizer_dir(tmp_path / "m")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(TokenizerError, match="chat_template"):
        load_tokenizer(d)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        load_tokenizer(d)


def test_remote_code_is_ignored(tmp_path):
    d = build_tokenizer_dir(tmp_path / "m", extra_config={
        "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"})
    (d / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    assert load_tokenizer(d).encode("hi", add_special_tokens=False)
