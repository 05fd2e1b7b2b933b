"""`kvmesh bench chaos` end to end, small: 40 streaming requests on 4 null-model workers through a
worker kill -9, a drain, a Redis restart and a scheduler restart (real processes: the behaviour
measured is about processes). None lost or corrupted, something migrated, nothing leaked."""
from __future__ import annotations

import json

import pytest

from services.bench.cli import main


def test_chaos_loses_nothing_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "chaos.json"
    assert main(["chaos", "--requests", "40", "--concurrency", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["faults"]) == ["drain_worker", "kill_worker", "restart_redis", "restart_scheduler"]
    assert (res["lost"], res["corrupted"], res["leaked_kv_blocks"], res["leaked_leases"]) == (0, 0, 0, 0), res
    assert res["migrated_total"] > 0
    assert "| 40 | 0 | 0 |" in capsys.readouterr().out


def test_chaos_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        main(["chaos", "--workers", "2"])
    assert "--workers must be at least 3" in capsys.readouterr().err
