"""`python -m inference_fleet` behaves like a command line: --help and --version, usage errors
exit 2, a refused fleet file exits 3 (inference_fleet/exit_codes.py), a closed pipe ends
quietly. Real processes, as a user runs them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import inference_fleet
from inference_fleet import exit_codes

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "tests" / "fleets"


def fleet_cli(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inference_fleet", *args], cwd=ROOT, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False)


def closed_pipe_run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose reader is already gone, as `... | head -1` after head exits."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, cwd=cwd, env=env, stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120, check=False)
    finally:
        os.close(write_end)


def test_version_is_the_package_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert inference_fleet.__version__ == version
    done = fleet_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"inference-fleet {version}", done.stderr


def test_help_speaks_to_the_user_and_documents_the_exit_statuses() -> None:
    done = fleet_cli("--help")
    assert done.returncode == 0
    assert "fleet file" in done.stdout and "Trainium" in done.stdout
    for status in (exit_codes.USAGE, exit_codes.CONFIG, exit_codes.CLOSED_PIPE):
        assert re.search(rf"^  {status}\s", done.stdout, re.MULTILINE), f"exit status {status} not in --help"
    # Developer text (module paths, "see planner/") is not what a user reads first.
    assert "planner/" not in done.stdout and "rollout.py" not in done.stdout


@pytest.mark.parametrize("args", [("bogus",), ("validate", "--no-such-option"), ("plan", "--concurrency", "0"),
                                  ("plan-rollout", "--unit-restart-minutes", "abc"), ()])
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    done = fleet_cli(*args)
    assert done.returncode == exit_codes.USAGE == 2, done.stderr
    assert "usage: inference-fleet" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["validate", "plan", "plan-rollout"])
def test_a_refused_fleet_file_exits_3_not_2(command: str) -> None:
    done = fleet_cli(command, "--config", str(FLEETS / "planner_too_small.yaml"))
    assert done.returncode == exit_codes.CONFIG == 3, done.stderr
    assert "unit.nodes = 1" in done.stderr and "Traceback" not in done.stderr


def test_a_missing_fleet_file_exits_3() -> None:
    done = fleet_cli("validate", "--config", "no/such fleet.yaml")
    assert done.returncode == exit_codes.CONFIG and "no such file" in done.stderr


@pytest.mark.parametrize("args", [("plan-rollout", "--json"), ("reference",), ("plan", "--json"), ("validate",)])
def test_a_closed_pipe_ends_quietly(args: tuple[str, ...]) -> None:
    done = closed_pipe_run([sys.executable, "-m", "inference_fleet", *args], ROOT)
    assert done.stderr == "", done.stderr
    assert done.returncode == exit_codes.CLOSED_PIPE


def test_help_into_a_closed_pipe_is_quiet() -> None:
    # Either argparse's own write fails (it drops the OSError: Lib/argparse.py, _print_message) or
    # the help sits in stdout's buffer when argparse exits and main's flush meets the closed pipe.
    done = closed_pipe_run([sys.executable, "-m", "inference_fleet", "--help"], ROOT)
    assert done.stderr == "" and done.returncode in (exit_codes.OK, exit_codes.CLOSED_PIPE)


def test_head_of_a_pipe_shows_no_traceback() -> None:
    """The user's own words: `plan-rollout --json | head -1` (reference is long enough to fill the pipe)."""
    for command in ("plan-rollout --json", "reference"):
        pipeline = f"{sys.executable} -m inference_fleet {command} | head -1"
        done = subprocess.run(["bash", "-c", pipeline], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "Error" not in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert done.stdout.count("\n") == 1


def test_suggest_for_an_unknown_instance_type_is_a_refused_fleet(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text((ROOT / "config" / "default.yaml").read_text().replace("trn2.48xlarge", "trn9.huge"))
    done = fleet_cli("plan", "--suggest", "--config", str(fleet))
    assert done.returncode == exit_codes.CONFIG, done.stderr
    assert "unit.instance_type = 'trn9.huge' is not a known instance type; allowed:" in done.stderr
