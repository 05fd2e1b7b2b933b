"""Redis with a password: the embedded server refuses clients without it (a fake worker record
cannot be written), keeps the password out of its argv, and every kvmesh client authenticates the
way services/redis_client.py documents (URL password first, then the trust directory's)."""
from __future__ import annotations

import secrets
from urllib.parse import quote

import pytest
import redis
import redis.exceptions

from services import redis_client
from services.embedded_redis import EmbeddedRedis
from services.redis_client import RedisAuth
from services.registry import Registry
from services.security import bundle

FAKE_WORKER = b'{"kind":"worker","id":"evil","epoch":1,"addrs":{"zmq":"tcp://127.0.0.1:1"}}'


@pytest.fixture(scope="module")
def trust_root(tmp_path_factory):
    return bundle.generate(tmp_path_factory.mktemp("trust") / "trust").root


@pytest.fixture(scope="module")
def server(trust_root):
    with EmbeddedRedis(password=RedisAuth.from_dir(trust_root).password) as r:
        yield r


def test_a_client_without_the_password_is_refused(server):
    plain = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):   # NOAUTH
            plain.set("kvmesh:svc:worker:evil", FAKE_WORKER)
        with pytest.raises(redis.exceptions.AuthenticationError):
            plain.keys("*")
    finally:
        plain.close()
    wrong = redis.Redis.from_url(server.url, password="guessed", socket_timeout=5)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()
    finally:
        wrong.close()


def test_the_password_is_not_on_the_command_line(server):
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        argv = f.read()
    assert server.password.encode() not in argv
    assert b"requirepass" not in argv


async def test_services_authenticate_with_the_trust_directorys_password(server, trust_root):
    reg = Registry(server.url, RedisAuth.of(bundle.load(trust_root, "worker")))
    try:
        lease = await reg.register("worker", "w-auth", addrs={}, info={}, lease_ms=5000)
        assert [r.id for r in await reg.list("worker")] == ["w-auth"]
        await lease.release()
    finally:
        await reg.close()


async def test_a_password_in_the_url_wins_over_the_trust_directorys(server, tmp_path):
    """An external Redis you do not control: its own password in the URL; the trust directory's
    (another one here) is not sent."""
    other = RedisAuth.from_dir(bundle.generate(tmp_path / "other").root)
    url = f"redis://:{quote(server.password, safe='')}@127.0.0.1:{server.port}/0"
    r = redis_client.connect(url, other)
    try:
        assert await r.ping()
    finally:
        await r.aclose()
    r = redis_client.connect(server.url, other)   # no password in the URL: the (wrong) trust one
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await r.ping()
    finally:
        await r.aclose()


def test_the_embedded_server_keeps_answering_its_own_ping_after_a_restart(trust_root):
    """The supervisor restarts Redis through the same object: the password comes back with it (one
    with quotes, a backslash and spaces, which the config file must quote)."""
    r = EmbeddedRedis(password='a "b" \\c d ' + secrets.token_urlsafe(8)).start()
    try:
        assert r.ping()
        r.stop()
        r.start()
        assert r.ping()
        plain = redis.Redis(port=r.port, socket_timeout=5)
        with pytest.raises(redis.exceptions.AuthenticationError):
            plain.ping()
        plain.close()
        authed = redis.Redis(port=r.port, password=r.password, socket_timeout=5)
        assert authed.ping()
        authed.close()
    finally:
        r.stop()


def test_a_password_that_could_inject_a_config_line_is_refused():
    with pytest.raises(ValueError):
        EmbeddedRedis(password="x\nrequirepass other")
