"""Engines with KV tiers on tiny models, multi-turn chats that push their history out of the
device's pool, and the integrity check of every tier."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from services.protocol.sampling import SamplingParams
# the engine tests' models and transformers references, shared rather than made twice
from tests.gpu_worker.engine.conftest import HFReference, _one_torch_thread, arch_model, tiny_models  # noqa: F401  (fixtures)

MAX_STEPS = 2_000           # every drive loop below is bounded
BLOCK_SIZE = 4
OUT_TOKENS = 4


@pytest.fixture
def llama(tiny_models) -> tuple[str, HFReference]:
    from tests.gpu_worker.engine import conftest as engine_conftest
    if "llama" not in engine_conftest._HF:
        engine_conftest._HF["llama"] = HFReference(tiny_models["llama"])
    return tiny_models["llama"], engine_conftest._HF["llama"]


def tiered_engine(model_dir: str, num_gpu_blocks: int = 24, **kw) -> Engine:
    kw.setdefault("device", "cpu")
    # the tiers' mechanics, not the policy: on the CPU the tiny models recompute faster than they
    # load, so `auto` recomputes as soon as a prompt's step has measured the prefill rate
    kw.setdefault("kv_load_policy", "always")
    return Engine(EngineConfig(model=model_dir, num_gpu_blocks=num_gpu_blocks, block_size=BLOCK_SIZE, **kw))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int = OUT_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(eng: Engine, request_id: str, prompt: list[int], max_tokens: int = OUT_TOKENS) -> tuple[list[int], int]:
    """One request to the end: (its tokens, its num_cached_tokens)."""
    eng.add_request(request_id, prompt, greedy(max_tokens))
    out, cached = [], 0
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished_requests():
            return out, cached
        for delta in eng.step():
            out += delta.new_token_ids
            cached = delta.num_cached_tokens
    raise AssertionError(f"{request_id} did not finish in {MAX_STEPS} steps")


def push_out(eng: Engine, seed: int) -> None:
    """A request of unrelated tokens filling the device pool: the LRU evicts what it cached."""
    n = eng.block_manager.num_blocks * BLOCK_SIZE - 2          # every block of the pool
    run(eng, f"filler-{seed}", tokens(n, 10_000 + seed), max_tokens=1)


def chat(eng: Engine, turns: int, seed: int = 0, between=None) -> list[tuple[list[int], list[int], int]]:
    """A chat whose every turn is the history + the last answer + a new user message, with the
    history pushed out of the device pool between turns: [(prompt, answer, cached_tokens)].
    between(eng, turn, next_prompt) runs before each next turn."""
    history, out = tokens(12, seed), []
    for turn in range(turns):
        answer, cached = run(eng, f"chat-{seed}-{turn}", history)
        out.append((list(history), answer, cached))
        push_out(eng, seed * 100 + turn)
        history = history + answer + tokens(5, seed * 1000 + turn)
        if between is not None:
            between(eng, turn, history)
    return out


def check_all_tiers(eng: Engine) -> None:
    """free + cached + used == total on the device and in every lower tier; nothing in use."""
    eng.block_manager.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    if eng.kv_tiers is not None:
        eng.kv_tiers.check_integrity()


def tier_stats(eng: Engine) -> dict:
    return eng.stats().extra["kv_tiers"]


def prompt_hashes(eng: Engine, prompt: list[int]) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the engine computes them."""
    from services.prefix_hash import chain_hashes
    return chain_hashes(None, eng.block_manager.model_id, "", prompt, BLOCK_SIZE)


def decoding(eng, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Start a request and step until it has its first token (it decodes from then on)."""
    eng.add_request(request_id, prompt, greedy(max_tokens))
    for _ in range(MAX_STEPS):
        out = [t for d in eng.step() if d.request_id == request_id for t in d.new_token_ids]
        if out:
            return out
    raise AssertionError(f"{request_id} produced no token")
