"""Command line of the package: `python -m inference_fleet <command>`.

Commands:
  validate       check a fleet file and print its cells and stacks
  plan           memory and parallel layout of the fleet's unit (see planner/)
  plan-rollout   waves, bake times and capacity floor of a cell-by-cell rollout (see rollout.py)
  compile        build and upload the unit layout's compiled Neuron artifacts and manifest (compile_job.py)
  reference      the fleet file reference (Markdown), generated from the config models
  simulate       run one cell through a scenario file (see simulation/, docs/simulation.md)
  verify         the first-deploy acceptance kit against a deployed cell (see verify/, docs/verifying.md)

Every command that reads a fleet reads it with `inference_fleet.checks.load_fleet`; a
mistake in the file prints every issue with its field path and exits 3 (exit_codes.py:
usage errors exit 2, as argparse does, so scripts tell the two apart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from inference_fleet import __version__, compile_cli, compile_job, evacuate, exit_codes, rollout
from inference_fleet.checks import check_fleet_file_place, fleet_warnings, load_fleet
from inference_fleet.config import ConfigError
from inference_fleet.planner import cli as planner_cli
from inference_fleet.reference import markdown
from inference_fleet.simulation import cli as simulation_cli
from inference_fleet.simulation.scenario import ScenarioError
from inference_fleet.verify import cli as verify_cli


def _validate(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.config)
    for issue in fleet_warnings(fleet):
        print(f"warning: {issue}", file=sys.stderr)
    try:
        check_fleet_file_place(fleet, args.config)
    except ConfigError as error:
        # Where the file lives is no mistake in it (a draft may be checked before it is committed), but `cdk synth`
        # refuses it there: say so, and still accept the content.
        print(f"warning: `cdk synth` refuses this file where it is: {error.issues[0].problem}", file=sys.stderr)
    for cell in fleet.cells:
        count = (f"{cell.resolved_min_units}-{cell.resolved_max_units} (elastic)" if cell.elastic
                 else str(cell.resolved_max_units))
        print(f"{fleet.cell_stack_name(cell)}: {count} unit(s) of {fleet.unit.nodes} x "
              f"{fleet.unit.instance_type} in {cell.trainium_az}, wave {cell.wave}")
    for router in fleet.routers:
        print(f"{fleet.router_stack_name(router)}: router of {', '.join(router.cells)}, {router.tasks} Fargate "
              f"tasks in {', '.join(fleet.router_azs(router))}")
    # The two stacks a first deploy names besides the cells (docs/deploying.md, steps 3 and 8).
    print(f"{compile_job.stack_name(fleet)}: the compile job's AWS Batch queue (`compile --submit`)")
    if fleet.pipeline is not None:
        print(f"{fleet.pipeline_stack_name}: the rollout pipeline, cell by cell")
    return 0


def _reference(args: argparse.Namespace) -> int:
    print(markdown())
    return 0


def _positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes") from None
    if not 0 < value <= 24 * 60:
        raise argparse.ArgumentTypeError(f"{text} minutes is out of range; allowed: more than 0, at most 1440")
    return value


def _rollout_arguments(parser: argparse.ArgumentParser) -> None:
    default = rollout.DEFAULT_UNIT_RESTART_MINUTES
    parser.add_argument(
        "--unit-restart-minutes", type=_positive_minutes, default=default,
        help="time for one unit to stop, load the model and pass its health check "
             f"(default {default:g}; model load dominates)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _plan_rollout(args: argparse.Namespace) -> int:
    plan = rollout.plan_rollout(load_fleet(args.config), args.unit_restart_minutes)
    if args.json:
        data = asdict(plan)
        data["total_minutes"] = plan.total_minutes
        print(json.dumps(data, indent=2))
    else:
        print(rollout.render(plan))
    return 0


# What the user reads first (`--help`): what the tool does for them, not how it is built.
DESCRIPTION = """\
Check and plan a fleet file (the YAML that describes your Trainium inference cells)
before you synthesize or deploy it: validate it, see the model's memory and parallel
layout on one unit, see how a rollout proceeds cell by cell, or print the reference
of every field. Without --config, offline commands use the example fleet
(config/default.yaml); compile (but --dry-run), verify and evacuate (but --local) reach
AWS, and compile --no-upload compiles one fleet's layout: they need your fleet's file."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-fleet", description=DESCRIPTION, epilog=exit_codes.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_arguments, run in (
        ("validate", "check a fleet file", None, _validate),
        ("plan", "print the unit's memory budget and parallel layout", planner_cli.add_arguments, planner_cli.run),
        ("plan-rollout", "print the cell-by-cell rollout plan", _rollout_arguments, _plan_rollout),
        ("compile", "compile the unit layout with NxD Inference, write and upload its manifest",
         compile_cli.add_arguments, compile_cli.run),
        ("simulate", simulation_cli.HELP, simulation_cli.add_arguments, simulation_cli.run),
        ("verify", verify_cli.HELP, verify_cli.add_arguments, verify_cli.run),
        ("evacuate", evacuate.HELP, evacuate.add_arguments, evacuate.run),
    ):
        sub = commands.add_parser(name, help=help_text, description=help_text, epilog=exit_codes.EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("--config", help="fleet YAML file (default: the example fleet, config/default.yaml, "
                                          "for offline commands; commands that reach AWS, and compile "
                                          "--no-upload, need it)")
        if add_arguments is not None:
            add_arguments(sub)
        sub.set_defaults(run=run)
    # No --config: the reference is of the fleet file's fields, not of one fleet.
    reference_help = "print the fleet file reference (every field: type, bounds, default; as docs/fleet-reference.md)"
    commands.add_parser("reference", help=reference_help, description=reference_help, epilog=exit_codes.EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter).set_defaults(run=_reference)
    return parser


def _closed_pipe() -> int:
    """The reader went away (`... | head -1`): end quietly. Python ignores SIGPIPE, so a write
    raises BrokenPipeError; stdout is pointed at /dev/null so that the flush at exit does not
    raise it again (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return exit_codes.CLOSED_PIPE


def refused_without_fleet_file(argv: list[str]) -> bool:
    """Whether this command line would be refused for naming no fleet file: a command that reaches AWS
    (`compile` but --dry-run, `verify`, `evacuate` but --local) or compiles (`compile --no-upload`) without
    --config. The pipeline's build and gate commands are checked with it (tests/test_template_scripts.py)."""
    return _missing_fleet_file(_parser().parse_args(argv)) is not None


# What an offline compile takes from the fleet file: the layout (unit_spec.layout_key, plan.neuron_config) and the
# versions in the key (compile_job.versions). Nothing else: no account, region, cell or artifacts_s3_uri.
COMPILE_NEEDS = ("model (name, dtype, max_seq_len) and unit (instance_type, nodes, logical_nc_config, "
                 "tensor_parallel_degree, context_parallel_degree, data_parallel_degree, max_concurrent_sequences), "
                 "which make the layout, and base_images (neuron_vllm_tag, neuron_vllm_digest), whose versions are "
                 "in the manifest's key")


def _missing_fleet_file(args: argparse.Namespace) -> str | None:
    """Why this command needs the fleet file it was not given (the error's text), or None."""
    if getattr(args, "config", "") is not None:
        return None
    deployed = (f"`{args.command}` acts on a deployed fleet: name its fleet file with --config FILE (make: "
                "CONFIG=FILE); only offline commands fall back to the example fleet, config/default.yaml")
    if args.command == "compile":
        if args.dry_run:
            return None
        if args.no_upload and not (args.check or args.submit):
            # Offline, but hours of compiling for one layout: the example fleet's would serve no other fleet (its
            # units refuse a manifest of another layout or key), so the layout's fields are asked for.
            return ("`compile --no-upload` reaches no AWS but compiles one fleet's unit layout: it needs the fleet "
                    f"file's {COMPILE_NEEDS}. Allowed: --config FILE (make: CONFIG=FILE); --config "
                    "config/default.yaml to compile the example fleet's layout on purpose; --dry-run to print the "
                    "example fleet's job without compiling")
        return deployed
    if args.command == "evacuate":
        return deployed if args.local is None else None
    return deployed if args.command == "verify" else None


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if (refusal := _missing_fleet_file(args)) is not None:
        # Without --config every command reads the package's example fleet (config/default.yaml). Offline that is a
        # demonstration; against AWS it would submit, verify or evacuate another fleet's stacks (a fleet copied from
        # the example keeps its name, so its stack names match), so the deployed fleet's file is asked for.
        print(f"error: {refusal}", file=sys.stderr)
        return exit_codes.USAGE
    try:
        return args.run(args)
    except (ConfigError, ScenarioError) as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_codes.CONFIG


def _io_error(error: OSError) -> int:
    """An output or file error no command handled: one line, not a traceback; stdout is pointed at /dev/null
    so that the flush at exit does not raise it again."""
    print(f"error: input/output failed: {error}", file=sys.stderr)
    if sys.stdout is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return exit_codes.IO_ERROR


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:
        # Started with stdout closed (`validate >&-`): Python sets sys.stdout to None and print() drops the text.
        print("error: standard output is closed: nothing could be printed", file=sys.stderr)
        return exit_codes.IO_ERROR
    if hasattr(sys.stdout, "reconfigure"):
        # Under a locale that is not UTF-8 (LANG=en_US.ISO-8859-1, PYTHONIOENCODING=ascii) the reference's em dash or
        # a non-ASCII model name raised UnicodeEncodeError: such characters are escaped (\u2014), as on stderr.
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # after --help too (SystemExit): a closed pipe shows here, not at exit
    except BrokenPipeError:
        return _closed_pipe()
    except OSError as error:  # `reference > /dev/full`: [Errno 28] No space left on device
        return _io_error(error)
    except KeyboardInterrupt:
        exit_codes.end_interrupted()
        return exit_codes.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
