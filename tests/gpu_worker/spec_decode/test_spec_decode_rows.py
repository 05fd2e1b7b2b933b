"""Verification steps as decode rows (batch_builder.build_decode_rows): the batch is the extend
form's row for row (tokens, positions, slots, logits rows), each row reading its sequence's
block table up to its own position; a model's logits are the extend form's, through a sliding
window, an fp8 KV cache and the decode graphs' replay (on the CPU the graphs' buffer logic runs
eagerly); and greedy tokens with n-gram, draft-model and MTP speculation replaying decode graphs
for their verification steps (MTP's graphs keeping the target's pre-norm states) are those of
decoding without speculation, through batching, chunked prefill, prefix hits and preemption,
with exact block accounting after every step. On CUDA (marked gpu) the same engines capture and
replay real CUDA graphs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_worker.batch_builder import BatchBuilder, fits_decode_rows
from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.model_config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.scheduler import ScheduledSeq
from services.protocol.sampling import SamplingParams
from tests.gpu_worker.devices import CPU_AND_CUDA
from tests.gpu_worker.engine.conftest import _one_torch_thread, tiny_models  # noqa: F401  (fixtures)
from tests.gpu_worker.spec_decode.draft_models import draft_spec, near_copy
from tests.gpu_worker.spec_decode.mtp_models import Recompute, mtp_spec, random_mtp, spy_first_drafts
from tests.gpu_worker.spec_decode.spec_fakes import ngram, prompt, repetitive
from tests.gpu_worker.spec_decode.test_draft_model import drain

BS = 4          # block size: verification rows cross block boundaries


def _seq(tokens: list[int], computed: int, blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, num_computed_tokens=computed, block_table=blocks)


def _verify_step() -> tuple[list[ScheduledSeq], list[int]]:
    """Two sequences verifying 3 and 2 drafts beside a plain decode; a's drafts cross a block."""
    a = _seq(list(range(10, 20)), 6, [3, 1, 4])          # x at 6, drafts at 7, 8, 9
    b = _seq(list(range(30, 35)), 2, [2, 5])             # x at 2, drafts at 3, 4
    c = _seq(list(range(40, 48)), 7, [6, 7])             # decode at 7
    return [ScheduledSeq(a, 4), ScheduledSeq(b, 3), ScheduledSeq(c, 1)], [3, 2, 0]


def test_decode_rows_are_the_extend_form_row_for_row():
    scheduled, drafts = _verify_step()
    assert fits_decode_rows(scheduled, drafts)
    ext = BatchBuilder(BS, "cpu", num_staging=1).build(scheduled, drafts)
    rows = BatchBuilder(BS, "cpu", num_staging=1).build_decode_rows(scheduled)
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        assert torch.equal(getattr(rows, name), getattr(ext, name)), name
    assert rows.logits_indices.tolist() == list(range(8))          # every row draws, in order
    assert rows.is_pure_decode and rows.num_seqs == rows.num_tokens == rows.num_decode_seqs == 8
    assert rows.context_lens.tolist() == [7, 8, 9, 10, 3, 4, 5, 8]  # position + 1: rows < j seen
    seq_of_row = [0, 0, 0, 0, 1, 1, 1, 2]
    for r, s in enumerate(seq_of_row):
        assert torch.equal(rows.block_tables[r], ext.block_tables[s])
    # a prefill chunk (b's prompt not all computed) or a chunk that does not sample keeps the extend form
    prefill = _seq(list(range(50, 60)), 0, [8, 9, 10])
    assert not fits_decode_rows(scheduled + [ScheduledSeq(prefill, 10)], drafts + [0])
    assert not fits_decode_rows(scheduled + [ScheduledSeq(prefill, 1)], drafts + [0])
    assert not fits_decode_rows([ScheduledSeq(scheduled[0].seq, 3)], [3])   # budget cut a draft


@pytest.fixture(scope="module")
def window_model(tmp_path_factory) -> str:
    """A tiny Mistral whose sliding window (5) is shorter than the test contexts."""
    from gpu_worker.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("swa"), "mistral", "tiny", seed=3, progress=False, sliding_window=5))


@pytest.mark.parametrize("case", ["llama", "sliding_window", "fp8_kv", "graphs"])
def test_a_models_logits_are_the_extend_forms(case, tiny_models, window_model):
    model_dir = window_model if case == "sliding_window" else tiny_models["llama"]
    kv = torch.float8_e4m3fn if case == "fp8_kv" else None
    runner = ModelRunner(ModelConfig.from_dir(model_dir), model_dir, kv_cache_dtype=kv)
    runner.allocate_kv_cache(16, BS)
    if case == "graphs":                          # the CPU stand-in: buffers, padding rows, replay
        runner.capture_cuda_graphs(16, 64)
    builder = BatchBuilder(BS, "cpu")
    scheduled, drafts = _verify_step()
    for item in scheduled:                        # every prefix computed, into its own blocks
        seq = item.seq
        runner.forward(builder.build([(_seq(seq.token_ids, 0, seq.block_table), seq.num_computed_tokens)]))
    ext = runner.forward(builder.build(scheduled, drafts)).clone()     # (8, V)
    batch = builder.build_decode_rows(scheduled)
    if case == "graphs":
        assert runner.decode_graphs.can_run(batch)   # replayed, not eager
    rows = runner.forward(batch)                    # (8, V); the same slots rewritten
    torch.testing.assert_close(rows.float(), ext.float(), rtol=1e-4, atol=1e-4)


# ---- engines -----------------------------------------------------------------------------

# CPU: torch attention, decode graphs captured by the test (their CPU stand-in). CUDA (marked
# gpu): fp32 through the Triton kernels, the engine capturing real decode graphs.
TARGETS = {"cpu": dict(device="cpu"),
           "cuda": dict(device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=32)}


@pytest.fixture(params=CPU_AND_CUDA)
def target(request) -> dict:
    return TARGETS[request.param]


def graph_engine(target: dict, model_dir: str, spec: str | None, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 128)
    eng = Engine(EngineConfig(model=model_dir, speculative_config=spec, **target, **kw))
    if eng.device.type == "cpu":                  # what Engine._prepare_gpu captures on CUDA
        if eng.speculator is not None and eng.speculator.reads_prenorm:
            eng.runner.capture_prenorm_cuda_graphs(32, eng.max_model_len)
        else:
            eng.runner.capture_cuda_graphs(32, eng.max_model_len)
    return eng


def count_verify_replays(eng: Engine) -> list[int]:
    """Rows of each decode-graph replay that ran a verification step built as decode rows."""
    built, replays = [], []
    build = eng.batch_builder.build_decode_rows

    def spy_build(scheduled):
        built.append(batch := build(scheduled))
        return batch

    eng.batch_builder.build_decode_rows = spy_build
    for graphs in (eng.runner.decode_graphs, eng.runner.short_decode_graphs):
        if graphs is not None:
            def spy_run(batch, run=graphs.run):
                if any(batch is b for b in built):
                    replays.append(batch.num_seqs)
                return run(batch)
            graphs.run = spy_run
    return replays


def greedy(n: int = 1, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def _arrivals() -> dict[int, list]:
    shared = repetitive(36, 6, 1)
    prompts = {"a": repetitive(30, 5, 2), "b": shared + [11], "c": prompt(40, 3), "d": shared + [12]}
    return {0: [("a", prompts["a"], greedy()), ("b", prompts["b"], greedy())],
            3: [("c", prompts["c"], greedy(n=2))], 12: [("d", prompts["d"], greedy())]}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verification_replays_decode_graphs_and_matches_no_speculation(method, target, tiny_models, tmp_path):
    """Staggered arrivals, chunked prefill (mixed steps stay on the extend path), prefix hits,
    n = 2, and preemption (16 blocks of 8 for 5 sequences)."""
    model_dir = tiny_models["llama"]
    spec = ngram(k=4, lo=1, hi=3) if method == "ngram" else draft_spec(near_copy(model_dir, tmp_path / "near", 0.3), k=3)
    kw = dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks=16)
    plain = drain(graph_engine(target, model_dir, None, **kw), _arrivals())
    eng = graph_engine(target, model_dir, spec, **kw)
    replays = count_verify_replays(eng)
    assert drain(eng, _arrivals()) == plain
    stats = eng.stats()
    assert stats.num_preemptions > 0 and eng.block_manager.prefix_hit_tokens >= 32
    spec_stats = stats.extra["spec_decode"]
    assert spec_stats["accepted"] > 0
    if method == "draft_model":       # (n-gram drafts of this model rarely meet a prefill chunk)
        assert spec_stats["extend_steps"] > 0          # a prefill chunk beside verifications
    assert len(replays) == spec_stats["decode_row_steps"] > 5     # every decode-row step replayed
    assert max(replays) > 4                                       # several sequences' rows at once


@pytest.mark.parametrize("case", ["fp8_kv", "sliding_window"])
def test_fp8_kv_and_a_sliding_window_match_no_speculation(case, target, tiny_models, window_model):
    """fp8: a verification row reads its drafts' K/V from the fp8 cache, as a plain decode step
    reads the tokens before it. Window 5 < the drafts' contexts. The target drafts for itself
    (draft_model with its own directory), so drafts are accepted whatever the random weights."""
    model_dir = window_model if case == "sliding_window" else tiny_models["llama"]
    kw = dict(kv_cache_dtype="fp8") if case == "fp8_kv" else {}
    ids = {f"r{i}": repetitive(20, 3 + i, 10 + i) for i in range(3)}
    arrivals = {0: [(rid, p, greedy()) for rid, p in ids.items()]}
    plain = drain(graph_engine(target, model_dir, None, **kw), arrivals)
    eng = graph_engine(target, model_dir, draft_spec(model_dir, k=4), **kw)
    replays = count_verify_replays(eng)
    assert drain(eng, arrivals) == plain
    spec_stats = eng.stats().extra["spec_decode"]
    assert spec_stats["accepted"] > 0 and len(replays) == spec_stats["decode_row_steps"] > 3


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return random_mtp("llama", tmp_path_factory.mktemp("mtp") / "random")


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_mtp_replays_decode_graphs_that_keep_the_prenorm_states(scheduling, target, mtp_model):
    """Every MTP row reads the target's pre-norm state h_i: first drafts equal to a recompute from
    scratch at every speculative step mean the graphs' states (plain decode steps' and
    verification rows') were right, through chunked prefill, prefix hits and preemption; async:
    a launched step's states are read by settle() right after its launch, before the next
    step's forward replays a graph over them."""
    kw = dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks=16, async_scheduling=scheduling == "async")
    plain = drain(graph_engine(target, mtp_model, None, **kw), _arrivals())
    eng = graph_engine(target, mtp_model, mtp_spec(3), **kw)
    assert eng.runner.prenorm_rows is not None and eng.runner.prefill_graphs is None
    replays, seen = count_verify_replays(eng), spy_first_drafts(eng)
    assert drain(eng, _arrivals()) == plain
    assert eng.stats().num_preemptions > 0 and eng.block_manager.prefix_hit_tokens >= 32
    spec_stats = eng.stats().extra["spec_decode"]
    assert len(replays) == spec_stats["decode_row_steps"] > 5
    ref = Recompute(mtp_model)
    assert [draft for _, draft in seen] == [ref.first_draft(tokens) for tokens, _ in seen]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_speculating_engines_capture_unfused_decode_graphs(tiny_models):
    """The fused RoPE decode kernel writes K/V inside the attention launch, where another row of
    the same sequence could read the slot first: a speculating engine's runners go without it,
    and its graphs reach a verification step's rows."""
    eng = Engine(EngineConfig(model=tiny_models["llama"], speculative_config=ngram(k=4, disable_by_batch_size=8),
                              max_num_seqs=16, **TARGETS["cuda"]))
    assert not eng.runner.attention.fuse_rope_decode
    assert eng.runner.decode_graphs.max_batch_size == 32          # min(32, max(16, 8 x 5))
