"""`python -m inference_fleet verify`: exit statuses, and the reports written whatever happens.

Run as a user runs it (a subprocess). Without credentials the kit cannot reach the cell: every
check fails with the reason, both reports are written, and the exit status is 6. No request
leaves the machine: the instance metadata and every credential source are turned off, so
botocore gives up before it sends anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inference_fleet.verify import cli as verify_cli
from inference_fleet.verify.report import Report

ROOT = Path(__file__).resolve().parents[1]


def verify(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp / "none"))
    config = ["--config", str(ROOT / "config" / "default.yaml")]
    return subprocess.run([sys.executable, "-m", "inference_fleet", "verify", *config, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_usage_errors_exit_2_and_an_unknown_cell_exits_3(tmp_path: Path) -> None:
    assert verify(tmp=tmp_path).returncode == 2
    bad = verify("--cell", "dev", "--evidence-wait", "-1", tmp=tmp_path)
    assert bad.returncode == 2 and "allowed: 0 to 7200" in bad.stderr
    unknown = verify("--cell", "nope", tmp=tmp_path)
    assert unknown.returncode == 3 and "no such cell in the fleet file; its cells: dev" in unknown.stderr
    wildcard = verify("--cell", "dev", "--tls-name", "*.example.com", tmp=tmp_path)
    assert wildcard.returncode == 2 and "'*.example.com' is not a DNS name" in wildcard.stderr
    assert "Traceback" not in unknown.stderr + bad.stderr + wildcard.stderr


def test_a_request_timeout_of_0_is_a_usage_error(tmp_path: Path) -> None:
    """Regression (found by the thirty-fourth session's defect hunt, checking the CLI's other number options):
    `--request-timeout 0` was taken ("allowed: 0 to 7200"); urllib's socket is then non-blocking and every
    request of the kit failed at once with no answer ("Operation now in progress"). Now a usage error, exit 2."""
    done = verify("--cell", "dev", "--request-timeout", "0", "--report", str(tmp_path / "out.json"), tmp=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-300:])
    assert "argument --request-timeout: 0 s is out of range; allowed: 1 to 7200" in done.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("value", ["1e-9", "0.000001", "0.5", "7201", "nan"])
def test_a_request_timeout_that_ends_at_once_is_refused_like_0(value: str) -> None:
    """Regression (a cold review in the thirty-fourth session): the check that refused 0 took 1e-9 s, with which
    every request of the kit ends on its timeout at once, as at 0. Now 1 to 7200 s, the message naming the range."""
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{value} s is out of range; allowed: 1 to 7200$"):
        verify_cli._request_seconds(value)
    assert verify_cli._request_seconds("1") == 1.0 and verify_cli._request_seconds("7200") == 7200.0


def test_a_malformed_region_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    """Regression (found by the thirty-third session's defect hunt): `--region` was taken as it was, and botocore
    refused a malformed name when the adapter made its clients (botocore.utils.validate_region_name ->
    InvalidRegionError), outside the adapter's _call: a traceback and exit 1 where a usage error exits 2."""
    done = verify("--cell", "dev", "--region", "us east 2", "--report", str(tmp_path / "out.json"), tmp=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert done.returncode == 2, (done.returncode, done.stderr[-300:])
    assert "argument --region: 'us east 2': not an AWS region; did you mean us-east-2?" in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_an_unreachable_cell_fails_every_check_and_writes_both_reports(tmp_path: Path) -> None:
    done = verify("--cell", "dev", "--report", str(tmp_path / "out.json"), tmp=tmp_path)
    assert done.returncode == 6, done.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["passed"] is False and report["counts"]["fail"] == len(report["checks"]) == 8
    assert all("cell not reachable" in c["detail"] and "credentials" in c["detail"] for c in report["checks"])
    assert (tmp_path / "out.md").read_text().startswith("# Acceptance kit: cell dev (aws): FAILED")
    assert "dev (aws): 0 passed, 8 failed, 0 not run" in done.stdout


def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    """Regression (found by the thirty-third session's defect hunt): `--report` was checked only when the report was
    written, after the run (with --destructive, two unit restarts), which then ended with exit 8 and no report."""
    (tmp_path / "a-file").write_text("x\n")
    done = verify("--cell", "dev", "--report", str(tmp_path / "a-file" / "out.json"), tmp=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-300:])
    assert f"error: --report {tmp_path / 'a-file' / 'out.json'}: the report could not be written there" in done.stderr
    assert "cell not reachable" not in done.stdout + done.stderr  # refused before the run
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("name: Rufus\n")
    (tmp_path / "fleet.verify-report.json").write_text("notes\n")
    taken = verify("--cell", "dev", "--report", str(fleet), tmp=tmp_path)
    assert taken.returncode == 2 and "hold files that are no report of this kit" in taken.stderr, taken.stderr[-300:]
    assert fleet.read_text() == "name: Rufus\n"


def test_help_lists_exit_status_6() -> None:
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "verify", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "6    verify: a check failed on the cell" in done.stdout


def test_a_previous_report_that_cannot_be_overwritten_is_refused_before_the_run(tmp_path: Path) -> None:
    """The cold review of the pre-run check (helper-185): --report names a previous report of the kit (so
    report_path keeps it) that this user cannot write (another
    user's, mode 444): the folder takes a new file, so unwritable() passes, the run happens, and the write fails
    after it: exit 8, the report lost -- the defect 0f1cdc8 fixed, by another path."""
    folder = tmp_path / "reports"
    folder.mkdir()
    Report("dev", "aws", False).write(folder / "out.json")  # the previous run's report
    (folder / "out.json").chmod(0o444)
    (folder / "out.md").chmod(0o444)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    # As root, drop the capability that ignores file modes (a user's run).
    prefix = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
              if os.geteuid() == 0 and shutil.which("setpriv") else [])
    done = subprocess.run([*prefix, sys.executable, "-m", "inference_fleet", "verify", "--config",
                           str(ROOT / "config" / "default.yaml"), "--cell", "dev",
                           "--report", str(folder / "out.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout[-400:], done.stderr[-400:])


def test_a_report_fifo_that_no_process_reads_is_refused_before_the_run(tmp_path: Path) -> None:
    """Regression (the thirty-eighth session): a FIFO is no report of the kit, so its report went quietly to
    <stem>.verify-report.json beside it, after the run, and a reader of the FIFO got nothing. As simulate --report
    (output_files.py): a FIFO that no process reads is refused before the run, exit 2."""
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    done = verify("--cell", "dev", "--report", str(fifo), tmp=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-400:])
    assert f"error: --report {fifo} is a named pipe (FIFO) that no process reads" in done.stderr
    assert "cell not reachable" not in done.stdout + done.stderr  # refused before the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_report_fifo_with_a_reader_gets_the_json_and_nothing_is_written_beside_it(tmp_path: Path) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader before the run, as `cat FIFO &` is
    try:
        done = verify("--cell", "dev", "--report", str(fifo), tmp=tmp_path)
        report = os.read(held, 1 << 20)
    finally:
        os.close(held)
    assert done.returncode == 6, (done.returncode, done.stderr[-400:])
    assert json.loads(report)["cell"] == "dev"
    assert f"report: {fifo} (the JSON alone: no Markdown beside a stream)" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no .md, no <stem>.verify-report.json


@pytest.mark.parametrize("stream", ["/dev/stdout", "/dev/stderr"])
def test_a_report_to_a_standard_stream_is_written_through_it_after_the_table(tmp_path: Path, stream: str) -> None:
    """Regression (the thirty-eighth session): `--report /dev/stdout` is no report of the kit, so the report went to
    a file /dev/stdout.verify-report.json (and .md), made in /dev when run as root. It is now written through the
    stream itself (a dup: its offset and append mode), after the table, so `>> log` keeps the log's lines."""
    log = tmp_path / "log.txt"
    log.write_text("an earlier line\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    command = [sys.executable, "-m", "inference_fleet", "verify", "--config", str(ROOT / "config" / "default.yaml"),
               "--cell", "dev", "--report", stream]
    with log.open("a") as handle:
        done = subprocess.run(command, cwd=ROOT, env=env, text=True, timeout=120, check=False,
                              **({"stdout": handle, "stderr": subprocess.PIPE} if stream == "/dev/stdout"
                                 else {"stdout": subprocess.PIPE, "stderr": handle}))
    assert done.returncode == 6, (done.returncode, (done.stderr or done.stdout)[-400:])
    text = log.read_text()
    assert text.startswith("an earlier line\n"), text[:200]
    assert json.loads(text[text.index("\n{") + 1:text.rindex("}") + 1])["cell"] == "dev"
    if stream == "/dev/stdout":
        assert text.index("dev (aws): 0 passed, 8 failed") < text.index("\n{")  # the table, then the report
    assert not Path(f"{stream}.verify-report.json").exists() and not Path(f"{stream}.verify-report.md").exists()


def test_a_report_to_a_piped_stdout_follows_the_table(tmp_path: Path) -> None:
    done = verify("--cell", "dev", "--report", "/dev/stdout", tmp=tmp_path)
    assert done.returncode == 6, (done.returncode, done.stderr[-400:])
    table, _, report = done.stdout.partition("\n{")
    assert "dev (aws): 0 passed, 8 failed, 0 not run" in table
    assert json.loads("{" + report)["counts"]["fail"] == 8


def test_a_report_to_dev_null_is_discarded_and_no_file_is_made(tmp_path: Path) -> None:
    """Regression (the thirty-ninth session): `simulate --report /dev/null` discarded the report, but verify refused
    it before the run as a device ("is a device or a socket, not a file"), exit 2. The null device is now taken by
    both, through the shared output_files.py: the run's table, the report written to nothing, no file beside it."""
    done = verify("--cell", "dev", "--report", os.devnull, tmp=tmp_path)
    assert done.returncode == 6, (done.returncode, done.stderr[-400:])
    assert "dev (aws): 0 passed, 8 failed, 0 not run" in done.stdout and "{" not in done.stdout
    assert f"report: {os.devnull} (discarded)" in done.stderr
    assert not Path(f"{os.devnull}.verify-report.json").exists() and not Path(f"{os.devnull}.verify-report.md").exists()
    assert Path(os.devnull).is_char_device()


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/full"])
def test_a_report_path_that_is_another_character_device_is_still_refused(tmp_path: Path, device: str) -> None:
    if not Path(device).exists():
        pytest.skip(f"needs {device}")
    done = verify("--cell", "dev", "--report", device, tmp=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-400:])
    assert f"error: --report {device} is a device or a socket, not a file" in done.stderr
    assert "cell not reachable" not in done.stdout + done.stderr  # refused before the run
    assert not Path(f"{device}.verify-report.json").exists()


def test_a_report_path_that_is_a_device_or_a_socket_is_refused(tmp_path: Path) -> None:
    """Such a path is no report of the kit: its report went to <stem>.verify-report.json beside it (for a device,
    in /dev). Refused before the run instead, naming what to give."""
    import stat

    sock = tmp_path / "report.json"
    os.mknod(sock, stat.S_IFSOCK | 0o600)  # an unprivileged mknod may make a socket (mknod(2))
    done = verify("--cell", "dev", "--report", str(sock), tmp=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-400:])
    assert (f"error: --report {sock} is a device or a socket, not a file; give a file such as verify-report.json, "
            "/dev/stdout, or a FIFO that a process reads (/dev/null discards the report)") in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_report_fifo_whose_reader_left_during_the_run_is_an_io_error_with_the_verdicts_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A cold review's finding (helper-265): the FIFO's write failed with EPIPE when its reader had gone during the
    run, and the command line's handler read that as its own stdout closed: exit 141, not a word that the report was
    lost. As simulate --report: one line naming the report, exit 8, the table printed before."""
    from inference_fleet import cli, exit_codes

    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    def run_kit(*_: object, **__: object) -> Report:
        os.close(reader)  # the reader goes away during the run
        return Report("dev", "aws", False)

    monkeypatch.setattr(verify_cli, "run_kit", run_kit)
    monkeypatch.setattr(verify_cli, "AwsAdapter", lambda *_, **__: None)
    code = cli.main(["verify", "--config", str(ROOT / "config" / "default.yaml"), "--cell", "dev",
                     "--report", str(fifo)])
    out, err = capsys.readouterr()
    assert code == exit_codes.IO_ERROR, (code, err)
    assert f"error: the report could not be written to {fifo}: Broken pipe; the verdicts above are the run's" in err
    assert "dev (aws): 0 passed" in out
