"""Which names a model answers to: a worker's served names and --model path (services/model_names.py),
and the gateway's catalog built from workers' registry records (services/gateway/models.py)."""
from __future__ import annotations

import os

from services.gateway.models import ModelCatalog
from services.model_names import path_aliases, served_names


def test_served_names_default_to_the_directory_name():
    assert served_names([], "/models/llama-3/") == ["llama-3"]
    assert served_names([], "") == ["null-model"]
    assert served_names(["a", "b", "a"], "/models/llama-3") == ["a", "b"]


def test_path_aliases_as_given_trimmed_and_absolute():
    assert path_aliases("") == []
    assert path_aliases("/m/x/") == ["/m/x/", "/m/x"]
    assert path_aliases("rel/x") == ["rel/x", os.path.abspath("rel/x")]


def info(names, paths=(), vocab=100, max_len=64):
    return {"model": names[0], "served_model_names": list(names), "model_paths": list(paths), "vocab_size": vocab,
            "max_model_len": max_len}


def test_catalog_lists_served_names_first_first_and_resolves_paths():
    cat = ModelCatalog.of([info(["b", "a"], ["/m/x"]), info(["b", "a"], ["/m/x"])])   # two workers, one model
    assert cat.names == ["b", "a"]
    assert [cat.resolve(n) for n in ("b", "a", "/m/x", "x", "")] == ["b", "b", "b", None, None]
    assert cat.vocab_sizes == {"b": 100} and cat.max_model_lens == {"b": 64}


def test_catalog_bounds_a_model_by_its_workers_smallest_max_model_len_in_any_order():
    """A worker joined with a smaller --max-model-len bounds the model as the scheduler does
    (the smallest known), whichever order the registry lists the records in; unknown (0) is no bound."""
    records = [info(["m"], max_len=2048), info(["m"], max_len=512), info(["m"], max_len=0)]
    for order in (records, records[::-1], records[1:] + records[:1]):
        assert ModelCatalog.of(order).max_model_lens == {"m": 512}
    assert ModelCatalog.of([info(["m"], max_len=0)]).max_model_lens == {"m": 0}


def test_catalog_served_names_win_over_path_aliases():
    cat = ModelCatalog.of([info(["m1"], ["m2"]), info(["m2"], ["/p"]), {"model": "old", "vocab_size": 5}, {}])
    assert cat.names == ["m1", "m2", "old"]
    assert (cat.resolve("m2"), cat.resolve("/p"), cat.resolve("old")) == ("m2", "m2", "old")


def test_a_record_with_a_malformed_number_is_left_out_not_fatal():
    """int() of a record's "vocab_size" or "max_model_len" raised for a value of the wrong type (a
    record written by hand or by another version): every discovery of the gateway failed, so it
    no longer followed its scheduler, tokenizers or workers. That record is left out now."""
    cat = ModelCatalog.of([info(["a"]), {"model": "b", "vocab_size": "lots"}, {"model": "c", "max_model_len": [1]}])
    assert cat.names == ["a"] and cat.resolve("b") is None and cat.max_model_lens == {"a": 64}


async def test_a_tokenizer_record_with_a_malformed_max_token_chars_counts_as_unknown():
    """The same for a tokenizer's record: its longest-token bound is unknown (0), the others' hold."""
    from services.gateway.text_path import RemoteText
    from services.registry import ServiceRecord
    text = RemoteText(None, [])
    records = [ServiceRecord(kind="tokenizer", id=f"t{i}", epoch=1, addrs={"zmq": f"tcp://127.0.0.1:{9200 + i}#tokenizer"},
                             info={"max_token_chars": chars}) for i, chars in enumerate(["wide", [3], 12])]
    text.update(records)
    assert text.token_chars == 12 and len(text.streams) == 3
