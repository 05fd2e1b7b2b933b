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
