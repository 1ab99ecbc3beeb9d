"""loopback_ports.held_port, the picker of every port a test, the e2e or a bench hands to a process that binds it
later: no bind to port 0 gets a picked port meanwhile, and each binder of such ports can bind it."""

from __future__ import annotations

import asyncio
import errno
import http.server
import importlib
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
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


def _werkzeug(port: int) -> None:
    from werkzeug.serving import make_server  # moto's server

    make_server(LOOPBACK, port, lambda environ, start_response: []).server_close()


BINDERS = {
    "unit proxy and router data ports": _proxy_data_port,
    "aiohttp sites (launcher rendezvous, admin ports)": _asyncio_default,
    "http.server (slow link, fakes)": _http_server,
    "werkzeug (moto)": _werkzeug,
    "vLLM API server (SO_REUSEADDR, SO_REUSEPORT)": _plain(LOOPBACK, socket.SO_REUSEADDR, socket.SO_REUSEPORT),
    "torch TCPStore through libuv (0.0.0.0, SO_REUSEADDR)": _plain("0.0.0.0", socket.SO_REUSEADDR),
    "HAProxy, nginx, libevhtp (SO_REUSEADDR)": _plain(LOOPBACK, socket.SO_REUSEADDR),
}


@pytest.mark.parametrize("binder", BINDERS)
def test_each_binder_of_picked_ports_can_bind_one(binder: str) -> None:
    from loopback_ports import held_port

    BINDERS[binder](held_port())


def test_a_listener_without_so_reuseaddr_cannot_bind_one_which_is_why_each_binder_must_set_it() -> None:
    from loopback_ports import held_port

    with pytest.raises(OSError) as raised:
        _plain(LOOPBACK)(held_port())
    assert raised.value.errno == errno.EADDRINUSE
