"""kvmesh bench chaos's reading of the moved streams' stalls: the detokenizers' log lines (exact
quantiles) and their /metrics pages (histogram quantiles, as Prometheus computes them)."""
from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.bench.chaos_stalls import bucket_quantile, logged_stalls, nearest_rank, parse


def test_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (nearest_rank(values, 0.5), nearest_rank(values, 0.99), nearest_rank(values, 1.0)) == (50.0, 99.0, 100.0)
    assert nearest_rank([7.0], 0.99) == 7.0


def test_bucket_quantile_interpolates_as_histogram_quantile():
    buckets = {0.1: 2.0, 0.5: 6.0, 1.0: 8.0, math.inf: 10.0}
    assert math.isclose(bucket_quantile(buckets, 0.5), 0.1 + 0.4 * (5 - 2) / 4)   # rank 5, in (0.1, 0.5]
    assert math.isclose(bucket_quantile(buckets, 0.1), 0.1 * 1 / 2)              # rank 1, in (0, 0.1]
    assert bucket_quantile(buckets, 0.99) == 1.0                                   # in +Inf: highest bound
    assert math.isnan(bucket_quantile({0.1: 0.0, math.inf: 0.0}, 0.5))


def test_pages_are_summed_and_log_lines_read(tmp_path):
    pages = []
    for stalls, resumed in (([0.02, 0.3], 2), ([0.7], 1)):      # the tokenizer service and a gateway
        registry = CollectorRegistry()
        hist = Histogram("kvmesh_detok_migration_stall_seconds", "", buckets=(0.1, 0.5, 1), registry=registry)
        moved = Counter("kvmesh_detok_migrations", "", ["outcome"], registry=registry)
        for s in stalls:
            hist.observe(s)
        moved.labels("resumed").inc(resumed)
        moved.labels("aborted").inc()
        pages.append(generate_latest(registry).decode())
    got = parse(pages)
    assert got["buckets"] == {0.1: 1.0, 0.5: 2.0, 1.0: 3.0, math.inf: 3.0}
    assert (got["count"], round(got["sum"], 6)) == (3.0, 1.02)
    assert got["outcomes"] == {"resumed": 3.0, "aborted": 2.0}


def test_log_lines_are_the_detokenizers_own(tmp_path, caplog):
    """The lines a DetokCore writes for two resumed streams, read back to the microsecond."""
    from services.protocol.messages import Migrate, SeqTokens, StepOutput, StreamOpen
    from services.protocol.sampling import SamplingParams
    from services.text.streams import DetokCore
    now = [10.0]

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)
    core = DetokCore(Tok(), lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvmesh.detok"):
        for rid, stall in (("a", 0.3), ("b", 0.0205)):
            core.open(StreamOpen(request_id=rid, params=SamplingParams(), reply_addr="gw", num_prompt_tokens=1))
            core.migrate(Migrate(request_id=rid, worker_id="w1", reply_addr="sched"))
            now[0] += stall
            core.step(StepOutput(worker_id="w2", epoch=1, step=0, seqs=[SeqTokens(rid, 0, [1])]))
    log = tmp_path / "tokenizer.log"
    log.write_text(caplog.text + "a line of something else\n")
    assert [round(s, 6) for s in logged_stalls([log, tmp_path / "absent.log"])] == [0.0205, 0.3]
