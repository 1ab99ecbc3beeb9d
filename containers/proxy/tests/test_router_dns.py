"""The cell router while the VPC resolver fails: cells named by DNS (as on AWS: PrivateLink endpoint names, the
private zone's TLS names) keep their last address and their health checks decide.

A defect hunt (thirty-second session): with HAProxy 2.6's default `hold` periods (30 s) a resolver silent for
about 30 s put every cell in `MAINT (resolution)` and the router answered 503 to everything (26 of 90 requests in
the hunt's run), although the cells still served at the addresses it had. The resolver here is a fake on
loopback, answering A queries and then going silent; the configuration is the shipped one with only its
`parse-resolv-conf` line replaced by that resolver. Takes about 45 s (it must outlast the old 30 s)."""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import unit_proxy.router as router_module
from unit_proxy.router import start
from unit_proxy.router_config import RouterSettings

from .conftest import cells_checked
from .test_router import LOOPBACK, NO_ALB, FakeCell, _post, cells  # noqa: F401 (fixtures)


class FakeDns:
    """A resolver on loopback answering every A query with 127.0.0.1 (TTL 60) while `answering`."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        self.answering = True
        self.queries = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            self.queries += 1
            if not self.answering:
                continue
            end = 12
            while data[end]:
                end += data[end] + 1
            end += 5  # the root label and QTYPE, QCLASS
            qtype = struct.unpack("!H", data[end - 4:end - 2])[0]
            answer = struct.pack("!HHHLH4s", 0xC00C, 1, 1, 60, 4, socket.inet_aton(LOOPBACK)) if qtype == 1 else b""
            header = data[:2] + struct.pack("!HHHHH", 0x8180, 1, 1 if answer else 0, 0, 0)
            self.sock.sendto(header + data[12:end] + answer, peer)


async def test_a_dns_outage_does_not_take_healthy_cells_out(cells, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    a, b = cells
    dns = FakeDns()
    shipped = router_module.render

    def render(settings, paths):  # the shipped configuration, with the VPC resolver replaced by the fake one
        text = shipped(settings, paths)
        assert "    parse-resolv-conf\n" in text
        return text.replace("    parse-resolv-conf\n", f"    nameserver local {LOOPBACK}:{dns.port}\n")

    monkeypatch.setattr(router_module, "render", render)
    port_a, port_b = a.url.rsplit(":", 1)[1], b.url.rsplit(":", 1)[1]
    settings = RouterSettings.from_env({
        "ROUTER_CELLS": f"a=http://cell-a.test:{port_a},b=http://cell-b.test:{port_b}", "ROUTER_HOST": LOOPBACK,
        "ROUTER_PORT": "0", "ROUTER_ADMIN_PORT": "0", "ROUTER_EVACUATION_FILE": str(tmp_path / "e.json"),
        "ROUTER_POLL_SECONDS": "0.2", "ROUTER_CHECK_INTERVAL_MS": "500", **NO_ALB})
    router = await start(replace(settings))
    try:
        async with aiohttp.ClientSession() as session:
            await cells_checked(router)
            assert [await _post(session, router.port) for _ in range(4)].count((200, "a")) >= 1
            dns.answering = False  # the resolver stops answering; the cells keep serving at their addresses
            began, answers = time.monotonic(), []
            while time.monotonic() - began < 40:
                answers.append((round(time.monotonic() - began), await _post(session, router.port)))
                await asyncio.sleep(0.5)
            statuses = {c: s.status for c, s in router.state.cells.items()}
            dns.answering = True
            back = time.monotonic()
            while (await _post(session, router.port))[0] != 200 and time.monotonic() - back < 30:
                await asyncio.sleep(0.2)
        failed = [(t, r) for t, r in answers if r[0] != 200]
        assert dns.queries > 1  # the router did ask the silent resolver
        assert failed == [], (statuses, failed[:3], len(failed))
        assert all(status.startswith("UP") for status in statuses.values()), statuses
    finally:
        await router.close()
