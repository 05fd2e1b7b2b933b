"""Pure metric functions: TPOT, summaries, goodput, sources, time series."""
import math

import numpy as np
import pytest

from services.bench.client import RequestResult
from services.bench.metrics import (compute_metrics, input_len, is_good, output_len, parse_goodput,
                                    parse_percentile_metrics, parse_percentiles, percentile_key, request_tpot,
                                    summarize, time_series)


def ok(ttft, itl, out=None, start=0.0, prompt_len=10, cached=None, usage_prompt=None, text="a b c"):
    lat = ttft + sum(itl)
    return RequestResult(prompt_len=prompt_len, success=True, start_time=start, ttft=ttft, itl=list(itl),
                         latency=lat, end_time=start + lat, generated_text=text, num_chunks=len(itl) + 1,
                         usage_output_tokens=out, usage_prompt_tokens=usage_prompt, cached_tokens=cached)


def failed(reason, start=0.0):
    return RequestResult(prompt_len=10, success=False, reason=reason, error=reason, start_time=start, end_time=start)


def test_tpot_excludes_first_token():
    r = ok(0.05, [0.01] * 9, out=10)
    assert request_tpot(r, 10) == pytest.approx(0.01)
    assert request_tpot(r, 1) == 0.0


def test_summarize_ms_and_percentiles():
    s = summarize([0.001, 0.002, 0.003, 0.004], [50, 99])
    assert s.mean == pytest.approx(2.5) and s.median == pytest.approx(2.5)
    assert s.std == pytest.approx(np.std([1, 2, 3, 4]))
    assert s.percentiles[99] == pytest.approx(np.percentile([1, 2, 3, 4], 99))
    assert summarize([], [99]).mean == 0.0


def test_parsers():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:1,e2el:2"]) == {"ttft": 1.0, "e2el": 2.0}
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["itl:5"])
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("0,100")
    with pytest.raises(ValueError):
        parse_percentile_metrics("ttft,foo")
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"


def test_goodput_rule():
    assert is_good(0.1, 0.01, 1.0, {"ttft": 100, "tpot": 10})
    assert not is_good(0.1001, 0.01, 1.0, {"ttft": 100})
    assert is_good(5, 5, 5, {})


def test_token_count_sources():
    r = ok(0.1, [0.1], out=None, text="x y z")
    assert output_len(r, None) == (2, "chunks")
    assert output_len(r, lambda t: len(t.split())) == (3, "tokenizer")
    r.usage_output_tokens = 7
    assert output_len(r, None) == (7, "usage")
    assert input_len(r, dataset_exact=True) == (10, "tokenizer")
    assert input_len(r, dataset_exact=False) == (10, "estimate")
    r.usage_prompt_tokens = 12
    assert input_len(r, dataset_exact=False) == (12, "usage")


def test_compute_metrics_aggregates():
    results = [ok(0.05, [0.01] * 9, out=10, cached=4, usage_prompt=10),
               ok(0.15, [0.02] * 4, out=5, start=0.1, cached=0, usage_prompt=10),
               ok(0.05, [], out=1, start=0.2),
               failed("HTTP 500"), failed("HTTP 500"), failed("timeout")]
    m = compute_metrics(results, duration=2.0, percentiles=[99.0], slos_ms={"ttft": 100, "tpot": 15})
    assert (m.completed, m.failed) == (3, 3)
    assert m.failure_reasons == {"HTTP 500": 2, "timeout": 1}
    assert m.total_output == 16 and m.output_throughput == pytest.approx(8.0)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.total_input == 30 and m.total_token_throughput == pytest.approx(23.0)
    # Good: request 1 (ttft 50, tpot 10) and request 3 (ttft 50, one token -> tpot 0); request 2 misses TTFT.
    assert m.request_goodput == pytest.approx(1.0)
    assert m.latency["tpot"].mean == pytest.approx((10 + 20) / 2)  # the 1-token request is left out
    assert m.latency["itl"].median == pytest.approx(10.0)
    assert m.latency["ttft"].median == pytest.approx(50.0)
    assert m.cached_token_ratio == pytest.approx(4 / 20)
    assert m.output_lens == [10, 5, 1, 0, 0, 0]
    assert compute_metrics(results, 2.0, [99.0], {}).request_goodput is None


def test_time_series_tokens_and_in_flight():
    # Two requests overlapping in [0.5, 1.0); tokens land in the bins of their chunks.
    a = ok(0.1, [0.2, 0.2], out=3, start=0.0)  # chunks at 0.1, 0.3, 0.5; ends 0.5
    b = ok(0.1, [1.0], out=4, start=0.5)  # chunks at 0.6, 1.6; ends 1.6
    ts = time_series([a, b], [3, 4], t0=0.0, bin_s=1.0)
    assert ts.output_tokens_per_s.tolist() == [5.0, 2.0]
    assert ts.concurrent_requests.tolist() == [1, 1]  # a ends exactly when b starts: never two at once
    c = ok(0.1, [0.1], out=2, start=0.2)  # 0.2 .. 0.4 overlaps a
    ts = time_series([a, b, c], [3, 4, 2], t0=0.0)
    assert ts.concurrent_requests.tolist() == [2, 1]
    assert math.isclose(ts.output_tokens_per_s.sum(), 9.0)


def step_at(line, x: float) -> float:
    """The value a steps-post line shows at x."""
    return line.y[np.searchsorted(line.x, x, side="right") - 1]


def test_plotted_in_flight_is_zero_after_the_last_finish():
    from services.bench.plots import throughput_lines

    a = ok(0.1, [0.2, 0.2], out=3, start=0.0)  # in flight 0 .. 0.5
    b = ok(0.1, [1.0, 1.1], out=3, start=0.2)  # in flight 0.2 .. 2.4, inside the part-empty bin [2, 3)
    lines = throughput_lines(time_series([a, b], [3, 3], t0=0.0))
    flight, out = lines["in_flight"], lines["output"]
    assert [step_at(flight, x) for x in (0.1, 0.3, 1.0, 2.39, 2.41, 2.9, 10.0)] == [1, 2, 1, 1, 0, 0, 0]
    assert flight.x[-1] == pytest.approx(2.4) and flight.y[-1] == 0
    assert out.x[-1] == pytest.approx(2.4) and step_at(out, 2.3) > 0 and step_at(out, 2.5) == 0


def test_plot_bins_divide_the_run_evenly():
    a = ok(0.1, [1.0, 1.1], out=30, start=0.0)  # ends at 2.2: two bins of 1.1 s, not 1 + 1 + a fifth
    ts = time_series([a], [30], t0=0.0, bin_s=None)
    assert ts.bin_s == pytest.approx(1.1) and len(ts.times) == 2 and ts.end == pytest.approx(2.2)
    assert ts.output_tokens_per_s.sum() * ts.bin_s == pytest.approx(30)


def test_throughput_legend_covers_no_data():
    from services.bench.plots import throughput_figure

    runs = [ok(0.05, [0.02] * 20, out=21, start=0.1 * i) for i in range(30)]
    fig = throughput_figure(time_series(runs, [21] * 30, t0=0.0, bin_s=None), "title")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend_box = (fig.legends[0] if fig.legends else fig.axes[0].get_legend()).get_window_extent(renderer)
    for ax in fig.axes:
        assert not legend_box.overlaps(ax.get_window_extent(renderer))
