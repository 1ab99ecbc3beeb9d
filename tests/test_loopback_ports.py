"""loopback_ports.held_port, the picker of every port a test, the e2e or a bench hands to a process that binds it
later: no bind to port 0 gets a picked port meanwhile, and each binder of such ports can bind it; kept_port (the
e2e's), whose hold is renewed until the port's process listens."""

from __future__ import annotations

import asyncio
import errno
import http.server
import importlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
TCP = Path("/proc/net/tcp")
LOOPBACK = "127.0.0.1"
# The pickers as their callers reach them: module, function. The e2e's (make e2e; router_mode's is harness's) and
# the proxy benches' run outside pytest; tests and the launcher's bench_unit use loopback_ports.held_port.
PICKERS = [("loopback_ports", "held_port"), ("harness", "free_port"), ("bench.proxy_bench", "free_port"),
           ("bench.haproxy_callgrind", "free_port")]


def _picker(module: str, name: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    monkeypatch.syspath_prepend(str(ROOT / "e2e"))  # as e2e/run_e2e.py: its modules import one another by name
    return getattr(importlib.import_module(module), name)


def _binds_to_port_0() -> int:
    """Binds to port 0 enough that a port found free and closed is handed out again about ten times over on
    average: Linux picks among the odd ports of the range first (plain binds, as the old pickers' own)."""
    low, high = map(int, RANGE.read_text().split())
    return 10 * ((high - low + 1) // 2)


@pytest.mark.skipif(not RANGE.exists(), reason="Linux only")
@pytest.mark.parametrize(("module", "name"), PICKERS)
def test_a_picked_port_is_handed_to_no_bind_of_port_0_before_its_process_binds_it(
        module: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pick = _picker(module, name, monkeypatch)
    picked = {pick() for _ in range(8)}  # a unit's: engine, master, rendezvous, runtime, proxy, admin...
    assert len(picked) == 8
    taken = set()
    for _ in range(_binds_to_port_0() // len(picked)):
        with socket.socket() as other:
            other.bind((LOOPBACK, 0))
            taken.add(other.getsockname()[1])
    assert not picked & taken, f"{len(picked & taken)} of the 8 picked ports handed out again"


@pytest.mark.skipif(not RANGE.exists(), reason="Linux only")
def test_a_port_given_up_and_held_again_is_handed_to_no_bind_of_port_0_before_its_server_binds_it_again() -> None:
    """A server stopped and started again on its port (the local SSM of test_router_ssm.py, down for seconds):
    free meanwhile, the port went to the next bind to port 0 and the restart waited forever."""
    from loopback_ports import held_port

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((LOOPBACK, 0))
        server.listen(1)
        port = server.getsockname()[1]
    held_port(port)
    taken = set()
    for _ in range(_binds_to_port_0()):
        with socket.socket() as other:
            other.bind((LOOPBACK, 0))
            taken.add(other.getsockname()[1])
    assert port not in taken, "the port given up was handed out again"
    _plain(LOOPBACK, socket.SO_REUSEADDR)(port)  # and the server's restart binds it


def _plain(host: str, *options: int) -> Callable[[int], None]:
    def bind(port: int) -> None:
        with socket.socket() as sock:
            for option in options:
                sock.setsockopt(socket.SOL_SOCKET, option, 1)
            sock.bind((host, port))
            sock.listen(1)
    return bind


def _proxy_data_port(port: int) -> None:
    from unit_proxy.agent import bind_data_port

    bind_data_port(LOOPBACK, port).close()


def _asyncio_default(port: int) -> None:
    """aiohttp's TCPSite leaves reuse_address to loop.create_server, whose default on Linux is SO_REUSEADDR."""
    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, LOOPBACK, port)
        server.close()
        await server.wait_closed()
    asyncio.run(serve())


def _http_server(port: int) -> None:
    http.server.ThreadingHTTPServer((LOOPBACK, port), http.server.BaseHTTPRequestHandler).server_close()


def _dual_stack(port: int) -> None:
    """As torch 2.13's TCPStore (libuv backend) binds its master port: `[::]`, IPv4 too, falling back to 0.0.0.0."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
        sock.listen(1)


def _werkzeug(port: int) -> None:
    from werkzeug.serving import make_server  # moto's server

    make_server(LOOPBACK, port, lambda environ, start_response: []).server_close()


BINDERS = {
    "unit proxy and router data ports": _proxy_data_port,
    "aiohttp sites (launcher rendezvous, admin ports)": _asyncio_default,
    "http.server (slow link, fakes)": _http_server,
    "werkzeug (moto)": _werkzeug,
    # vLLM 0.32.0 launcher.create_server_socket: SO_REUSEPORT too only with more than one API server.
    "vLLM API server (SO_REUSEADDR)": _plain(LOOPBACK, socket.SO_REUSEADDR),
    "torch TCPStore through libuv ([::] dual-stack, SO_REUSEADDR)": _dual_stack,
    "torch TCPStore through libuv (0.0.0.0 without IPv6, SO_REUSEADDR)": _plain("0.0.0.0", socket.SO_REUSEADDR),
    "HAProxy, nginx, libevhtp (SO_REUSEADDR)": _plain(LOOPBACK, socket.SO_REUSEADDR),
}


def _renewed_alone() -> int:
    """A port held by a renewal alone, as a kept port is once its first TIME_WAIT is over."""
    from loopback_ports import renew

    with socket.socket() as other:
        other.bind((LOOPBACK, 0))
        port: int = other.getsockname()[1]
    assert renew(port), f"port {port}: found free, then listened on by another before its renewal"
    return port


def _held() -> int:
    from loopback_ports import held_port

    return held_port()


HOLDS = {"held_port": _held, "a renewal alone (kept_port past 60 s)": _renewed_alone}


@pytest.mark.parametrize("hold", HOLDS)
@pytest.mark.parametrize("binder", BINDERS)
def test_each_binder_of_picked_ports_can_bind_one(binder: str, hold: str) -> None:
    BINDERS[binder](HOLDS[hold]())


@pytest.mark.skipif(not RANGE.exists(), reason="Linux only")
def test_a_port_held_by_a_renewal_alone_is_handed_to_no_bind_of_port_0() -> None:
    picked = {_renewed_alone() for _ in range(8)}
    taken = set()
    for _ in range(_binds_to_port_0() // len(picked)):
        with socket.socket() as other:
            other.bind((LOOPBACK, 0))
            taken.add(other.getsockname()[1])
    assert not picked & taken, f"{len(picked & taken)} of the 8 renewed ports handed out again"


def test_a_listener_without_so_reuseaddr_cannot_bind_one_which_is_why_each_binder_must_set_it() -> None:
    from loopback_ports import held_port

    with pytest.raises(OSError) as raised:
        _plain(LOOPBACK)(held_port())
    assert raised.value.errno == errno.EADDRINUSE


def _time_wait_left(port: int) -> float:
    """The longest TIME_WAIT left on local port `port`, in seconds (0: none), from /proc/net/tcp (state 06, its
    timer in clock ticks)."""
    left = [0.0]
    for line in TCP.read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "06" and int(fields[1].split(":")[1], 16) == port:
            left.append(int(fields[5].split(":")[1], 16) / os.sysconf("SC_CLK_TCK"))
    return max(left)


def _wait(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)


def _renewed_since(port: int, picked: float) -> bool:
    """Whether the port has a TIME_WAIT made more than 1 s after its pick (the pick's has 60 s - age left)."""
    age = time.monotonic() - picked
    return _time_wait_left(port) > 60 - age + 1


LISTENERS: dict[str, Callable[[int], socket.socket]] = {
    "127.0.0.1 (vLLM, the launcher, the proxy, moto, ...)": lambda port: socket.create_server((LOOPBACK, port)),
    "[::] dual-stack (torch's TCPStore)": lambda port: socket.create_server(
        ("::", port), family=socket.AF_INET6, dualstack_ipv6=True),
}


@pytest.mark.skipif(not TCP.exists(), reason="Linux only")
@pytest.mark.parametrize("listener", LISTENERS)
def test_the_e2e_s_port_is_held_again_until_its_process_listens_on_it(
        listener: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """make e2e binds its unit's ports 95 to 200 s after it picks them (loopback_ports): TIME_WAIT's 60 s alone
    lapsed first, and the port was anyone's again. harness.free_port's hold is renewed (here every 0.3 s, the
    run's every 20 s) until a listener has the port, then no more."""
    import loopback_ports

    keeper = loopback_ports.Keeper(every=0.3)
    monkeypatch.setattr(loopback_ports, "KEEPER", keeper)
    port = _picker("harness", "free_port", monkeypatch)()
    picked = time.monotonic()
    _wait(lambda: _renewed_since(port, picked), f"a TIME_WAIT on port {port} made after its pick: its hold renewed")
    with LISTENERS[listener](port):  # create_server sets SO_REUSEADDR, as every binder of these ports does
        _wait(lambda: port not in keeper.kept(), f"port {port} no longer kept once its process listens on it")


@pytest.mark.parametrize(
    "binder", ["vLLM API server (SO_REUSEADDR)", "torch TCPStore through libuv ([::] dual-stack, SO_REUSEADDR)"])
def test_a_renewal_never_fails_the_bind_of_the_port_s_process(binder: str) -> None:
    """A renewal may come at any moment of the process's bind and listen (a kept port's process binds it whenever
    it is ready). held_port(port) as the renewal listens for a moment: 2733 of 3000 such binds failed EADDRINUSE."""
    from loopback_ports import held_port, renew

    port, stop, renewals, failed = held_port(), threading.Event(), [0], []

    def renewing() -> None:
        while not stop.is_set():
            renewals[0] += renew(port)

    thread = threading.Thread(target=renewing, daemon=True)
    thread.start()
    try:
        for _ in range(3000):
            try:
                BINDERS[binder](port)
            except OSError as error:
                failed.append(errno.errorcode.get(error.errno, str(error.errno)))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert renewals[0] > 0, "no renewal ran beside the binds"
    assert not failed, f"{len(failed)} of 3000 binds of the port's process failed during renewals: {set(failed)}"
