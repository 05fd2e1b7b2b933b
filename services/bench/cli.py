"""`kvmesh bench serve`: flags follow `vllm bench serve` wherever vLLM has one; see README.md."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

from services.bench import chaos, mock_server, spec_metrics
from services.bench.arrivals import parse_rates
from services.bench.datasets import DatasetOptions, load_dataset, range_bounds
from services.bench.metrics import (compute_metrics, parse_goodput, parse_percentile_metrics,
                                    parse_percentiles, time_series)
from services.bench.report import (default_filename, failure_summary, format_table, format_turn_table, rate_label,
                                   result_dict, save_result)
from services.bench.runner import RunConfig, run_benchmark
from services.bench.server_tokenizer import PromptRefused, ServerTokenizer, ServerTokenizerError
from services.bench.tokens import TokenCounter

DATASETS = ("random", "sharegpt", "sharegpt-synthetic", "generated-shared-prefix", "multi-turn", "custom")
# what sets each dataset's prompt lengths: named when the server refuses a prompt as too long
PROMPT_LENGTH_FLAGS = {"random": "--random-input-len (with --random-prefix-len, --random-range-ratio)",
                       "sharegpt": "--dataset-path (its prompts)",
                       "sharegpt-synthetic": "--dataset-name sharegpt-synthetic (its lengths go up to 1024 tokens)",
                       "generated-shared-prefix": "--gsp-system-prompt-len / --gsp-question-len",
                       "multi-turn": "--multi-turn-history-tokens / --multi-turn-user-len",
                       "custom": "--dataset-path (its prompts)"}
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def _serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--backend", choices=tuple(ENDPOINTS), default=None,
                   help="openai = /v1/completions, openai-chat = /v1/chat/completions (default: from --endpoint)")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None, help="API path (default: from --backend, else /v1/completions)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer dir (tokenizer.json) to count tokens and build prompts with "
                        "(default: the server's own, through its /tokenize endpoint)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds allowed per request")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON (sharegpt, multi-turn) or JSONL (custom)")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send (conversations for multi-turn)")
    g.add_argument("--prompt-token-ids", action="store_true",
                   help="send random/synthetic/gsp prompts to /v1/completions as token-id lists (exact lengths; "
                        "needs --tokenizer for the vocabulary)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="vLLM's convention: lengths uniform in [L*(1-r), L*(1+r)], r in [0, 1); 0 = fixed")
    g.add_argument("--random-prefix-len", type=int, default=0, help="shared random prefix tokens before each prompt")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed max_tokens instead of the reply length")
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--multi-turn-turns", "--multi-turn-num-turns", dest="multi_turn_num_turns", type=int, default=10,
                   help="turns of each conversation")
    g.add_argument("--multi-turn-users", type=int, default=None,
                   help="conversations, one user each, all started at once unless --request-rate or "
                        "--max-concurrency pace them (default: --num-prompts)")
    g.add_argument("--multi-turn-history-tokens", type=int, default=None,
                   help="tokens of history the last turn sends (its user messages and the replies); sets "
                        "--multi-turn-user-len")
    g.add_argument("--multi-turn-user-len", type=int, default=64, help="tokens of each new user message")
    g.add_argument("--multi-turn-output-len", type=int, default=64)
    g.add_argument("--multi-turn-think-time", type=float, default=0.0, help="seconds between a reply and the next turn")
    g.add_argument("--custom-output-len", type=int, default=256, help="max_tokens for JSONL lines without output_tokens")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", help="requests/s; 'inf' sends all at once; '1,2,4,inf' sweeps")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests (conversations) in flight")
    g.add_argument("--duration", type=float, default=None, help="send for this many seconds instead of --num-prompts")
    g.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent before the run")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so that every request makes max_tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("report")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics shown in the table")
    g.add_argument("--metric-percentiles", default="90,99", help="percentiles reported, e.g. 50,90,99")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:3000; goodput = requests meeting all / duration")
    g.add_argument("--save-result", action="store_true", help="write the JSON result (and plots)")
    g.add_argument("--result-dir", default=".", help="where results go")
    g.add_argument("--result-filename", default=None, help="JSON file name (default: vLLM's pattern)")
    g.add_argument("--plot-dir", default=None, help="write PNG plots here (default: --result-dir with --save-result)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--label", default=None, help="free text stored in the result")
    g.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="a /metrics page to scrape before and after each run for speculative-decoding counters "
                        "(a kvmesh worker's; repeat for several workers); the server's own /metrics is scraped "
                        "too (vLLM's carries them). With counters, the report shows acceptance rate and mean "
                        "accepted length")
    g.add_argument("--metrics-settle-s", type=float, default=1.5,
                   help="with --metrics-url: seconds to wait after a run before scraping again (kvmesh workers "
                        "publish their counters each heartbeat, 0.5 s by default)")
    g.add_argument("--disable-tqdm", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh bench", description="Benchmark an OpenAI-compatible server.")
    sub = p.add_subparsers(dest="command", metavar="{serve,mock-server,chaos}")
    serve = sub.add_parser("serve", help="run the serving benchmark (vLLM's `bench serve` flags)",
                           description="Serving benchmark with vLLM's metric definitions (see services/bench/README.md).")
    _serve_args(serve)
    serve.set_defaults(_parser=serve)  # flag errors print serve's usage
    mock = sub.add_parser("mock-server", help="run a scripted OpenAI-compatible server with known timing")
    mock_server.add_arguments(mock)
    chaos_p = sub.add_parser("chaos", help="failover under load on a stack of its own: worker kill -9 and drain, "
                                           "Redis and scheduler restarts; lost, corrupted and migrated requests",
                             description=chaos.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    chaos.add_arguments(chaos_p)
    chaos_p.set_defaults(_parser=chaos_p)
    return p


# (flag, bound, bound excluded): refused before the run starts, not a traceback once it has
# (burstiness) nor a length the dataset would silently raise to 1 token
_NUMBER_BOUNDS = (
    ("burstiness", 0, True), ("request_timeout", 0, True), ("temperature", 0, False),
    ("random_input_len", 1, False), ("random_output_len", 1, False), ("random_prefix_len", 0, False),
    ("sharegpt_output_len", 1, False), ("custom_output_len", 1, False),
    ("gsp_num_groups", 1, False), ("gsp_prompts_per_group", 1, False), ("gsp_system_prompt_len", 0, False),
    ("gsp_question_len", 1, False), ("gsp_output_len", 1, False), ("multi_turn_think_time", 0, False),
)


class Plan:
    """Validated settings derived from the flags; each check names the flag that is wrong."""

    def __init__(self, args: argparse.Namespace, parser: argparse.ArgumentParser):
        err = parser.error
        try:
            self.rates = parse_rates(args.request_rate)
        except ValueError as exc:
            err(f"--request-rate: {exc}")
        try:
            self.percentiles = parse_percentiles(args.metric_percentiles)
            # p99 is always computed (the sweep summary uses it); the table shows the requested ones.
            self.computed_percentiles = sorted(set(self.percentiles) | {99.0})
            self.percentile_metrics = parse_percentile_metrics(args.percentile_metrics)
            self.slos = parse_goodput(args.goodput)
            range_bounds(1, args.random_range_ratio)
        except ValueError as exc:
            err(str(exc))
        self.backend, self.endpoint = _backend_endpoint(args, err)
        self.chat = self.backend == "openai-chat"
        if args.dataset_name == "multi-turn" and not self.chat:
            err("--dataset-name multi-turn needs the chat endpoint: use --backend openai-chat")
        if args.dataset_name in ("sharegpt", "custom") and not args.dataset_path:
            err(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
        if args.prompt_token_ids and (self.chat or not args.tokenizer):
            err("--prompt-token-ids needs --tokenizer and the completions endpoint (--backend openai)")
        for flag in ("num_prompts", "max_concurrency", "num_warmups", "multi_turn_num_turns", "multi_turn_users",
                     "multi_turn_history_tokens", "multi_turn_user_len", "multi_turn_output_len"):
            value = getattr(args, flag)
            if value is not None and value < (0 if flag == "num_warmups" else 1):
                name = "multi-turn-turns" if flag == "multi_turn_num_turns" else flag.replace("_", "-")
                err(f"--{name} must be >= {0 if flag == 'num_warmups' else 1}, got {value}")
        for flag, low, strict in _NUMBER_BOUNDS:
            value = getattr(args, flag)
            if value is not None and (value <= low if strict else value < low):
                err(f"--{flag.replace('_', '-')} must be {'>' if strict else '>='} {low}, got {value}")
        if not 0 <= args.metrics_settle_s <= 60:
            err(f"--metrics-settle-s must be in [0, 60], got {args.metrics_settle_s}")
        if args.duration is not None and (args.duration <= 0 or (math.isinf(max(self.rates)) and not args.max_concurrency)):
            err("--duration needs a positive value and a finite --request-rate or a --max-concurrency")
        try:
            self.extra_body = json.loads(args.extra_body) if args.extra_body else None
        except json.JSONDecodeError as exc:
            err(f"--extra-body is not JSON: {exc}")
        if args.base_url is not None and not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", args.base_url):
            # httpx refuses it per request: the run would end with every request failed
            err(f"--base-url {args.base_url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000")
        base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        self.base_url = base[:-3] if base.endswith("/v1") and self.endpoint.startswith("/v1/") else base
        self.api_url = self.base_url + self.endpoint
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _backend_endpoint(args, err) -> tuple[str, str]:
    if args.endpoint and args.backend and ("chat" in args.endpoint) != (args.backend == "openai-chat"):
        err(f"--endpoint {args.endpoint} does not match --backend {args.backend}")
    backend = args.backend or ("openai-chat" if args.endpoint and "chat" in args.endpoint else None)
    if backend is None:
        backend = "openai-chat" if args.dataset_name == "multi-turn" else "openai"
    return backend, args.endpoint or ENDPOINTS[backend]


def first_model(base_url: str, headers: dict) -> str:
    import httpx

    url = base_url + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=10.0, trust_env=False)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"kvmesh bench: could not read the model name from {url} ({exc}); pass --model") from None


def _dataset_options(args) -> DatasetOptions:
    names = DatasetOptions.__dataclass_fields__
    values = {k: getattr(args, k) for k in names if hasattr(args, k)}
    values.update(name=args.dataset_name, path=args.dataset_path)
    return DatasetOptions(**values)


def token_counter(args: argparse.Namespace, plan: Plan, model: str) -> TokenCounter:
    """--tokenizer DIR, else the server's /tokenize; without either the benchmark cannot size its prompts."""
    try:
        tokenizer = args.tokenizer or ServerTokenizer(plan.base_url, model, plan.headers)
        counter = TokenCounter(tokenizer, chat=plan.chat)
    except (ServerTokenizerError, OSError, ValueError) as exc:
        raise SystemExit(f"kvmesh bench: no tokenizer to count prompt tokens with: {exc}") from None
    print(f"Tokenizer: {counter.name}")
    return counter


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    plan = Plan(args, parser)
    model = args.model or first_model(plan.base_url, plan.headers)
    counter = token_counter(args, plan, model)
    try:
        return _run_rates(args, parser, plan, model, counter)
    finally:
        if isinstance(counter.tokenizer, ServerTokenizer):
            counter.tokenizer.close()


def _run_rates(args, parser, plan: Plan, model: str, counter: TokenCounter) -> int:
    try:
        items = load_dataset(_dataset_options(args), counter, args.seed)
    except PromptRefused as exc:         # a length the flags asked for: a usage error naming them
        parser.error(f"{PROMPT_LENGTH_FLAGS[args.dataset_name]}: {exc}")
    except ServerTokenizerError as exc:  # /tokenize stopped answering part way
        raise SystemExit(f"kvmesh bench: {exc}") from None
    except (ValueError, OSError) as exc:
        parser.error(f"--dataset-name {args.dataset_name}: {exc}")
    every_item = args.dataset_name == "generated-shared-prefix" or (
        args.dataset_name == "multi-turn" and args.multi_turn_users is not None)
    num_requests = len(items) if every_item else args.num_prompts
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    sweep_points = []
    nothing_measured = False       # some rate's run had every request fail: exit 1 (vLLM's warns only)
    for i, rate in enumerate(plan.rates):
        print(f"Traffic request rate: {rate_label(rate)}")
        print(f"Burstiness factor: {args.burstiness}{' (Poisson process)' if args.burstiness == 1 else ' (gamma)'}")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        cfg = RunConfig(api_url=plan.api_url, model=model, chat=plan.chat, headers=plan.headers, request_rate=rate,
                        burstiness=args.burstiness, max_concurrency=args.max_concurrency, num_requests=num_requests,
                        duration=args.duration, num_warmups=args.num_warmups if i == 0 else 0,
                        ignore_eos=args.ignore_eos, temperature=args.temperature, extra_body=plan.extra_body,
                        request_timeout=args.request_timeout, think_time=args.multi_turn_think_time,
                        seed=args.seed + i, disable_tqdm=args.disable_tqdm)
        spec_before = _scrape_spec(plan, args)
        out = asyncio.run(run_benchmark(items, cfg, counter.count, on_warmup=_print_warmup))
        if args.metrics_url:
            time.sleep(args.metrics_settle_s)     # the workers' next heartbeat publishes the run
        spec = spec_metrics.run_stats(spec_before, _scrape_spec(plan, args))
        metrics = compute_metrics(out.results, out.duration, plan.computed_percentiles, plan.slos,
                                  count_tokens=counter.count, dataset_exact=True)
        print(format_table(metrics, plan.percentile_metrics, plan.percentiles, rate, args.max_concurrency))
        if metrics.ttft_by_turn:
            print(format_turn_table(metrics.ttft_by_turn))
        if spec is not None:
            print("\n".join(spec_metrics.format_lines(spec)))
        if not plan.chat:  # chat prompts carry the template's tokens on top of the dataset's count
            _note_length_mismatch(out.results, counter.name)
        failures = failure_summary(out.results)
        if failures:
            print(failures, file=sys.stderr)
        nothing_measured |= bool(out.results) and metrics.completed == 0
        meta = _meta(args, plan, model, rate, stamp, counter.name)
        result = result_dict(metrics, out.results, out.t0, meta, plan.computed_percentiles, plan.slos)
        result.update(spec or {})
        stem = _stem(args, plan, model, rate, multi=len(plan.rates) > 1)
        if args.save_result:
            path = save_result(result, Path(args.result_dir) / f"{stem}.json")
            print(f"Result saved to {path}")
        _maybe_plot_run(args, model, metrics, out, stem, rate)
        sweep_points.append({"rate": rate_label(rate), **{k: result[k] for k in (
            "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms")}})
    if len(plan.rates) > 1:
        _finish_sweep(args, plan, model, sweep_points)
    return 1 if nothing_measured else 0


def _scrape_spec(plan: Plan, args) -> dict:
    """Speculation counters of the server's /metrics (silent when it has none or no page) and of
    each --metrics-url (a page that does not answer is named on stderr)."""
    totals, failed = spec_metrics.scrape([plan.base_url + "/metrics", *args.metrics_url])
    for url, why in failed:
        if url in args.metrics_url:
            print(f"kvmesh bench: --metrics-url {url}: {why}", file=sys.stderr)
    return totals


def _print_warmup(results) -> None:
    failed = [r.reason for r in results if not r.success]
    msg = f"Warm-up: {len(results)} requests" + (f", {len(failed)} failed ({', '.join(sorted(set(failed)))})" if failed else "")
    print(msg, file=sys.stderr)


def _note_length_mismatch(results, tokenizer_name: str) -> None:
    """Say when the server counted other prompt lengths than the benchmark's tokenizer did."""
    off = [(r.usage_prompt_tokens, r.prompt_len) for r in results
           if r.success and r.usage_prompt_tokens is not None and r.usage_prompt_tokens != r.prompt_len]
    if off:
        print(f"Note: for {len(off)} of {len(results)} requests the server counted other prompt lengths than "
              f"{tokenizer_name} (e.g. {off[0][0]} instead of {off[0][1]}); the JSON has both "
              "(server_prompt_tokens, input_lens).", file=sys.stderr)


def _meta(args, plan: Plan, model: str, rate: float, stamp: str, tokenizer_name: str) -> dict:
    return {"date": stamp, "backend": plan.backend, "endpoint": plan.endpoint, "label": args.label,
            "model_id": model, "tokenizer_id": args.tokenizer or tokenizer_name, "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts, "request_rate": rate if not math.isinf(rate) else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "duration_limit": args.duration,
            "ignore_eos": args.ignore_eos, "num_warmups": args.num_warmups,
            **({"multi_turn_turns": args.multi_turn_num_turns, "multi_turn_users": args.multi_turn_users,
                "multi_turn_history_tokens": args.multi_turn_history_tokens}
               if args.dataset_name == "multi-turn" else {})}


def _stem(args, plan: Plan, model: str, rate: float, multi: bool) -> str:
    if args.result_filename:
        stem = Path(args.result_filename).stem
        return f"{stem}-{rate_label(rate)}qps" if multi else stem
    return Path(default_filename(plan.backend, rate, args.max_concurrency, model)).stem


def _plot_dir(args) -> Path | None:
    if args.no_plots:
        return None
    if args.plot_dir:
        return Path(args.plot_dir)
    return Path(args.result_dir) if args.save_result else None


def _maybe_plot_run(args, model: str, metrics, out, stem: str, rate: float) -> None:
    plot_dir = _plot_dir(args)
    if plot_dir is None:
        return
    from services.bench import plots

    ok = [r for r in out.results if r.success]
    samples = {"ttft": [r.ttft for r in ok], "tpot": [t for t, n in zip(metrics.tpots, metrics.output_lens) if n > 1],
               "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    cap = f"at most {args.max_concurrency} in flight" if args.max_concurrency else "no concurrency cap"
    title = f"{model}: {args.dataset_name}, request rate {rate_label(rate)} req/s, {cap}"
    p1 = plots.plot_latency_cdfs(samples, plot_dir / f"{stem}-latency-cdf.png", title)
    series = time_series(out.results, metrics.output_lens, out.t0, bin_s=None)
    p2 = plots.plot_throughput(series, plot_dir / f"{stem}-throughput.png", title)
    print(f"Plots saved to {p1} and {p2}")
    if metrics.ttft_by_turn:
        p3 = plots.plot_ttft_by_turn(metrics.ttft_by_turn, plot_dir / f"{stem}-ttft-by-turn.png", title)
        print(f"TTFT by turn plotted in {p3}")


def _finish_sweep(args, plan: Plan, model: str, points: list[dict]) -> None:
    print(_rule_table(points))
    plot_dir = _plot_dir(args)
    if plot_dir is None:
        return
    from services.bench import plots

    stem = Path(args.result_filename).stem if args.result_filename else \
        f"{plan.backend}-sweep-{Path(model).name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path = plots.plot_sweep(points, plot_dir / f"{stem}-sweep.png", f"{args.dataset_name} sweep, {model}")
    print(f"Sweep plot saved to {path}")


def _rule_table(points: list[dict]) -> str:
    head = f"{'rate (req/s)':>12} {'req/s':>8} {'out tok/s':>10} {'med TTFT':>9} {'p99 TTFT':>9} {'med TPOT':>9} {'p99 TPOT':>9}"
    rows = [f"{p['rate']:>12} {p['request_throughput']:>8.2f} {p['output_throughput']:>10.1f} "
            f"{p['median_ttft_ms']:>9.1f} {p['p99_ttft_ms']:>9.1f} {p['median_tpot_ms']:>9.1f} {p['p99_tpot_ms']:>9.1f}"
            for p in points]
    return "\n".join(["Sweep summary (latencies in ms)", head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "serve":
        return run_serve(args, args._parser)
    if args.command == "chaos":
        return chaos.main(args, args._parser)
    if args.command == "mock-server":
        mock_server.serve(mock_server.config_from_args(args), args.host, args.port)
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
