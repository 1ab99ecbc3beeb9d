"""Command line of the launcher.

python -m unit_launcher run
    The container entry point: role from UNIT_ROLE, spec from UNIT_SPEC (or UNIT_SPEC_FILE).
    UNIT_ROLE=spare: a warm spare node (unit_launcher.spare): fetch the model, then idle.
python -m unit_launcher plan --spec FILE --role leader|follower --rank R [--leader-addr A] [--json]
python -m unit_launcher plan --config fleet.yaml --cell NAME --unit I --role ... --rank R
    Print the engine's argv, environment and files for one node; starts nothing.
    --config needs the inference_fleet package (the repository's venv).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unit_launcher", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="form the unit and run the engine (role and spec from the environment)")
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
    logging.basicConfig(
        level=os.environ.get("UNIT_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "plan":
            return _plan(args)
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
