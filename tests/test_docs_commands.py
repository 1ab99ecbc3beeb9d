"""Every command line of the docs (docs/*.md, the READMEs) is accepted by the program it names, without running it.

A renamed flag or subcommand leaves a runbook with a command that fails in an incident. Each command
(tests/doc_commands.py extracts them) is checked against the real thing:
- `python -m inference_fleet ...`: parsed by the package's own argparse parser (cli._parser) without
  abbreviations; a command shown to be run as written must also give what the parser requires and not be
  refused for naming no fleet file (cli.refused_without_fleet_file);
- another module or script of the repository: its `--help` (and its subcommand's) names every flag given,
  and a value given to a flag with choices is one of them; a script without argparse must be given no flag
  (its `--help` would run it); a module must be runnable;
- `python -m pytest PATH`: each test file exists;
- `make T VAR=...`: T is a target of the Makefile, VAR one it reads; a `*_ARGS` value is checked as the
  command of T's recipe it ends in (`COMPILE_ARGS=--check` as `python -m inference_fleet compile --check`);
  a make command shown to be run sets every variable the recipe refuses to run without (`test -n "$$X"`);
- `npx cdk SUB ...`: a stack named is one of the fleet's stack name forms; SUB and every flag are in the
  pinned CLI's `--help` (node_modules, after `make setup`);
- `node SCRIPT`: the script exists.
A placeholder (`<cell>`, `NAME`, `...`) given to a flag is replaced by a value the flag takes; one in a
positional place is left out; a flag is never left out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

from inference_fleet import cli, compile_job
from inference_fleet.config import FleetConfig
from tests.doc_commands import (
    PYTHONS,
    ROOT,
    Command,
    doc_commands,
    is_placeholder,
    is_repository_module,
    module_file,
    script_file,
    words_of,
)

MAKEFILE = ROOT / "Makefile"
CDK = ROOT / "node_modules" / ".bin" / "cdk"
KINDS = ("make", "cdk", "node", "fleet", "pytest", "program")


@pytest.fixture(scope="module")
def commands() -> list[Command]:
    return doc_commands()


def _kind(words: tuple[str, ...]) -> str:
    if words[0] in ("make", "node"):
        return words[0]
    if words[0] in ("npx", "cdk"):
        return "cdk"
    if words[0] in PYTHONS and words[1:3] == ("-m", "inference_fleet"):
        return "fleet"
    if words[0] in PYTHONS and words[1:3] == ("-m", "pytest"):
        return "pytest"
    return "program"


def _of_kind(commands: list[Command], *kinds: str) -> list[Command]:
    return [c for c in commands if _kind(c.words) in kinds]


def _check(command: Command) -> list[str]:
    return {"make": _make_problems, "cdk": _cdk_problems, "node": _node_problems, "fleet": _fleet_problems,
            "pytest": _pytest_problems, "program": _program_problems}[_kind(command.words)](command)


def _problems(commands: list[Command]) -> list[str]:
    return [f"{c.where()}: {p}" for c in commands for p in _check(c)]


def _shown(path: str | Path) -> str:
    return str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else str(path)


def test_the_docs_name_commands_of_every_kind(commands: list[Command]) -> None:
    """The extraction finds the runbooks' commands (a broken extractor would pass every check below)."""
    counts = {kind: len(_of_kind(commands, kind)) for kind in KINDS}
    assert all(counts.values()) and counts["fleet"] >= 30 and counts["make"] >= 30, counts
    undo = [c for c in _of_kind(commands, "fleet") if c.page == "docs/router.md" and c.words[-1] == "--undo"]
    assert undo and not undo[0].complete, "`... [--undo]` in running text is read as --undo, named in passing"


# -- python -m inference_fleet: its own parser ----------------------------------------------------------


class _Refused(Exception):
    pass


class _Exited(Exception):
    pass


def _refuse(message: str) -> None:
    raise _Refused(message)


def _exit(status: int = 0, message: str | None = None) -> None:
    raise _Exited(status)


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def _strict_parser(complete: bool) -> argparse.ArgumentParser:
    """The CLI's parser raising instead of exiting, without abbreviations (a flag renamed to a longer name
    would still take the old one as its prefix); for a command named in passing, nothing is required."""
    parser = cli._parser()
    for each in _all_parsers(parser):
        each.allow_abbrev = False
        each.error = _refuse  # type: ignore[method-assign]
        each.exit = _exit  # type: ignore[method-assign]
        for action in each._actions if not complete else ():
            action.required = False
        for group in each._mutually_exclusive_groups if not complete else ():
            group.required = False
    return parser


def _dummy(action: argparse.Action) -> str:
    """A value the flag takes, for a placeholder given to it: a choice, its default, or a count, a length
    (a sequence length has bounds) or a name its type accepts."""
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type is None:
        return "x"
    defaults = [str(action.default)] if action.default not in (None, False, True) else []
    for candidate in (*defaults, "1", "1024", "x"):
        try:
            if callable(action.type):
                action.type(candidate)
            return candidate
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            continue
    return "x"


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    return next((a.choices.get(name) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _takes_value(action: argparse.Action | None) -> bool:
    return action is not None and action.nargs != 0


def _with_values(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The arguments with each placeholder given to a flag replaced by a value it takes; others left out."""
    argv: list[str] = []
    current = parser
    for word in words:
        name, equals, value = word.partition("=")
        if word.startswith("--") and equals and is_placeholder(value):
            action = current._option_string_actions.get(name)
            argv.append(f"{name}={_dummy(action)}" if action else word)
        elif not is_placeholder(word):
            argv.append(word)
            current = (_subparser(current, word) or current) if current is parser else current
        elif argv and argv[-1].startswith("-") and _takes_value(action := current._option_string_actions.get(argv[-1])):
            argv.append(_dummy(action))
    # A flag named last without its value (`plan --config` in running text) is given one.
    last = current._option_string_actions.get(argv[-1]) if argv and argv[-1].startswith("-") else None
    return [*argv, _dummy(last)] if last is not None and last.nargs is None and _takes_value(last) else argv


def _fleet_problems(command: Command) -> list[str]:
    # `.venv/bin/python -m inference_fleet` alone names the program; it is not a command to run as it is.
    parser = _strict_parser(command.complete and len(command.words) > 3)
    argv = _with_values(list(command.words[3:]), parser)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(argv)
    except _Refused as refusal:
        return [f"`python -m inference_fleet` refuses {argv}: {refusal}"]
    except _Exited:  # --help or --version: accepted
        return []
    if command.complete and len(command.words) > 3 and cli.refused_without_fleet_file(argv):
        return [f"`python -m inference_fleet` refuses {argv}: it names no fleet file (--config)"]
    return []


def test_inference_fleet_commands_are_accepted_by_its_parser(commands: list[Command]) -> None:
    problems = _problems(_of_kind(commands, "fleet"))
    assert not problems, "\n".join(problems)


# -- the repository's other modules and scripts: their --help --------------------------------------------


def _program(words: tuple[str, ...]) -> tuple[list[str], Path | None, list[str]] | None:
    """(argv that runs it, its file or None if missing, its arguments), or None for a program not the
    repository's (`python3 -m venv`, `python -c`)."""
    if words[0] in PYTHONS:
        if words[1:2] == ("-m",):
            module = words[2]
            return ([sys.executable, "-m", module], module_file(module), list(words[3:])) \
                if is_repository_module(module) else None
        if len(words) < 2 or words[1].startswith("-"):
            return None
        return _script(words[1], words[2:])
    if words[0].endswith(".py"):
        return _script(words[0], words[1:])
    return [sys.executable, "-m", words[0]], module_file(words[0]), list(words[1:])


def _script(word: str, arguments: tuple[str, ...]) -> tuple[list[str], Path | None, list[str]]:
    file = script_file(word)
    return [sys.executable, str(file or word)], file, list(arguments)


def _flags(arguments: list[str] | tuple[str, ...]) -> list[str]:
    return [w.split("=")[0] for w in arguments if re.match(r"--?[A-Za-z]", w)]


@cache
def _help(argv: tuple[str, ...]) -> str:
    done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true"})
    shown = " ".join(_shown(a) for a in argv[1:])
    assert done.returncode == 0, f"`python {shown} --help` failed ({done.returncode}): {done.stderr[-600:]}"
    return done.stdout


def _runnable(file: Path) -> bool:
    """Whether `python -m` runs the module as a program: a package's __main__, or a module with the guard."""
    return file.name == "__main__.py" or 'if __name__ == "__main__"' in file.read_text()


def _has_parser(file: Path) -> bool:
    files = file.parent.glob("*.py") if file.name == "__main__.py" else [file]
    return any("argparse" in f.read_text() for f in files)


def _program_problems(command: Command) -> list[str]:
    found = _program(command.words)
    if found is None:
        return []
    argv, file, arguments = found
    if file is None:
        return [f"no such module or script in the repository: {argv[-1]}"]
    if argv[1] == "-m" and not _runnable(file):
        return [f"{_shown(file)} does nothing when run (no __main__)"]
    if not arguments:
        return []
    if not _has_parser(file):  # it reads sys.argv itself (measure_blame.py <checkout>): positional words only
        flags = _flags(arguments)
        return [f"{_shown(file)} reads no options (no argparse), yet is given {flags}"] if flags else []
    return _help_problems(tuple(argv), arguments)


def _help_problems(argv: tuple[str, ...], arguments: list[str]) -> list[str]:
    text = _help(argv)
    choices = re.search(r"^usage:[^{]*?\{([\w,-]+)\}", text, re.MULTILINE)
    if choices and arguments and not arguments[0].startswith("-") and not is_placeholder(arguments[0]):
        if arguments[0] not in choices.group(1).split(","):
            return [f"no subcommand {arguments[0]!r}; allowed: {choices.group(1)}"]
        argv, arguments = (*argv, arguments[0]), arguments[1:]
        text = _help(argv)
    program = " ".join(_shown(a) for a in argv[1:])
    return [f"`{program}`: {problem}" for problem in _option_problems(text, arguments)]


def _option_problems(text: str, arguments: list[str]) -> Iterator[str]:
    """Each flag given must be in the help; a value given to a flag with choices (`--x {a,b}`) one of them."""
    # Only the usage and the option rows: a flag named in a description or epilog is no option.
    usage = text.split("\n\n")[0]
    text = "\n".join([usage, *re.findall(r"^ {2,}-.*$", text, re.MULTILINE)])
    for i, word in enumerate(arguments):
        if not re.match(r"--?[A-Za-z]", word):
            continue
        flag, _, value = word.partition("=")
        if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is None:
            yield f"no option {flag} (not in its --help)"
            continue
        value = value or (arguments[i + 1] if i + 1 < len(arguments) else "")
        allowed = re.search(rf"(?<![\w-]){re.escape(flag)} \{{([^}}]+)\}}", text)
        if allowed and value and not is_placeholder(value) and value not in allowed.group(1).split(","):
            yield f"{flag} {value}: not one of {{{allowed.group(1)}}}"


def _warm_help(commands: list[Command]) -> None:
    """Run the --help of every program the docs give arguments to at once (each one is a Python start)."""
    argvs = {tuple(found[0]) for c in commands if (found := _program(c.words)) and found[1] and found[2]
             and _has_parser(found[1])}
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(_help, argvs))


def test_repository_programs_accept_the_options_the_docs_give(commands: list[Command]) -> None:
    programs = _of_kind(commands, "program")
    _warm_help(programs)
    problems = _problems(programs)
    assert not problems, "\n".join(problems)


def _pytest_problems(command: Command) -> list[str]:
    words = command.words[3:]
    paths = [w.split("::")[0] for w in words if w.endswith(".py") or "::" in w]
    missing = [f"no test file {p}" for p in paths if not (ROOT / p).is_file()]
    if missing or "-k" not in words[:-1]:
        return missing
    # Each name that -k asks for (not after `not`) is part of a test's name in those files: a renamed test
    # would leave the command selecting nothing.
    expression = words[words.index("-k") + 1]
    wanted = re.findall(r"(?<!not )\b(?!(?:and|or|not)\b)(\w+)", expression)
    names = " ".join(re.findall(r"(?:def|class) (\w+)", "\n".join((ROOT / p).read_text() for p in paths))).lower()
    return [f"-k {expression}: no test of {', '.join(paths)} is named with {w!r}" for w in wanted
            if w.lower() not in names]


def _node_problems(command: Command) -> list[str]:
    script = command.words[1] if len(command.words) > 1 else ""
    return [] if not script or (ROOT / script).is_file() else [f"no script {script}"]


def test_pytest_and_node_commands_name_files_that_exist(commands: list[Command]) -> None:
    problems = _problems(_of_kind(commands, "pytest", "node"))
    assert not problems, "\n".join(problems)


# -- make: targets, variables, and the options an *_ARGS variable passes on -------------------------------

# `make` commands of other projects that the docs show: not this Makefile's.
NOT_OURS = {
    r"make (-j\d+ )?TARGET=linux-glibc .*": "HAProxy's own build from source (proxy.md)",
}


@cache
def _makefile() -> tuple[dict[str, list[str]], set[str], dict[str, list[str]]]:
    """The Makefile's targets with their prerequisites, the variables it reads, and each target's recipe lines
    (continuations joined)."""
    text = MAKEFILE.read_text()
    targets = {target: prerequisites.split("##")[0].split() for target, prerequisites in
               re.findall(r"^([\w.-]+):(?!=)(.*)$", text, re.MULTILINE)}
    read = re.findall(r"\$\((\w+)\)|\$\$\{?(\w+)|^(\w+) *[?:]?=", text, re.MULTILINE)
    variables = {name for names in read for name in names if name}
    variables |= {v for line in re.findall(r"^export ([\w ]+)$", text, re.MULTILINE) for v in line.split()}
    recipes = {target: [line.strip() for line in body.splitlines()] for target, body in
               re.findall(r"^([\w.-]+):(?!=).*\n((?:\t.*\n)*)", text.replace("\\\n", " "), re.MULTILINE)}
    return targets, variables, recipes


def _recipe_line(target: str, variable: str) -> str | None:
    """The recipe line that reads `$(variable)`: the target's, or a prerequisite's (`make bench BENCH_ARGS=...`
    runs bench-proxy with it: a variable set on make's command line holds for every target)."""
    targets, _, recipes = _makefile()
    line = next((r for r in recipes.get(target, []) if f"$({variable})" in r), None)
    for prerequisite in targets.get(target, []) if line is None else ():
        line = line or _recipe_line(prerequisite, variable)
    return line


def _recipe_command(command: Command, target: str, variable: str, value: str) -> Command | None:
    """The command of the target's recipe that `$(variable)` ends up in, with the value in its place."""
    line = _recipe_line(target, variable)
    if line is None:
        return None
    line = re.sub(r"\$\$\{[^}]*\}", "", line.replace("$(WITH_AWS)", "").replace("$(BIN)/", ".venv/bin/"))
    return Command(command.page, command.line, tuple(words_of(line.replace(f"$({variable})", value))),
                   via=" ".join(command.words))


def _make_targets(words: tuple[str, ...]) -> list[str]:
    return [w for w in words[1:] if not w.startswith("-") and "=" not in w]


def _make_recipes(command: Command) -> list[tuple[str, Command | None]]:
    """Each *_ARGS variable set and the recipe command it reaches (None: the target ignores it)."""
    assignments = [w.partition("=") for w in command.words[1:] if re.match(r"\w+_ARGS=", w)]
    return [(f"{name} of `make {target}`", _recipe_command(command, target, name, value))
            for name, _, value in assignments for target in _make_targets(command.words)]


def _make_problems(command: Command) -> list[str]:
    if any(re.fullmatch(pattern, " ".join(command.words)) for pattern in NOT_OURS):
        return []
    targets, variables, recipes = _makefile()
    problems = [f"no make target {t!r}" for t in _make_targets(command.words) if t not in targets]
    given = [w.split("=")[0] for w in command.words[1:] if "=" in w and not w.startswith("-")]
    problems += [f"the Makefile reads no variable {name}" for name in given if name not in variables]
    for target in _make_targets(command.words) if command.complete else ():
        needed = re.findall(r'test -n "\$\$(\w+)"', " ".join(recipes.get(target, [])))
        problems += [f"`make {target}` refuses to run without {name}=" for name in needed if name not in given]
    for name, recipe in _make_recipes(command):
        problems += [f"{name}: {p}" for p in (_check(recipe) if recipe else ["the recipe ignores it"])]
    return problems


def test_make_commands_name_targets_and_variables_the_makefile_has(commands: list[Command]) -> None:
    makes = _of_kind(commands, "make")
    _warm_help([recipe for m in makes for _, recipe in _make_recipes(m) if recipe])
    problems = _problems(makes)
    assert not problems, "\n".join(problems)


def test_an_args_variable_is_checked_as_the_command_its_recipe_runs() -> None:
    """COMPILE_ARGS=--check is checked as `python -m inference_fleet compile --check`, not as nothing."""
    command = Command("x.md", 1, ("make", "compile", "CONFIG=f.yaml", "COMPILE_ARGS=--check --no-such-flag"))
    [(_, recipe)] = _make_recipes(command)
    assert recipe is not None and recipe.words == (
        ".venv/bin/python", "-m", "inference_fleet", "compile", "--check", "--no-such-flag")
    assert _make_problems(command) == ["COMPILE_ARGS of `make compile`: `python -m inference_fleet` refuses "
                                       "['compile', '--check', '--no-such-flag']: unrecognized arguments: "
                                       "--no-such-flag"]


# -- npx cdk: the stacks named and the pinned CLI's commands and options -----------------------------------


def _stack_forms() -> dict[str, re.Pattern[str]]:
    """The fleet's stack names (config.py, compile_job.py), shown and as patterns: any fleet, cell, region."""
    fleet = SimpleNamespace(name="<Fleet>")
    names = [FleetConfig.cell_stack_name(fleet, SimpleNamespace(name="<name>")),  # type: ignore[arg-type]
             FleetConfig.router_stack_name(fleet, SimpleNamespace(region="<region>")),  # type: ignore[arg-type]
             FleetConfig.pipeline_stack_name.fget(fleet), compile_job.stack_name(fleet)]  # type: ignore[arg-type]
    return {n: re.compile(re.escape(n).replace("<Fleet>", r"[^\s-]+").replace("<name>", r"\S+")
                          .replace("<region>", r"\S+")) for n in names}


def _cdk_words(command: Command) -> list[str]:
    return list(command.words[1:] if command.words[0] == "npx" else command.words)


def _stack_problems(command: Command) -> list[str]:
    words = _cdk_words(command)
    if len(words) < 2 or words[1] not in ("deploy", "destroy", "diff", "synth"):
        return []
    rest = words[2:]
    # A stack is a word that is neither a flag nor a flag's value (`-c config=fleet.yaml`).
    stacks = [w for i, w in enumerate(rest) if not w.startswith("-") and not (i and rest[i - 1].startswith("-"))]
    forms = _stack_forms()
    return [f"{stack} is none of the fleet's stack names ({', '.join(forms)})"
            for stack in stacks if not any(form.fullmatch(stack) for form in forms.values())]


@cache
def _cdk_help(sub: str) -> str:
    done = subprocess.run([str(CDK), *([sub] if sub else []), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"cdk {sub} --help: {done.stderr[-600:]}"
    return done.stdout


def _cdk_commands() -> list[str]:
    return re.findall(r"^  cdk ([\w-]+)", _cdk_help(""), re.MULTILINE)


def _cdk_problems(command: Command) -> list[str]:
    words = _cdk_words(command)
    if len(words) < 2 or not CDK.exists():
        return _stack_problems(command)
    sub = words[1]
    if sub not in _cdk_commands():
        return [f"the pinned CLI has no command {sub!r}"]
    accepted = {o for pair in re.findall(r"^  (-[\w-]+)(?:, (-[\w-]+))?", _cdk_help(sub), re.MULTILINE)
                for o in pair if o}
    return _stack_problems(command) + [  # yargs takes --no-X for a boolean --X
        f"`cdk {sub}` has no option {flag} (not in its --help)" for flag in _flags(words[2:])
        if flag not in accepted and "--" + flag.removeprefix("--no-") not in accepted]


def test_cdk_commands_name_the_fleets_stacks(commands: list[Command]) -> None:
    problems = [f"{c.where()}: {p}" for c in _of_kind(commands, "cdk") for p in _stack_problems(c)]
    assert not problems, "\n".join(problems)


def test_cdk_commands_are_the_pinned_clis(commands: list[Command]) -> None:
    if not CDK.exists():
        pytest.skip("no pinned CDK CLI (node_modules): `make setup` installs it")
    cdks = _of_kind(commands, "cdk")
    subs = {words[1] for c in cdks if len(words := _cdk_words(c)) > 1}
    with ThreadPoolExecutor(max_workers=4) as pool:  # each --help is a Node start
        list(pool.map(_cdk_help, subs & set(_cdk_commands())))
    problems = _problems(cdks)
    assert not problems, "\n".join(problems)
