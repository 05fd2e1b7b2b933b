"""`kvmesh bench chaos` end to end: 800 streaming requests on 4 null-model workers through a worker
kill -9, a drain, a Redis restart and a scheduler restart (real processes: the behaviour measured is
about processes), half through a gateway that makes its own text and half through the tokenizer
service. None lost or corrupted, each fault's requests moved and none failed to, the drained worker
exits cleanly, nothing leaked; the moved requests' added latency (resumed streams timed by their
detokenizers, requests re-sent or moved before their first token by their gateways), as the
processes log it and as their histograms hold it, agree, and every move is timed or named untimed."""
from __future__ import annotations

import json

import pytest

from services.bench.cli import main


def test_800_requests_through_every_fault_lose_and_corrupt_nothing(tmp_path, capsys):
    out = tmp_path / "chaos.json"
    # 10 ms steps and 96 streams at once keep 800 requests within the CI budget on 2 cores; a 50 ms
    # drain grace leaves the drained worker streams to hand back (most streams last over 0.16 s)
    assert main(["chaos", "--requests", "800", "--concurrency", "96", "--step-ms", "10", "--drain-grace-s", "0.05",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["faults"]) == ["drain_worker", "kill_worker", "restart_redis", "restart_scheduler"]
    assert (res["lost"], res["corrupted"], res["leaked_kv_blocks"], res["leaked_leases"]) == (0, 0, 0, 0), res
    moved = {k: v for k, v in res["migrated"].items() if 'outcome="moved"' in k}
    assert all(any(f'reason="{r}"' in k and v > 0 for k, v in moved.items()) for r in ("worker_died", "drain")), res
    assert not any('outcome="failed"' in k and v for k, v in res["migrated"].items()), res
    assert res["drained_exit"] == 0
    assert "| 800 | 0 | 0 |" in capsys.readouterr().out
    # the moved requests' waits: each process's log lines (exact quantiles) and its histograms agree
    resumed = res["moved_streams"].get("resumed", 0)
    assert 0 < resumed == res["moved_stall_logged"] == res["moved_stall_observed"], res
    assert abs(res["moved_stall_logged_sum_s"] - res["moved_stall_observed_sum_s"]) <= 0.002, res
    # the scheduler restart: requests it had queued are re-sent before their first token and timed;
    # with those moved off a stopped worker before it opened their streams, by their gateways
    assert res["resent_wait_logged"] > 0, res
    assert res["gateway_wait_logged"] == res["resent_wait_logged"] + res["moved_early_logged"], res
    assert res["gateway_wait_logged"] == res["gateway_wait_observed"], res
    assert abs(res["gateway_wait_logged_sum_s"] - res["gateway_wait_observed_sum_s"]) <= 0.002, res
    assert res["moved_timed"] == res["moved_stall_logged"] + res["gateway_wait_logged"], res
    # every move no process timed is named: a second one within one wait, or one with no wait
    assert res["moved_untimed"] <= res["moved_untimed_again"] + res["moved_untimed_no_wait"], res
    assert res["moved_timed"] == res["stall_buckets"]["inf"], res   # both histograms, merged, hold every wait
    p50, p99 = res["moved_added_latency_p50_ms"], res["moved_added_latency_p99_ms"]
    assert 0 < p50 <= p99 <= res["moved_added_latency_max_ms"], res
    assert res["moved_added_latency_max_ms"] == max(res["resumed_added_latency_max_ms"],
                                                    res["resent_added_latency_max_ms"],
                                                    res["moved_early_added_latency_max_ms"]), res
    bounds = [0.0] + [1000 * float(le) for le in res["stall_buckets"]]
    for exact, hist in ((p50, res["moved_added_latency_hist_p50_ms"]), (p99, res["moved_added_latency_hist_p99_ms"])):
        # histogram_quantile() lands in the bucket that holds the exact (nearest-rank) quantile
        i = next(i for i in range(1, len(bounds)) if exact <= bounds[i] + 0.1)
        assert bounds[i - 1] - 0.1 <= hist <= min(bounds[i], bounds[-2]) + 0.1, (exact, hist, res["stall_buckets"])


def test_chaos_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        main(["chaos", "--workers", "2"])
    assert "--workers must be at least 3" in capsys.readouterr().err
