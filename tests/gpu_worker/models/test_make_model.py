"""make-model: file layout, sharding, exact 8B shapes, tokenizer and chat template via transformers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from test_model_parity import assert_close, three_step_run

import gpu_worker.make_model as mm
from gpu_worker.model_config import ModelConfig

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2? Answer in one word, déjà vu 😀."},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And 3 + 3?"},
]


def test_directory_layout(tiny_models):
    for arch, model_dir in tiny_models.items():
        names = {p.name for p in Path(model_dir).iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"} <= names, arch


def test_llama_8b_parameter_count_and_shapes():
    shape = mm.SHAPES[("llama", "8b")]
    specs = list(mm._tensor_specs("llama", shape))
    params = sum(math.prod(dims) for _, dims, _, _ in specs)
    assert params == 8_030_261_248  # Llama-3.1-8B
    shards = mm._shard_plan(specs, 2)
    assert len(shards) == 4 and sum(len(s) for s in shards) == len(specs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_checkpoint_loads_like_hf(tmp_path, monkeypatch, arch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(mm, "SHARD_BYTES", 200_000)
    model_dir = str(mm.make_model(tmp_path / arch, arch, "tiny", seed=3, progress=False))
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (Path(model_dir) / "model.safetensors").exists()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs, _ = three_step_run(model_dir, 1024)
    with torch.no_grad():
        refs = [hf(torch.tensor([s.tokens])).logits[0] for s in seqs]
    assert_close(seqs, refs)


def test_same_seed_same_weights(tmp_path):
    a = mm.make_model(tmp_path / "a", "qwen3", "tiny", seed=7, progress=False)
    b = mm.make_model(tmp_path / "b", "qwen3", "tiny", seed=7, progress=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_cli_main(tmp_path, capsys):
    assert mm.main(["--arch", "mistral", "--size", "tiny", "--seed", "5", "--dtype", "bfloat16",
                    "--vocab-size", "2048", str(tmp_path / "m")]) == 0
    cfg = ModelConfig.from_dir(tmp_path / "m")
    assert cfg.vocab_size == 2048 and cfg.torch_dtype == "bfloat16" and cfg.family == "mistral"
    tok = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 2048
    assert "wrote mistral tiny" in capsys.readouterr().out


def test_mtp_layers_deepseek_names_and_the_rest_unchanged(tmp_path, capsys):
    """--mtp-layers: DeepSeek-V3's tensor names after the decoder's layers (an MoE layer, in the
    hub's expert names, for MoE families), config.json's num_nextn_predict_layers, every other
    tensor as without them; transformers and kvmesh's target load the directory and ignore the
    MTP layer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert mm.main(["--arch", "qwen3_moe", "--mtp-layers", "1", str(tmp_path / "moe")]) == 0
    moe = load_file(str(tmp_path / "moe" / "model.safetensors"))
    assert {"model.layers.2.mlp.gate.weight", "model.layers.2.mlp.experts.7.down_proj.weight",
            "model.layers.2.shared_head.norm.weight"} <= set(moe)
    assert "model.layers.2.mlp.gate_proj.weight" not in moe
    capsys.readouterr()
    plain = mm.make_model(tmp_path / "plain", "llama", "tiny", seed=3, progress=False)
    with_mtp = str(mm.make_model(tmp_path / "mtp", "llama", "tiny", seed=3, progress=False, mtp_layers=1))
    assert ModelConfig.from_dir(with_mtp).num_nextn_predict_layers == 1
    a, b = load_file(str(plain / "model.safetensors")), load_file(with_mtp + "/model.safetensors")
    extra = sorted(set(b) - set(a))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert extra[:4] == ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
                         "model.layers.2.hnorm.weight", "model.layers.2.input_layernorm.weight"]
    assert b["model.layers.2.eh_proj.weight"].shape == (64, 128)
    hf = AutoModelForCausalLM.from_pretrained(with_mtp, dtype=torch.float32).eval()
    seqs, _ = three_step_run(with_mtp, 1024)
    with torch.no_grad():
        refs = [hf(torch.tensor([s.tokens])).logits[0] for s in seqs]
    assert_close(seqs, refs)


@pytest.mark.parametrize("arch, start, turn_end", [
    ("llama", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
    ("mistral", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
    ("qwen2", "<|im_start|>system\n", "<|im_end|>"),
    ("qwen3", "<|im_start|>system\n", "<|im_end|>"),
])
def test_tokenizer_and_chat_template_with_transformers(tiny_models, arch, start, turn_end):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    model_dir = tiny_models[arch]
    cfg = ModelConfig.from_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) <= cfg.vocab_size
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith(start) and text.count(turn_end) == 4
    assert text.endswith("assistant<|end_header_id|>\n\n" if turn_end == "<|eot_id|>" else "<|im_start|>assistant\n")
    # Rendering then encoding == encoding in apply_chat_template (no doubled BOS), and ids round-trip.
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    # The raw tokenizers library (what services/text may use) agrees with transformers.
    raw = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids
    # The turn terminator is one special token and a stop id of the model.
    end_id = tok.convert_tokens_to_ids(turn_end)
    assert ids.count(end_id) == 4 and end_id in cfg.eos_token_ids and tok.eos_token == turn_end
    tricky = "12345 abc\n\n  def   x'll CAPS de\u0301ja\u0300 vu 😀\ttail"
    assert raw.encode(tricky, add_special_tokens=False).ids == tok(tricky, add_special_tokens=False)["input_ids"]
    plain = tok("Hello world")["input_ids"]
    assert tok.decode(plain, skip_special_tokens=True) == "Hello world"
    assert (plain[0] == cfg.bos_token_id) == (arch in ("llama", "mistral"))


def test_large_vocab_tokenizer_decodes_every_id_to_text():
    """Llama-3's 128,256 ids exceed the committed BPE asset: the ids past it get fillers that no
    merge produces (encoding is unchanged) but that decode to visible text."""
    from tokenizers import Tokenizer
    from gpu_worker.models.tokenizer_asset import ASSET_VOCAB_SIZE

    big, _ = mm.tokenizer_files("llama", 128256)
    small, _ = mm.tokenizer_files("llama", ASSET_VOCAB_SIZE)
    big_tok, small_tok = Tokenizer.from_str(json.dumps(big)), Tokenizer.from_str(json.dumps(small))
    assert big_tok.get_vocab_size() == 128256
    text = "def encode(self, text):  # the same ids either way, ünïcode too"
    assert big_tok.encode(text).ids == small_tok.encode(text).ids
    for i in (ASSET_VOCAB_SIZE, 100_000, 128255):
        assert big_tok.decode([i]) == f" t{i}"


@pytest.mark.parametrize("argv, needle", [
    (["--vocab-size", "-5", "{tmp}/m"], "--vocab-size"),
    (["--device", "tpu9", "{tmp}/m"], "--device"),
    (["{tmp}/file"], "out_dir"),                    # an existing file, not a directory
    (["{tmp}/file/m"], "out_dir"),                  # its parent is a file: cannot be made
])
def test_cli_bad_values_exit_2_naming_the_argument(tmp_path, capsys, argv, needle):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        mm.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvmesh make-model: error: ") and needle in err
