"""`python -m inference_fleet simulate`: its options, and the run (exit statuses of exit_codes.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from inference_fleet import exit_codes
from inference_fleet.output_files import ReportTarget, stream_target

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


def _report_path(text: str) -> ReportTarget:
    """--report, checked before the run (which can take minutes) rather than when the report is written. A path the
    checks cannot examine (a name too long; EACCES on a parent) is refused as a bad option value (exit 2) like the
    others: Path.is_dir raises those errors, which argparse would let through as an output failure (exit 8)."""
    if not text:  # Path("") is ".", the working directory: it would be called a directory
        raise argparse.ArgumentTypeError("an empty path; give the report's file name, e.g. " + DEFAULT_REPORT)
    try:
        # A stream first: its parent (/dev, /proc/self/fd) is no directory a user other than root may write in, and
        # a FIFO is written through, not created there; the file checks are for a file's path only.
        return stream_target(text, DEFAULT_REPORT) or ReportTarget(_writable_report(text, Path(text)))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", required=True, help="scenario YAML file (simulations/*.yaml)")
    parser.add_argument("--seeds", type=_seeds, default=1,
                        help="run the scenario with this many seeds, from the scenario's seed (default 1 seed)")
    parser.add_argument("--timeline", action="store_true",
                        help="print each seed's whole time line (and keep it in the report)")
    parser.add_argument("--report", type=_report_path, default=DEFAULT_REPORT,
                        help=f"where to write the report (default {DEFAULT_REPORT}); /dev/null discards it")


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
