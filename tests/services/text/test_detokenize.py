"""services.text.requests.detokenize: the shared core of /detokenize (gateway) and gRPC Detokenize."""
from __future__ import annotations

import random
import threading
import time

import pytest

from gpu_worker.make_model import make_model
from services.protocol.messages import DetokenizeRequest
from services.text.tokenizer import load_tokenizer
from services.text.requests import MAX_DETOKENIZE_IDS, TokenizeError, detokenize


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


@pytest.mark.parametrize("skip", [True, False])
def test_the_long_decode_is_the_same_text(tok, skip):
    """decode_long (decode_batch: releases the GIL) against decode, specials and partial UTF-8 included."""
    ids = [0, *range(2, tok.vocab_size), 1, *range(tok.vocab_size - 1, 1, -7)]
    assert tok.decode_long(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_a_million_ids_detokenize_without_holding_the_gil(tok):
    """The gateway detokenizes long id lists in a thread beside its event loop: the GIL must stay
    free meanwhile (tokenizers' decode held it 0.2-1.2 s for these ids on the test host)."""
    rng = random.Random(3)
    ids = [rng.randrange(600, tok.vocab_size) for _ in range(MAX_DETOKENIZE_IDS)]   # long tokens
    done, worst = threading.Event(), [0.0]

    def decode() -> None:
        try:
            detokenize(tok, DetokenizeRequest(token_ids=ids))
        finally:
            done.set()

    worker = threading.Thread(target=decode)
    worker.start()
    while not done.is_set():          # at most as long as the decode (bounded by join below)
        t0 = time.perf_counter()
        time.sleep(0.005)
        worst[0] = max(worst[0], time.perf_counter() - t0 - 0.005)
    worker.join(timeout=60)
    assert worst[0] < 0.15, f"the GIL was held for {worst[0]:.2f} s"
