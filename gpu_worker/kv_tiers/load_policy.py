"""Load or recompute: how many of a prompt's lower-tier blocks to bring back.

Loading block i costs block_bytes / bandwidth(its tier); computing a token costs 1 / prefill rate.
With the prompt's T uncached tokens of which the first n blocks sit in lower tiers, loading the
first k of them and computing the rest is predicted to take

    cost(k) = sum_{i<k} block_bytes / bw[tier_i]  +  (T - k * block_size) / prefill_rate

and `auto` takes the k in 0..n with the least cost (the largest on a tie): all (load), none
(recompute) or a split, where a fast host prefix is followed by slow disk blocks. `always` loads
all n, `never` none. Bandwidths are measured at start-up and then follow real copies; the
prefill rate follows recent steps that were mostly prefill (tokens over the time between their
starts); both are exponential moving averages. Until a step has been measured, `auto` loads.

Where the load runs (`joins_step`): inside the step that admits the prompt, its forward waiting
layer group by layer group for the copy (the prompt's first token a step sooner), when no other
sequence runs (nobody else waits) or when the predicted load takes no longer than the step's
predicted compute (tokens over the prefill rate: the forward hides the copy); else beside that
step, the prompt joining a later one, so running requests never wait for another's load.
"""
from __future__ import annotations

from typing import NamedTuple

from gpu_worker.prefill_rate import PrefillRate, ewma

POLICIES = ("auto", "always", "never")


class LoadPlan(NamedTuple):
    num_blocks: int            # blocks to load, from the first lower-tier block on
    load_s: float              # predicted time of loading them
    recompute_s: float         # predicted time of computing the rest of the prompt


class LoadPolicy:
    def __init__(self, policy: str, block_bytes: int, block_size: int) -> None:
        assert policy in POLICIES, policy
        self.policy = policy
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.bandwidth: dict[str, float] = {}          # tier -> bytes per second
        self.prefill = PrefillRate()                   # the engine's scheduler measures it

    @property
    def prefill_rate(self) -> float | None:
        """Tokens per second; None until a step has been measured."""
        return self.prefill.rate

    @prefill_rate.setter
    def prefill_rate(self, rate: float | None) -> None:
        self.prefill.rate = rate

    def observe_copy(self, tier: str, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.bandwidth[tier] = ewma(self.bandwidth.get(tier), num_bytes / seconds)

    def joins_step(self, load_s: float, step_tokens: int, others_running: bool) -> bool:
        """Load inside this step (True) or beside it (False); see the module's docstring."""
        if not others_running:
            return True
        return self.prefill_rate is not None and load_s <= step_tokens / self.prefill_rate

    def choose(self, tiers: list[str], num_uncached_tokens: int) -> LoadPlan:
        """`tiers`: the tier of each lower-tier block, in prompt order; num_uncached_tokens: the
        prompt tokens after the device's prefix hit (T above)."""
        per_block = [self.block_bytes / self.bandwidth[t] if self.bandwidth.get(t) else 0.0 for t in tiers]
        rate = self.prefill_rate
        recompute_s = (lambda tokens: tokens / rate) if rate else (lambda tokens: 0.0)
        if self.policy == "never":
            return LoadPlan(0, 0.0, recompute_s(num_uncached_tokens))
        if self.policy == "always" or rate is None:
            k = len(tiers)
            return LoadPlan(k, sum(per_block), recompute_s(num_uncached_tokens - k * self.block_size))
        best = LoadPlan(0, 0.0, recompute_s(num_uncached_tokens))
        load_s = 0.0
        for k in range(1, len(tiers) + 1):
            load_s += per_block[k - 1]
            plan = LoadPlan(k, load_s, recompute_s(num_uncached_tokens - k * self.block_size))
            if plan.load_s + plan.recompute_s <= best.load_s + best.recompute_s:
                best = plan
        return best
