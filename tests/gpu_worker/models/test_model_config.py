"""ModelConfig parsing and every clear error a bad model directory produces."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gpu_worker.loader import check_checkpoint, read_header
from gpu_worker.make_model import SHAPES, config_json
from gpu_worker.model_config import ModelConfig, ModelLoadError
from gpu_worker.model_runner import ModelRunner


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_each_family_parses(tiny_models):
    llama, qwen2, qwen3, mistral = (ModelConfig.from_dir(tiny_models[a])
                                    for a in ("llama", "qwen2", "qwen3", "mistral"))
    assert (llama.family, llama.qkv_bias, llama.qk_norm, llama.tie_word_embeddings) == ("llama", False, False, False)
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.tie_word_embeddings) == (True, False, True)
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    assert mistral.family == "mistral" and mistral.sliding_window is None
    # eos ids: generation_config.json's list first, then config.json's id, no duplicates
    assert llama.eos_token_ids == (4, 1) and qwen2.eos_token_ids == (6, 7)
    assert llama.bos_token_id == 0 and llama.torch_dtype == "float32"


def test_llama31_8b_config_is_exact():
    cfg = ModelConfig.from_dict(config_json("llama", SHAPES[("llama", "8b")], "bfloat16"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 4096, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (14336, 128256, 131072)
    assert cfg.rope_theta == 500000.0 and not cfg.tie_word_embeddings
    rs = cfg.rope_scaling
    assert (rs.rope_type, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
            rs.original_max_position_embeddings) == ("llama3", 8.0, 1.0, 4.0, 8192)


def test_transformers5_rope_parameters_spelling():
    raw = config_json("llama", SHAPES[("llama", "tiny")], "float32")
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = dict(scaling, rope_theta=raw.pop("rope_theta"))
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 8.0


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}}, "custom code"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
    ({"hidden_size": None}, "lacks 'hidden_size'"),
    ({"num_key_value_heads": 3}, "multiple of"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_config_is_refused(tiny_models, tmp_path, changes, message):
    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    _edit_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dir(model_dir)


def test_missing_and_invalid_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(ModelConfig.from_dir(model_dir), str(model_dir))


def test_missing_weights_file(tiny_models, tmp_path):
    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        _runner(model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelLoadError, match="pickle"):
        _runner(model_dir)


def test_missing_shard_named_in_index(tiny_models, tmp_path):
    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    names = list(read_header(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors is missing"):
        _runner(model_dir)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_corrupt_shard(tiny_models, tmp_path, damage):
    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "garbage_header":
        path.write_bytes(data[:8] + b"\xff" * 40 + data[48:])
    else:
        path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="corrupt"):
        _runner(model_dir)


def test_missing_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = _copy(tiny_models["qwen3"], tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="k_norm"):
        _runner(model_dir)


def test_tensor_the_architecture_does_not_use(tiny_models, tmp_path):
    """A checkpoint tensor with no place in the model is named (one loop serves both loaders:
    loader.copy_checkpoint); a tied model's lm_head.weight is not one of them."""
    from safetensors.torch import load_file, save_file

    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].clone()
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="does not use, e.g. .'model.layers.0.mlp.extra_proj.weight'"):
        _runner(model_dir)


def test_wrong_shape_tensor(tiny_models, tmp_path):
    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    _edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="shape"):
        _runner(model_dir)


def test_check_checkpoint_lists_tensors(tiny_models):
    shards = check_checkpoint(tiny_models["qwen2"], {"model.embed_tokens.weight"})
    names = shards["model.safetensors"]
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names


def test_loading_off_a_terminal_logs_whole_lines(tiny_models, monkeypatch, caplog):
    """A service's stderr is a pipe or a pod log: progress comes as log lines (no tqdm carriage
    returns), the last one with the tensors, bytes and time."""
    import logging
    import sys

    import gpu_worker.loader as loader
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    monkeypatch.setattr(loader, "LOG_EVERY_S", 0.0)        # a line per tensor
    with caplog.at_level(logging.INFO, logger="kvmesh.loader"):
        _runner(tiny_models["llama"])
    lines = [r.getMessage() for r in caplog.records if r.name == "kvmesh.loader"]
    shards = check_checkpoint(tiny_models["llama"], set())
    n = sum(len(names) for names in shards.values())
    assert sum(line.startswith("loading weights: ") and "/" in line.split()[2] for line in lines) == n
    assert lines[-1].startswith(f"loading weights: done, {n} tensors, ") and " MB, from " in lines[-1], lines[-1]


def test_loaded_weights_are_frozen(tiny_models):
    """Inference only: a direct call (outside the runner's inference_mode) builds no autograd
    graph and its outputs carry no grad."""
    runner = _runner(tiny_models["llama"])
    assert not any(p.requires_grad for p in runner.model.parameters())
    logits = runner.model.compute_logits(torch.randn(2, runner.config.hidden_size))
    assert not logits.requires_grad
