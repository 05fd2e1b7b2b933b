"""Load a Hugging Face tokenizer directory with the `tokenizers` library (fast start, no transformers).

Reads `tokenizer.json` (required), `tokenizer_config.json` (special tokens, add_bos_token,
chat templates), `chat_template.jinja` / `chat_template.json` (where newer transformers save
templates), and the eos ids of `generation_config.json` and `config.json`. `auto_map` and
custom tokenizer classes are ignored: remote code is never run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from tokenizers import Tokenizer

from services.text.chat_template import ChatLimits, DEFAULT_LIMITS, render_chat, select_template
from services.text.parallel_encode import ParallelEncoder, cut_safe
from services.text.prompt_bounds import check_count, max_token_chars

_MAX_CONFIG_BYTES = 16 * 1024 * 1024
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer directory is missing a file or holds a corrupt one; the message names it."""


class TextTokenizer:
    """Encode, decode and chat-render for one model. Thread-safe for reading."""

    def __init__(self, tokenizer: Tokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 chat_template: str | dict[str, str] | None = None,
                 extra_eos_token_ids: set[int] | None = None,
                 chat_limits: ChatLimits = DEFAULT_LIMITS, model_type: str = "") -> None:
        self._tok = tokenizer
        self.model_type = model_type
        """config.json's model_type ("llama", "qwen3"...): how the model writes tool calls, where
        its chat template does not say (services/text/chat_formats.py)."""
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        """Named special tokens as text: bos_token, eos_token, pad_token... (what templates see)."""
        self.chat_template = chat_template
        """The template source, a {name: source} dict when the model has several, or None."""
        self.chat_limits = chat_limits
        self._add_bos = add_bos_token
        self._add_eos = add_eos_token
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        eos = set(extra_eos_token_ids or ())
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        """Every id that ends generation: the tokenizer's eos plus generation_config/config eos ids."""
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets that `encode` tracks
        # and nobody here reads: the same ids, ~12% less time on a fresh 512-token prompt.
        self._encode_fast = getattr(tokenizer, "encode_batch_fast", None)
        # long prompts encode in pieces on several cores where that gives the same ids
        # (parallel_encode.py); `parallel_encode_off` says why not for this tokenizer
        self.parallel_encode_off = "no encode_batch_fast" if self._encode_fast is None else cut_safe(tokenizer)
        self._parallel = ParallelEncoder(tokenizer) if self.parallel_encode_off is None else None
        added = tokenizer.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_token_chars: int | None = max_token_chars(tokenizer)
        """Most prompt characters one token covers (None: no such bound); see prompt_bounds.py."""

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # -- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int = 0) -> list[int]:
        """Token ids of `text`; with add_special_tokens, bos/eos as the model's config asks.
        More than max_tokens (0: no bound) raise TooManyTokens, mostly before the ids are made
        (prompt_bounds.py says why); the special tokens may take the count one or two past it."""
        if self._add_bos is None and self._add_eos is None:
            # The tokenizer.json post-processor decides (Llama-3, Qwen, ... work this way).
            return self._ids(text, add_special_tokens, max_tokens)
        # tokenizer_config.json sets add_bos_token/add_eos_token: transformers rebuilds the
        # post-processor as `[bos] text [eos]` from these flags, and so do we.
        ids = self._ids(text, False, max_tokens)
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self._add_eos and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def _ids(self, text: str, add_special_tokens: bool, max_tokens: int) -> list[int]:
        if self._parallel is not None:
            return self._parallel.encode(text, add_special_tokens, max_tokens)
        if self._encode_fast is not None:
            encoding = self._encode_fast([text], add_special_tokens=add_special_tokens)[0]
        else:   # encode_batch, not encode: it releases the GIL while it works (encode holds it throughout)
            encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        check_count(len(encoding), max_tokens)
        return encoding.ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_long(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """decode, for a long id list in a thread beside an event loop: decode_batch releases the
        GIL while it works, decode holds it throughout (1.2 s for a million ids, measured)."""
        return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, template_name: str | None = None,
                            **variables: Any) -> str:
        """Render `messages` to a prompt string (sandboxed); raises ChatTemplateError."""
        template = select_template(self.chat_template, template_name, tools)
        context = {**self.special_tokens, **variables}
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           tools=tools, limits=self.chat_limits, **context)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **variables: Any) -> list[int]:
        """Prompt ids of a conversation; the template writes bos itself, so none is added."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **variables)
        return self.encode(text, add_special_tokens=False)


# -----------------------------------------------------------------------------------------------

def load_tokenizer(model_dir: str | Path, chat_limits: ChatLimits = DEFAULT_LIMITS) -> TextTokenizer:
    """Load the tokenizer of a Hugging Face model directory; raises TokenizerError."""
    root = Path(model_dir)
    if not root.is_dir():
        raise TokenizerError(f"model directory {str(root)!r} does not exist")
    path = root / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{path} is missing: kvmesh needs a fast tokenizer (tokenizer.json); "
            "convert a slow one with transformers' AutoTokenizer(...).save_pretrained()")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises Exception subclasses with serde messages
        raise TokenizerError(f"{path} is not a valid tokenizer file: {e}") from None

    config = _read_json(root / "tokenizer_config.json")
    special = {name: tok for name in _SPECIAL_NAMES
               if (tok := _token_text(config.get(name))) is not None}
    template = _chat_template(root, config)
    model_config = _read_json(root / "config.json")
    extra_eos = _eos_ids(_read_json(root / "generation_config.json")) | _eos_ids(model_config)
    model_type = model_config.get("model_type")
    return TextTokenizer(tokenizer, special_tokens=special,
                         add_bos_token=_opt_bool(config, "add_bos_token"),
                         add_eos_token=_opt_bool(config, "add_eos_token"),
                         chat_template=template, extra_eos_token_ids=extra_eos, chat_limits=chat_limits,
                         model_type=model_type if isinstance(model_type, str) else "")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise TokenizerError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # A special token is a string or a serialized AddedToken {"content": ..., ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _opt_bool(config: dict, key: str) -> bool | None:
    value = config.get(key)
    return value if isinstance(value, bool) else None


def _eos_ids(config: dict) -> set[int]:
    value = config.get("eos_token_id")
    if value is None and isinstance(config.get("text_config"), dict):  # multimodal configs
        value = config["text_config"].get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _chat_template(root: Path, config: dict) -> str | dict[str, str] | None:
    """A template source, or {name: source} when there are several (transformers' precedence)."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = root / "chat_template.json"
    value = _read_json(json_file).get("chat_template") if json_file.is_file() else None
    if value is None:
        value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {}
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError("chat_template list entries must be {name, template} strings")
            named[entry["name"]] = entry["template"]
        return named
    raise TokenizerError("chat_template must be a string or a list of {name, template}")
