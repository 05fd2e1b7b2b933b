"""services.tokenize.detokenize: the shared core of /detokenize (gateway) and gRPC Detokenize."""
from __future__ import annotations

import pytest

from gpu_worker.make_model import make_model
from services.protocol.messages import DetokenizeRequest
from services.text.tokenizer import load_tokenizer
from services.tokenize import MAX_DETOKENIZE_IDS, TokenizeError, detokenize


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_model(tmp_path_factory.mktemp("m") / "tiny", arch="llama", size="tiny",
                                     progress=False))


def test_text_and_token_strings(tok):
    ids = tok.encode("hello world", add_special_tokens=False)
    reply = detokenize(tok, DetokenizeRequest(token_ids=ids, token_strs=True))
    assert reply.text == "hello world" and reply.token_strs == [tok.id_to_token(i) for i in ids]
    assert detokenize(tok, DetokenizeRequest(token_ids=ids)).token_strs is None


@pytest.mark.parametrize("ids, needle", [([-1], "token ids must be in"), ([10 ** 6], "token ids must be in"),
                                         ([1] * (MAX_DETOKENIZE_IDS + 1), "at most")])
def test_bad_ids_are_refused(tok, ids, needle):
    with pytest.raises(TokenizeError, match=needle):
        detokenize(tok, DetokenizeRequest(token_ids=ids))
