"""Parse rendered engine commands with the installed vLLM's own `vllm serve` parser.

Runs inside the engine's environment (`.e2e/venv`): reads a JSON list of argv lists on
standard input (each as the launcher renders it: `[*engine.command, "serve", model, ...]`),
parses each with the parser `vllm serve` builds (`ServeSubcommand.subparser_init`, then
`validate_parsed_serve_args`, then `EngineArgs.from_cli_args`), and prints, per argv, the
engine arguments vLLM ended up with, or the parser's error. An argument vLLM does not know
fails here, not in a container on ECS. With `--options` it prints instead every option string of
that parser with its destination (what `engine.extra_args` is checked against). With `--with-options` it
does both in one process ({"parsed": [...], "options": [...]}): importing vLLM is most of a run's time.
"""

from __future__ import annotations

import json
import sys
from typing import Any

FIELDS = (
    "model", "served_model_name", "tensor_parallel_size", "nnodes", "node_rank", "master_addr",
    "master_port", "max_num_seqs", "max_model_len", "dtype", "distributed_executor_backend",
    "enforce_eager", "additional_config", "enable_prefix_caching", "block_size",
)


def serve_parser() -> tuple[Any, Any]:
    """vLLM's top parser with its `serve` subcommand, and that subcommand's own parser."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return top, subparsers.choices["serve"]


def options() -> list[list[str]]:
    """[option string, dest] of every option of `vllm serve`."""
    _, serve = serve_parser()
    return sorted([option, action.dest] for option, action in serve._option_string_actions.items())


def parse(argv: list[str]) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    serve_at = argv.index("serve")
    top, _ = serve_parser()
    try:
        args = top.parse_args(argv[serve_at:])
    except SystemExit as error:
        return {"error": f"vLLM's parser refused the command (exit {error.code})"}
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    engine = EngineArgs.from_cli_args(args)
    result = {name: getattr(engine, name, None) for name in FIELDS}
    result["headless"] = bool(getattr(args, "headless", False))
    return json.loads(json.dumps(result, default=str))


def main() -> int:
    if sys.argv[1:] == ["--options"]:
        json.dump(options(), sys.stdout)
        return 0
    parsed = parse_all(json.load(sys.stdin))
    json.dump({"parsed": parsed, "options": options()} if sys.argv[1:] == ["--with-options"] else parsed, sys.stdout)
    return 0


def parse_all(argvs: list[list[str]]) -> list[dict[str, Any]]:
    out = []
    for argv in argvs:
        try:
            out.append(parse(argv))
        except Exception as error:  # reported to the caller, who fails the check
            out.append({"error": f"{type(error).__name__}: {error}"})
    return out


if __name__ == "__main__":
    sys.exit(main())
