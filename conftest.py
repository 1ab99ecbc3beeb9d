"""Test-wide guard for the rule "no network at test time beyond loopback": every in-process socket
stream connect, datagram send and name lookup is checked, and one that would leave the machine fails
the test, naming the address or name (a stray AWS call, the instance metadata service). This machine
answers on 169.254.169.254:80, so without the guard such a connect would quietly succeed. The guard
is in place for the whole session, module- and session-scoped fixtures included.
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
_send = socket.socket.send
_sendall = socket.socket.sendall
_sendto = socket.socket.sendto
_sendmsg = socket.socket.sendmsg
_getaddrinfo = socket.getaddrinfo
_gethostbyname = socket.gethostbyname
_gethostbyname_ex = socket.gethostbyname_ex
_gethostbyaddr = socket.gethostbyaddr
_getnameinfo = socket.getnameinfo


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
    return _local_address(address)


def _local_address(address: Any) -> bool:
    if address[0] == _OWN:
        return True
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    except ValueError:
        return address[0] == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _refuse_datagram(sock: socket.socket, address: Any) -> None:
    """A datagram to another host (a DNS query by hand, a metrics agent's UDP port) leaves the machine."""
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_DGRAM \
            and not _local_address(address):
        raise ConnectionRefusedError(f"test guard (conftest.py): a datagram to {address!r} would leave the machine")


def _peer(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return ("127.0.0.1", 0)  # not connected: the send fails on its own


def _guarded_connect(self: socket.socket, address: Any) -> None:
    if not _local(self, address):
        raise ConnectionRefusedError(f"test guard (conftest.py): a connect to {address!r} would leave the machine")
    return _connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    if not _local(self, address):
        raise ConnectionRefusedError(f"test guard (conftest.py): a connect to {address!r} would leave the machine")
    return _connect_ex(self, address)


def _guarded_send(self: socket.socket, data: Any, *args: Any) -> int:
    if self.type == socket.SOCK_DGRAM:
        _refuse_datagram(self, _peer(self))
    return _send(self, data, *args)


def _guarded_sendall(self: socket.socket, data: Any, *args: Any) -> None:
    if self.type == socket.SOCK_DGRAM:
        _refuse_datagram(self, _peer(self))
    return _sendall(self, data, *args)


def _guarded_sendto(self: socket.socket, data: Any, *args: Any) -> int:
    _refuse_datagram(self, args[-1])
    return _sendto(self, data, *args)


def _guarded_sendmsg(self: socket.socket, buffers: Any, *args: Any) -> int:
    address = args[2] if len(args) > 2 else _peer(self) if self.type == socket.SOCK_DGRAM else None
    if address is not None:
        _refuse_datagram(self, address)
    return _sendmsg(self, buffers, *args)


def _check_name(host: Any) -> None:
    """A name that is not an address nor localhost would be looked up in DNS, off the machine."""
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and name != "localhost" and not name.endswith(".localhost"):
        try:
            ipaddress.ip_address(str(name).split("%", 1)[0])
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, f"test guard (conftest.py): looking up {name!r} would leave "
                                                     "the machine") from None


def _guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    _check_name(host)
    return _getaddrinfo(host, *args, **kwargs)


def _guarded_gethostbyname(host: str) -> str:
    _check_name(host)
    return _gethostbyname(host)


def _guarded_gethostbyname_ex(host: str) -> Any:
    _check_name(host)
    return _gethostbyname_ex(host)


def _guarded_gethostbyaddr(host: str) -> Any:
    """A reverse lookup of another host's address asks DNS."""
    _check_name(host)
    if not _local_address((host, 0)):
        raise socket.herror(1, f"test guard (conftest.py): a reverse lookup of {host!r} would leave the machine")
    return _gethostbyaddr(host)


def _guarded_getnameinfo(address: Any, flags: int) -> Any:
    if not flags & socket.NI_NUMERICHOST and not _local_address(address):
        raise socket.gaierror(socket.EAI_NONAME, f"test guard (conftest.py): naming {address[0]!r} would leave "
                                                 "the machine (NI_NUMERICHOST stays local)")
    return _getnameinfo(address, flags)


@pytest.fixture(autouse=True, scope="session")
def _loopback_only() -> Iterator[None]:
    """Session-scoped, so module- and session-scoped fixtures run under the guard too. A test's own
    monkeypatch of these names restores the guarded one at its end."""
    with pytest.MonkeyPatch.context() as patch:
        for name, guarded in (("connect", _guarded_connect), ("connect_ex", _guarded_connect_ex),
                              ("send", _guarded_send), ("sendall", _guarded_sendall), ("sendto", _guarded_sendto),
                              ("sendmsg", _guarded_sendmsg)):
            patch.setattr(socket.socket, name, guarded)
        for name, guarded in (("getaddrinfo", _guarded_getaddrinfo), ("gethostbyname", _guarded_gethostbyname),
                              ("gethostbyname_ex", _guarded_gethostbyname_ex),
                              ("gethostbyaddr", _guarded_gethostbyaddr), ("getnameinfo", _guarded_getnameinfo)):
            patch.setattr(socket, name, guarded)
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
