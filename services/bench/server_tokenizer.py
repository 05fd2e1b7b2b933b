"""The server's own tokenizer, read through its `/tokenize` endpoint (vLLM's, also served by kvmesh).

    POST {base}/tokenize  {"model": M, "prompt": TEXT, "add_special_tokens": BOOL}
                       -> {"count": N, "tokens": [...], "max_model_len": L}

Only `count` is used: prompts are built from words whose token cost the server reports
(tokens.py), and every finished prompt is counted by the server once more, so its length is the
length the server will see.
"""
from __future__ import annotations

import httpx

TOKENIZER_HINT = ("pass --tokenizer DIR (a Hugging Face tokenizer directory with tokenizer.json, "
                  "e.g. the model's directory) so that prompt lengths can be counted")


class ServerTokenizerError(RuntimeError):
    """/tokenize could not count: the message says what failed (and names --tokenizer where it would help)."""


class PromptRefused(ServerTokenizerError):
    """/tokenize works but refused one prompt (a 400: longer than the model's context)."""


class ServerTokenizer:
    """Counts tokens with POST /tokenize on the server under test; one keep-alive connection."""

    def __init__(self, base_url: str, model: str, headers: dict, timeout_s: float = 30.0):
        self.url = base_url.rstrip("/") + "/tokenize"
        self.name = f"the server's /tokenize ({self.url})"
        self._model = model
        self._http = httpx.Client(headers=headers, timeout=timeout_s, trust_env=False)
        self._probe()

    def count(self, text: str, add_special_tokens: bool) -> int:
        return self._post(text, add_special_tokens)

    def close(self) -> None:
        self._http.close()

    def _probe(self) -> None:
        """One request up front, so that a server without /tokenize fails before any prompt is built."""
        try:
            self._post("hello world", False)
        except ServerTokenizerError:
            self.close()
            raise

    def _post(self, text: str, add_special_tokens: bool) -> int:
        body = {"model": self._model, "prompt": text, "add_special_tokens": add_special_tokens}
        try:
            resp = self._http.post(self.url, json=body)
        except httpx.HTTPError as exc:
            raise ServerTokenizerError(f"could not reach {self.url} ({type(exc).__name__}: {exc}); "
                                       f"{TOKENIZER_HINT}") from None
        if resp.status_code == 400:  # the endpoint works but refused this prompt (too long, ...)
            raise PromptRefused(f"{self.url} refused to count a prompt of {len(text)} characters "
                                       f"(HTTP 400: {_error_message(resp)})")
        if resp.status_code != 200:
            why = _error_message(resp)
            if resp.status_code in (401, 403):
                why += "; check --api-key"
            raise ServerTokenizerError(f"{self.url} answered HTTP {resp.status_code} ({why}); {TOKENIZER_HINT}")
        try:
            count = resp.json()["count"]
        except (ValueError, KeyError, TypeError):
            count = None
        if not isinstance(count, int) or count < 0:
            raise ServerTokenizerError(f"{self.url} did not answer with a token count; {TOKENIZER_HINT}")
        return count


def _error_message(resp: httpx.Response) -> str:
    """The OpenAI-style error message of a refusal, cut short; the status text when there is none."""
    try:
        err = resp.json().get("error")
        message = err.get("message") if isinstance(err, dict) else resp.json().get("detail")
    except (ValueError, AttributeError):
        message = None
    return str(message)[:200] if message else (resp.reason_phrase or "no message")
