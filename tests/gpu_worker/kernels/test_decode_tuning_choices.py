"""The decode-attention choices made from a DecodeAttentionTuning are the ones the module-global
knobs made before the tuning object existed, for every shape and setting of a grid.

data/decode_choices_8a44f70.json.gz was captured from commit 8a44f70 (the globals, set with
set_attention_config): per row, a knob string, an SM count, a batch shape and a cache dtype, with
choose_decode_split's result and every kernel launch paged_decode_attention made (grid, tiles,
warps, stages, merge). Here the same rows run through the tuning object, the launches recorded the
same way (the Triton kernels replaced by recorders: only the host-side choices are compared)."""
import gzip
import json
from pathlib import Path

import pytest
import torch

from gpu_worker.kernels import paged_decode_attention as pda
from gpu_worker.tuning import DecodeAttentionTuning

TABLE = Path(__file__).parent / "data" / "decode_choices_8a44f70.json.gz"
DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
KEPT = {"BLOCK_N", "num_warps", "num_stages", "NUM_SPLITS", "HPP", "MERGE_LAST", "UPCAST", "DIRECT"}


class _Recorder:
    """Stands in for a Triton kernel: kernel[grid](...) appends (name, grid, launch choices)."""

    def __init__(self, sink: list, name: str):
        self.sink, self.name = sink, name

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.sink.append([self.name, list(grid), {k: kw[k] for k in sorted(kw) if k in KEPT}])
        return launch


def _launches(row: dict, tuning: DecodeAttentionTuning, monkeypatch) -> list:
    B, nkv, group, hd = row["num_seqs"], row["num_kv_heads"], row["group"], row["head_dim"]
    sink: list = []
    monkeypatch.setattr(pda, "_decode_stage1_kernel", _Recorder(sink, "s1"))
    monkeypatch.setattr(pda, "_decode_stage2_kernel", _Recorder(sink, "s2"))
    q = torch.zeros(B, nkv * group, hd, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, nkv, hd, dtype=DTYPES[row["kv_dtype"]])
    pda.paged_decode_attention(q, cache, cache, torch.zeros(B, 1, dtype=torch.int32), torch.ones(B, dtype=torch.int32),
                               0.1, max_context_len=row["max_context_len"], tuning=tuning)
    return sink


def test_tuning_object_chooses_as_the_globals_did(monkeypatch):
    rows = json.loads(gzip.decompress(TABLE.read_bytes()))["rows"]
    assert len(rows) == 10080 and len({r["config"] for r in rows}) == 8
    cpu = torch.device("cpu")
    mismatches = []
    for row in rows:
        tuning = DecodeAttentionTuning.parse(row["config"])
        monkeypatch.setattr(pda, "num_sms", lambda device, n=row["num_sms"]: n)
        split = pda.choose_decode_split(row["num_seqs"], row["num_kv_heads"], row["max_context_len"], cpu,
                                        row["group"], DTYPES[row["kv_dtype"]], tuning)
        launches = _launches(row, tuning, monkeypatch)
        if list(split) != row["split"] or launches != row["launches"]:
            mismatches.append((row, list(split), launches))
    assert not mismatches, f"{len(mismatches)} rows differ, first: {mismatches[0]}"


def test_default_tuning_is_the_default_spec():
    """The object's defaults are the old module defaults (DEFAULT_ATTENTION_CONFIG s16x16+2p1,
    LONG_NUM_WARPS_FP8 None, FP8_UPCAST f16)."""
    assert DecodeAttentionTuning() == DecodeAttentionTuning.parse("s16x16+2p1")
    assert DecodeAttentionTuning().spec() == "s16x16+2p1"
    assert (DecodeAttentionTuning().long_num_warps_fp8, DecodeAttentionTuning().fp8_upcast) == (None, "f16")


def test_tuning_is_frozen():
    with pytest.raises(AttributeError):
        DecodeAttentionTuning().short_max_splits = 4          # type: ignore[misc]
