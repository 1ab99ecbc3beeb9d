"""`unit-proxy` / `python -m unit_proxy`: settings from the environment, then the agent
(`unit_proxy.agent`) with HAProxy as its child.

Settings come from the environment only (the container sets them); the command line takes
`--help` (the variables and their defaults) and `--version`, and refuses anything else with
a usage error (exit 2) before it listens, so a stray argument never starts a proxy.

Every failure an operator can fix ends in one line on stderr and exit code 2, never a
traceback: a bad setting, a listen address that cannot be bound, a port in use, or
another unit proxy already serving the port. HAProxy failing to start or dying: exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import uvloop

from unit_proxy import __version__
from unit_proxy.agent import BindError, claim_port, configure_logging, serve
from unit_proxy.settings import ENVIRONMENT, Settings, SettingsError

# 128 + SIGPIPE: what a shell reports for a process ended by a closed pipe.
EXIT_CLOSED_PIPE = 141


def _parser() -> argparse.ArgumentParser:
    rows = "\n".join(f"  {name}={default}\n      {meaning}" for name, default, meaning in ENVIRONMENT)
    return argparse.ArgumentParser(
        prog="unit_proxy",
        description="Streaming reverse proxy beside a unit's leader: HAProxy for the data path, this agent\n"
        "for health, load, the unit gate, admission settings and drain.\n"
        "With no arguments it starts serving; every setting comes from the environment.",
        epilog=f"environment (variable=default, then meaning; docs/contracts.md has each in full):\n{rows}\n\n"
        "exit status: 0 after SIGTERM and the drain; 1 if HAProxy cannot start or dies; 2 for a usage\n"
        "error, a bad setting, or a listen address that cannot be bound; 141 when the output is closed\n"
        "early (--help | head).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _parse_arguments(argv: Sequence[str] | None) -> None:
    """--help and --version print and exit 0; anything else exits 2 (argparse) before any listen."""
    parser = _parser()
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    try:
        try:
            parser.parse_args(argv)
        finally:
            sys.stdout.flush()  # after --help too (SystemExit): a closed pipe shows here, not at exit
    except BrokenPipeError:
        # `--help | head`: end quietly (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_CLOSED_PIPE)


def main(argv: Sequence[str] | None = None) -> int:
    _parse_arguments(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"unit_proxy: {exc}", file=sys.stderr)
        return 2
    try:
        claim = claim_port(settings)
        try:
            configure_logging()
            return uvloop.run(serve(settings))
        finally:
            claim.close()
    except BindError as exc:
        print(f"unit_proxy: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
