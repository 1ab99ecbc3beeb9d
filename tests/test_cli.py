"""`python -m inference_fleet` behaves like a command line: --help and --version, usage errors
exit 2, a refused fleet file exits 3 (inference_fleet/exit_codes.py), a closed pipe ends
quietly. Real processes, as a user runs them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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


def without_warnings(stderr: str) -> list[str]:
    """stderr's lines but the warnings (validate's of the example fleet's placeholder account)."""
    return [line for line in stderr.splitlines() if not line.startswith("warning: ")]


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
    # validate warns of the example fleet's placeholder account (docs/deploying.md, step 0) before it prints.
    assert without_warnings(done.stderr) == [], done.stderr
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


@pytest.mark.parametrize(("old", "new", "field"), [
    ("instance_type: trn2.48xlarge", "instance_type: [trn2.48xlarge]", "unit.instance_type"),
    ("max_concurrent_sequences: 32", "max_concurrent_sequences: many", "unit.max_concurrent_sequences"),
    ("max_concurrent_sequences: 32", "max_concurrent_sequences: -5", "unit.max_concurrent_sequences"),
    ("max_concurrent_sequences: 32", "max_concurrent_sequences: true", "unit.max_concurrent_sequences"),
], ids=["instance-type-list", "sequences-word", "sequences-negative", "sequences-boolean"])
def test_suggest_refuses_a_wrong_unit_hint_of_a_refused_fleet(tmp_path: Path, old: str, new: str, field: str) -> None:
    # Regression: `plan --suggest` read the raw `unit:` section of a refused fleet: a list or a word raised a
    # TypeError traceback, -5 and true were taken as batch sizes.
    fleet = tmp_path / "fleet.yaml"
    text = (ROOT / "config" / "default.yaml").read_text()
    assert old in text
    fleet.write_text(text.replace(old, new))
    done = fleet_cli("plan", "--suggest", "--config", str(fleet))
    assert done.returncode == exit_codes.CONFIG, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert f"{field} = " in done.stderr and not done.stdout


def test_suggest_refuses_a_length_the_fleet_would_refuse() -> None:
    # Regression: --seq-len 262144 suggested layouts for a length load_fleet refuses on Neuron (> 131072).
    done = fleet_cli("plan", "--suggest", "--seq-len", "262144")
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert "argument --seq-len: 262144 tokens is out of range; allowed: 128 to 131072" in done.stderr
    assert fleet_cli("plan", "--suggest", "--seq-len", "131072", "--json").returncode in (exit_codes.OK,
                                                                                       exit_codes.NO_FIT)


@pytest.mark.parametrize("option", [("--concurrency", "4"), ("--seq-len", "8192"), ("--instance-type", "trn2.48xlarge"),
                                    ("--max-nodes", "2"), ("--top", "3")], ids=lambda o: o[0])
def test_plan_refuses_options_only_suggest_reads(option: tuple[str, str]) -> None:
    # Regression: `plan --concurrency 4` printed the fleet's plan and ignored the option silently.
    done = fleet_cli("plan", *option)
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert f"{option[0]}: only with --suggest" in done.stderr and not done.stdout


def test_suggest_with_no_fit_prints_the_numbers() -> None:
    # Regression: "no unit of up to --max-nodes nodes fits" gave neither the limit nor how far off the unit was.
    done = fleet_cli("plan", "--suggest", "--instance-type", "trn1.32xlarge", "--max-nodes", "1")
    assert done.returncode == exit_codes.NO_FIT, done.stderr
    assert "no unit of up to 1 node(s) (--max-nodes) fits; at 1 node(s) the roomiest layout (LNC 1, tp 32" \
        in done.stdout
    assert "holds 0 of the 32 sequences: per NeuronCore, weights 24.36 GiB + KV cache" in done.stdout
    assert "of 16.00 GiB of HBM" in done.stdout


def test_compile_into_a_closed_pipe_is_quiet() -> None:
    # Regression: compile caught OSError, which includes BrokenPipeError: `compile --dry-run | (exec 0<&-; true)`
    # printed "error: [Errno 32] Broken pipe" and exited 5 (a compile failure) instead of 141.
    done = closed_pipe_run([sys.executable, "-m", "inference_fleet", "compile", "--dry-run"], ROOT)
    assert done.returncode == exit_codes.CLOSED_PIPE, done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize("command", ["validate", "reference"])
def test_a_closed_stdout_is_one_line_not_a_traceback(command: str) -> None:
    # Regression: `validate >&-` raised AttributeError ('NoneType' object has no attribute 'flush') at cli.py.
    done = subprocess.run(f"{sys.executable} -m inference_fleet {command} >&-", shell=True, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == exit_codes.IO_ERROR, done.stderr
    assert done.stderr == "error: standard output is closed: nothing could be printed\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["validate", "reference"])
def test_a_full_output_is_one_line_not_a_traceback(command: str) -> None:
    # Regression: `reference > /dev/full` raised OSError [Errno 28] from print() at cli.py.
    with open("/dev/full", "w") as full:
        done = fleet_cli(command, stdout=full.fileno())
    assert done.returncode == exit_codes.IO_ERROR, done.stderr
    # validate warns of the example fleet's placeholder account first (docs/deploying.md, step 0).
    assert without_warnings(done.stderr) == ["error: input/output failed: [Errno 28] No space left on device"]


@pytest.mark.parametrize(("report", "message"), [
    ("/no/such/dir/r.json", "argument --report: directory /no/such/dir does not exist"),
    ("tests", "argument --report: tests is a directory; give the report's file name, e.g. "
              "tests/simulate-cell-report.json"),
    # Regression (thirty-seventh session's probe): Path.is_dir raised ENAMETOOLONG, which argparse lets through:
    # "input/output failed", exit 8, before the run; and "" was called a directory (Path("") is ".").
    ("a" * 300, "argument --report: " + "a" * 300 + " cannot be examined (File name too long); give a report path"),
    ("", "argument --report: an empty path; give the report's file name, e.g. simulate-cell-report.json"),
])
def test_simulate_checks_its_report_path_before_the_run(report: str, message: str) -> None:
    # Regression: the path was first used after the whole run: FileNotFoundError / IsADirectoryError traceback.
    done = fleet_cli("simulate", "--scenario", "simulations/ami-change.yaml", "--report", report)
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr and not done.stdout


@pytest.mark.parametrize("argv", [
    ["compile", "--submit"], ["compile", "--check"], ["compile", "--checkpoint", "ckpt"],
    ["verify", "--cell", "dev"], ["verify", "--cell", "dev", "--destructive"],
    ["evacuate", "--cell", "dev"], ["evacuate", "--cell", "dev", "--undo"],
])
def test_a_command_that_reaches_aws_refuses_the_example_fleet_it_was_not_given(argv: list[str]) -> None:
    """Without --config every command read config/default.yaml: `compile --submit` submitted the example fleet's
    job (a fleet copied from the example keeps its name, so the queue and stacks exist), `evacuate` said no router
    fronts the cell. The command now stops before it reads a fleet or reaches AWS, and says what to pass."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    done = subprocess.run([sys.executable, "-m", "inference_fleet", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == exit_codes.USAGE, (done.returncode, done.stderr)
    assert done.stderr.strip() == (
        f"error: `{argv[0]}` acts on a deployed fleet: name its fleet file with --config FILE (make: CONFIG=FILE); "
        "only offline commands fall back to the example fleet, config/default.yaml")


def test_an_offline_compile_without_a_fleet_file_names_what_it_needs_and_the_alternatives(tmp_path: Path) -> None:
    """Regression: `compile --checkpoint D --no-upload` reaches no AWS, yet was refused as a command that "acts on a
    deployed fleet". It does need the fleet file (its layout and the versions in its key), so it is still refused,
    naming those fields and what to pass instead; each alternative named runs."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    done = fleet_cli("compile", "--checkpoint", str(checkpoint), "--no-upload", "--work-dir", str(tmp_path / "w"))
    assert done.returncode == exit_codes.USAGE and not done.stdout, (done.returncode, done.stderr)
    message = done.stderr.strip()
    assert "Traceback" not in message, message
    assert "deployed fleet" not in message, f"an offline compile refused as if it reached AWS: {message}"
    assert message.startswith("error: `compile --no-upload` reaches no AWS but compiles one fleet's unit layout")
    for named in ("model (name, dtype, max_seq_len)", "unit (instance_type, nodes", "base_images (neuron_vllm_tag",
                  "--config FILE (make: CONFIG=FILE)", "--config config/default.yaml", "--dry-run"):
        assert named in message, (named, message)
    assert not (tmp_path / "w").exists(), "refused, yet it wrote its work directory"
    # Every field the error names is a field of the fleet file's sections.
    from inference_fleet.cli import COMPILE_NEEDS
    from inference_fleet.config import FleetConfig

    for section, fields in re.findall(r"(\w+) \(([^)]*)\)", COMPILE_NEEDS):
        model = FleetConfig.model_fields[section].annotation
        assert set(fields.split(", ")) <= set(model.model_fields), (section, fields)
    # The alternatives: the example fleet named on purpose compiles (here up to the missing NxDI command, exit 5,
    # with no AWS reached), and --dry-run prints the job.
    named = fleet_cli("compile", "--config", "config/default.yaml", "--checkpoint", str(checkpoint), "--no-upload",
                      "--work-dir", str(tmp_path / "w"))
    assert named.returncode == exit_codes.COMPILE and "'inference_demo' not found" in named.stderr, named.stderr
    assert fleet_cli("compile", "--dry-run", "--checkpoint", str(checkpoint)).returncode == exit_codes.OK


@pytest.mark.parametrize("argv", [["compile", "--dry-run"], ["compile", "--submit", "--dry-run"],
                                  ["validate"], ["plan-rollout"]])
def test_offline_commands_still_use_the_example_fleet(argv: list[str]) -> None:
    done = fleet_cli(*argv)
    assert done.returncode == exit_codes.OK, done.stderr


def test_validate_names_every_stack_a_first_deploy_asks_for() -> None:
    """docs/deploying.md has the user deploy `<Fleet>-Compile` and `<Fleet>-Pipeline` by name; validate
    listed only the cell and router stacks."""
    done = fleet_cli("validate")
    assert done.returncode == exit_codes.OK, done.stderr
    names = [line.split(":")[0] for line in done.stdout.splitlines()]
    assert names == ["Rufus-Cell-dev", "Rufus-Compile", "Rufus-Pipeline"], done.stdout


def write_scenario(tmp_path: Path, text: str) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return str(path)


HUGE = str(10**400)  # a YAML integer no float holds


@pytest.mark.parametrize(("events", "duration", "message"), [
    ("[]", HUGE, "  - duration: at most 7 days"),
    (f"[{{at: {HUGE}, do: ami_change}}]", "1h", "  - events[0].at: " + HUGE + " is after the scenario's end (3600 s)"),
    (f"[{{at: -{HUGE}, do: ami_change}}]", "1h", "  - events[0].at: -" + HUGE + " must be at least 0"),
])
def test_a_scenario_integer_past_a_float_is_refused_not_a_traceback(tmp_path: Path, events: str, duration: str,
                                                                    message: str) -> None:
    # Regression: parse_duration's float(10**400) raised OverflowError: a traceback and exit 1.
    scenario = write_scenario(tmp_path, f"name: x\nduration: {duration}\nevents: {events}\n")
    done = fleet_cli("simulate", "--scenario", scenario, "--report", str(tmp_path / "r.json"))
    assert done.returncode == exit_codes.CONFIG, done.stderr
    assert message in done.stderr.splitlines(), done.stderr


def test_a_scenario_nested_too_deeply_is_refused_not_a_traceback(tmp_path: Path) -> None:
    # Regression: PyYAML's composer recursed past Python's limit: a RecursionError traceback and exit 1 (the fleet
    # file's reader caught it, load_scenario did not).
    scenario = write_scenario(tmp_path, "name: " + "[" * 100_000 + "]" * 100_000 + "\n")
    done = fleet_cli("simulate", "--scenario", scenario, "--report", str(tmp_path / "r.json"))
    assert done.returncode == exit_codes.CONFIG, done.stderr
    assert done.stderr == f"error: {scenario}: not valid YAML: nested too deeply\n"


def test_a_scenario_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    # Regression: `--scenario FIFO` blocked in read_text until a writer came (this test timed out); a fleet file
    # that is a FIFO was already refused at once.
    fifo = tmp_path / "scenario.yaml"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario", str(fifo), "--report",
                           str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == exit_codes.CONFIG, done.stderr
    assert "it is a named pipe (FIFO), not a regular file; give a scenario file" in done.stderr


def test_a_scenario_path_that_cannot_be_examined_is_a_scenario_error_not_an_io_failure(tmp_path: Path) -> None:
    # Regression (the cold re-read of the thirty-sixth session): the FIFO check's stat raised what Path.is_fifo does
    # not swallow (ENAMETOOLONG; EACCES for a user under a directory it cannot search) before the read's own
    # handling: "input/output failed" and exit 8, where the path was refused as a scenario file (exit 3) before.
    scenario = str(tmp_path / ("a" * 300 + ".yaml"))
    done = fleet_cli("simulate", "--scenario", scenario, "--report", str(tmp_path / "r.json"))
    assert done.returncode == exit_codes.CONFIG, done.stderr
    assert done.stderr.startswith(f"error: {scenario}: cannot read the scenario file: the path cannot be examined "
                                  "(File name too long")


def _looping_link(tmp_path: Path) -> Path:
    (tmp_path / "one.yaml").symlink_to(tmp_path / "two.yaml")
    (tmp_path / "two.yaml").symlink_to(tmp_path / "one.yaml")
    return tmp_path / "one.yaml"


@pytest.mark.parametrize(("make_path", "said"), [
    (lambda tmp: tmp / ("a" * 300 + ".yaml"), "the path cannot be examined (File name too long"),
    (_looping_link, "the path cannot be examined (Too many levels of symbolic links"),
])
def test_a_fleet_path_that_cannot_be_examined_exits_3_as_a_scenario_path_does(make_path, said, tmp_path: Path) -> None:
    # Regression: Path.is_file swallows ENOENT and ELOOP but raises ENAMETOOLONG (and EACCES on a parent a user
    # cannot search), which reached main's OSError handler: "input/output failed", exit 8, where the scenario's
    # path was exit 3 since the thirty-sixth session. A link loop was reported as "a symbolic link to nothing".
    path = str(make_path(tmp_path))
    for args in (("validate", "--config", path), ("simulate", "--scenario", path)):
        done = fleet_cli(*args)
        assert done.returncode == exit_codes.CONFIG, (args, done.stderr)
        assert said in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)


def test_an_empty_fleet_or_scenario_path_is_named_so_not_the_working_directory() -> None:
    # Regression (thirty-seventh session's probe): `--config ""` said "<file> = '.': is a directory", and
    # `--scenario ""` printed "error: : cannot read the scenario file: [Errno 21] Is a directory: ''".
    done = fleet_cli("validate", "--config", "")
    assert done.returncode == exit_codes.CONFIG, done.stderr
    assert done.stderr == ("error: invalid fleet config '':\n  - <file> = '': is an empty path; give the fleet file "
                           "(e.g. config/default.yaml)\n")
    done = fleet_cli("simulate", "--scenario", "")
    assert done.returncode == exit_codes.CONFIG, done.stderr
    assert done.stderr == ("error: '': cannot read the scenario file: it is an empty path; give a scenario file "
                           "(simulations/*.yaml)\n")


def test_ctrl_c_mid_run_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    # Regression: SIGINT during a simulation printed a KeyboardInterrupt traceback. The process still ends by SIGINT
    # (the shell's 130), as Python's own default does, so that a calling loop stops.
    argv = [sys.executable, "-m", "inference_fleet", "simulate", "--scenario", "simulations/day-36-units.yaml",
            "--config", "tests/fleets/large.yaml", "--seeds", "20", "--report", str(tmp_path / "r.json")]
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as run:
        time.sleep(4)  # past the imports, into the seeds (one seed takes seconds)
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == -signal.SIGINT, (run.returncode, stderr)
    assert stderr == "interrupted (Ctrl-C): stopped before it finished\n"
    assert not (tmp_path / "r.json").exists() and not stdout


@pytest.mark.parametrize(("encoding", "argv", "escaped"), [
    ("latin-1", ["reference"], "\\u2014"),  # the em dash of each section's heading
    ("ascii", ["plan", "--config", "{fleet}"], "Instruct-\\xfc"),  # a model name with an umlaut
])
def test_a_stdout_that_is_not_utf8_gets_escapes_not_a_traceback(tmp_path: Path, encoding: str, argv: list[str],
                                                                  escaped: str) -> None:
    # Regression: under a locale that is not UTF-8 (here as PYTHONIOENCODING) print() raised UnicodeEncodeError:
    # a traceback and exit 1, where stderr already escaped such characters.
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text((ROOT / "config" / "default.yaml").read_text().replace(
        "name: meta-llama/Llama-3.1-405B-Instruct", "name: meta-llama/Llama-3.1-405B-Instruct-\u00fc"))
    done = subprocess.run([sys.executable, "-m", "inference_fleet", *(a.format(fleet=fleet) for a in argv)], cwd=ROOT,
                          env={**os.environ, "PYTHONIOENCODING": encoding}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == exit_codes.OK, done.stderr
    assert escaped in done.stdout and "Traceback" not in done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_keeps_the_verdicts(tmp_path: Path) -> None:
    # Regression: the report was written before the verdicts were printed: a write that failed after the run (a full
    # disk; /dev/full passes the path checks) printed only "input/output failed" and the run was lost.
    done = fleet_cli("simulate", "--scenario", "simulations/hang.yaml", "--report", "/dev/full")
    assert done.returncode == exit_codes.IO_ERROR, done.stderr
    assert "I2 serving units: held" in done.stdout.splitlines()
    assert done.stderr.startswith("error: the report could not be written to /dev/full: No space left on device")


def test_a_report_fifo_that_no_process_reads_is_refused_before_the_run(tmp_path: Path) -> None:
    # Regression: the path checks passed a FIFO, and after the whole run (minutes on a large fleet) opening it to write
    # the report waited for a reader that never came (this test timed out). A probe opens it without waiting
    # (open(2): O_WRONLY | O_NONBLOCK on a FIFO no process reads fails with ENXIO) and refuses it as a bad value.
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario", "simulations/hang.yaml",
                           "--report", str(fifo)], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == exit_codes.USAGE, done.stderr
    assert f"argument --report: {fifo} is a named pipe (FIFO) that no process reads" in done.stderr
    assert not done.stdout and "Traceback" not in done.stderr


def test_a_report_fifo_with_a_reader_gets_the_report(tmp_path: Path) -> None:
    # The probe's write end is the one the report is written through: closed after the probe, it would end a reader
    # such as `cat FIFO` (end of file once no writer is left) and the report's later open would wait again.
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader before the run, as `cat FIFO &` is
    try:
        child = subprocess.Popen([sys.executable, "-m", "inference_fleet", "simulate", "--scenario",
                                  "simulations/hang.yaml", "--report", str(fifo)], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        out, err = child.communicate(timeout=60)
        report = os.read(held, 1 << 20)
    finally:
        os.close(held)
    assert child.returncode == exit_codes.OK, err
    assert "I2 serving units: held" in out.splitlines() and f"report: {fifo}" in err
    assert json.loads(report)["scenario"] == "hang"


def test_the_report_fifos_write_end_stays_open_from_the_check_to_the_write(tmp_path: Path) -> None:
    from inference_fleet.simulation.cli import _report_path

    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        target = _report_path(str(fifo))
        # A writer is still open: the reader waits (EAGAIN) rather than seeing the end of the file (b"").
        with pytest.raises(BlockingIOError):
            os.read(reader, 1)
        target.close()
        assert os.read(reader, 1) == b""
    finally:
        os.close(reader)


def test_a_report_to_a_piped_stdout_is_written_there() -> None:
    # /dev/stdout is a pipe here (a FIFO to stat), one that is read: the FIFO probe lets it through.
    done = fleet_cli("simulate", "--scenario", "simulations/hang.yaml", "--report", "/dev/stdout")
    assert done.returncode == exit_codes.OK, done.stderr
    assert "I2 serving units: held" in done.stdout.splitlines()
    assert json.loads(done.stdout[done.stdout.index("\n{") + 1:])["scenario"] == "hang"


@pytest.mark.parametrize("stream", ["/dev/stdout", "/dev/stderr"])
def test_a_report_to_a_standard_stream_that_is_a_file_keeps_what_the_file_held(tmp_path: Path, stream: str) -> None:
    # Regression (review of the thirty-eighth session, helper-260): `--report /dev/stdout >> log` opened the stream's
    # file anew with truncation (Path.write_text), so the log's earlier lines and the verdicts just printed were
    # lost, the report alone left. The report is now written through the stream's own open file (its offset, its
    # append mode), after what was printed.
    log = tmp_path / "log.txt"
    log.write_text("an earlier line\n")
    with log.open("a") as handle:
        done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario",
                               "simulations/hang.yaml", "--report", stream], cwd=ROOT, text=True, timeout=120,
                              check=False, **({"stdout": handle, "stderr": subprocess.PIPE} if stream == "/dev/stdout"
                                              else {"stdout": subprocess.PIPE, "stderr": handle}))
    assert done.returncode == exit_codes.OK, done.stderr
    text = log.read_text()
    assert text.startswith("an earlier line\n"), text[:200]
    assert json.loads(text[text.index("\n{") + 1:text.rindex("}") + 1])["scenario"] == "hang"
    if stream == "/dev/stdout":
        assert "I2 serving units: held" in text.splitlines()


def test_a_report_to_dev_null_is_discarded(monkeypatch: pytest.MonkeyPatch) -> None:
    # The operator's way to discard the report, as verify takes it (output_files.py): written through the device's
    # own descriptor. Regression (the thirty-ninth session): simulate took /dev/null as a file, so only root could
    # (os.access on /dev): any other user had it refused "cannot be written (no permission)".
    done = fleet_cli("simulate", "--scenario", "simulations/hang.yaml", "--report", os.devnull)
    assert done.returncode == exit_codes.OK, done.stderr
    assert "I2 serving units: held" in done.stdout.splitlines() and f"report: {os.devnull}" in done.stderr
    assert Path(os.devnull).is_char_device()
    from inference_fleet.simulation import cli as simulation_cli

    real_access = os.access
    monkeypatch.setattr(simulation_cli.os, "access", lambda path, mode: (
        False if str(path) == "/dev" else real_access(path, mode)))
    target = simulation_cli._report_path(os.devnull)
    try:
        assert target.fd is not None and target.discards
    finally:
        target.close()


@pytest.mark.parametrize("stream", ["/dev/stdout", "/dev/stderr", "/proc/self/fd/1"])
def test_a_report_to_a_standard_stream_is_taken_from_a_user_who_cannot_write_in_dev(monkeypatch: pytest.MonkeyPatch,
                                                                                   stream: str) -> None:
    # Regression (cold read of the thirty-eighth session): the file checks ran before the stream's, and /dev (root's,
    # 0755) or /proc/self/fd (0500) is no directory another user may write in, so any user but root had
    # `--report /dev/stdout` refused "cannot be written (no permission)". os.access answers here as for such a user.
    from inference_fleet.simulation import cli as simulation_cli

    real_access = os.access
    monkeypatch.setattr(simulation_cli.os, "access", lambda path, mode: (
        False if str(path) in ("/dev", "/proc/self/fd") else real_access(path, mode)))
    target = simulation_cli._report_path(stream)
    try:
        assert target.fd is not None and str(target) == stream
    finally:
        target.close()
