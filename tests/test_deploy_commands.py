"""The commands of a first deploy exist as the docs write them.

A platform engineer deploys by the README, docs/deploying.md and the pages it sends them to for the walk
(verifying, compiled artifacts, the pipeline, the router, the account prerequisites). Every `make` target and
variable those pages name is the Makefile's, every `inference_fleet` command and option is the CLI's, and every
`cdk deploy` or `cdk destroy` names the fleet file (without `-c config=` the app synthesizes the example fleet, whose
stacks are not the reader's) and a stack a fleet builds. Checked offline, without `make setup`: the Makefile is read,
the CLI's own parser parses, and stack names come from the fleet models.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from inference_fleet import cli, compile_job
from inference_fleet.checks import load_fleet

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAKEFILE = ROOT / "Makefile"
PAGES = (ROOT / "README.md", *(DOCS / f"{name}.md" for name in (
    "deploying", "verifying", "compiled-artifacts", "rollout-pipeline", "router", "cell-lifecycle")))
# Pages that tell the reader what to type (not what the pipeline or a container runs): the CLI is in .venv only.
READER_PAGES = (ROOT / "README.md", DOCS / "deploying.md", DOCS / "verifying.md")
# Fleets whose concrete stack names the pages use as examples (Rufus-Cell-dev, Rufus-Router-us-east-2 ...).
EXAMPLE_FLEETS = (None, ROOT / "tests" / "fleets" / "router.yaml")
# The placeholder forms of the stacks' names.
STACK_PATTERNS = ("<Fleet>-Cell-<name>", "<Fleet>-Cell-<canary>", "<Fleet>-Compile", "<Fleet>-Pipeline",
                  "<Fleet>-Router-<region>")

_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INLINE = re.compile(r"`((?:make|npx|cdk|python3?|\.venv/bin/python|\.\.\.) [^`]*)`")


def _commands(page: Path) -> list[str]:
    """The commands a page shows: in running text (a command may wrap across lines), in fenced blocks (`$ `
    prompts dropped), and in backquotes in those blocks' comments."""
    text = page.read_text()
    found = _INLINE.findall(" ".join(_FENCE.sub("", text).split()))
    for block in _FENCE.findall(text):
        for line in block.splitlines():
            command, _, comment = line.removeprefix("$ ").partition("#")
            found += _INLINE.findall(comment)
            if re.match(r"(make|npx|cdk|python3?|\.venv/bin/python) ", command.strip()):
                found.append(command.strip())
    return found


def _all_commands(pages: tuple[Path, ...] = PAGES) -> list[tuple[str, str]]:
    return [(page.name, command) for page in pages for command in _commands(page)]


# -- make ---------------------------------------------------------------------------------------------------------

def _makefile() -> tuple[set[str], set[str]]:
    """The Makefile's targets, and the variables it reads (assigned, exported, or expanded by make or the shell)."""
    text = MAKEFILE.read_text()
    targets = set(re.findall(r"^([a-zA-Z0-9_-]+):", text, re.MULTILINE))
    variables = {*re.findall(r"^([A-Z0-9_]+)\s*[?:]?=", text, re.MULTILINE),
                 *re.findall(r"\$\(([A-Z0-9_]+)\)", text), *re.findall(r"\$\$\{?([A-Z0-9_]+)", text)}
    for line in re.findall(r"^export ([A-Z0-9_ ]+)$", text, re.MULTILINE):
        variables.update(line.split())
    return targets, variables


def _make_problem(command: str, targets: set[str], variables: set[str]) -> str | None:
    words = re.sub(r"[\[\]]", " ", command).split()[1:]
    assignments = [w.split("=", 1)[0] for w in words if re.match(r"^[A-Za-z0-9_]+=", w)]
    goals = [w for w in words if "=" not in w and not w.startswith(("-", '"', "'")) and re.match(r"^[a-z]", w)]
    unknown_goals = [g for g in goals[:1] if g not in targets]
    unknown_variables = [v for v in assignments if v not in variables]
    if unknown_goals or unknown_variables:
        return f"no make target {unknown_goals}" if unknown_goals else f"the Makefile reads no {unknown_variables}"
    return None


def test_every_make_command_names_a_target_and_variables_the_makefile_reads() -> None:
    targets, variables = _makefile()
    problems = [f"{page}: `{c}`: {p}" for page, c in _all_commands()
                if c.startswith("make ") for p in [_make_problem(c.split("&&")[0], targets, variables)] if p]
    assert not problems, problems


# -- the CLI ------------------------------------------------------------------------------------------------------

def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _cli_arguments(command: str) -> list[str] | None:
    """The words after `inference_fleet` (or after the `...` the pages write for `.venv/bin/python -m
    inference_fleet`), or None when the command is not the CLI."""
    match = re.match(r"^(?:(?:\.venv/bin/)?python3? -m inference_fleet|\.\.\.)(?: (.*))?$", command)
    return None if match is None else re.sub(r"[\[\]]", " ", match.group(1) or "").split()


def _cli_problem(arguments: list[str], subcommands: dict[str, argparse.ArgumentParser]) -> str | None:
    if not arguments or arguments[0].startswith("-"):
        return None if all(a in ("--help", "-h", "--version") for a in arguments) else f"options {arguments}"
    name, options = arguments[0], [a.split("=", 1)[0] for a in arguments[1:] if a.startswith("-")]
    if name not in subcommands:
        return f"no command {name!r}"
    unknown = [o for o in options if o not in subcommands[name]._option_string_actions]
    return f"{name} has no option {unknown}" if unknown else None


def test_every_inference_fleet_command_and_option_is_the_clis() -> None:
    subcommands = _subcommands()
    problems = [f"{page}: `{c}`: {p}" for page, c in _all_commands()
                for args in [_cli_arguments(c)] if args is not None for p in [_cli_problem(args, subcommands)] if p]
    assert not problems, problems


def test_the_reader_is_told_the_venvs_python() -> None:
    """A fresh shell has the package in .venv only (`make setup`): `python -m inference_fleet` fails there."""
    plain = [f"{page}: `{c}`" for page, c in _all_commands(READER_PAGES)
             if re.match(r"^python3? -m inference_fleet", c)]
    assert not plain, plain


# -- cdk deploy / destroy -----------------------------------------------------------------------------------------

def _stack_names() -> set[str]:
    names = set(STACK_PATTERNS)
    for path in EXAMPLE_FLEETS:
        fleet = load_fleet(path)
        names |= {fleet.cell_stack_name(c) for c in fleet.cells} | {fleet.router_stack_name(r) for r in fleet.routers}
        names |= {compile_job.stack_name(fleet)} | ({fleet.pipeline_stack_name} if fleet.pipeline else set())
    return names


def _cdk_commands() -> list[tuple[str, str]]:
    # With or without npx (the pages name the pipeline's deploy as `cdk deploy <Fleet>-Pipeline` too): a deploy or
    # destroy of a named stack, not a mention of the command or of an option (`cdk deploy --all`).
    return [(page, c.removeprefix("npx ")) for page, c in _all_commands()
            if re.match(r"^(npx )?cdk (deploy|destroy) (-c |[^-\s])", c)]


def test_every_cdk_deploy_and_destroy_names_the_fleet_file() -> None:
    """Without `-c config=` the app synthesizes config/default.yaml: its placeholder account's stacks, not yours
    (`cdk destroy` synthesizes the app too, and finds no stack of your fleet's name in it)."""
    commands = _cdk_commands()
    assert commands
    missing = [f"{page}: `{c}`" for page, c in commands if "-c config=" not in c]
    assert not missing, missing


def test_every_stack_a_cdk_command_names_is_one_a_fleet_builds() -> None:
    known = _stack_names()
    unknown = []
    for page, command in _cdk_commands():
        words = command.split()[2:]
        stacks = [w for i, w in enumerate(words) if not w.startswith("-") and (i == 0 or words[i - 1] != "-c")]
        unknown += [f"{page}: `{command}`: {s}" for s in stacks if s not in known]
    assert not unknown, unknown


def test_the_make_check_finds_a_wrong_target_or_variable() -> None:
    targets, variables = _makefile()
    assert _make_problem("make verify-cell CELL=dev CONFIG=fleet.yaml VERIFY_ARGS=--destructive", targets,
                         variables) is None
    assert _make_problem("make verfy-cell CELL=dev", targets, variables) is not None
    assert _make_problem("make verify-cell CELLS=dev", targets, variables) is not None


def test_the_cli_check_finds_a_wrong_command_or_option() -> None:
    subcommands = _subcommands()
    assert _cli_problem(["compile", "--config", "f.yaml", "--submit"], subcommands) is None
    assert _cli_problem(["compile", "--sumbit"], subcommands) is not None
    assert _cli_problem(["verfy", "--cell", "dev"], subcommands) is not None
