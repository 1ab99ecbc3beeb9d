"""The test-wide guard (conftest.py at the repository root) refuses every connect beyond loopback."""

from __future__ import annotations

import socket

import pytest

from loopback_ports import held_port


def test_a_connect_beyond_loopback_fails_naming_the_address() -> None:
    with socket.socket() as s, pytest.raises(ConnectionRefusedError, match=r"169\.254\.169\.254.*leave the machine"):
        s.settimeout(0.5)
        s.connect(("169.254.169.254", 80))
    with socket.socket(socket.AF_INET6) as s, pytest.raises(ConnectionRefusedError, match="leave the machine"):
        s.connect_ex(("2001:db8::1", 443, 0, 0))


def test_loopback_connects() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as s:
        s.connect(server.getsockname())
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", held_port())) != 0  # refused by the kernel, not by the guard


def test_a_name_lookup_fails_unless_it_is_loopback() -> None:
    with pytest.raises(socket.gaierror, match=r"amazonaws\.com.*leave the machine"):
        socket.getaddrinfo("s3.us-east-2.amazonaws.com", 443)
    assert socket.getaddrinfo("localhost", 80) and socket.getaddrinfo("127.0.0.1", 80)


def test_a_datagram_beyond_loopback_fails_and_a_loopback_one_is_sent() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        with pytest.raises(ConnectionRefusedError, match=r"datagram to \('192\.0\.2\.1', 53\)"):
            s.sendto(b"\0" * 12, ("192.0.2.1", 53))
        s.connect(("192.0.2.1", 53))  # a datagram connect sends nothing: allowed
        with pytest.raises(ConnectionRefusedError, match="leave the machine"):
            s.send(b"\0" * 12)
        with pytest.raises(ConnectionRefusedError, match="leave the machine"):
            s.sendmsg([b"\0" * 12])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        server.bind(("127.0.0.1", 0))
        assert s.sendto(b"ping", server.getsockname()) == 4
        assert server.recv(16) == b"ping"


def test_the_older_lookups_are_guarded_too() -> None:
    with pytest.raises(socket.gaierror, match=r"amazonaws\.com.*leave the machine"):
        socket.gethostbyname("sts.amazonaws.com")
    with pytest.raises(socket.gaierror, match="leave the machine"):
        socket.gethostbyname_ex("sts.amazonaws.com")
    with pytest.raises(socket.herror, match=r"192\.0\.2\.1.*leave the machine"):
        socket.gethostbyaddr("192.0.2.1")
    with pytest.raises(socket.gaierror, match="leave the machine"):
        socket.getnameinfo(("192.0.2.1", 443), 0)
    assert socket.getnameinfo(("192.0.2.1", 443), socket.NI_NUMERICHOST | socket.NI_NUMERICSERV) == ("192.0.2.1", "443")
    assert socket.gethostbyname("localhost") and socket.gethostbyname("127.0.0.1") == "127.0.0.1"


@pytest.fixture(scope="module")
def _module_connect() -> str:
    """A module-scoped fixture runs before any function-scoped one: the guard must already be there."""
    with socket.socket() as s:
        s.settimeout(0.5)
        try:
            s.connect(("192.0.2.1", 80))
        except OSError as refused:
            return str(refused) or type(refused).__name__
    return "connected"


def test_a_module_scoped_fixture_is_guarded(_module_connect: str) -> None:
    assert "leave the machine" in _module_connect
