"""The gateway's intake under hostile or heavy input: a prompt too long
to fit is refused by its characters before it is tokenized, long prompts tokenize off the event
loop (/health keeps answering), /tokenize's answer is bounded, slow clients are timed out, a
burst past the connection limit is refused cleanly, and a client leaving mid-body is one log line.

Its own stack (real processes): a null-model worker with a long context (MAX_MODEL_LEN) so that
multi-megabyte prompts pass the character bound and really are tokenized; a gateway that
tokenizes in-process (`local`), one that asks the tokenizer service over gRPC (`grpc`, with short
read timeouts) and one with a small connection limit (`few`).
"""
from __future__ import annotations

import concurrent.futures
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.ports import free_port
from services.text.tokenizer import load_tokenizer
from tests.integration.stack import FAST, INTERNAL, redis_and_procs, wait_for, wait_ready

MAX_MODEL_LEN = 100_000
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, FEW_CONNECTIONS = 2.0, 3.0, 20
WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


def text_of(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = " ".join(rng.choice(WORDS) for _ in range(chars // 5 + 1))
    return out[:chars]


def refusal_time(addr: tuple[str, int], path: str, body: dict) -> tuple[int, dict, float]:
    """POST body; the status, the JSON answer and the seconds from the last byte sent to the answer
    (what the gateway spent, not the client's encoding or the transfer)."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    with socket.create_connection(addr, timeout=60) as s:
        s.sendall(head.encode() + b"connection: close\r\n\r\n" + data)
        t0 = time.monotonic()
        answer = s.recv(1)
        elapsed = time.monotonic() - t0
        while chunk := s.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2]), elapsed


# /health polled from its own process (a kubelet's probe is one) every 20 ms, until the file
# argv[2] exists (at most 120 s); prints the slowest answer's seconds and the number of polls
HEALTH_POLLER = """
import os, sys, time, httpx
worst, polls, end = 0.0, 0, time.monotonic() + 120
with httpx.Client(base_url=sys.argv[1], timeout=10) as http:
    while time.monotonic() < end and not os.path.exists(sys.argv[2]):
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        worst, polls = max(worst, time.monotonic() - t0), polls + 1
        time.sleep(0.02)
print(worst, polls)
"""


class Gateways:
    def __init__(self, model: str, token_chars: int, logs: Path, urls: dict[str, str]) -> None:
        self.model, self.model_name, self.token_chars = model, Path(model).name, token_chars
        self.logs, self.urls = logs, urls

    def client(self, which: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls[which] + "/v1", api_key="none", timeout=120, max_retries=0)

    def log(self, which: str) -> str:
        return (self.logs / f"gw-{which}.log").read_text(errors="replace")

    def addr(self, which: str) -> tuple[str, int]:
        host, port = self.urls[which].removeprefix("http://").split(":")
        return host, int(port)


@pytest.fixture(scope="module")
def gws(tiny_model, tmp_path_factory) -> Gateways:
    logs = tmp_path_factory.mktemp("intake-logs")
    ports = {name: free_port() for name in ("local", "grpc", "few")}
    with redis_and_procs(logs) as (redis, procs):
        procs.start("tokenizer", "tokenizer", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model)
        procs.start("scheduler", "scheduler", *FAST, *INTERNAL, "--metrics-port", "-1")
        procs.start("worker", "worker", *FAST, *INTERNAL, "--metrics-port", "-1", "--model", tiny_model,
                    "--null-model", "--worker-id", "intake-worker", "--max-model-len", str(MAX_MODEL_LEN),
                    "--num-gpu-blocks", "16384", "--max-num-seqs", "16")
        procs.start("gw-local", "gateway", *FAST, "--port", str(ports["local"]), "--zmq-port", "0",
                    "--text-in-gateway", "--model", tiny_model)
        procs.start("gw-grpc", "gateway", *FAST, "--port", str(ports["grpc"]), "--zmq-port", "0",
                    "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S))
        procs.start("gw-few", "gateway", *FAST, "--port", str(ports["few"]), "--zmq-port", "0",
                    "--max-connections", str(FEW_CONNECTIONS))
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for url in urls.values():
            wait_ready(url, 180)
        token_chars = load_tokenizer(tiny_model).max_token_chars
        assert token_chars, "the tiny model's byte-level BPE tokenizer has a character bound"
        yield Gateways(tiny_model, token_chars, logs, urls)


BOTH = pytest.mark.parametrize("which", ["local", "grpc"])


# ---- item 2: long prompts ------------------------------------------------------------------------

@BOTH
def test_a_prompt_over_the_character_bound_is_refused_fast_without_tokenizing(gws, which):
    limit = MAX_MODEL_LEN * gws.token_chars
    with pytest.raises(openai.BadRequestError) as err:   # the official client sees a plain 400
        gws.client(which).completions.create(model=gws.model_name, prompt=text_of(limit + 1), max_tokens=1)
    body = err.value.body
    assert body["param"] == "prompt" and body["code"] == "context_length_exceeded"
    assert f"at most {limit} characters" in body["message"]   # the character bound, not a token count
    status, answer, elapsed = refusal_time(gws.addr(which), "/v1/completions",
                                           {"model": gws.model_name, "prompt": text_of(limit + 1), "max_tokens": 1})
    assert status == 400 and "characters" in answer["error"]["message"]
    # tokenizing it takes seconds; the bound, milliseconds (generous: the test host is busy)
    assert elapsed < 1.0, f"{elapsed:.2f} s to refuse a prompt that cannot fit"


@BOTH
def test_a_chat_message_over_the_character_bound_is_refused_fast(gws, which):
    content = text_of(MAX_MODEL_LEN * gws.token_chars + 1)
    status, answer, elapsed = refusal_time(gws.addr(which), "/v1/chat/completions", {
        "model": gws.model_name, "max_tokens": 1, "messages": [{"role": "user", "content": content}]})
    assert status == 400 and answer["error"]["param"] == "messages" and "characters" in answer["error"]["message"]
    assert elapsed < 1.0, f"{elapsed:.2f} s"


@BOTH
def test_health_answers_while_four_multi_megabyte_prompts_tokenize(gws, which, tmp_path):
    # 1.2 MB each: under the character bound (so each is tokenized in full), over the context in tokens
    prompts = [text_of(1_200_000, seed=i) for i in range(4)]
    assert len(prompts[0]) < MAX_MODEL_LEN * gws.token_chars

    def send(prompt: str) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as err:
            gws.client(which).completions.create(model=gws.model_name, prompt=prompt, max_tokens=1)
        return err.value

    done = tmp_path / "done"
    poller = subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, gws.urls[which], str(done)],
                              stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            errors = list(pool.map(send, prompts, timeout=120))
        done.touch()
        out, _ = poller.communicate(timeout=30)
    finally:
        poller.kill()
        poller.wait()
    for e in errors:   # tokenized in full, then refused by its token count
        assert e.body["code"] == "context_length_exceeded" and "tokens" in e.body["message"]
        assert e.body["param"] == "prompt"
    worst, polls = out.split()
    assert int(polls) >= 20
    assert float(worst) < 0.5, f"/health took {float(worst):.2f} s while prompts were tokenized"


@BOTH
def test_a_long_prompt_that_fits_is_served(gws, which):
    prompt = text_of(60_000)
    out = gws.client(which).completions.create(model=gws.model_name, prompt=prompt, max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert 1_000 < out.usage.prompt_tokens < MAX_MODEL_LEN
    # /tokenize counts the same prompt the same way
    r = httpx.post(gws.urls[which] + "/tokenize", json={"model": gws.model_name, "prompt": prompt}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] == out.usage.prompt_tokens == len(r.json()["tokens"])


@BOTH
def test_tokenize_answers_at_most_the_context_length(gws, which):
    url = gws.urls[which] + "/tokenize"
    # fits the character bound, not the context: refused with its count, not 1.3M ids
    r = httpx.post(url, json={"model": gws.model_name, "prompt": text_of(MAX_MODEL_LEN * 3)}, timeout=60)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"] and len(r.content) < 1000
    # over the character bound: refused before tokenizing
    status, answer, elapsed = refusal_time(gws.addr(which), "/tokenize", {
        "model": gws.model_name, "prompt": text_of(MAX_MODEL_LEN * gws.token_chars + 1)})
    assert status == 400 and "characters" in answer["error"]["message"] and elapsed < 1.0


# ---- item 3: slow clients, connection limit, disconnects -----------------------------------------

def _open(addr: tuple[str, int], data: bytes) -> socket.socket:
    s = socket.create_connection(addr, timeout=5)
    s.sendall(data)
    return s


def _answer_and_close(s: socket.socket, within_s: float) -> bytes:
    """What the server sent before closing; fails if it keeps the connection open past within_s."""
    s.settimeout(within_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except socket.timeout:
        raise AssertionError(f"the connection was still open after {within_s} s (got {out[:80]!r})") from None
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return out


def _close_all(sockets: list[socket.socket], timeout_s: float) -> list[bytes]:
    with concurrent.futures.ThreadPoolExecutor(len(sockets)) as pool:
        return list(pool.map(lambda s: _answer_and_close(s, timeout_s), sockets))


def test_slow_headers_are_closed_after_the_header_timeout(gws):
    addr = gws.addr("grpc")
    t0 = time.monotonic()
    sockets = [_open(addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(25)]
    sockets += [socket.create_connection(addr, timeout=5) for _ in range(25)]   # connect, send nothing
    answers = _close_all(sockets, HEADER_TIMEOUT_S + 15)
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 15
    assert all(a.startswith(b"HTTP/1.1 408") or a == b"" for a in answers), answers[:3]
    assert sum(a.startswith(b"HTTP/1.1 408") for a in answers) >= 40
    assert httpx.get(gws.urls["grpc"] + "/health", timeout=10).status_code == 200


def test_oversized_headers_are_refused_with_431(gws):
    addr = gws.addr("grpc")
    s = _open(addr, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"p" * 70_000 + b"\r\n\r\n")
    answer = _answer_and_close(s, 10)
    assert answer.startswith(b"HTTP/1.1 431") and b"headers_too_large" in answer
    assert httpx.get(gws.urls["grpc"] + "/health", headers={"X-Pad": "p" * 8000}, timeout=10).status_code == 200


def _health_on(s: socket.socket) -> bytes:
    """One GET /health on an open keep-alive connection: the response's status line."""
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    out = b""
    while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < _content_length(out):
        chunk = s.recv(65536)
        if not chunk:
            raise AssertionError(f"the gateway closed the connection (got {out[:80]!r})")
        out += chunk
    return out.split(b"\r\n", 1)[0]


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_an_idle_keep_alive_connection_outlives_the_clients_idle_expiry(gws):
    """The openai client (httpx) reuses a connection idle up to 5 s: a gateway closing it at 5 s
    (uvicorn's default) races that reuse and the client sees "Server disconnected"."""
    s = socket.create_connection(gws.addr("grpc"), timeout=10)
    try:
        assert _health_on(s) == b"HTTP/1.1 200 OK"
        time.sleep(6)
        assert _health_on(s) == b"HTTP/1.1 200 OK"
    finally:
        s.close()


def test_half_bodies_are_closed_after_the_body_timeout(gws):
    addr = gws.addr("grpc")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2000\r\n\r\n")
    logged = gws.log("grpc").count("body bytes in 3 s (408)")
    t0 = time.monotonic()
    sockets = [_open(addr, head + b'{"prompt": "' + b"a" * 900) for _ in range(50)]
    answers = _close_all(sockets, BODY_TIMEOUT_S + 15)
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 15
    assert sum(a.startswith(b"HTTP/1.1 408") for a in answers) >= 40, answers[:3]
    # one line each ("closed the connection of ...: POST '/v1/completions' sent 912 of 2000 body bytes ...")
    wait_for(lambda: gws.log("grpc").count("body bytes in 3 s (408)") - logged == 50, 10, "a log line per 408")
    assert "Traceback" not in gws.log("grpc")
    # the gateway still serves
    out = gws.client("grpc").completions.create(model=gws.model_name, prompt="hello", max_tokens=2)
    assert out.choices[0].text is not None


def test_a_disconnect_mid_body_is_one_log_line_and_no_traceback(gws):
    addr = gws.addr("local")
    before = gws.log("local")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    s = _open(addr, head + b"b" * 1000)
    time.sleep(0.3)
    s.close()
    line = "disconnected during POST '/v1/completions' after 1000 of 100000 body bytes"
    wait_for(lambda: line in gws.log("local"), 10, "the disconnect's log line")
    time.sleep(0.5)   # anything else it would log (a traceback) comes with it
    new = gws.log("local")[len(before):]
    assert new.count(line) == 1 and len([x for x in new.splitlines() if x.strip()]) == 1, new[:2000]
    assert "Traceback" not in new and "ClientDisconnect" not in new


def test_a_burst_over_the_connection_limit_is_refused_and_normal_requests_follow(gws):
    addr, url = gws.addr("few"), gws.urls["few"]
    held = [socket.create_connection(addr, timeout=5) for _ in range(FEW_CONNECTIONS)]
    try:
        time.sleep(0.3)
        with httpx.Client(timeout=10) as http:
            answers = [http.get(url + "/health", headers={"connection": "close"}) for _ in range(10)]
        for r in answers:
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    def served() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    wait_for(served, 10, "the gateway to serve once the held connections closed")
    out = gws.client("few").completions.create(model=gws.model_name, prompt="hello", max_tokens=2)
    assert out.usage.completion_tokens == 2
    log = gws.log("few")
    assert log.count("--max-connections is") <= 2 and "Traceback" not in log
