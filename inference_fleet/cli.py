"""Command line of the package: `python -m inference_fleet <command>`.

Commands:
  validate       check a fleet file and print its cells and stacks
  plan           memory and parallel layout of the fleet's unit (see planner.py)
  plan-rollout   waves, bake times and capacity floor of a cell-by-cell rollout (see rollout.py)
  reference      the fleet file reference (Markdown), generated from the config models
"""

from __future__ import annotations

import argparse
import sys

from inference_fleet.config import ConfigError, load_fleet


def _validate(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.config)
    for cell in fleet.cells:
        print(f"{fleet.cell_stack_name(cell)}: {cell.units} unit(s) of {fleet.unit.nodes} x "
              f"{fleet.unit.instance_type} in {cell.trainium_az}, wave {cell.wave}")
    return 0


def _reference(args: argparse.Namespace) -> int:
    from inference_fleet.reference import markdown

    print(markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    from inference_fleet import planner, rollout

    parser = argparse.ArgumentParser(prog="inference-fleet", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text, module in (
        ("validate", "check a fleet file", None),
        ("plan", "print the unit's memory budget and parallel layout", planner),
        ("plan-rollout", "print the cell-by-cell rollout plan", rollout),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--config", help="fleet YAML file (default: config/default.yaml)")
        if module is not None:
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
        else:
            sub.set_defaults(run=_validate)
    commands.add_parser("reference", help="print the fleet file reference").set_defaults(run=_reference)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
