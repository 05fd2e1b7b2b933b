"""`kvmesh generate`: run the engine offline on one or more prompts and print the completions.

    kvmesh generate --model DIR --prompt "Hello" --max-tokens 32 --temperature 0
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from services.protocol.sampling import SamplingParams, SamplingParamsError

# SamplingParams / EngineConfig field -> the flag that sets it (errors name the flag).
_SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
    "min_p": "--min-p", "n": "--n", "seed": "--seed", "stop": "--stop", "logprobs": "--logprobs",
    "min_tokens": "--min-tokens", "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
}
_ENGINE_FLAGS = {
    "max_model_len": "--max-model-len", "num_gpu_blocks": "--num-gpu-blocks", "device": "--device",
    "dtype": "--dtype", "block_size": "--block-size", "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens", "attention_backend": "--attention-backend",
    "gpu_memory_utilization": "--gpu-memory-utilization",
}
_FLAGS = {**_SAMPLING_FLAGS, **_ENGINE_FLAGS, "prompt_token_ids": "--prompt"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh generate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
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
    s.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible samples)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    s.add_argument("--logprobs", type=int, default=None, help="also print the top-N logprobs of each token")
    e = ap.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--num-gpu-blocks", type=int, default=None)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--device", default="auto", help="auto, cpu or cuda")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--attention-backend", default="auto", help="auto, torch or triton")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return ap


def _flag_error(ap: argparse.ArgumentParser, err: Exception) -> int:
    """Print err with the field named as its command-line flag; exit code 2."""
    message = str(err)
    match = re.search(r"engine argument (\w+)", message) or re.search(r"invalid (\w+)", message)
    if match and match.group(1) in _FLAGS:
        message = f"{_FLAGS[match.group(1)]}: {message}"
    ap.print_usage(sys.stderr)
    print(f"kvmesh generate: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
            min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        params.validate()
    except SamplingParamsError as err:
        return _flag_error(ap, err)

    from gpu_worker.llm import LLM
    from gpu_worker.outputs import RequestError
    engine_args = {name: getattr(args, name) for name in _ENGINE_FLAGS}
    try:
        llm = LLM(model=args.model, enable_prefix_caching=not args.no_prefix_caching, **engine_args)
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
