"""The command line as operators and ECS use it: real processes, exit codes and messages."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import unit_launcher
from unit_launcher.cli import COMPILE_ENVIRONMENT, EXIT_CLOSED_PIPE, RUN_ENVIRONMENT, main

REPO = Path(__file__).resolve().parents[3]


def launcher(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("UNIT_")}
    return subprocess.run(
        [sys.executable, "-m", "unit_launcher", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_plan_from_a_spec_file_prints_argv_and_environment(tmp_path, h):
    spec = h.cpu_spec(4, record_dir=tmp_path)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    text = launcher("plan", "--spec", str(path), "--role", "follower", "--rank", "3", "--leader-addr", "127.0.0.1")
    assert text.returncode == 0, text.stderr
    assert "--node-rank=3" in text.stdout and "--headless" in text.stdout and "UNIT_RANK=3" in text.stdout
    as_json = json.loads(launcher("plan", "--spec", str(path), "--role", "leader", "--json").stdout)
    assert as_json["rank"] == 0 and as_json["argv"][2:4] == ["serve", str(tmp_path)]
    # Nothing was started: no engine wrote a record.
    assert not list(tmp_path.glob("i-*.json")) and not list(tmp_path.glob("pid*.json"))


def test_plan_from_the_fleet_file(h):
    result = launcher(
        "plan",
        "--config",
        str(REPO / "config" / "default.yaml"),
        "--cell",
        "dev",
        "--unit",
        "0",
        "--role",
        "follower",
        "--rank",
        "1",
        "--leader-addr",
        "10.10.0.5",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    node = json.loads(result.stdout)
    assert node["env"]["NEURON_RT_ROOT_COMM_ID"] == "10.10.0.5:62182"
    assert node["neuron_config"]["start_rank_id"] == 64 and node["neuron_config"]["local_ranks_size"] == 64
    assert node["env"]["NEURON_COMPILED_ARTIFACTS"].endswith(".node1")


def test_plan_errors_say_what_is_allowed(tmp_path, h, capsys):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(h.cpu_spec(2, record_dir=tmp_path)))
    assert main(["plan", "--spec", str(path), "--role", "follower", "--rank", "5"]) == 2
    assert "follower rank 5 out of range: unit u0 of size 2 has ranks 1..1" in capsys.readouterr().err
    assert main(["plan", "--cell", "dev", "--unit", "9", "--role", "leader"]) == 2
    assert "--unit 9 out of range: cell dev has units 0..0" in capsys.readouterr().err
    assert main(["plan", "--spec", str(tmp_path / "missing.json"), "--role", "leader"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_run_refuses_a_bad_role_or_spec_before_doing_anything(tmp_path, h, monkeypatch, caplog):
    for name in [k for k in os.environ if k.startswith(("UNIT_", "ECS_"))]:
        monkeypatch.delenv(name)
    spec = json.dumps(h.cpu_spec(2, record_dir=tmp_path))
    monkeypatch.setenv("UNIT_ROLE", "worker")
    monkeypatch.setenv("UNIT_SPEC", spec)
    assert main(["run"]) == 2 and "UNIT_ROLE='worker' not allowed; allowed: leader, follower" in caplog.text
    monkeypatch.setenv("UNIT_ROLE", "leader")
    monkeypatch.setenv("UNIT_SPEC", '{"size": 0}')
    assert main(["run"]) == 2
    monkeypatch.delenv("UNIT_SPEC")
    assert main(["run"]) == 2
    monkeypatch.setenv("UNIT_SPEC", spec)
    monkeypatch.setenv("UNIT_HOST_IP", "127.0.0.1")
    assert main(["run"]) == 2 and "ECS_CONTAINER_METADATA_URI_V4 is not set" in caplog.text


def test_bad_spec_messages(capsys, monkeypatch):
    monkeypatch.setenv("UNIT_ROLE", "leader")
    monkeypatch.setenv("UNIT_SPEC", '{"size": 0}')
    monkeypatch.delenv("UNIT_SPEC_FILE", raising=False)
    assert main(["run"]) == 2
    assert "size: Input should be greater than or equal to 1" in capsys.readouterr().err
    monkeypatch.delenv("UNIT_SPEC")
    assert main(["run"]) == 2
    assert "no unit spec: set UNIT_SPEC" in capsys.readouterr().err


def test_the_log_level_is_taken_in_any_case_and_a_bad_one_is_exit_2_not_a_traceback():
    """docs/contracts.md: UNIT_LOG_LEVEL (default INFO); a bad environment is exit 2 with a message. `debug`
    once reached logging.basicConfig as is: ValueError, a traceback and exit 1, the engine's own status
    (a defect hunt, thirty-fourth session)."""
    lower = launcher("run", env={"UNIT_ROLE": "worker", "UNIT_LOG_LEVEL": "debug"})
    # Taken: the launcher goes on to its next check (the role) and refuses that instead.
    assert "Traceback" not in lower.stderr, lower.stderr[-600:]
    assert lower.returncode == 2 and "UNIT_ROLE='worker' not allowed" in lower.stderr, lower.stderr[-600:]
    bad = launcher("run", env={"UNIT_ROLE": "leader", "UNIT_LOG_LEVEL": "verbose"})
    assert (bad.returncode, bad.stderr) == (2, "error: UNIT_LOG_LEVEL='verbose' not allowed; allowed: DEBUG, INFO, "
                                               "WARNING, ERROR, CRITICAL (any case; also WARN, FATAL, NOTSET; "
                                               "default INFO)\n")


@pytest.mark.parametrize(("value", "level"), [("WARN", "WARNING"), ("warn", "WARNING"), ("FATAL", "CRITICAL"),
                                              ("NOTSET", "NOTSET"), ("Error", "ERROR")])
def test_the_level_names_logging_took_before_the_check_are_still_taken(value, level):
    """logging.basicConfig took WARN, FATAL and NOTSET (logging's own names) before the level was checked: a
    launcher with UNIT_LOG_LEVEL=WARN must still start (a cold review, thirty-fourth session: the check refused
    it with exit 2)."""
    from unit_launcher.cli import _log_level

    assert _log_level(value) == level and logging.getLevelName(level) != f"Level {level}"


# -- the command line's conventions: --version, run --help, usage errors, a closed pipe ------------

PACKAGE = REPO / "containers" / "inference"
# How the launcher's modules read a variable: env.get("X"), os.environ.get("X"), env["X"], or a
# module constant named *_ENV (health_file.PATH_ENV).
_READS = re.compile(r"""(?:environ|env)(?:\.get)?[\[(]\s*"([A-Z][A-Z0-9_]+)"|^[A-Z_]*_ENV = "([A-Z][A-Z0-9_]+)\"""",
                    re.MULTILINE)


def test_run_help_lists_every_variable_the_launcher_reads():
    read, compile_read = set(), set()
    for source in (PACKAGE / "unit_launcher").glob("*.py"):
        found = {a or b for a, b in _READS.findall(source.read_text())}
        (compile_read if source.name == "compile_run.py" else read).update(found)
    assert read == {name for name, _ in RUN_ENVIRONMENT}, "update RUN_ENVIRONMENT in unit_launcher/cli.py"
    assert compile_read == {name for name, _ in COMPILE_ENVIRONMENT}, "update COMPILE_ENVIRONMENT"
    for command, names in (("run", read), ("compile", compile_read)):
        done = launcher(command, "--help")
        assert done.returncode == 0, done.stderr
        missing = [name for name in sorted(names) if name not in done.stdout]
        assert not missing, f"{command} --help does not name {missing}"


def test_version_is_the_package_version():
    version = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]["version"]
    assert unit_launcher.__version__ == version
    done = launcher("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"unit_launcher {version}"


@pytest.mark.parametrize("args", [("start",), ("run", "--now"), ("plan", "--role", "boss"), ()])
def test_usage_errors_exit_2(args):
    done = launcher(*args)
    assert done.returncode == 2 and "usage: unit_launcher" in done.stderr and "Traceback" not in done.stderr


def test_plan_into_a_closed_pipe_ends_quietly(tmp_path, h):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(h.cpu_spec(2, record_dir=tmp_path)))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "unit_launcher", "plan", "--spec", str(path), "--role", "leader",
                               "--json"], cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == EXIT_CLOSED_PIPE


def test_the_containers_command_reaches_run():
    """The image runs ENTRYPOINT + CMD (`python -m unit_launcher run`): accepted, and `run` reads its role."""
    text = (PACKAGE / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.MULTILINE).group(1))
    assert entrypoint[1:] == ["-m", "unit_launcher"] and cmd == ["run"]
    done = launcher(*cmd, env={"UNIT_ROLE": "worker"})
    assert done.returncode == 2 and "UNIT_ROLE='worker' not allowed" in done.stderr
