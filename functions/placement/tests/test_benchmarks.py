"""The placement benchmarks the docs cite, run in a quick mode so they cannot rot unseen
(issue 21 item 10): `make bench-placement` (docs/placement.md's topology table) with a few
trials, and measure_blame.py (the blame figures of docs/placement.md and self-healing.md)
as the docs run it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def _run(*argv: str) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bench_placement_quick_prints_every_row_and_the_controller_beats_the_fallback():
    out = _run(str(HERE.parent / "bench_placement.py"), "--trials", "5")
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+) \|\s+([\d.]+)\s+([\d.]+) \|", out, re.MULTILINE)
    assert [(int(n), int(u)) for n, u, *_ in rows] == [(2, 32), (2, 24), (4, 16), (4, 12), (8, 8), (8, 6)], out
    assert all(float(ctrl) >= float(fallback) for *_, ctrl, fallback in rows), out
    repairs = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+) \|\s+([\d.]+)\s+([\d.]+)$", out, re.MULTILINE)
    assert [int(n) for n, *_ in repairs] == [2, 4, 8], out


def test_measure_blame_finds_no_healthy_follower_quarantined_as_the_docs_say():
    out = _run(str(HERE / "measure_blame.py"), ".")
    assert out.strip().splitlines()[-1] == ".: healthy follower quarantined in 0 of 1000 runs", out
