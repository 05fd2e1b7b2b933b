"""kvmesh bench chaos's reading of the moved requests' added latency: the detokenizers' and the
gateways' log lines (exact quantiles) and their /metrics pages (histogram quantiles, as Prometheus
computes them)."""
from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from services.bench.chaos_stalls import (
    MOVED_EARLY_LINE, RESENT, RESENT_LINE, STALL, STALL_LINE, bucket_quantile, logged, merged_buckets, nearest_rank,
    parse, summary, untimed)


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
    for stalls, resumed, waits in (([0.02, 0.3], 2, [0.4]), ([0.7], 1, []), ([], 0, [2.0])):   # two detokenizers
        registry = CollectorRegistry()                                                         # and a gateway
        hist = Histogram(STALL, "", buckets=(0.1, 0.5, 1), registry=registry)
        resent = Histogram(RESENT, "", buckets=(0.1, 0.5, 1), registry=registry)
        moved = Counter("kvmesh_detok_migrations", "", ["outcome"], registry=registry)
        for s in stalls:
            hist.observe(s)
        for w in waits:
            resent.observe(w)
        if resumed:
            moved.labels("resumed").inc(resumed)
            moved.labels("aborted").inc()
        pages.append(generate_latest(registry).decode())
    got = parse(pages)
    assert got[STALL]["buckets"] == {0.1: 1.0, 0.5: 2.0, 1.0: 3.0, math.inf: 3.0}
    assert (got[STALL]["count"], round(got[STALL]["sum"], 6)) == (3.0, 1.02)
    assert got[RESENT]["buckets"] == {0.1: 0.0, 0.5: 1.0, 1.0: 1.0, math.inf: 2.0}
    assert (got[RESENT]["count"], round(got[RESENT]["sum"], 6)) == (2.0, 2.4)
    assert merged_buckets(got[STALL], got[RESENT]) == {0.1: 1.0, 0.5: 3.0, 1.0: 4.0, math.inf: 5.0}
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
    assert [round(s, 6) for s in logged([log, tmp_path / "absent.log"], STALL_LINE)] == [0.0205, 0.3]
    assert logged([log], RESENT_LINE) == []


def test_log_lines_are_the_gateways_own(tmp_path, caplog):
    """The line a GatewayCore writes for a request re-sent before its first token, read back."""
    from services.gateway.core import GatewayCore
    from services.protocol.messages import Submit, TextBatch, TextDelta
    from services.protocol.sampling import SamplingParams
    core = GatewayCore(15.0, 600.0)
    core.submit([Submit(request_id="g", tenant="t", prompt_token_ids=[1], params=SamplingParams(), reply_addr="gw",
                        detok_addr="tok")], 1, "tcp://s#scheduler|s-1#1", 5.0)
    core.redrive("tcp://s#scheduler|s-2#1")
    with caplog.at_level(logging.INFO, logger="kvmesh.gateway"):
        core.step([TextBatch(deltas=[TextDelta("g", 0, "x", 1, None)])], 7.0625)
    log = tmp_path / "gateway.log"
    log.write_text(caplog.text)
    assert logged([log], RESENT_LINE) == [2.0625] and logged([log], STALL_LINE) == []


def test_every_kind_of_moved_request_is_counted_once_and_the_rest_named(tmp_path):
    """Resumed (detokenizer), re-sent and moved-early (gateway: one histogram for both) waits, each
    counted in its kind and in the total; the schedulers' moves beyond them are the untimed ones."""
    registry = CollectorRegistry()
    stall = Histogram(STALL, "", buckets=(0.1, 1, 5), registry=registry)
    resent = Histogram(RESENT, "", buckets=(0.1, 1, 5), registry=registry)
    Counter("kvmesh_detok_migrations", "", ["outcome"], registry=registry).labels("not_held").inc(3)
    for s in (0.05, 2.0):
        stall.observe(s)
    for w in (1.5, 3.0, 0.8):
        resent.observe(w)
    log = tmp_path / "all.log"
    log.write_text("request a resumed on its new worker after a stall of 50.000 ms\n"
                   "request b resumed on its new worker after a stall of 2000.000 ms\n"
                   "request c, sent again before its first token, got it 1500.000 ms after its submit\n"
                   "request d, sent again before its first token, got it 3000.000 ms after its submit\n"
                   "request e, moved off its worker before its first token, got it 800.000 ms after its submit\n")
    assert logged([log], MOVED_EARLY_LINE) == [0.8] and len(logged([log], RESENT_LINE)) == 2
    res = summary([log], parse([generate_latest(registry).decode()]))
    assert (res["moved_timed"], res["moved_stall_logged"], res["resent_wait_logged"], res["moved_early_logged"]) == \
        (5, 2, 2, 1)
    assert res["gateway_wait_logged"] == res["gateway_wait_observed"] == 3
    assert res["gateway_wait_logged_sum_s"] == res["gateway_wait_observed_sum_s"] == 5.3
    assert res["stall_buckets"]["inf"] == res["moved_timed"]
    assert (res["moved_added_latency_p50_ms"], res["moved_added_latency_max_ms"]) == (1500.0, 3000.0)
    assert (res["moved_early_added_latency_p50_ms"], res["resent_added_latency_p99_ms"]) == (800.0, 3000.0)
    assert res["moved_streams"] == {"not_held": 3}


def test_the_moves_no_process_timed_are_split_by_why():
    # 9 moves at the schedulers, 8 streams at the detokenizers (one moved twice in one wait), 6 timed:
    # 2 streams with no wait (aborted before their new tokens, or over before the move)
    assert untimed(9.0, {"resumed": 3, "not_held": 4, "aborted": 1}, 6) == {"total": 3, "again": 1, "no_wait": 2}
    assert untimed(5.0, {"resumed": 2, "not_held": 3}, 5) == {"total": 0, "again": 0, "no_wait": 0}
