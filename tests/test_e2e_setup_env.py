"""The e2e's engine env (e2e/setup_env.py) is reused only where it was built.

A venv holds its own path: a `.e2e` copied from another checkout kept running that checkout's engine env (its
Triton venv's .pth names the other venv's site-packages, console scripts' `#!` lines the other interpreter), so a
`make e2e-triton` there failed its lockstep check on the other checkout's code (thirteenth session). The install
itself is not run here: `run` is replaced by a recorder."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "e2e" / "setup_env.py"


@pytest.fixture
def setup_env(monkeypatch):
    spec = importlib.util.spec_from_file_location("e2e_setup_env_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _point_at(module, monkeypatch, e2e_dir: Path) -> list[list[str]]:
    commands: list[list[str]] = []
    monkeypatch.setattr(module, "E2E_DIR", e2e_dir)
    monkeypatch.setattr(module, "VENV", e2e_dir / "venv")
    monkeypatch.setattr(module, "STAMP", e2e_dir / "venv" / ".e2e-installed")
    monkeypatch.setattr(module, "STATS", e2e_dir / "env-stats.json")
    monkeypatch.setattr(module, "wheel_dirs", lambda: ["/nowhere"])
    monkeypatch.setattr(module, "_uv", lambda: "uv")

    def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 0) -> None:
        commands.append(cmd)
        if cmd[:2] == ["uv", "venv"]:
            Path(cmd[-1]).mkdir(parents=True)

    monkeypatch.setattr(module, "run", run)
    return commands


def test_an_env_is_reused_where_it_was_built_and_rebuilt_where_it_was_copied_to(setup_env, monkeypatch, tmp_path):
    built = tmp_path / "checkout-a" / ".e2e"
    commands = _point_at(setup_env, monkeypatch, built)
    (built / "venv").mkdir(parents=True)
    setup_env.ensure_env()
    assert commands and commands[0][:2] == ["uv", "venv"]  # built

    commands.clear()
    assert setup_env.ensure_env()["reused"] is True and commands == []  # the same place: reused

    copied = tmp_path / "checkout-b" / ".e2e"
    shutil.copytree(built, copied)
    commands = _point_at(setup_env, monkeypatch, copied)
    stats = setup_env.ensure_env()
    assert stats["reused"] is False and commands[0][:2] == ["uv", "venv"], commands  # copied: rebuilt
    assert json.loads((copied / "env-stats.json").read_text())["reused"] is False
