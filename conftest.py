"""Test-wide guard for the rule "no network at test time beyond loopback": every in-process socket
stream connect and name lookup is checked, and one that would leave the machine fails the test, naming
the address or name (a stray AWS call, the instance metadata service). This machine answers on
169.254.169.254:80, so without the guard such a connect would quietly succeed.
Subprocesses are not covered: their environments turn the instance metadata off and point AWS
endpoints at loopback fakes. Also: each test starts without boto3's default session.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import pytest

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo


def _own_address() -> str | None:
    """This host's address on its default route: a datagram socket's connect sends no packet, it only
    picks the route (tests reach the host's own address to check what the launcher refuses from it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        return str(probe.getsockname()[0])


_OWN = _own_address()


def _local(sock: socket.socket, address: Any) -> bool:
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type == socket.SOCK_DGRAM:
        return True  # Unix sockets never leave the machine; a datagram connect sends nothing
    if address[0] == _OWN:
        return True
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    except ValueError:
        return address[0] == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _guarded_connect(self: socket.socket, address: Any) -> None:
    if not _local(self, address):
        raise ConnectionRefusedError(f"test guard (conftest.py): a connect to {address!r} would leave the machine")
    return _connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    if not _local(self, address):
        raise ConnectionRefusedError(f"test guard (conftest.py): a connect to {address!r} would leave the machine")
    return _connect_ex(self, address)


def _guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and name != "localhost" and not name.endswith(".localhost"):
        try:
            ipaddress.ip_address(str(name).split("%", 1)[0])
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, f"test guard (conftest.py): looking up {name!r} would leave "
                                                     "the machine") from None
    return _getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(socket.socket, "connect", _guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", _guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", _guarded_getaddrinfo)
    yield


@pytest.fixture(autouse=True)
def _fresh_boto3_default_session() -> Iterator[None]:
    """`boto3.client()` builds on one module-wide session, and botocore keeps the credentials that session
    first resolved (Session.get_credentials, botocore 1.44.8 session.py l.510). A test that set fake keys for
    loopback (test_evacuate) left them to the next test in the process, whose `boto3.client("s3")` then signed
    with them and tried amazonaws.com instead of failing on no credentials. Each test starts with none."""
    import boto3

    boto3.DEFAULT_SESSION = None
    yield
    boto3.DEFAULT_SESSION = None
