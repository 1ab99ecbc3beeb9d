"""The unit benchmark the docs cite runs in its quick mode, so that it cannot rot unseen (`make test`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench_unit.py"


@pytest.mark.timeout(180)
def test_bench_unit_quick_forms_each_run_without_waiting_out_the_previous_runs_backoff(tmp_path):
    # Each run ends with a follower killed (a failure in the unit's history). Two runs in a
    # row: the second must form as fast as the first, not after a restart backoff.
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=170,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    release = re.search(r"size 2: release_s\s+[\d.]+ s \[([\d.]+)-([\d.]+)\]", done.stdout)
    assert release, done.stdout
    # The restart backoff's base is 15 s; a formation on loopback takes 1-3 s on a loaded 2-core machine.
    assert float(release.group(2)) < 10, done.stdout
    assert "leader exit status after the kill: [5]" in done.stdout, done.stdout
