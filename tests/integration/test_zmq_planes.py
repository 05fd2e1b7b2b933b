"""A local attacker's attempts on the ZeroMQ planes of a running stack, from raw pyzmq sockets on the same
machine: without keys, and with a valid key of the wrong role. Each is refused and the victims'
streams complete normally."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from services.protocol.kv_events import SnapshotRequest
from services.protocol.messages import (
    Abort, Admitted, Dispatch, GatewayInbox, StepOutput, StreamOpen, Submit, TextBatch, TextDelta)
from services.protocol.sampling import SamplingParams
from services.security import bundle
from services.security.curve import split_role
from tests.integration.stack import ROOT, records, wait_for

QUIET_S = 3.0   # how long an attacker's socket must stay silent


class Attacker:
    """Raw sockets in their own context (no ZAP handler: an attacker's inbox accepts anyone)."""

    def __init__(self, trust_dir: Path) -> None:
        self.ctx = zmq.Context()
        self.trust_dir = trust_dir
        self.socks: list[zmq.Socket] = []

    def socket(self, kind: int, key_role: str = "", server_role: str = "") -> zmq.Socket:
        """A socket; with `key_role`, holding that role's real key pair (a CURVE client expecting
        `server_role`, or a CURVE server when no server_role is given)."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if key_role:
            trust = bundle.load(self.trust_dir, key_role)
            sock.curve_publickey, sock.curve_secretkey = trust.curve_public, trust.curve_secret
            if server_role:
                sock.curve_serverkey = trust.peer_key(server_role)
            else:
                sock.curve_server = True
        self.socks.append(sock)
        return sock

    def sender(self, addr: str, key_role: str = "", server_role: str = "") -> zmq.Socket:
        sock = self.socket(zmq.PUSH, key_role, server_role)
        sock.connect(split_role(addr)[0])
        return sock

    def inbox(self, key_role: str = "") -> tuple[zmq.Socket, str]:
        """A PULL socket for replies and its address (naming `key_role` as its server's role)."""
        sock = self.socket(zmq.PULL, key_role)
        addr = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        return sock, (f"{addr}#{key_role}" if key_role else addr)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


@pytest.fixture
def attacker(stack):
    atk = Attacker(stack.procs.trust_dir)
    yield atk
    atk.close()


def addr(stack, kind: str, key: str = "zmq") -> str:
    recs = wait_for(lambda: [r for r in records(stack.redis_url, kind) if key in r.addrs], 30, f"a {kind} record")
    return recs[0].addrs[key]


def silent(sock: zmq.Socket, seconds: float = QUIET_S) -> bool:
    if sock.poll(int(seconds * 1000), zmq.POLLIN):
        raise AssertionError(f"the attacker received {sock.recv()[:200]!r}")
    return True


def send(sock: zmq.Socket, msg) -> None:
    try:
        sock.send(msgspec.msgpack.encode(msg), flags=zmq.NOBLOCK)
    except zmq.Again:   # no handshaken peer: the message cannot even be queued
        pass


class Victim(threading.Thread):
    """A user's streaming completion through the gateway with the official client."""

    def __init__(self, stack, max_tokens: int = 48) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.max_tokens = stack.openai(), stack.model_name, max_tokens
        self.text, self.finish, self.error = "", None, None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            stream = self.client.completions.create(model=self.model, prompt="the victim's private prompt",
                                                    max_tokens=self.max_tokens, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:
                self.started.set()
                self.text += chunk.choices[0].text if chunk.choices else ""
                self.finish = (chunk.choices[0].finish_reason if chunk.choices else None) or self.finish
        except Exception as exc:   # reported by finished_normally
            self.error = exc
        finally:
            self.started.set()

    def finished_normally(self) -> bool:
        self.join(120)
        assert not self.is_alive(), "the victim's stream hung"
        assert self.error is None, f"the victim's stream failed: {self.error!r}"
        assert self.finish == "length", f"the victim's stream ended with {self.finish!r}"
        assert "PWNED" not in self.text
        return True


def guessed_ids(stack, count: int = 400) -> list[str]:
    """The ids a gateway whose ids were `<tag><counter>` would give out (tag from its Redis record)."""
    gw = records(stack.redis_url, "gateway")[0].id
    tag = gw.rsplit("-", 1)[-1] + "-"
    return [f"{tag}{i:x}" for i in range(count)]


def submit(rid: str, reply_addr: str) -> Submit:
    return Submit(request_id=rid, tenant="anyone", prompt_token_ids=[5, 6, 7, 8], priority=-1000,
                  params=SamplingParams(max_tokens=8, ignore_eos=True), reply_addr=reply_addr, detok_addr=reply_addr)


def test_forged_submit_is_refused(stack, attacker):
    scheduler = addr(stack, "scheduler")
    plain_inbox, plain_addr = attacker.inbox()
    keyed_inbox, keyed_addr = attacker.inbox("worker")
    send(attacker.sender(scheduler), submit("forged-plain", plain_addr))
    send(attacker.sender(scheduler, "worker", "scheduler"), submit("forged-worker-key", keyed_addr))
    victim = Victim(stack)
    victim.start()
    assert silent(plain_inbox) and silent(keyed_inbox)
    assert victim.finished_normally()
    log = (stack.procs.log_dir / "scheduler.log").read_text(errors="replace")
    assert "from role worker" in log


def worker_epoch(stack) -> int:
    """The live worker's epoch: a forged Dispatch that is refused must be refused for its sender,
    not because it named a stale incarnation."""
    return next(r.epoch for r in records(stack.redis_url, "worker"))


def test_forged_dispatch_is_refused(stack, attacker):
    worker = addr(stack, "worker")
    plain_inbox, plain_addr = attacker.inbox()
    keyed_inbox, keyed_addr = attacker.inbox("gateway")
    for sock, reply in ((attacker.sender(worker), plain_addr),
                        (attacker.sender(worker, "gateway", "worker"), keyed_addr)):
        send(sock, Dispatch(request_id="forged", prompt_token_ids=[5, 6, 7], reply_addr=reply, detok_addr=reply,
                            params=SamplingParams(max_tokens=8, ignore_eos=True), epoch=worker_epoch(stack)))
    victim = Victim(stack)
    victim.start()
    assert silent(plain_inbox) and silent(keyed_inbox)
    assert victim.finished_normally()


def test_forged_aborts_do_not_stop_other_streams(stack, attacker):
    """Aborts for every id the old `<tag><counter>` scheme would have given out, to the scheduler and
    to the worker, without keys and with keys of roles that may not abort there."""
    victims = [Victim(stack, max_tokens=200) for _ in range(2)]
    for v in victims:
        v.start()
    for v in victims:
        v.started.wait(60)
    scheduler, worker = addr(stack, "scheduler"), addr(stack, "worker")
    socks = [attacker.sender(scheduler), attacker.sender(worker),
             attacker.sender(scheduler, "worker", "scheduler"), attacker.sender(worker, "tokenizer", "worker")]
    for rid in guessed_ids(stack):
        for sock in socks:
            send(sock, Abort(request_id=rid))
    assert all(v.finished_normally() for v in victims)


def test_forged_abort_of_a_known_id_is_refused(stack, attacker):
    """Even with the exact id: this test submits a request as a real gateway (gateway key), then
    aborts it from sockets that may not; the stream still runs to its last token."""
    inbox, inbox_addr = attacker.inbox("gateway")
    scheduler, worker = addr(stack, "scheduler"), addr(stack, "worker")
    legit = attacker.sender(scheduler, "gateway", "scheduler")
    rid = "r-known-victim"
    msg = submit(rid, inbox_addr)
    send(legit, Submit(**{**msgspec.structs.asdict(msg), "params": SamplingParams(max_tokens=300, ignore_eos=True)}))
    deadline, tokens, aborted = time.monotonic() + 120, 0, False
    # (a gateway may abort on a worker: the sample a stop string it found ended)
    forgers = [attacker.sender(scheduler), attacker.sender(worker), attacker.sender(scheduler, "worker", "scheduler"),
               attacker.sender(worker, "prefix-cache", "worker"), attacker.sender(worker, "tokenizer", "worker")]
    decoder = msgspec.msgpack.Decoder(GatewayInbox)
    finish = None
    while finish is None:
        assert time.monotonic() < deadline, f"the stream stalled after {tokens} tokens"
        if not inbox.poll(30_000, zmq.POLLIN):
            raise AssertionError(f"the stream stopped after {tokens} tokens")
        out = decoder.decode(inbox.recv())
        if not isinstance(out, (Admitted, StreamOpen, StepOutput)):
            raise AssertionError(f"the stream ended after {tokens} tokens: {out}")
        if isinstance(out, StepOutput):
            for seq in out.seqs:
                tokens += len(seq.token_ids)
                finish = seq.finish_reason or finish
        if tokens and not aborted:   # mid-stream
            for sock in forgers:
                send(sock, Abort(request_id=rid))
            aborted = True
    assert aborted and finish == "length" and tokens == 300


def test_a_gateway_may_stop_a_sample_on_the_worker_directly(stack, attacker):
    """The one Abort a gateway sends a worker: a request submitted with the gateway's key, then
    stopped mid-stream on the worker itself (not through the scheduler), as a gateway that found a
    stop string does. The worker stops it: the stream ends with the worker's Abort, far short of
    its max_tokens."""
    inbox, inbox_addr = attacker.inbox("gateway")
    scheduler, worker = addr(stack, "scheduler"), addr(stack, "worker")
    gateway = attacker.sender(scheduler, "gateway", "scheduler")
    direct = attacker.sender(worker, "gateway", "worker")
    rid = "r-stopped-by-its-gateway"
    msg = submit(rid, inbox_addr)
    send(gateway, Submit(**{**msgspec.structs.asdict(msg), "params": SamplingParams(max_tokens=2000, ignore_eos=True)}))
    decoder = msgspec.msgpack.Decoder(GatewayInbox)
    deadline, tokens, stopped_at = time.monotonic() + 120, 0, None
    while True:
        assert time.monotonic() < deadline, f"the stream neither stopped nor ended after {tokens} tokens"
        if not inbox.poll(30_000, zmq.POLLIN):
            raise AssertionError(f"the stream went silent after {tokens} tokens")
        out = decoder.decode(inbox.recv())
        if isinstance(out, StepOutput):
            tokens += sum(len(seq.token_ids) for seq in out.seqs)
            assert not any(seq.finish_reason == "length" for seq in out.seqs), "never stopped"
        if isinstance(out, Abort):
            assert (out.request_id, out.reason) == (rid, "stop")
            break
        if tokens and stopped_at is None:
            send(direct, Abort(request_id=rid, index=0, reason="stop"))
            stopped_at = tokens
    assert stopped_at is not None and tokens < 2000


def test_forged_text_batch_does_not_reach_a_stream(stack, attacker):
    victim = Victim(stack, max_tokens=200)
    victim.start()
    victim.started.wait(60)
    gateway = addr(stack, "gateway")
    socks = [attacker.sender(gateway), attacker.sender(gateway, "worker", "gateway")]
    for rid in guessed_ids(stack):
        for sock in socks:
            send(sock, TextBatch(deltas=[TextDelta(rid, 0, "PWNED", 1)]))
    assert victim.finished_normally()


def test_kv_events_and_snapshots_need_the_prefix_cache_key(stack, attacker):
    events, snapshots = addr(stack, "worker", "kv_events"), addr(stack, "worker", "kv_snapshot")
    subs = [attacker.socket(zmq.SUB), attacker.socket(zmq.SUB, "gateway", "worker")]
    for sub in subs:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(split_role(events)[0])
    askers = [attacker.socket(zmq.DEALER), attacker.socket(zmq.DEALER, "scheduler", "worker")]
    for dealer in askers:
        dealer.connect(split_role(snapshots)[0])
    time.sleep(0.5)   # PUB/SUB: let the subscriptions arrive before the traffic
    victim = Victim(stack)
    victim.start()
    for dealer in askers:
        send(dealer, SnapshotRequest(request_id="steal"))
    assert victim.finished_normally()
    for sock in subs + askers:
        assert silent(sock, 1.5)


@pytest.mark.parametrize("service, extra", [
    ("scheduler", ["--port", "0"]), ("tokenizer", ["--port", "0", "--model", "x"]), ("prefix-cache", ["--port", "0"]),
    ("gateway", []), ("worker", ["--port", "0", "--null-model"])])
def test_services_refuse_to_start_without_trust_material(service, extra, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", service, "--redis-url", "redis://127.0.0.1:1/0",
                             *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{service} started without trust material")
    assert proc.returncode == 2, out
    assert "--trust-dir" in out and "kvmesh keys generate" in out and "--insecure-internal-planes" in out, out
