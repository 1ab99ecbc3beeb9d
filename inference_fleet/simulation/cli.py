"""`python -m inference_fleet simulate`: its options, and the run (exit statuses of exit_codes.py)."""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from inference_fleet import exit_codes

HELP = "simulate one cell through a scenario file, this package's own controllers deciding"
DEFAULT_REPORT = "simulate-cell-report.json"


def _seeds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seeds") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{value} seeds is out of range; allowed: 1 to 1000")
    return value


@dataclass(frozen=True)
class ReportTarget:
    """Where --report goes: a path, and for a FIFO the write end opened by the check, which the report is written
    through. Kept open from the check to the write: closed in between, it would end a reader such as `cat FIFO`
    (end of file once no writer is left), and the report's own open would then wait for a reader again."""

    path: Path
    fd: int | None = None

    def __str__(self) -> str:
        return str(self.path)

    def write(self, text: str) -> None:
        """The report's text at the path, or through the FIFO's write end (OSError when it cannot be written)."""
        if self.fd is None:
            self.path.write_text(text)
            return
        with open(self.fd, "w", closefd=False) as out:
            out.write(text)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _report_path(text: str) -> ReportTarget:
    """--report, checked before the run (which can take minutes) rather than when the report is written. A path the
    checks cannot examine (a name too long; EACCES on a parent) is refused as a bad option value (exit 2) like the
    others: Path.is_dir raises those errors, which argparse would let through as an output failure (exit 8)."""
    if not text:  # Path("") is ".", the working directory: it would be called a directory
        raise argparse.ArgumentTypeError("an empty path; give the report's file name, e.g. " + DEFAULT_REPORT)
    try:
        path = _writable_report(text, Path(text))
        if (stream := STANDARD_STREAMS.get(text)) is not None:
            return ReportTarget(path, os.dup(stream))
        return ReportTarget(path, _fifo_write_end(text, path))
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text} cannot be examined ({error.strerror or error}); give a report "
                                         f"path that can be written, e.g. {DEFAULT_REPORT}") from None


def _writable_report(text: str, path: Path) -> Path:
    """path, or ArgumentTypeError saying why the report could not be written there."""
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the report's file name, e.g. "
                                         f"{path / DEFAULT_REPORT}")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist; create it or write the report elsewhere")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} cannot be written (no permission)")
    return path


# A report sent to the command's own stdout or stderr is written through that descriptor (a duplicate: the same open
# file, its offset and append mode), after what was printed. Opened anew by its name, a stream that is a file was
# truncated (`--report /dev/stdout >> log` left the report alone: the log's lines and the verdicts were lost).
STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/fd/1": 1, "/proc/self/fd/1": 1,
                    "/dev/stderr": 2, "/dev/fd/2": 2, "/proc/self/fd/2": 2}


def _fifo_write_end(text: str, path: Path) -> int | None:
    """For a FIFO (a named pipe; `/dev/stdout` when piped), its write end opened now, or ArgumentTypeError when no
    process reads it: the report's open after the run would wait for a reader that may never come. O_NONBLOCK
    makes open fail with ENXIO instead of waiting (open(2), fifo(7)); the end is made blocking again so that a
    report larger than the pipe's buffer waits for the reader rather than failing with EAGAIN."""
    if not path.exists() or not stat.S_ISFIFO(path.stat().st_mode):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno != errno.ENXIO:
            raise
        raise argparse.ArgumentTypeError(f"{text} is a named pipe (FIFO) that no process reads: the report would "
                                         "wait for a reader after the run; start its reader first (e.g. "
                                         f"`cat {text} &`) or give a file, e.g. {DEFAULT_REPORT}") from None
    os.set_blocking(fd, True)
    return fd


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", required=True, help="scenario YAML file (simulations/*.yaml)")
    parser.add_argument("--seeds", type=_seeds, default=1,
                        help="run the scenario with this many seeds, from the scenario's seed (default 1 seed)")
    parser.add_argument("--timeline", action="store_true",
                        help="print each seed's whole time line (and keep it in the report)")
    parser.add_argument("--report", type=_report_path, default=DEFAULT_REPORT,
                        help=f"where to write the report (default {DEFAULT_REPORT})")


def run(args: argparse.Namespace) -> int:
    """Runs the scenario; a refused scenario or fleet raises ConfigError (exit 3 in cli._run)."""
    from inference_fleet.simulation.runner import render, report_text, simulate
    from inference_fleet.simulation.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    # The verdicts are printed before the report is written: a report that cannot be written (a full disk, a
    # device) loses no run, which can take minutes.
    doc = simulate(scenario, args.config, args.seeds, None, timeline=args.timeline)
    for line in render(doc):
        print(line)
    for seed in doc["per_seed"] if args.timeline else ():
        print(f"time line of seed {seed['seed']}:")
        for line in seed["timeline"]:
            print(f"  {line}")
    sys.stdout.flush()  # the verdicts reach the reader before a report error's line
    try:
        args.report.write(report_text(doc))
    except OSError as error:
        print(f"error: the report could not be written to {args.report}: {error.strerror or error}; the verdicts "
              "above are the run's (write the report elsewhere with --report FILE)", file=sys.stderr)
        return exit_codes.IO_ERROR
    print(f"report: {args.report}", file=sys.stderr)
    violated = any(not v["held"] for v in doc["invariants"].values())
    return exit_codes.VIOLATED if violated else exit_codes.OK
