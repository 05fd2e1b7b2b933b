"""One sample's text: its tokens in, text out, by vLLM's rules of what is text. The streaming
detokenizer (services/text/streams.py) and the offline `LLM` (gpu_worker/llm.py) both use it, so
a served answer and an offline one read the same.

    text = SampleText(tokenizer, prompt_tail, params, eos_ids)
    piece, stopped = text.push(token_ids, finish_reason)    # per step, in order

- The EOS or stop_token_ids token that ended a sample counts (usage, logprobs, token ids) but is
  not text, even with skip_special_tokens false; an EOS that ignore_eos made ordinary is text, and
  so is the last token of a sample a grammar ended ("stop" on an ordinary token).
- A stop string ends the sample only when it ends in the text of a token past the sample's
  min_tokens-th (where a stop token may first be sampled); the text of the tokens up to it can
  only begin one. The text returned stops right before the stop string.
- Text that may begin a stop string is held back until it cannot (or the sample ends).
- include_stop_str_in_output (vLLM's): the text ends right after the stop string, nothing is
  held back, and the stop or EOS token that ended the sample is text too (its own text: empty
  for a special token under skip_special_tokens).
"""
from __future__ import annotations

from typing import Any

from services.protocol.sampling import SamplingParams
from services.text.detokenizer import IncrementalDetokenizer
from services.text.stop_strings import StopStringMatcher


def stop_token_of(token_ids: list[int], finish_reason: str | None, params: SamplingParams) -> int | None:
    """The stop_token_ids entry that ended the sample (its stop_reason): the engine ends a sample on
    the stop token it sampled, the last of the step. An EOS token ends it the same way but is not a
    stop token (None), unless the client listed it in stop_token_ids."""
    if finish_reason == "stop" and token_ids and token_ids[-1] in params.stop_token_ids:
        return token_ids[-1]
    return None


class SampleText:
    def __init__(self, tokenizer: Any, prompt_tail: list[int], params: SamplingParams,
                 eos_ids: frozenset[int]) -> None:
        self.params, self.eos_ids = params, eos_ids
        self.detok = IncrementalDetokenizer(tokenizer, prompt_tail, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, include_stop=params.include_stop_str_in_output)
        self.num_tokens = 0             # tokens pushed so far

    @property
    def matched(self) -> str | None:
        """The stop string that ended the sample, once one did."""
        return self.stops.matched

    def push(self, token_ids: list[int], finish_reason: str | None) -> tuple[str, bool]:
        """The text these tokens add, and whether a stop string ended the sample with them.
        `finish_reason`: the engine's, with the sample's last tokens (the held text then goes out)."""
        p, before = self.params, self.num_tokens
        self.num_tokens += len(token_ids)
        text_ids = token_ids[:-1] if self._ends_on_stop_token(token_ids, finish_reason) else token_ids
        early = min(max(p.min_tokens - before, 0), len(text_ids))
        held = self.stops.hold(self.detok.push(text_ids[:early])) if early else ""
        text = self.detok.push(text_ids[early:])
        if finish_reason is not None:
            text += self.detok.flush()
        hit = self.stops.push(text)
        if hit.stopped:
            return held + hit.emit, True
        return held + hit.emit + (self.stops.flush() if finish_reason is not None else ""), False

    def _ends_on_stop_token(self, token_ids: list[int], finish_reason: str | None) -> bool:
        if finish_reason != "stop" or not token_ids or self.params.include_stop_str_in_output:
            return False
        last = token_ids[-1]
        return last in self.params.stop_token_ids or (not self.params.ignore_eos and last in self.eos_ids)
