"""`python -m unit_proxy`'s command line: --help lists the environment with defaults, --version,
any other argument is a usage error (exit 2) that starts nothing, and the container's own
command (the Dockerfile's ENTRYPOINT, no CMD) still starts the proxy. Real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import unit_proxy
from unit_proxy.settings import ENVIRONMENT, Settings

from .raw_http import free_port

HERE = Path(__file__).resolve().parents[1]


def quiet_env() -> dict[str, str]:
    """If an argument were ignored and the proxy started, it would listen here, not on 8080."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PROXY_HOST": "127.0.0.1", "PROXY_WORKERS": "1",
            "PROXY_PORT": str(free_port()), "PROXY_ADMIN_PORT": str(free_port()), "LAUNCHER_STATUS_URL": "",
            "DRAIN_SECONDS": "0", "DRAIN_TIMEOUT_SECONDS": "0"}


def proxy_cli(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    # An ignored argument would start a proxy that serves until killed: the timeout shows it.
    return subprocess.run([sys.executable, "-m", "unit_proxy", *args], env=quiet_env(), cwd=HERE, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=20, check=False)


class _Recording(dict):
    """An environment that records which variables are read."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def get(self, key: str, default: object = None) -> object:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def test_the_help_table_names_exactly_the_variables_the_settings_read() -> None:
    env = _Recording()
    Settings.from_env(env)
    assert {name for name, _, _ in ENVIRONMENT} == env.read


def test_help_lists_every_variable_with_its_default() -> None:
    done = proxy_cli("--help")
    assert done.returncode == 0, done.stderr
    for name, default, _ in ENVIRONMENT:
        assert f"{name}={default}" in done.stdout
    defaults = Settings()
    assert f"PROXY_PORT={defaults.port}" in done.stdout and f"PROXY_WORKERS={defaults.workers}" in done.stdout


def test_version_is_the_package_version() -> None:
    version = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]["version"]
    assert unit_proxy.__version__ == version
    done = proxy_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"unit_proxy {version}"


@pytest.mark.parametrize("args", [("serve",), ("--port", "9000"), ("-x",)])
def test_any_other_argument_is_a_usage_error_and_starts_nothing(args: tuple[str, ...]) -> None:
    done = proxy_cli(*args)
    assert done.returncode == 2, done.stderr
    assert "usage: unit_proxy" in done.stderr and "Traceback" not in done.stderr


def _container_argv() -> Iterator[str]:
    text = (HERE / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))
    cmd = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    assert entrypoint[0] == "python"
    yield from [sys.executable, *entrypoint[1:], *(json.loads(cmd.group(1)) if cmd else [])]


def test_the_containers_command_still_reaches_the_settings() -> None:
    """The image's ENTRYPOINT passes no argument: it is accepted, and the settings are read (a bad one
    exits 2 with its name, before any listen)."""
    env = {**quiet_env(), "PROXY_PORT": "99999"}
    done = subprocess.run(list(_container_argv()), env=env, cwd=HERE, capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 2 and "PROXY_PORT='99999' is not allowed" in done.stderr
    assert "usage:" not in done.stderr


def test_help_into_a_closed_pipe_is_quiet() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "unit_proxy", "--help"], env=quiet_env(), cwd=HERE,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=20, check=False)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 141
