"""The offline API, shaped like vLLM's:

    from gpu_worker import LLM, SamplingParams
    llm = LLM(model="/models/tiny-llama", max_model_len=1024)
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].outputs[0].text

Text is made as the server makes it (services/text/sample_text.py): a matched stop string ends
that sample with finish_reason "stop" and is not part of the text, nor is the EOS or stop token
that ended it (both are, with include_stop_str_in_output); stop strings count past min_tokens only.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.outputs import PromptLogprob, SequenceDelta, TokenLogprob
from services.protocol.sampling import SamplingParams
from services.text.requests import TokenizeError, bad_words_token_ids
from services.text.sample_text import stop_token_of

PromptType = Union[str, Sequence[int], dict]


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None           # 1 = most likely; None when outside the returned top-k
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # vLLM's: with SamplingParams.prompt_logprobs, None for the first prompt token, then per token
    # {its id and the top-k ids: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class _Sample:
    """Accumulates one sample's deltas into text and tokens."""
    index: int
    params: SamplingParams
    text_of: Any                  # services.text.sample_text.SampleText (None without a tokenizer)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class LLM:
    """One engine plus a tokenizer, for batch (offline) generation."""

    def __init__(self, model: str, *, tokenizer: str | None = None, skip_tokenizer_init: bool = False,
                 **engine_args: Any) -> None:
        self.llm_engine = Engine(EngineConfig.from_kwargs(model=model, **engine_args))
        self.tokenizer = None
        if not skip_tokenizer_init:
            from services.text.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(tokenizer or model)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops what the engine started (tensor-parallel ranks); the LLM is unusable after."""
        self.llm_engine.close()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids"); returns RequestOutputs in prompt order."""
        items = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority has {len(priority)} entries but there are {len(items)} prompts")
        outputs: dict[str, RequestOutput] = {}
        samples: dict[str, list[_Sample]] = {}
        try:
            for i, (item, p) in enumerate(zip(items, params)):
                text, ids = self._tokenize(item)
                p = self._with_bad_words(p)
                rid = str(next(self._ids))
                self.llm_engine.add_request(rid, ids, p, priority=priority[i] if priority else 0)
                outputs[rid] = RequestOutput(rid, text, ids, [])
                samples[rid] = [self._new_sample(j, ids, p) for j in range(p.n)]
            self._run(outputs, samples, use_tqdm)
        finally:
            for rid in outputs:
                self.llm_engine.abort_request(rid)     # no-op for finished requests
        return list(outputs.values())

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render one conversation (or a list of them) with the model's chat template, then generate."""
        if self.tokenizer is None:
            raise ValueError("chat() needs the tokenizer; do not pass skip_tokenizer_init=True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- internals -----------------------------------------------------------------------
    def _tokenize(self, item: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(item, dict):
            if "prompt_token_ids" in item:
                return item.get("prompt"), list(item["prompt_token_ids"])
            item = item["prompt"]
        if isinstance(item, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need the tokenizer; pass token ids or drop skip_tokenizer_init")
            return item, self.tokenizer.encode(item)
        return None, list(item)

    def _with_bad_words(self, p: SamplingParams) -> SamplingParams:
        """p with its bad_words encoded (vLLM's update_from_tokenizer), which the engine masks by."""
        if not p.bad_words or p.bad_words_token_ids:
            return p
        if self.tokenizer is None:
            raise ValueError("bad_words need the tokenizer; do not pass skip_tokenizer_init=True")
        try:
            return msgspec.structs.replace(p, bad_words_token_ids=bad_words_token_ids(self.tokenizer, p.bad_words))
        except TokenizeError as exc:
            raise ValueError(str(exc)) from None

    def _new_sample(self, index: int, prompt_ids: list[int], p: SamplingParams) -> _Sample:
        text_of = None
        if self.tokenizer is not None:
            from services.text.sample_text import SampleText
            text_of = SampleText(self.tokenizer, prompt_ids, p, frozenset(self.llm_engine.eos_token_ids))
        elif p.stop:
            raise ValueError("stop strings need the tokenizer; use stop_token_ids instead")
        sample = _Sample(index, p, text_of)
        if p.logprobs is not None:
            sample.logprobs, sample.cumulative = [], 0.0
        return sample

    def _run(self, outputs: dict[str, RequestOutput], samples: dict[str, list[_Sample]], use_tqdm: bool) -> None:
        from tqdm.auto import tqdm
        pending = set(outputs)
        with tqdm(total=len(outputs), desc="Processed prompts", disable=not use_tqdm) as bar:
            while pending:
                for delta in self.llm_engine.step():
                    self._absorb(delta, samples[delta.request_id][delta.index])
                    out = outputs[delta.request_id]
                    out.num_cached_tokens = delta.num_cached_tokens
                    if delta.prompt_logprobs is not None:
                        out.prompt_logprobs = self._prompt_logprobs(delta.prompt_logprobs)
                    if all(s.finish_reason for s in samples[delta.request_id]) and not out.finished:
                        out.finished = True
                        out.outputs = [_completion(s) for s in samples[delta.request_id]]
                        pending.discard(delta.request_id)
                        bar.update(1)
                failed = self.llm_engine.take_failed()
                if failed:                   # a grammar that did not compile: the call fails whole
                    for rid in pending:
                        self.llm_engine.abort_request(rid)
                    raise ValueError(failed[0][1])
                if pending and not self.llm_engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with unfinished requests")

    def _absorb(self, delta: SequenceDelta, s: _Sample) -> None:
        if s.finish_reason is not None:
            return
        s.token_ids += delta.new_token_ids
        for lp in delta.new_logprobs or []:
            s.logprobs.append(self._logprob_dict(lp))
            s.cumulative += lp.logprob
        if s.text_of is not None:
            piece, stopped = s.text_of.push(delta.new_token_ids, delta.finish_reason)
            s.text += piece
            if stopped:
                s.finish_reason, s.stop_reason = "stop", s.text_of.matched
                if delta.finish_reason is None:      # the engine is still generating it
                    self.llm_engine.abort_request(delta.request_id, index=s.index)
                return
        if delta.finish_reason is not None:
            s.finish_reason = delta.finish_reason
            s.stop_reason = stop_token_of(delta.new_token_ids, delta.finish_reason, s.params)

    def _logprob_dict(self, lp: TokenLogprob) -> dict[int, Logprob]:
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (lambda t: None)
        ranks = {tok: rank for rank, (tok, _) in enumerate(lp.top, start=1)}
        entry = {lp.token_id: Logprob(lp.logprob, ranks.get(lp.token_id), decode(lp.token_id))}
        for tok, value in lp.top:
            entry.setdefault(tok, Logprob(value, ranks[tok], decode(tok)))
        return entry


    def _prompt_logprobs(self, entries: list[PromptLogprob]) -> list[dict[int, Logprob] | None]:
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (lambda t: None)
        out: list[dict[int, Logprob] | None] = []
        for e in entries:
            if e.logprob is None:
                out.append(None)
                continue
            entry = {e.token_id: Logprob(e.logprob, e.rank, decode(e.token_id))}
            for rank, (tok, value) in enumerate(e.top, start=1):
                entry.setdefault(tok, Logprob(value, rank, decode(tok)))
            out.append(entry)
        return out


def _completion(s: _Sample) -> CompletionOutput:
    return CompletionOutput(s.index, s.text, s.token_ids, s.cumulative, s.logprobs, s.finish_reason,
                            s.stop_reason)


def _is_token_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        for p in prompts:
            if not (isinstance(p, (str, dict)) or _is_token_list(p)):
                raise TypeError("each prompt must be a string, a non-empty list of token ids, or a dict "
                                "with 'prompt' or 'prompt_token_ids'")
        return list(prompts)
    raise TypeError(f"prompts must be a string, token ids, or a list of them, got {type(prompts).__name__}")


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt")
    return params
