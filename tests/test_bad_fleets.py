"""The corpus of broken fleet files: each gets one clear answer before synth, naming the field at fault.

Every file in tests/fleets/bad/ is the default fleet with one mistake; its first line,
`# expect: <field path or words>`, names what its error must say. Each file is run
  - through `load_fleet` (what `validate`, `plan`, `plan-rollout` and the launcher's
    `plan` call): one ConfigError whose issues name exactly that field and nothing else;
  - through the CDK app's entry point (app.py, as `cdk synth -c config=F` runs it,
    in-process): exit 3 (exit_codes.CONFIG, as the CLI) before any construct is built, the field named on stderr;
  - a handful through `python -m inference_fleet validate --config F` and
    `python app.py` as subprocesses: non-zero exit, the field named, no traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aws_cdk import App

from inference_fleet import exit_codes
from inference_fleet.checks import load_fleet
from inference_fleet.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "fleets" / "bad"
FILES = sorted(BAD.glob("*.yaml"))
# A few of every kind, run as real processes (each costs an interpreter start, and app.py a jsii start).
SUBPROCESS = ("region-typo", "not-utf8", "duplicate-key", "inf-response", "kv-heads-above-heads", "syntax-error",
              "port-triton-metrics")


def expected(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode()
    assert first.startswith("# expect: "), f"{path.name}: first line must be '# expect: <field>'"
    return first.removeprefix("# expect: ").strip()


def test_the_corpus_is_large_enough() -> None:
    assert len(FILES) >= 60


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_validate_names_exactly_the_field_at_fault(path: Path) -> None:
    want = expected(path)
    with pytest.raises(ConfigError) as caught:
        load_fleet(path)
    error = caught.value
    message = str(error)
    if " " in want:  # words the one issue must say (a duplicate key, bytes that are not UTF-8)
        assert len(error.issues) == 1 and want in message, message
    else:  # a field path (or <file>, <yaml>, <root>): that field and no other
        assert {issue.path for issue in error.issues} == {want}, message
    # A whole cell or a huge number is cut, not dumped: every line stays readable.
    assert all(len(line) < 600 for line in message.splitlines()), message


@pytest.fixture(scope="module")
def app_module():
    spec = importlib.util.spec_from_file_location("fleet_app", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _must_not_build(*_args, **_kwargs):
    raise AssertionError("the app built constructs from a fleet file validate refuses")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_the_app_refuses_before_building_anything(path: Path, app_module, monkeypatch) -> None:
    # `cdk synth -c config=F` hands the context to the app in CDK_CONTEXT_JSON, which the jsii
    # kernel (a node process started once per test session) reads only at its start: pass the
    # same context to the App directly. test_cdk_app_command_line runs the real environment path.
    monkeypatch.setattr(app_module, "App", lambda: App(context={"config": str(path)}))
    monkeypatch.setattr(app_module, "build_fleet", _must_not_build)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as caught:
        app_module.main()
    assert caught.value.code == exit_codes.CONFIG  # the same status as `python -m inference_fleet validate`
    assert expected(path) in stderr.getvalue()


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20", **env}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.parametrize("name", SUBPROCESS)
def test_validate_command_line(name: str) -> None:
    path = BAD / f"{name}.yaml"
    result = _run(["-m", "inference_fleet", "validate", "--config", str(path)])
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert expected(path) in result.stderr


@pytest.mark.parametrize("name", SUBPROCESS[:3])
def test_cdk_app_command_line(name: str) -> None:
    path = BAD / f"{name}.yaml"
    result = _run(["app.py"], CDK_CONTEXT_JSON=json.dumps({"config": str(path)}))
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert expected(path) in result.stderr
