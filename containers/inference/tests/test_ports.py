"""The test harness's own loopback ports (conftest.free_ports): picked before the launchers start, bound by
them seconds later, and handed to no other bind meanwhile (tests run in parallel, `pytest -n 2`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="Linux only")
def test_a_picked_port_is_handed_to_no_other_bind_before_its_process_binds_it(h):
    """Enough binds to port 0 (the other worker's servers, moto, its own picks) that a port found free and closed
    is handed out again about ten times over on average; the picked ports must be handed out none."""
    low, high = map(int, RANGE.read_text().split())
    picked = set(h.free_ports(4))  # one cpu_spec's: engine, master, rendezvous, Neuron runtime
    assert len(picked) == 4
    taken = set()
    for _ in range(10 * ((high - low + 1) // 2) // len(picked)):  # binds to 0 pick the odd ports first
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            taken.add(other.getsockname()[1])
    assert not picked & taken, f"{len(picked & taken)} of the 4 picked ports handed out again"
    for port in picked:  # and a listener with SO_REUSEADDR, as the leader's rendezvous site, binds each
        with socket.socket() as mine:
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            mine.bind(("127.0.0.1", port))
            mine.listen(1)
