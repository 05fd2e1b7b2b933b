"""NOTES.txt, what `helm install` prints: its command to resize a pool names a pool the release
has, as the kind the chart made it (a Deployment, or a StatefulSet with a persistent disk KV tier),
and says so instead when an autoscaler owns the pool's replicas (a manual scale would be undone)."""
from __future__ import annotations

import pytest

from tests.helm.chart import CHART, FULLNAME, RELEASE, helm, run_helm  # noqa: F401

PROM = "http://prometheus-operated.monitoring:9090"


@pytest.mark.parametrize("values, wanted, not_wanted", [
    ([], f"kubectl -n llm scale deployment {FULLNAME}-decode --replicas=4", None),
    (["workerPools.prefill.enabled=false", "workerPools.decode.enabled=false", "workerPools.mixed.enabled=true"],
     f"kubectl -n llm scale deployment {FULLNAME}-mixed --replicas=4", f"{FULLNAME}-decode"),
    (["workerPools.decode.kvOffload.disk.enabled=true", "workerPools.decode.kvOffload.disk.persistent=true"],
     f"kubectl -n llm scale statefulset {FULLNAME}-decode --replicas=4", "scale deployment"),
    (["planner.enabled=true", f"planner.prometheusUrl={PROM}"],
     "the planner sets the replicas of the prefill and decode pools", "kubectl -n llm scale"),
    (["workerPools.decode.autoscaling.enabled=true"],
     "its HorizontalPodAutoscaler sets the decode pool's replicas", "kubectl -n llm scale"),
])
def test_notes_resize_a_pool_the_release_has(helm, values, wanted, not_wanted):
    out = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", "llm", "--dry-run=client",
                   *[a for v in values for a in ("--set", v)])
    assert out.returncode == 0, out.stderr
    notes = " ".join(out.stdout.split("NOTES:", 1)[1].split())     # one line: the wrapping is free
    assert wanted in notes, notes
    after_table = notes.split("(bundled)", 1)[1]
    assert not_wanted is None or not_wanted not in after_table, notes
