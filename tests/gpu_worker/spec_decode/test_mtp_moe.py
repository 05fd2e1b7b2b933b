"""mtp speculation on MoE models, whose MTP layer (checkpoint layer L = num_hidden_layers) is MoE
where the family's rule makes layer L MoE: the rule at L (ModelConfig.mtp_moe_layers); the layer
equal to a plain-torch reference read from the checkpoint's hub-named tensors (mtp_reference.py)
for Qwen3-MoE and Mixtral; greedy tokens identical to decoding without speculation through
batching, chunked prefill, prefix hits and preemption, every first draft equal to a recompute;
an oracle MoE MTP layer accepts every draft; a checkpoint whose MTP MLP is not what the rule
says is refused, naming the tensors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from gpu_worker.batch_builder import build_forward_batch
from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.model_config import ModelConfig, ModelLoadError
from gpu_worker.models.moe import SparseMoE
from gpu_worker.models.mtp_module import mtp_prefix
from gpu_worker.mtp_oracle import write_mtp_oracle
from tests.gpu_worker.devices import CPU_AND_CUDA
from tests.gpu_worker.engine.conftest import _one_torch_thread  # noqa: F401  (fixture)
from tests.gpu_worker.spec_decode.mtp_models import Recompute, mtp_spec, random_mtp, spy_first_drafts
from tests.gpu_worker.spec_decode.mtp_reference import ReferenceMTP
from tests.gpu_worker.spec_decode.spec_fakes import prompt, repetitive
from tests.gpu_worker.spec_decode.test_draft_model import drain, greedy

K = 3
TARGETS = {"cpu": dict(device="cpu"),
           "cuda": dict(device="cuda", dtype="float32", attention_backend="triton")}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp_moe")
    random = random_mtp("qwen3_moe", root / "qwen3_moe")
    return {"qwen3_moe": random, "mixtral": random_mtp("mixtral", root / "mixtral"),
            "oracle": write_mtp_oracle(random, root / "oracle", branch=0.0)}


def engine(model_dir: str, device: str, k: int | None = K, **kw) -> Engine:
    """k None: the same engine without speculation. No back-off: the random layer's drafts are
    mostly rejected, and every step that may draft should verify (its KV checked each time)."""
    kw.setdefault("num_gpu_blocks", 128)
    spec = mtp_spec(k, backoff_max_steps=0) if k else None
    return Engine(EngineConfig(model=model_dir, speculative_config=spec, **TARGETS[device], **kw))


def _config(model_dir: str, **changes) -> ModelConfig:
    raw = json.loads(open(f"{model_dir}/config.json").read())
    return ModelConfig.from_dict({**raw, **changes})


def test_the_mtp_layer_is_moe_where_the_familys_rule_makes_layer_L_moe(moe_models):
    """L = 2 for these configs: Qwen3-MoE's step and mlp_only_layers apply at L as at any
    decoder layer (DeepSeek-V3's convention, vLLM's deepseek_mtp.py); Mixtral's is always MoE."""
    qwen = moe_models["qwen3_moe"]
    assert _config(qwen).mtp_moe_layers == (2,) and _config(qwen).moe_layers == (0, 1)
    assert _config(qwen, mlp_only_layers=[2]).mtp_moe_layers == ()
    assert _config(qwen, decoder_sparse_step=3).mtp_moe_layers == (2,)          # (2 + 1) % 3 == 0
    assert _config(qwen, decoder_sparse_step=2).mtp_moe_layers == ()
    assert _config(qwen, decoder_sparse_step=2).moe_layers == (1,)
    assert _config(qwen, num_nextn_predict_layers=0).mtp_moe_layers == ()
    assert _config(moe_models["mixtral"]).mtp_moe_layers == (2,)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_moe_mtp_layer_equals_a_plain_torch_reference(moe_models, arch):
    """The MtpRunner's g and logits over a prompt, given the target's pre-norm states, equal the
    reference's from the checkpoint's tensors: the MoE layer is built and loaded as named."""
    model_dir = moe_models[arch]
    ref, rec = ReferenceMTP(model_dir), Recompute(model_dir, max_len=64)
    assert ref.is_moe() and isinstance(rec.mtp.module.layer.mlp, SparseMoE)
    tokens = prompt(23, 7)
    n = len(tokens)
    whole = SimpleNamespace(token_ids=tokens, num_computed_tokens=0, block_table=rec.table)
    h = rec.runner.forward_with_prenorm(build_forward_batch([(whole, n)], rec.block_size, "cpu")).prenorm[:n - 1]
    shifted = SimpleNamespace(token_ids=tokens[1:], num_computed_tokens=0, block_table=rec.table)
    g = rec.mtp.forward(build_forward_batch([(shifted, n - 1)], rec.block_size, "cpu"), h)
    want = ref.g(tokens[1:], h)
    torch.testing.assert_close(g, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(rec.mtp.logits(g), ref.logits(want), atol=2e-3, rtol=2e-3)
    # the module reads every tensor of layer L but DeepSeek's copies of the embedding and head
    names = {k for f in sorted(Path(model_dir).glob("*.safetensors"))
             for k in safe_open(str(f), "pt").keys() if k.startswith(mtp_prefix(rec.mtp.config))}
    assert names == set(rec.mtp.module.hf_weight_targets())


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_moe_mtp_through_chunks_prefix_hits_and_preemption_matches_no_speculation(moe_models, device):
    """Greedy tokens equal decoding without speculation, and every first draft equals a
    recompute from scratch (the MoE layer's KV and pending rows right on every path)."""
    model_dir = moe_models["qwen3_moe"]
    shared = prompt(36, 1)
    arrivals = {0: [("a", prompt(30, 2), greedy()), ("b", shared + [11, 12], greedy())],
                3: [("c", prompt(40, 3), greedy(n=2))], 20: [("d", shared + [11, 13], greedy())]}
    kw = dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks=16)   # 5 x 7 blocks: preempts
    plain = drain(engine(model_dir, device, None, **kw), arrivals)
    eng = engine(model_dir, device, **kw)
    seen = spy_first_drafts(eng)
    assert drain(eng, arrivals) == plain and len(plain) == 5
    assert eng.block_manager.prefix_hit_tokens >= 32 and eng.stats().num_preemptions > 0
    assert eng.stats().extra["spec_decode"]["verify_steps"] > 20
    ref = Recompute(model_dir)
    assert [draft for _, draft in seen] == [ref.first_draft(tokens) for tokens, _ in seen]


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_an_oracle_moe_mtp_layer_accepts_every_draft(moe_models, device):
    """write_mtp_oracle silences every expert's down projection too: the target is a bigram
    model and its MoE MTP layer the bigram, so each step's k drafts are all accepted. Expert
    parallelism asked for at tensor_parallel_size 1 is a no-op for the MTP layer as for the
    decoder's MoE layers."""
    eng = engine(moe_models["oracle"], device, enable_expert_parallel=True)
    steps = 1 + 4 * (K + 1)
    ids = {f"r{i}": repetitive(20, 4 + i, i) for i in range(2)}
    out = drain(eng, {0: [(rid, p, greedy(max_tokens=steps)) for rid, p in ids.items()]})
    stats = eng.stats().extra["spec_decode"]
    assert stats["verify_steps"] == 2 * 4 and stats["accepted"] == stats["proposed"] == 2 * 4 * K
    assert all(len(t) == steps for t in out.values())


def test_an_mtp_layer_unlike_the_rule_is_refused_naming_tensors(moe_models, tmp_path):
    """A checkpoint with an MoE MTP layer where config.json makes layer L dense (mlp_only_layers)
    is refused at start, naming tensors: never loaded as the wrong kind of layer."""
    dense = tmp_path / "dense"
    shutil.copytree(moe_models["qwen3_moe"], dense)
    raw = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**raw, "mlp_only_layers": [2]}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.(down|gate|up)_proj\.weight"):
        engine(str(dense), "cpu")
