"""Speculative decoding over one benchmark run: the servers' counters scraped from /metrics before
and after it, their increase reported as acceptance rate and mean accepted length.

    kvmesh (worker /metrics)              vLLM (server /metrics)
    kvmesh_spec_decode_num_drafts_total   vllm:spec_decode_num_drafts_total
    ..._num_draft_tokens_total            vllm:spec_decode_num_draft_tokens_total
    ..._num_accepted_tokens_total         vllm:spec_decode_num_accepted_tokens_total
    ..._num_accepted_tokens_per_pos_total{position}

Samples of each name are summed over every endpoint and label (method, engine) except position.
mean accepted length = 1 + accepted / drafts: the tokens a verifying sequence gains per step.
"""
from __future__ import annotations

import urllib.error
import urllib.request

PREFIXES = ("kvmesh_spec_decode_", "vllm:spec_decode_")
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"
MAX_POSITIONS = 64                 # draft positions reported (servers speculate at most a few)
MAX_METRICS_BYTES = 16 << 20       # a /metrics page larger than this is not read further


def _parse(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    totals: dict = {name: 0.0 for name in COUNTERS}
    totals[PER_POS] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:       # by sample name: exposition formats name families apart
            prefix = next((p for p in PREFIXES if sample.name.startswith(p)), None)
            if prefix is None or not sample.name.endswith("_total"):
                continue                         # another metric, or a counter's _created
            short = sample.name[len(prefix):-len("_total")]
            if short == PER_POS:
                label = sample.labels.get("position", "")
                if not (label.isdigit() and int(label) < MAX_POSITIONS):
                    continue                     # not a draft position this report can show
                pos = int(label)
                totals[PER_POS][pos] = totals[PER_POS].get(pos, 0.0) + sample.value
            elif short in COUNTERS:
                totals[short] += sample.value
    return totals


def scrape(urls: list[str]) -> tuple[dict, list[tuple[str, str]]]:
    """Summed counters over the /metrics pages at `urls`, and (url, why) per page that did not answer."""
    total: dict = {name: 0.0 for name in COUNTERS}
    total[PER_POS] = {}
    notes = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read(MAX_METRICS_BYTES).decode(errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            notes.append((url, str(exc)))
            continue
        page = _parse(text)
        for name in COUNTERS:
            total[name] += page[name]
        for pos, value in page[PER_POS].items():
            total[PER_POS][pos] = total[PER_POS].get(pos, 0.0) + value
    return total, notes


def run_stats(before: dict, after: dict) -> dict | None:
    """The run's speculation (None when it verified no draft)."""
    drafts = after["num_drafts"] - before["num_drafts"]
    tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    if drafts <= 0 or tokens <= 0:
        return None
    per_pos = [after[PER_POS].get(p, 0.0) - before[PER_POS].get(p, 0.0) for p in sorted(after[PER_POS])]
    return {"spec_num_drafts": int(drafts), "spec_num_draft_tokens": int(tokens),
            "spec_num_accepted_tokens": int(accepted), "spec_acceptance_rate": accepted / tokens,
            "spec_mean_accepted_length": 1.0 + accepted / drafts,
            "spec_acceptance_rate_per_pos": [round(a / drafts, 4) for a in per_pos]}


def format_lines(stats: dict) -> list[str]:
    per_pos = ", ".join(f"{r:.3f}" for r in stats["spec_acceptance_rate_per_pos"])
    return ["{s:{c}^{n}}".format(s=" Speculative decoding ", n=50, c="-"),
            f"{'Drafts (verifications):':<40}{stats['spec_num_drafts']:<10}",
            f"{'Draft tokens:':<40}{stats['spec_num_draft_tokens']:<10}",
            f"{'Accepted tokens:':<40}{stats['spec_num_accepted_tokens']:<10}",
            f"{'Acceptance rate (%):':<40}{100 * stats['spec_acceptance_rate']:<10.2f}",
            f"{'Mean accepted length:':<40}{stats['spec_mean_accepted_length']:<10.2f}",
            f"{'Acceptance rate per position:':<40}{per_pos}"]
