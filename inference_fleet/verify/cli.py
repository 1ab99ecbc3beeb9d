"""`python -m inference_fleet verify`: the acceptance kit against one deployed cell (docs/verifying.md).

Reads the fleet file for what the cell must do, finds the cell's stack in its account and
region with the caller's AWS credentials, runs the checks (read-only unless --destructive),
prints a table and writes the JSON report and its Markdown beside it. Exit 0 when no check
failed, 6 when one did (exit_codes.VERIFY), 3 for a refused fleet file or an unknown cell.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inference_fleet import exit_codes
from inference_fleet.checks import load_fleet
from inference_fleet.config import CellConfig, DnsName, FleetConfig
from inference_fleet.output_files import ReportTarget, stream_target
from inference_fleet.regions import region_problem
from inference_fleet.verify.adapter import expectations
from inference_fleet.verify.aws import AwsAdapter
from inference_fleet.verify.report import unwritable
from inference_fleet.verify.runner import run_kit

HELP = "check a deployed cell against the docs' claims (the first-deploy acceptance kit)"
DEFAULT_REPORT = "verify-report.json"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 7200:
        raise argparse.ArgumentTypeError(f"{text} s is out of range; allowed: 0 to 7200")
    return value


def _request_seconds(text: str) -> float:
    """--request-timeout: 1 to 7200 s. At 0 urllib's socket is non-blocking ("If zero is given, the socket is put in
    non-blocking mode", https://docs.python.org/3/library/socket.html#socket.socket.settimeout) and every request
    failed at once with no answer (http_base.HttpClient.call: "Operation now in progress"); 1e-9 s did the same
    through the timeout (a cold review in the thirty-fourth session). The floor of 1 s is a choice: the kit's
    requests generate tokens through a load balancer, and a shorter timeout would judge itself, not the cell."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 1 <= value <= 7200:  # nan and inf fail it too
        raise argparse.ArgumentTypeError(f"{text} s is out of range; allowed: 1 to 7200")
    return value


def _dns_name(text: str) -> str:
    from pydantic import TypeAdapter, ValidationError

    try:
        return str(TypeAdapter(DnsName).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a DNS name; allowed: lower-case labels a-z, 0-9 "
                                         "and -, dot-separated, no wildcard (e.g. inference.example.com)") from None


def _region(text: str) -> str:
    """A region of the fleet file's list (inference_fleet/regions.py): botocore refuses a malformed name only when
    the adapter makes its clients (InvalidRegionError), and the fleet's cells may name no other region."""
    problem = region_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem} (a region's name looks like us-east-2)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cell", required=True, help="the cell to check (its name in the fleet file)")
    parser.add_argument("--destructive", action="store_true",
                        help="also stop a follower task, then a leader task (ECS StopTask), and measure the recovery")
    parser.add_argument("--report", type=Path, default=Path(DEFAULT_REPORT),
                        help=f"JSON report path (default {DEFAULT_REPORT}); the Markdown goes beside it (.md); "
                        "/dev/stdout, /dev/stderr or a FIFO a process reads get the JSON alone; /dev/null discards it")
    parser.add_argument("--region", type=_region,
                        help="the cell's region, an AWS region name such as us-east-2 (default: the fleet file's)")
    parser.add_argument("--tls-name", type=_dns_name,
                        help="the DNS name the cell's certificate covers, to verify it against (default: the fleet "
                        "file's cells[].tls_name, else the name a router gives it in routers[].tls_names)")
    parser.add_argument("--evidence-wait", type=_seconds, default=180.0,
                        help="longest wait for EMF metrics to appear in CloudWatch (default 180 s)")
    parser.add_argument("--request-timeout", type=_request_seconds, default=300.0,
                        help="longest wait for one HTTP request (1 to 7200 s, default 300 s)")


def tls_name(args: argparse.Namespace, fleet: FleetConfig, cell: CellConfig) -> str | None:
    """The name to verify an HTTPS cell's certificate against: --tls-name, cells[].tls_name, or a router's name."""
    if getattr(args, "tls_name", None):
        return str(args.tls_name)
    if cell.tls_name:
        return cell.tls_name
    return next((r.tls_names[cell.name] for r in fleet.routers if cell.name in (r.tls_names or {})), None)


def run(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.config)
    cell = next((c for c in fleet.cells if c.name == args.cell), None)
    if cell is None:
        print(f"error: --cell {args.cell!r}: no such cell in the fleet file; its cells: "
              f"{', '.join(c.name for c in fleet.cells)}", file=sys.stderr)
        return exit_codes.CONFIG
    stream, problem = _report_target(args.report)
    if problem is not None:
        print(f"error: {problem} (checked before the run; allowed: a path in a folder you can write)", file=sys.stderr)
        return exit_codes.USAGE
    adapter = AwsAdapter(fleet.cell_stack_name(cell), args.region or cell.region, tls_name=tls_name(args, fleet, cell))
    report = run_kit(adapter, expectations(fleet, cell), destructive=args.destructive,
                     request_timeout=args.request_timeout, settle_seconds=20.0, evidence_wait=args.evidence_wait,
                     log=lambda line: print(line, file=sys.stderr, flush=True))
    # The table is printed before the report is written: a report sent to stdout comes after it, and a report that
    # cannot be written loses no verdict.
    print(report.table(), flush=True)
    try:
        if stream is not None:
            try:
                stream.write(report.json_text())
            finally:
                stream.close()
            note = "discarded" if stream.discards else "the JSON alone: no Markdown beside a stream"
            print(f"report: {stream} ({note})", file=sys.stderr)
        else:
            json_path, md_path = report.write(args.report)
            print(f"report: {json_path} and {md_path}")
    except OSError as error:
        # As simulate --report: a FIFO's reader gone during the run (EPIPE), a full disk. Left to the command line's
        # handler, EPIPE read as the command's own stdout closed: exit 141 and not a word that the report was lost.
        print(f"error: the report could not be written to {stream or args.report}: {error.strerror or error}; the "
              "verdicts above are the run's (write the report elsewhere with --report FILE)", file=sys.stderr)
        return exit_codes.IO_ERROR
    return exit_codes.OK if report.passed else exit_codes.VERIFY


def _report_target(path: Path) -> tuple[ReportTarget | None, str | None]:
    """Where --report goes, checked before the run (some minutes, with --destructive two unit restarts): the
    command's stdout or stderr, a FIFO a process reads or the null device, written through its descriptor (as
    simulate --report: output_files.py), or None for a path the report's rules for a file apply to (Report.write);
    and the problem that refuses it, or None. Until the thirty-eighth session a FIFO or /dev/stdout went the way of
    any path that is no report of this kit, to <stem>.verify-report.json beside it: a reader of the FIFO got
    nothing, and `--report /dev/stdout` made /dev/stdout.verify-report.json (in /dev, as root). Until the
    thirty-ninth, /dev/null was refused as a device."""
    try:
        stream = stream_target(str(path), DEFAULT_REPORT)
    except argparse.ArgumentTypeError as error:
        return None, f"--report {error}"
    except OSError as error:
        return None, f"--report {path}: the path cannot be examined ({error.strerror or error})"
    return stream, None if stream is not None else unwritable(path)
