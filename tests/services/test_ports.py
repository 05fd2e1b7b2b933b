"""services.ports.free_port: ports a later owner binds come from below the kernel's ephemeral range,
so no bind(0) in between (another service's random port) can take them first."""
import socket

from services.ports import LOWEST, _ephemeral_low, free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_random_ports_never_land_there():
    picked = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))             # what every service's own random port does
        assert s.getsockname()[1] != picked and s.getsockname()[1] >= _ephemeral_low()


def test_no_port_is_handed_out_twice_in_a_process_or_across_processes(tmp_path, monkeypatch):
    import subprocess
    import sys

    from services import ports
    monkeypatch.setattr(ports.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(ports.random, "randint", lambda lo, hi: lo + len(ports._handed) % 4)  # 4 ports only
    mine = {free_port() for _ in range(3)}
    assert len(mine) == 3                              # never the same port twice in one process
    # another process (its own _handed) skips the ports claimed here, fresh claims only
    code = ("import random, tempfile, sys; from services import ports; "
            f"tempfile.gettempdir = lambda: {str(tmp_path)!r}; "
            "seen = []; random.randint = lambda lo, hi: lo + len(seen) % 4; "
            "claim = ports._claim; ports._claim = lambda d, p: seen.append(p) or claim(d, p); "
            "print(ports.free_port(attempts=8))")
    other = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               cwd=ports.Path(ports.__file__).parents[1]).stdout)
    assert other not in mine
    claims = tmp_path / f"kvmesh-ports-{ports.os.getuid()}"
    assert oct(claims.stat().st_mode & 0o777) == "0o700" and len(list(claims.iterdir())) == 4
    # a claim past CLAIM_S is taken over
    stale = claims / str(min(mine))
    ports.os.utime(stale, (0, 0))
    assert ports._claim(claims, min(mine)) and not ports._claim(claims, min(mine))
