"""`python -m unit_launcher triton-selfcheck` against the e2e's real Triton 2.51 and stub Python.

Needs `.e2e/triton` and `.e2e/triton-venv` (built by `make e2e-triton`); skipped without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TRITON = ROOT / ".e2e" / "triton" / "pytriton" / "tritonserver"
STUB_PYTHON = ROOT / ".e2e" / "triton-venv" / "bin" / "python3"
pytestmark = pytest.mark.skipif(not (TRITON / "bin" / "tritonserver").exists() or not STUB_PYTHON.exists(),
                                reason="no .e2e Triton: built by make e2e-triton")


def _selfcheck(backends: Path, *imports: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "unit_launcher", "triton-selfcheck",
            f"--tritonserver={TRITON / 'bin' / 'tritonserver'}",
            f"--backends={backends}", f"--python={STUB_PYTHON}", "--timeout=240"]
    argv += [f"--import={name}" for name in imports]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])


def test_the_stub_runs_the_backend_module_and_imports_vllm():
    done = _selfcheck(TRITON / "backends", "vllm")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert '"encoding": "UTF-8"' in done.stdout and '"echo": "ping"' in done.stdout


def test_a_failure_only_the_stub_shows_is_caught(tmp_path):
    """The image's former check imported vLLM with the stub's Python from a shell, which works; inside the
    stub (pybind11's isolated interpreter, C locale) the same import fails. Without the backend module's
    utf8_locale (a backend directory with the Python backend only), the self-check must fail on it."""
    plain = subprocess.run([str(STUB_PYTHON), "-c", "import numpy, vllm"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "LC_ALL": "C"}, cwd="/tmp")
    assert plain.returncode == 0, plain.stderr[-2000:]
    (tmp_path / "python").symlink_to(TRITON / "backends" / "python")  # the stub finds its libraries by $ORIGIN
    done = _selfcheck(tmp_path, "vllm")
    assert done.returncode == 2, done.stdout[-3000:]
    assert "triton-selfcheck failed" in done.stdout and "UnicodeDecodeError" in done.stdout, done.stdout[-3000:]


def test_a_module_the_stub_cannot_import_is_named(tmp_path):
    done = _selfcheck(TRITON / "backends", "no_such_module_here")
    assert done.returncode == 2 and "No module named 'no_such_module_here'" in done.stdout, done.stdout[-3000:]
