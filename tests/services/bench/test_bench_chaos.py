"""`kvmesh bench chaos` end to end: 800 streaming requests on 4 null-model workers through a worker
kill -9, a drain, a Redis restart and a scheduler restart (real processes: the behaviour measured is
about processes), half through a gateway that makes its own text and half through the tokenizer
service. None lost or corrupted, each fault's requests moved and none failed to, the drained worker
exits cleanly, nothing leaked."""
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


def test_chaos_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        main(["chaos", "--workers", "2"])
    assert "--workers must be at least 3" in capsys.readouterr().err
