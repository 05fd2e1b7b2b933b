"""SamplingParams: one definition used by the offline API, the wire protocol and the engine.

Field names follow vLLM's `SamplingParams` so users can switch without relearning.
"""
from __future__ import annotations

import msgspec

# Hard caps: every request field is bounded (security and KV-capacity reasons).
MAX_N = 16
MAX_LOGPROBS = 20
# prompt_logprobs (vLLM's): at most this many prompt tokens (each carries up to MAX_LOGPROBS + 1
# entries back to the client), so one answer stays a few MB
MAX_PROMPT_LOGPROBS_TOKENS = 8192
# ... and one answer carries at most this many prompt-logprob entries (prompt tokens x (k + 1), once
# per completion choice that repeats them): four longest prompts at k = 20, about 50 MB of JSON,
# where 128 choices (prompts x n) of such prompts would be 1.5 GB of JSON built in the gateway
MAX_PROMPT_LOGPROBS_ENTRIES = 4 * MAX_PROMPT_LOGPROBS_TOKENS * (MAX_LOGPROBS + 1)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1
MAX_MAX_TOKENS = 2**63 - 1      # bounded only to fit the wire (msgpack ints); max_model_len bounds it in use
MAX_LOGIT_BIAS = 1024            # token ids one request may bias
MAX_ABS_LOGIT_BIAS = 100.0       # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_ALLOWED_TOKEN_IDS = 4096     # allowed_token_ids: the mask is rebuilt from them each step
MAX_BAD_WORDS = 64
MAX_BAD_WORD_LEN = 256           # characters of one bad word
MAX_BAD_WORD_TOKENS = 4 * MAX_BAD_WORD_LEN + 1   # tokens of one: a byte a token, and a leading space


MAX_STRUCTURED_SPEC_BYTES = 64 * 1024   # a schema, regex or grammar as sent on the wire
MAX_CHOICES = 256                         # entries of a `choice` constraint


class SamplingParamsError(ValueError):
    """A request's sampling parameters are invalid; the message names the field."""


class StructuredOutput(msgspec.Struct, kw_only=True, frozen=True):
    """A constraint on the generated text, compiled by the worker into a token grammar.

    Exactly one field is set (vLLM's `StructuredOutputsParams`): a JSON Schema (serialized
    JSON), any JSON object, a regular expression, one of a list of strings, or an EBNF grammar.
    """
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def validate(self) -> None:
        """Raise SamplingParamsError unless exactly one bounded constraint is set."""
        texts = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}
        given = [k for k, v in texts.items() if v is not None]
        given += ["json_object"] * self.json_object + ["choice"] * (self.choice is not None)
        if len(given) != 1:
            raise SamplingParamsError(f"invalid structured output: exactly one constraint must be set, got "
                                      f"{', '.join(given) or 'none'}")
        for name, text in texts.items():
            if text is not None and not 0 < len(text.encode()) <= MAX_STRUCTURED_SPEC_BYTES:
                raise SamplingParamsError(f"invalid {name}: must have 1 to {MAX_STRUCTURED_SPEC_BYTES} bytes")
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES:
                raise SamplingParamsError(f"invalid choice: must list 1 to {MAX_CHOICES} strings")
            if sum(len(c.encode()) for c in self.choice) > MAX_STRUCTURED_SPEC_BYTES:
                raise SamplingParamsError(f"invalid choice: at most {MAX_STRUCTURED_SPEC_BYTES} bytes in all")


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None   # vLLM's: per prompt token (the first: None) its logprob given
                                 # its prefix, and this many top alternatives (0: only its own)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False   # the matched stop string (and stop token) stay in the text
    logit_bias: dict[int, float] = {}   # token id -> added to its logit before penalties and sampling
    speculative: bool = True     # False: never verify speculative drafts for this request (an engine
                                 # with speculative_config decodes it one token a step)
    structured: StructuredOutput | None = None   # constrained decoding (JSON schema, regex, ...)
    allowed_token_ids: list[int] | None = None   # vLLM's: every other token gets -inf
    bad_words: list[str] = []    # vLLM's: a word's last token is banned once the output ends in the rest
    bad_words_token_ids: list[list[int]] = []   # bad_words as token sequences, set where text is
                                 # tokenized (bad_words_token_ids() in services/text/requests.py); the
                                 # engine masks by these

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first invalid field."""
        def bad(field: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"invalid {field}: {why}")

        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be between 1 and {MAX_N}, got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or (vocab_size is not None and self.top_k > vocab_size):
            raise bad("top_k", f"must be -1, 0 (disabled) or in [1, vocab size], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", f"must be in [0, 2**63-1], got {self.seed}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_MAX_TOKENS:
            raise bad("max_tokens", f"must be in [1, 2**63-1], got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            raise bad("stop", f"each stop string must have 1 to {MAX_STOP_STRING_LEN} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"ids must be in [0, {vocab_size})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.structured is not None:
            self.structured.validate()
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise bad("logit_bias", f"token ids must be in [0, {vocab_size or 'vocab size'}), got {token}")
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:    # NaN fails too
                raise bad("logit_bias", f"biases must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], "
                                        f"got {bias} for token {token}")
        self._validate_token_masks(vocab_size)

    def _validate_token_masks(self, vocab_size: int | None) -> None:
        """allowed_token_ids and bad_words (vLLM's: an empty allowed list is an error)."""
        top = vocab_size or "vocab size"
        if self.allowed_token_ids is not None:
            if not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise SamplingParamsError(f"invalid allowed_token_ids: must list 1 to {MAX_ALLOWED_TOKEN_IDS} ids, "
                                          f"got {len(self.allowed_token_ids)}")
            if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in self.allowed_token_ids):
                raise SamplingParamsError(f"invalid allowed_token_ids: ids must be in [0, {top})")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise SamplingParamsError(f"invalid bad_words: at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        if any(not w.strip() or len(w) > MAX_BAD_WORD_LEN for w in self.bad_words):
            raise SamplingParamsError(f"invalid bad_words: each word must have 1 to {MAX_BAD_WORD_LEN} characters "
                                      "and not be only spaces")
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise SamplingParamsError(f"invalid bad_words: at most {MAX_BAD_WORDS} words")
        for ids in self.bad_words_token_ids:
            if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
                raise SamplingParamsError(f"invalid bad_words: each word must encode to 1 to {MAX_BAD_WORD_TOKENS} "
                                          "tokens")
            if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
                raise SamplingParamsError(f"invalid bad_words: their token ids must be in [0, {top})")
