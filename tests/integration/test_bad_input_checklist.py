"""docs/bad-input.md, a test per line, on the integration session's stack (embedded Redis,
tokenizer, scheduler, prefix-cache index, one tiny CPU worker: a real engine with greedy tokens,
KV events and snapshots; every service with a metrics page) plus a gateway of this module's with
API keys.

Each case runs while a good request streams (a witness: greedy, so its text is fixed) and
checks three things: the bad input is answered with a 4xx OpenAI-style error in < 100 ms (HTTP)
or dropped and counted in kvmesh_dropped_frames_total (internal sockets), INVALID_ARGUMENT or
PERMISSION_DENIED (gRPC); every witness's text equals the undisturbed one; every process still runs.
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from services.protocol.kv_events import KVEventBatch
from services.protocol.messages import Abort, Admitted, Dispatch, StreamOpen, Submit
from services.protocol.sampling import SamplingParams
from services.transport import MAX_FRAME_BYTES
from tests.integration.conftest import free_port
from tests.integration.stack import FAST, records, wait_for, wait_ready
from tests.integration.test_zmq_planes import Attacker

KEY = "sk-checklist"
ANSWER_S = 0.1            # every bad HTTP input is answered within this after its body arrived
LOOPBACK_BYTES_PER_S = 20e6   # a body's upload (and parse) time counts on top, at this rate (2 busy cores)
DROP_S = 2.0              # a dropped frame shows on its service's metrics page within this


@pytest.fixture(scope="module")
def st(stack):
    port = free_port()
    gateway = stack.procs.start("gateway-checklist", "gateway", *FAST, "--port", str(port), "--zmq-port", "0",
                                "--api-key", KEY)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, 60)
    atk = Attacker(stack.procs.trust_dir)
    yield {"base": base, "procs": stack.procs, "redis": stack.redis_url, "model": stack.model_name,
           "attacker": atk, "gateway_pid": gateway.pid}
    atk.close()
    stack.procs.kill("gateway-checklist")


class Witness(threading.Thread):
    """A good request beside the bad ones: a greedy stream through the official client, and the
    cases that ran while it streamed."""

    MAX_TOKENS = 64

    def __init__(self, st) -> None:
        super().__init__(daemon=True)
        self.http = openai.OpenAI(base_url=st["base"] + "/v1", api_key=KEY, timeout=60, max_retries=0)
        self.model, self.text, self.error = st["model"], "", None
        self.started = threading.Event()
        self.cases: list[str] = []

    def run(self) -> None:
        try:
            for chunk in self.http.completions.create(model=self.model, prompt="the witness says",
                                                      max_tokens=self.MAX_TOKENS, temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True}):
                self.text += chunk.choices[0].text if chunk.choices else ""
                self.started.set()
        except Exception as exc:  # the assertion names it
            self.error = exc
        finally:
            self.started.set()


class Witnesses:
    """One witness streams at all times while the cases run (a fresh one when the last ended): every
    case has a good request in flight beside it, and every witness's text must equal the
    undisturbed one's, whatever cases it saw."""

    def __init__(self, st, reference: str) -> None:
        self.st, self.reference = st, reference
        self.current: Witness | None = None

    def check(self, w: Witness) -> None:
        w.join(60)
        assert not w.is_alive(), f"a good request hung beside {w.cases}"
        assert w.error is None, f"a good request failed beside {w.cases}: {w.error!r}"
        assert w.text == self.reference, f"a good request's tokens changed beside {w.cases}"

    def beside(self, case: str) -> None:
        """Make sure a witness streams now, and note the case it sees."""
        if self.current is not None and not self.current.is_alive():
            self.check(self.current)
            self.current = None
        if self.current is None:
            self.current = Witness(self.st)
            self.current.start()
            assert self.current.started.wait(30)
        self.current.cases.append(case)


@pytest.fixture(scope="module")
def witnesses(st):
    first = Witness(st)
    first.start()
    first.join(60)
    assert first.error is None and first.text
    pool = Witnesses(st, first.text)
    yield pool
    if pool.current is not None:
        pool.check(pool.current)


@pytest.fixture
def witness(st, witnesses, request):
    """A good request streams while the test runs; after it, the witness that ended (if one did) had
    the reference text, and every process of the stack still runs."""
    witnesses.beside(request.node.name)
    yield
    if witnesses.current is not None and not witnesses.current.is_alive():
        witnesses.check(witnesses.current)
        witnesses.current = None
    assert {name: p.poll() for name, p in st["procs"].procs.items()} == {name: None for name in st["procs"].procs}


def answered(st, method: str, path: str, *, key: str | None = KEY, within_s: float = ANSWER_S,
             **kw) -> httpx.Response:
    """One HTTP request, timed: answered within `within_s` with an OpenAI-style 4xx error. Timed
    up to three times, the fastest counting: on CI's two busy cores (another test runs beside
    this one) a single answer can miss the bound by the scheduler's jitter alone; every answer
    must still be the 4xx. A streamed body (a generator) is sent once."""
    headers = {**kw.pop("headers", {}), **({"authorization": f"Bearer {key}"} if key is not None else {})}
    took = float("inf")
    attempts = 3 if isinstance(kw.get("content", b""), (bytes, str)) else 1
    with httpx.Client(base_url=st["base"], timeout=10) as http:
        for _ in range(attempts):
            http.get("/health")                                # the connection is open: time the request only
            t0 = time.perf_counter()
            r = http.request(method, path, headers=headers, **kw)
            took = min(took, time.perf_counter() - t0)
            assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "code"} and err["message"], err
            if took < within_s:
                break
    assert took < within_s, f"{method} {path}: answered in {took * 1000:.0f} ms at best of three"
    return r


def completion(st, **fields) -> dict:
    return {"model": st["model"], "prompt": "hi", "max_tokens": 4, **fields}


def chat(st, **fields) -> dict:
    return {"model": st["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


# ----------------------------------------------------------------------------- request bounds per field

BOUNDS = [
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 10_000_000}, None),
    ("completions", {"n": 100}, "n"),
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_k": -5}, "top_k"),
    ("completions", {"presence_penalty": 9}, "presence_penalty"),
    ("completions", {"frequency_penalty": -9}, "frequency_penalty"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"logprobs": 100}, "logprobs"),
    ("completions", {"stop": ["x"] * 17}, "stop"),
    ("completions", {"stop": ["x" * 1000]}, "stop"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"prompt": ["a"] * 65}, "prompt"),
    ("completions", {"prompt": [5, 99999999]}, None),
    ("completions", {"prompt": "x" * 3_000_000}, "prompt"),
    ("completions", {"model": "no-such-model"}, "model"),
    ("completions", {"user": "u" * 10_000}, "user"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 10_000}, "messages"),
    ("chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
]


@pytest.mark.parametrize("route, fields, param", BOUNDS, ids=[f"{r}-{'-'.join(f)}-{i}" for i, (r, f, _) in
                                                               enumerate(BOUNDS)])
def test_request_bounds(st, witness, route, fields, param):
    body = chat(st, **fields) if route == "chat/completions" else completion(st, **fields)
    size = len(msgspec.json.encode(body))
    r = answered(st, "POST", f"/v1/{route}", json=body, within_s=ANSWER_S + size / LOOPBACK_BYTES_PER_S)
    if param:
        assert r.json()["error"]["param"] == param, r.json()


# ----------------------------------------------------------------------------- bodies

DEEP = 100_000
BODIES = {
    "malformed-json": b"{not json",
    "empty": b"",
    "wrong-top-level-type": b"[1, 2, 3]",
    "wrong-field-type": b'{"model": 1, "prompt": "x"}',
    "nested-array-1e5": b"[" * DEEP + b"]" * DEEP,
    "nested-object-1e5": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "nested-in-a-field-1e5": b'{"model": "m", "prompt": "x", "logit_bias": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "nan": b'{"model": "%s", "prompt": "x", "temperature": NaN}',
    "infinity": b'{"model": "%s", "prompt": "x", "top_p": Infinity}',
    "minus-infinity": b'{"model": "%s", "prompt": "x", "presence_penalty": -Infinity}',
    "overflowing-float": b'{"model": "%s", "prompt": "x", "temperature": 1e999}',
    "huge-integer": b'{"model": "%s", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    "lone-surrogate-prompt": b'{"model": "%s", "prompt": "a\\ud800b"}',
    "lone-surrogate-chat": b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}',
    "invalid-utf8": b'{"model": "%s", "prompt": "\xff\xfe"}',
    "duplicate-keys-bad-last": b'{"model": "%s", "prompt": "x", "max_tokens": 4, "max_tokens": -4}',
}


@pytest.mark.parametrize("name", list(BODIES))
def test_malformed_bodies(st, witness, name):
    raw = BODIES[name].replace(b"%s", st["model"].encode())
    route = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = answered(st, "POST", route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_an_oversize_body_is_413_from_its_length(st, witness):
    """Refused from its Content-Length, before the body is read."""
    answered(st, "POST", "/v1/completions", content=b"x" * (9 << 20), headers={"content-type": "application/json"})


def test_an_oversize_chunked_body_is_413_while_it_streams(st, witness):
    def chunks():
        for _ in range(20):
            yield b"x" * (1 << 20)
    r = answered(st, "POST", "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                 within_s=ANSWER_S + (9 << 20) / LOOPBACK_BYTES_PER_S)   # read up to the limit, no further
    assert r.status_code == 413


def test_oversize_headers_are_431(st, witness):
    with httpx.Client(base_url=st["base"], timeout=10) as http:
        r = http.get("/v1/models", headers={"x-junk": "j" * 100_000, "authorization": f"Bearer {KEY}"})
    assert r.status_code == 431


# ----------------------------------------------------------------------------- paths

PATHS = [
    ("GET", "/v1/../v1/models"),
    ("GET", "/v1/%2e%2e/v1/models"),
    ("POST", "/v1/completions%2F..%2Fcompletions"),
    ("POST", "/v1//completions"),
    ("GET", "/v1/models/" + "a" * 20_000),
    ("GET", "/" + "p/" * 5_000),
    ("GET", "/v1/models/%00"),
    ("GET", "/admin"),
    ("GET", "/v1/completions/../../etc/passwd"),
]


def raw_http(st, method: str, path: str, body: bytes) -> tuple[int, bytes, float]:
    """One request with its path exactly as given (HTTP clients normalize `..`): status, body, seconds."""
    port = int(st["base"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        t0 = time.perf_counter()
        conn.sendall(head.encode() + body)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    took = time.perf_counter() - t0
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2], took


@pytest.mark.parametrize("method, path", PATHS, ids=[f"{m}-{p[:40]}" for m, p in PATHS])
def test_path_tricks_reach_no_handler_they_should_not(st, witness, method, path):
    status, body, took = raw_http(st, method, path, msgspec.json.encode(completion(st)))
    assert status in (400, 404, 405, 414), (status, body[:200])
    assert took < ANSWER_S
    if status != 414:                      # (the HTTP server's own answer to an overlong line)
        assert msgspec.json.decode(body)["error"]["message"]


# ----------------------------------------------------------------------------- API keys, methods

ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/models/m", None), ("POST", "/v1/completions", "c"),
          ("POST", "/v1/chat/completions", "chat"), ("POST", "/tokenize", {"prompt": "hi"}),
          ("POST", "/detokenize", {"tokens": [1]})]


@pytest.mark.parametrize("key", [None, "sk-wrong" + KEY, "Basic " + KEY, "Bearer"])
@pytest.mark.parametrize("method, path, body", ROUTES, ids=[p for _, p, _ in ROUTES])
def test_every_route_needs_the_api_key(st, witness, method, path, body, key):
    payload = completion(st) if body == "c" else chat(st) if body == "chat" else body
    headers = {}
    if key is not None and key.startswith(("Basic ", "Bearer")):    # a header that is not `Bearer <key>`
        headers, key = {"authorization": key}, None
    r = answered(st, method, path, key=key, json=payload, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("method, path", [("GET", "/v1/completions"), ("GET", "/v1/chat/completions"),
                                          ("DELETE", "/v1/models"), ("PUT", "/tokenize"), ("PATCH", "/detokenize"),
                                          ("POST", "/v1/models"), ("POST", "/health")])
def test_a_wrong_method_is_405(st, witness, method, path):
    r = answered(st, method, path)
    assert r.status_code == 405 and method not in r.headers["allow"]


# ----------------------------------------------------------------------------- internal sockets

def record_of(st, kind: str):
    """The stack's record of `kind` (for gateways, this module's), read once."""
    cache = st.setdefault("records", {})
    if kind not in cache:
        mine = (lambda r: r.id.startswith(f"gw-{st['gateway_pid']}-")) if kind == "gateway" else (lambda r: True)
        cache[kind] = next(r for r in records(st["redis"], kind) if mine(r))
    return cache[kind]


def scrape_dropped(st, kind: str) -> dict[tuple[str, str], float]:
    """A service's kvmesh_dropped_frames_total samples: (socket, reason) -> count (a gateway serves
    its page on its HTTP port)."""
    page = st["base"] + "/metrics" if kind == "gateway" else record_of(st, kind).addrs["metrics"]
    out = {}
    for line in httpx.get(page, timeout=5).text.splitlines():
        if line.startswith("kvmesh_dropped_frames_total{"):
            labels, value = line.rsplit(" ", 1)
            parts = dict(p.split("=", 1) for p in labels[len("kvmesh_dropped_frames_total{"):-1].split(","))
            out[(parts["socket"].strip('"'), parts["reason"].strip('"'))] = float(value)
    return out


def inbox_of(st, kind: str) -> str:
    return record_of(st, kind).addrs["zmq"]


SP = SamplingParams(max_tokens=4)
# socket -> (service kind for its record and metrics, its inbox's metrics name, a role that may connect,
#            a valid message that role may NOT send there, a role that may send `ok_kind`, ok_kind)
SOCKETS = {
    "scheduler": ("scheduler", "scheduler", "tokenizer",
                  Submit(request_id="r-x", tenant="t", prompt_token_ids=[5], params=SP, reply_addr="tcp://127.0.0.1:9",
                         detok_addr="tcp://127.0.0.1:9"), "gateway"),
    "worker": ("worker", "worker", "gateway",
               Dispatch(request_id="r-x", epoch=1, prompt_token_ids=[5], params=SP, reply_addr="tcp://127.0.0.1:9",
                        detok_addr="tcp://127.0.0.1:9"), "scheduler"),
    "gateway": ("gateway", "gateway", "tokenizer", Admitted(request_id="r-x"), "scheduler"),
    "detokenizer": ("tokenizer", "detokenizer", "scheduler",
                    StreamOpen(request_id="r-x", params=SP, reply_addr="tcp://127.0.0.1:9", num_prompt_tokens=1),
                    "worker"),
}
FRAMES = {
    "random-bytes": lambda sock_name: os.urandom(257),
    "msgpack-of-a-wrong-type": lambda sock_name: msgspec.msgpack.encode({"t": "submit", "request_id": 7}),
    "msgpack-of-another-plane": lambda sock_name: msgspec.msgpack.encode(KVEventBatch(worker_id="w", epoch=1, seq=0, ts=0.0,
                                                                                       events=[])),
    "msgpack-scalar": lambda sock_name: msgspec.msgpack.encode(12345),
}


def addr_of(st, sock_name: str) -> str:
    kind = SOCKETS[sock_name][0]
    return inbox_of(st, kind)     # a tokenizer's record advertises its detokenizer inbox


def send_and_see_drop(st, sock_name: str, payload: bytes, key_role: str, reason: str) -> None:
    kind, metric_name = SOCKETS[sock_name][0], SOCKETS[sock_name][1]
    before = scrape_dropped(st, kind).get((metric_name, reason), 0.0)
    sock = st["attacker"].sender(addr_of(st, sock_name), key_role, sock_name if sock_name != "detokenizer"
                                 else "tokenizer")
    sock.send(payload)
    wait_for(lambda: scrape_dropped(st, kind).get((metric_name, reason), 0.0) > before, DROP_S,
             f"the {sock_name} inbox to drop it ({reason})", interval=0.02)


@pytest.mark.parametrize("frame", list(FRAMES))
@pytest.mark.parametrize("sock_name", list(SOCKETS))
def test_garbage_frames_on_every_inbox_are_dropped(st, witness, sock_name, frame):
    allowed = SOCKETS[sock_name][4]
    send_and_see_drop(st, sock_name, FRAMES[frame](sock_name), allowed, "malformed")


@pytest.mark.parametrize("sock_name", list(SOCKETS))
def test_a_message_of_a_wrong_sender_role_is_dropped(st, witness, sock_name):
    _, _, role, msg, _ = SOCKETS[sock_name]
    send_and_see_drop(st, sock_name, msgspec.msgpack.encode(msg), role, "role")


@pytest.mark.parametrize("sock_name", list(SOCKETS))
def test_a_message_of_another_protocol_version_is_dropped(st, witness, sock_name):
    _, _, _, msg, allowed = SOCKETS[sock_name]
    legit = {"scheduler": Abort(request_id="r-none", version=999), "worker": Abort(request_id="r-none", version=999),
             "gateway": Admitted(request_id="r-none", version=999),
             "detokenizer": Abort(request_id="r-none", version=999)}[sock_name]
    send_and_see_drop(st, sock_name, msgspec.msgpack.encode(legit), allowed, "version")


@pytest.mark.parametrize("sock_name", list(SOCKETS))
def test_an_oversize_frame_closes_its_senders_connection(st, witness, sock_name):
    """Past MAX_FRAME_BYTES the socket drops the connection before the frame is buffered whole; the
    same sender's next (reconnected) message is served as usual."""
    allowed = SOCKETS[sock_name][4]
    sock = st["attacker"].sender(addr_of(st, sock_name), allowed,
                                 sock_name if sock_name != "detokenizer" else "tokenizer")
    sock.send(b"\0" * (MAX_FRAME_BYTES + 1))
    send_and_see_drop(st, sock_name, os.urandom(33), allowed, "malformed")   # the process reads on


@pytest.mark.parametrize("sock_name", list(SOCKETS))
def test_a_sender_without_a_key_of_the_stack_gets_nothing_through(st, witness, sock_name):
    """No CURVE key: the handshake fails, so not even a counter moves."""
    kind, metric_name = SOCKETS[sock_name][:2]
    before = scrape_dropped(st, kind)
    sock = st["attacker"].sender(addr_of(st, sock_name))
    try:
        sock.send(os.urandom(64), flags=zmq.NOBLOCK)
    except zmq.Again:
        pass
    time.sleep(0.3)
    assert scrape_dropped(st, kind) == before


def test_garbage_on_a_workers_snapshot_socket_is_answered_as_malformed(st, witness):
    rec = record_of(st, "worker")
    before = scrape_dropped(st, "worker").get(("snapshot requests", "malformed"), 0.0)
    sock = st["attacker"].socket(zmq.DEALER, "prefix-cache", "worker")
    sock.connect(rec.addrs["kv_snapshot"].split("#")[0])
    for payload in (os.urandom(99), msgspec.msgpack.encode({"t": "nope"}), b"\x93\x01\x02\x03"):
        sock.send(payload)
        assert sock.poll(2000), "no answer"
        sock.recv()
    wait_for(lambda: scrape_dropped(st, "worker").get(("snapshot requests", "malformed"), 0.0) >= before + 3,
             DROP_S, "the snapshot socket to count them")


# ----------------------------------------------------------------------------- gRPC

def test_grpc_garbage_is_invalid_argument(st, witness):
    """Raw bytes to Tokenize (gateway's certificate) and Match (scheduler's): INVALID_ARGUMENT,
    answered in < 100 ms; without the caller's role: PERMISSION_DENIED."""
    import grpc
    from services.security import bundle
    from services.transport import grpc_channel

    async def call(target: str, method: str, role: str, server_role: str) -> tuple[grpc.StatusCode, float]:
        trust = bundle.load(st["procs"].trust_dir, role)
        channel = grpc_channel(target, trust, server_role)
        try:
            rpc = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            answers = []
            for _ in range(2):       # the second is timed: the first also opens the TLS connection
                t0 = time.perf_counter()
                try:
                    await rpc(os.urandom(200), timeout=5)
                    answers.append((grpc.StatusCode.OK, time.perf_counter() - t0))
                except grpc.aio.AioRpcError as exc:
                    answers.append((exc.code(), time.perf_counter() - t0))
            return answers[-1]
        finally:
            await channel.close()

    tok, idx = record_of(st, "tokenizer").addrs["grpc"], record_of(st, "prefix-cache").addrs["grpc"]
    cases = [(tok, "/kvmesh.Tokenizer/Tokenize", "gateway", "tokenizer"),
             (idx, "/kvmesh.PrefixCache/Match", "scheduler", "prefix-cache")]

    async def all_calls() -> list[tuple[grpc.StatusCode, float]]:
        return [await call(target, method, role, server) for target, method, caller, server in cases
                for role in (caller, "worker")]

    answers = asyncio.run(all_calls())
    for (_, method, _, _), bad, refused in zip(cases, answers[::2], answers[1::2]):
        assert bad[0] is grpc.StatusCode.INVALID_ARGUMENT and bad[1] < ANSWER_S, (method, bad)
        assert refused[0] is grpc.StatusCode.PERMISSION_DENIED, (method, refused)
