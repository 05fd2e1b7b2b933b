"""`kvmesh generate`: run the engine offline on one or more prompts and print the completions.

    kvmesh generate --model DIR --prompt "Hello" --max-tokens 32 --temperature 0
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from services.config import ConfigError, add_flags, convert_flag, flag_name
from services.engine_args import EngineArgs
from services.protocol.sampling import SamplingParams, SamplingParamsError

# SamplingParams field -> the flag that sets it (errors name the flag).
_SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
    "min_p": "--min-p", "n": "--n", "seed": "--seed", "stop": "--stop", "logprobs": "--logprobs",
    "min_tokens": "--min-tokens", "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
    "prompt_token_ids": "--prompt",
}
_ENGINE_FIELDS = dataclasses.fields(EngineArgs)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh generate", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    ap.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    s = ap.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=16, help="most tokens to generate per sample")
    s.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    s.add_argument("--logprobs", type=int, default=None, help="also print the top-N logprobs of each token")
    e = ap.add_argument_group("engine", "Every engine field, with LLM(...)'s offline defaults (docs/services.md). "
                                        "The model directory is required; the engine seed also seeds every "
                                        "prompt's samples.")
    add_flags(e, _ENGINE_FIELDS, env=False)
    e.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False,
                   default=argparse.SUPPRESS, help="same as --no-enable-prefix-caching")
    ap.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return ap


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields given on the command line, as their types; LLM(...) has the defaults."""
    return {f.name: convert_flag(f, getattr(args, f.name)) for f in _ENGINE_FIELDS
            if getattr(args, f.name) is not None}


def _flag_error(ap: argparse.ArgumentParser, err: Exception) -> int:
    """Print err with the field named as its command-line flag; exit code 2."""
    message = str(err)
    match = re.search(r"engine argument (\w+)", message) or re.search(r"invalid (\w+)", message)
    if match and match.group(1) in _SAMPLING_FLAGS:
        message = f"{_SAMPLING_FLAGS[match.group(1)]}: {message}"
    elif match and match.group(1) in EngineArgs.__dataclass_fields__:
        message = f"{flag_name(match.group(1))}: {message}"
    ap.print_usage(sys.stderr)
    print(f"kvmesh generate: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        engine_args = _engine_args(args)
    except ConfigError as err:
        return _flag_error(ap, err)
    if not engine_args.get("model"):
        ap.error("the following arguments are required: --model")
    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, seed=engine_args.get("seed"), max_tokens=args.max_tokens,
            min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        params.validate()
    except SamplingParamsError as err:
        return _flag_error(ap, err)

    from gpu_worker.config import tuning_from_env
    from gpu_worker.llm import LLM
    from gpu_worker.outputs import RequestError
    try:
        # read here, not by the engine's config, so that a bad KVMESH_* tuning value is reported as
        # itself: the catch-all below would blame it on --model
        engine_args["tuning"] = tuning_from_env()
    except ValueError as err:
        print(f"kvmesh generate: error: {err}", file=sys.stderr)
        return 2
    try:
        llm = LLM(**engine_args)
    except (ValueError, OSError) as err:
        if "engine argument" in str(err):
            return _flag_error(ap, err)
        print(f"kvmesh generate: error: --model: {err}", file=sys.stderr)
        return 2
    try:
        if args.chat:
            outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in args.prompt]
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (RequestError, SamplingParamsError) as err:
        return _flag_error(ap, err)
    for out in outputs:
        _print(out, args.json)
    return 0


def _print(out, as_json: bool) -> None:
    if as_json:
        print(json.dumps({
            "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
            "num_cached_tokens": out.num_cached_tokens,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                         "finish_reason": c.finish_reason, "cumulative_logprob": c.cumulative_logprob}
                        for c in out.outputs]}, ensure_ascii=False))
        return
    for c in out.outputs:
        tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
        print(f"{tag}{out.prompt}{c.text}")
        print(f"  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
