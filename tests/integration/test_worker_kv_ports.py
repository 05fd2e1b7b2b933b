"""A worker binds its KV-event and snapshot sockets on the ports it is given (--kv-events-port,
--kv-snapshot-port) and advertises exactly those, so a NetworkPolicy or firewall can name them
(the Helm chart fixes them)."""
from __future__ import annotations

from services.ports import free_port
from tests.integration.stack import records, redis_and_procs, wait_for


def test_worker_advertises_the_fixed_kv_event_and_snapshot_ports(tiny_model, tmp_path):
    events_port, snapshot_port = free_port(), free_port()
    while snapshot_port == events_port:
        snapshot_port = free_port()
    with redis_and_procs(tmp_path) as (redis, procs):
        procs.start_worker("w-fixed", tiny_model, "--kv-events-port", str(events_port),
                           "--kv-snapshot-port", str(snapshot_port))
        record = wait_for(lambda: next((r for r in records(redis.client_url, "worker") if r.id == "w-fixed"), None),
                          180, "the worker's registry record")
        assert record.addrs["kv_events"] == f"tcp://127.0.0.1:{events_port}#worker"   # the role serving it picks the CURVE key
        assert record.addrs["kv_snapshot"] == f"tcp://127.0.0.1:{snapshot_port}#worker"
