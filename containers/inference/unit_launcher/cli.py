"""Command line of the launcher.

python -m unit_launcher run
    The container entry point: role from UNIT_ROLE, spec from UNIT_SPEC (or UNIT_SPEC_FILE).
    UNIT_ROLE=spare: a warm spare node (unit_launcher.spare): fetch the model, then idle.
python -m unit_launcher plan --spec FILE --role leader|follower --rank R [--leader-addr A] [--json]
python -m unit_launcher plan --config fleet.yaml --cell NAME --unit I --role ... --rank R
    Print the engine's argv, environment and files for one node; starts nothing.
    --config needs the inference_fleet package (the repository's venv).
python -m unit_launcher compile
    The compile job's command on AWS Batch (unit_launcher.compile_run): the job in COMPILE_JOB.

`--version` prints the package version; `run --help` lists the environment `run` reads.
Usage errors exit 2 (argparse); `run`'s other statuses are runner.EXIT_*.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from unit_launcher import __version__, stop_signals
from unit_launcher import plan as plans
from unit_launcher.spec import SpecError, UnitSpec, load_spec_file, load_spec_from_env, parse_spec


def _spec_from_config(path: str | None, cell: str, unit: int) -> UnitSpec:
    try:
        from inference_fleet.checks import load_fleet
        from inference_fleet.config import ConfigError
        from inference_fleet.unit_spec import build_unit_spec
    except ImportError:
        raise SpecError(
            "--config needs the inference_fleet package (run from the repository's venv); "
            "in the image use --spec with a JSON spec"
        ) from None
    try:
        fleet = load_fleet(path)
        cell_config = fleet.cell(cell)
    except (ConfigError, KeyError) as error:
        raise SpecError(str(error).strip('"')) from None
    # An elastic cell has no `units`: its template holds max_units units (resolved_max_units).
    units = cell_config.resolved_max_units
    if not 0 <= unit < units:
        raise SpecError(f"--unit {unit} out of range: cell {cell} has units 0..{units - 1}")
    return parse_spec(
        build_unit_spec(fleet, cell_config, unit, revision="plan"), f"{path or 'default config'}"
    )


def _plan(args: argparse.Namespace) -> int:
    if args.spec:
        spec = load_spec_file(args.spec)
    elif args.cell is not None and args.unit is not None:
        spec = _spec_from_config(args.config, args.cell, args.unit)
    else:
        raise SpecError("give --spec FILE, or --cell NAME --unit I (with --config FILE or the default fleet)")
    rank = args.rank if args.rank is not None else (0 if args.role == "leader" else 1)
    leader_addr = args.leader_addr or "LEADER_ADDR"
    node = plans.build_plan(spec, args.role, rank, leader_addr=leader_addr, host_ip=args.host_ip or "HOST_IP")
    for path, content in node.files.items():
        if path.endswith("config.pbtxt"):
            plans.check_triton_config(content)
    if args.json:
        print(json.dumps(node.to_json(), indent=2))
    else:
        sys.stdout.write(node.to_text())
    return 0


# What `run` reads from the environment (docs/contracts.md, "Inference container environment");
# the cell stack sets the first ones. tests/test_cli.py checks this names every variable read.
RUN_ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("UNIT_ROLE", "required: leader, follower or spare"),
    ("UNIT_SPEC", "required (or UNIT_SPEC_FILE): the unit spec, JSON"),
    ("UNIT_SPEC_FILE", "path of a JSON unit spec, read when UNIT_SPEC is unset (local runs)"),
    ("AWS_REGION", "region of the Cloud Map and S3 calls when the spec has none"),
    ("AWS_DEFAULT_REGION", "read when AWS_REGION is unset"),
    ("ECS_CONTAINER_METADATA_URI_V4", "set by ECS: this node's address and task ARN come from it"),
    ("UNIT_HOST_IP", "this node's address (local runs; default from ECS task metadata)"),
    ("UNIT_INSTANCE_ID", "this node's id (local runs; default from ECS task metadata)"),
    ("UNIT_LEADER_ADDR", "the leader's address (local runs; default: Cloud Map discovery)"),
    ("UNIT_BIND_ADDR", "leader's rendezvous listen address (default 0.0.0.0)"),
    ("UNIT_HEALTH_FILE", "where the node's state file is written (default /tmp/unit-launcher.state)"),
    ("UNIT_LOG_LEVEL", "log level: DEBUG, INFO, WARNING, ERROR or CRITICAL (or WARN, FATAL, NOTSET), any case "
                       "(default INFO)"),
    ("UNIT_SELF_CHECK_IMDS", "host:port the self-check tries instead of IMDS 169.254.169.254:80 (tests)"),
    ("AWS_EC2_METADATA_DISABLED", "true without UNIT_SELF_CHECK_IMDS: the IMDS self-check is not tried (fails)"),
    ("UNIT_STEPS_REPORT_SECONDS", "how often the leader publishes its unit_steps line (default 60)"),
)
# What `compile` reads (unit_launcher.compile_run), shown by `compile --help`.
COMPILE_ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("COMPILE_JOB", "required: the job, rendered by `python -m inference_fleet compile --submit` (JSON)"),
)
RUN_EPILOG = (
    "environment:\n"
    + "\n".join(f"  {name}\n      {meaning}" for name, meaning in RUN_ENVIRONMENT)
    + "\n\nexit status: 2 bad spec, role or environment (or usage error); 3 the unit did not form;\n"
    "4 artifacts missing or not matching the layout; 5 the unit was lost (a member, a step overran);\n"
    "otherwise the engine's own exit status."
)
# 128 + SIGPIPE: what a shell reports for a process ended by a closed pipe.
EXIT_CLOSED_PIPE = 141
# The levels UNIT_LOG_LEVEL may name, in any case: logging.basicConfig takes only these upper-case names
# (or numbers) and raises ValueError on `debug`, which would end the launcher with a traceback and exit 1.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Also taken, as logging.basicConfig took them before the level was checked (logging's own aliases and NOTSET;
# a cold review: UNIT_LOG_LEVEL=WARN worked and must go on working).
LOG_LEVEL_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL", "NOTSET": "NOTSET"}


def _log_level(value: str) -> str | None:
    """`value` as the level name logging takes, or None when it names no level logging knows."""
    name = value.strip().upper()
    return name if name in LOG_LEVELS else LOG_LEVEL_ALIASES.get(name)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # after --help too (SystemExit): a closed pipe shows here, not at exit
    except BrokenPipeError:
        # `plan --json | head -1`: end quietly (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLOSED_PIPE


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="unit_launcher", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "run", help="form the unit and run the engine (role and spec from the environment)",
        description="Form the unit and run the engine on this node: the container's command.\n"
        "Everything comes from the environment.",
        epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands.add_parser(
        "compile", help="the compile job's command on AWS Batch: the job rendered in COMPILE_JOB",
        description="Run the compile job rendered by `python -m inference_fleet compile --submit`: fetch the "
        "checkpoint, compile each node slice with NxD Inference, upload the layout and its manifest.",
        epilog="environment:\n" + "\n".join(f"  {name}\n      {meaning}" for name, meaning in COMPILE_ENVIRONMENT)
        + "\n\nexit status: 0 built (or already built), 5 anything else.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check = commands.add_parser(
        "triton-selfcheck", help="start tritonserver with a stand-in model in the stub's Python; generate once",
        description="Start tritonserver with a tiny decoupled Python model in the stub environment the leader "
        "uses, wait for readiness and generate once (the image build runs it).",
        epilog="exit status: 0 answered, 2 anything else.")
    from unit_launcher import triton_selfcheck

    triton_selfcheck.add_arguments(check)
    p = commands.add_parser("plan", help="print one node's launch plan; starts nothing")
    p.add_argument("--spec", help="unit spec JSON file")
    p.add_argument(
        "--config", help="fleet YAML (needs inference_fleet); default: the repository's default fleet"
    )
    p.add_argument("--cell", help="cell name (with --config)")
    p.add_argument("--unit", type=int, help="unit index in the cell (with --config)")
    p.add_argument("--role", choices=("leader", "follower"), required=True)
    p.add_argument("--rank", type=int, help="node rank (leader 0, followers 1..size-1); default 0 / 1")
    p.add_argument("--leader-addr", help="leader address to render (default placeholder LEADER_ADDR)")
    p.add_argument("--host-ip", help="this node's address to render (default placeholder HOST_IP)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.command != "run":
        stop_signals.restore_defaults()  # only `run` acts on a stop itself (unit_launcher.stop_signals)
    level = _log_level(os.environ.get("UNIT_LOG_LEVEL", "INFO"))
    if level is None:
        print(f"error: UNIT_LOG_LEVEL={os.environ['UNIT_LOG_LEVEL']!r} not allowed; allowed: "
              f"{', '.join(LOG_LEVELS)} (any case; also {', '.join(LOG_LEVEL_ALIASES)}; default INFO)",
              file=sys.stderr)
        return 2
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "triton-selfcheck":
            return triton_selfcheck.main(args)
        if args.command == "compile":
            from unit_launcher import compile_run

            return compile_run.main()
        role = os.environ.get("UNIT_ROLE", "")
        if role == "spare":
            from unit_launcher.spare import run_spare

            return run_spare(load_spec_from_env())
        from unit_launcher.runner import EXIT_CONFIG, run

        if role not in ("leader", "follower"):
            logging.getLogger("unit_launcher").error(
                "UNIT_ROLE=%r not allowed; allowed: leader, follower, spare", role
            )
            return EXIT_CONFIG
        return run(role, load_spec_from_env(), os.environ)
    except (SpecError, plans.PlanError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
