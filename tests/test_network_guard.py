"""The test-wide guard (conftest.py at the repository root) refuses every connect beyond loopback."""

from __future__ import annotations

import socket

import pytest


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
        assert s.connect_ex(("127.0.0.1", _closed_port())) != 0  # refused by the kernel, not by the guard


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_name_lookup_fails_unless_it_is_loopback() -> None:
    with pytest.raises(socket.gaierror, match=r"amazonaws\.com.*leave the machine"):
        socket.getaddrinfo("s3.us-east-2.amazonaws.com", 443)
    assert socket.getaddrinfo("localhost", 80) and socket.getaddrinfo("127.0.0.1", 80)
