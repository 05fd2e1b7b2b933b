"""Fixtures: a byte-level BPE tokenizer directory trained on the fly (see text_fixtures)."""
from __future__ import annotations

from pathlib import Path

import pytest
from text_fixtures import build_tokenizer_dir


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok") / "model")


@pytest.fixture(scope="session")
def tok(tok_dir):
    from services.text.tokenizer import load_tokenizer
    return load_tokenizer(tok_dir)
