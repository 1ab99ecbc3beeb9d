"""The loopback ports of the launcher tests (conftest.free_ports) and of the unit benchmark they run
(bench_unit.py, test_bench_unit.py): picked before the launchers start, bound by them seconds later, and handed
to no other bind meanwhile (tests run in parallel, `pytest -n 2`; `make test` runs every suite beside them). Both
take them from loopback_ports.held_port (tests/test_loopback_ports.py); this checks that each caller does, the
benchmark from its own folder as it runs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BENCH_DIR = Path(__file__).resolve().parents[1]  # bench_unit.py: a script, importable from its directory only


def _bench_spec_ports(tmp_path: Path) -> list[int]:
    """The four ports of a unit spec of the benchmark (picked in a process of its own: the TIME_WAIT that holds
    them is the kernel's, it outlives the process)."""
    code = ("import json, sys, bench_unit; s = bench_unit._spec(2, __import__('pathlib').Path(sys.argv[1]), 3.0, 0.5)"
            "; print(json.dumps([s['engine']['port'], s['engine']['master_port'], s['rendezvous']['port'],"
            " s['neuron']['rt_root_comm_port']]))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=BENCH_DIR, capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(not RANGE.exists(), reason="Linux only")
@pytest.mark.parametrize("picker", ["conftest", "bench_unit"])
def test_a_picked_port_is_handed_to_no_other_bind_before_its_process_binds_it(h, tmp_path, picker):
    """Enough binds to port 0 (the other worker's servers, moto, its own picks) that a port found free and closed
    is handed out again about ten times over on average; the picked ports must be handed out none."""
    low, high = map(int, RANGE.read_text().split())
    # One unit spec's: engine, master, rendezvous, Neuron runtime.
    picked = set(h.free_ports(4) if picker == "conftest" else _bench_spec_ports(tmp_path))
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
