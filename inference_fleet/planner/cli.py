"""Planner, command line: `python -m inference_fleet plan [--suggest | --compare] [--json]`.

Loads the fleet through `inference_fleet.checks.load_fleet` (every check runs), then
prints the plan, the suggestion or the comparison with published figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError, create_model
from pydantic.fields import FieldInfo

from inference_fleet import config, exit_codes
from inference_fleet.catalogue import CATALOGUE, instance_type
from inference_fleet.checks import NEURON_MAX_PROMPT_TOKENS, load_fleet
from inference_fleet.config import ConfigError, ModelConfig, UnitConfig
from inference_fleet.planner.fit import DEFAULT_MAX_NODES
from inference_fleet.planner.plan import format_plan, plan_report
from inference_fleet.planner.roofline import DEFAULT_PROMPT_TOKENS, EFFICIENCY, comparison_rows
from inference_fleet.planner.shape import shape_of
from inference_fleet.planner.suggestion import format_suggestion, suggest, suggestion_data

DEFAULT_TOP = 10


def _positive_int(text: str) -> int:
    """An option's value: a bad one is a usage error (exit 2, argparse's message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _seq_len(text: str) -> int:
    """--seq-len: a length the fleet file could hold (model.max_seq_len, at most the Neuron budget)."""
    value = _positive_int(text)
    low, high = ModelConfig.model_fields["max_seq_len"].metadata[0].ge, NEURON_MAX_PROMPT_TOKENS
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} tokens is out of range; allowed: {low} to {high} (a fleet "
                                         f"refuses a longer model.max_seq_len on Neuron)")
    return value


# Options only `--suggest` reads: given without it they would be ignored silently.
SUGGEST_ONLY = ("concurrency", "seq_len", "instance_type", "max_nodes", "top")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `inference-fleet plan`."""
    parser.add_argument("--suggest", action="store_true",
                        help="find the smallest unit for the model and rank its layouts")
    parser.add_argument("--concurrency", type=_positive_int, help="concurrent sequences (default: the fleet's)")
    parser.add_argument("--seq-len", type=_seq_len, help="max sequence length (default: the model's)")
    parser.add_argument("--prompt-tokens", type=_positive_int,
                        help=f"prompt length of the prefill estimate (default {DEFAULT_PROMPT_TOKENS})")
    parser.add_argument("--instance-type", choices=sorted(CATALOGUE),
                        help="for --suggest (default: the fleet's)")
    parser.add_argument("--max-nodes", type=_positive_int,
                        help=f"largest unit --suggest tries (default {DEFAULT_MAX_NODES})")
    parser.add_argument("--top", type=_positive_int, help=f"layouts --suggest prints (default {DEFAULT_TOP})")
    parser.add_argument("--compare", action="store_true",
                        help="print the estimate next to published Neuron figures")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(usage_error=parser.error)


def run(args: argparse.Namespace) -> int:
    """`inference-fleet plan`: print the plan (or suggestions, or the comparison)."""
    if args.compare:
        return _print_comparison(args.json)
    if args.suggest:
        return _run_suggest(args)
    given = [f"--{name.replace('_', '-')}" for name in SUGGEST_ONLY if getattr(args, name) is not None]
    if given:
        args.usage_error(f"{', '.join(given)}: only with --suggest (the plan reads the fleet's unit)")  # exits 2
    fleet = load_fleet(args.config)
    prompt = min(args.prompt_tokens or DEFAULT_PROMPT_TOKENS, fleet.model.max_seq_len)
    report = plan_report(fleet, prompt)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_plan(fleet, report))
    return 0



# unit.instance_type and unit.max_concurrent_sequences, checked as the fleet model checks them (its field
# constraints, and booleans refused as numbers): the hints `--suggest` reads from a fleet refused as a whole.
_UnitHints = create_model(
    "_UnitHints",
    __base__=config._Strict,  # the fleet model's own base: its YAML scalar rules
    instance_type=(str, ""),
    max_concurrent_sequences=(int | None, FieldInfo.merge_field_infos(
        UnitConfig.model_fields["max_concurrent_sequences"], default=None)),
)


def _model_section(path: str | None) -> tuple[ModelConfig, str, int | None]:
    """The model section and the unit hints of a fleet file, each validated on its own."""
    data, _ = config.read_fleet_file(path)
    unit = data.get("unit") or {}
    hints = _UnitHints.model_validate({key: unit[key] for key in _UnitHints.model_fields if key in unit})
    return ModelConfig.model_validate(data["model"]), hints.instance_type, hints.max_concurrent_sequences


def _run_suggest(args: argparse.Namespace) -> int:
    try:
        fleet = load_fleet(args.config)
        model, inst_name, batch = fleet.model, fleet.unit.instance_type, fleet.unit.max_concurrent_sequences
    except ConfigError as error:
        # The configured layout may be the very thing that does not fit: suggest anyway
        # when the file reads and the model section alone is valid, after saying what is
        # wrong. A wrong model (or file) has no layout to suggest.
        if any(issue.path.startswith(("<", "model")) for issue in error.issues):
            raise
        try:
            model, inst_name, batch = _model_section(args.config)
        except (ConfigError, AttributeError, KeyError, TypeError, ValidationError):
            raise error from None
        print(f"note: {error}\n", file=sys.stderr)
    if (args.instance_type or inst_name) not in CATALOGUE:
        allowed = ", ".join(sorted(CATALOGUE))
        print(f"error: unit.instance_type = {inst_name!r} is not a known instance type; allowed: {allowed}",
              file=sys.stderr)
        return exit_codes.CONFIG
    inst = instance_type(args.instance_type or inst_name)
    batch = args.concurrency or batch or 1
    seq_len = args.seq_len or model.max_seq_len
    prompt = min(args.prompt_tokens or DEFAULT_PROMPT_TOKENS, seq_len)
    shape = shape_of(model)
    result = suggest(shape, inst, batch, seq_len, prompt, args.max_nodes or DEFAULT_MAX_NODES)
    top = args.top or DEFAULT_TOP
    if args.json:
        print(json.dumps(suggestion_data(result, top), indent=2))
    else:
        print(format_suggestion(shape, result, top))
    return exit_codes.OK if result.nodes is not None else exit_codes.NO_FIT



def _print_comparison(as_json: bool) -> int:
    rows = comparison_rows()
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"estimate (efficiency {EFFICIENCY}) next to published Neuron figures")
    for r in rows:
        ttft = (f"TTFT {r['ttft_ms_published']:.0f} ms published, {r['ttft_ms_estimate']:.0f} ms estimated "
                f"({r['ttft_error']:+.0%})" if r["ttft_ms_published"] else "TTFT not published")
        print(f"- {r['model']} on {r['instance']}: TPOT {r['tpot_ms_published']} ms published, "
              f"{r['tpot_ms_estimate']:.1f} ms estimated ({r['tpot_error']:+.0%}); {ttft}\n"
              f"  setup: {r['setup']}\n  source: {r['source']}")
    return 0

