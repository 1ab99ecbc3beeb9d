"""The command lines of the docs (docs/*.md and the READMEs), as shell words, with where each is written.

A command is any code span or fenced-block line that starts (after `$ `, `time`, `nice`, `taskset -c N`
and VAR=value prefixes) with a Python interpreter, `make`, `npx cdk`/`cdk`, `node`, or a script or module of
the repository followed by arguments. Fenced lines ending in a backslash are joined with the next; comments are
dropped. Optional brackets are taken off (`[--undo]` is `--undo`); a placeholder (`<fleet file>`, `NAME`,
`...`, `unit|raw|FILE`) stays one word for the checks to recognise (is_placeholder).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
# Where `python -m X` finds the repository's modules: the root and the packages `make setup` installs (Makefile
# CONTAINER_PACKAGES), and the Lambda folders pytest puts on the path (pyproject.toml).
MODULE_ROOTS = (ROOT, ROOT / "containers/inference", ROOT / "containers/inference/executor", ROOT / "containers/proxy",
                ROOT / "functions/placement", ROOT / "functions/autoscaler")
_FENCE = re.compile(r"^ *```[^\n]*\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")
_SEPARATOR = re.compile(r"\s+(?:&&|\|\||\|)\s+|;\s+")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
_PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|…|[A-Z][A-Z0-9_-]*")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    words: tuple[str, ...]
    # Shown to be run as written (a fenced line, or a span of `.venv/bin/python ...`), not named in passing
    # (`evacuate --wait`): it must also give every argument the program requires.
    complete: bool = False
    via: str = ""  # the make command this one is the recipe of, if any
    written: str = ""  # as the page writes it, to find it there

    def where(self) -> str:
        command = f"`{self.written or ' '.join(self.words)}`"
        shown = f"`{self.via}` (its recipe: `{' '.join(self.words)}`)" if self.via else command
        return f"{self.page}:{self.line}: {shown}"


def is_placeholder(word: str) -> bool:
    """A word that stands for a value the reader supplies: `<cell>`, `NAME`, `...`, `unit|raw|FILE`."""
    return bool(_PLACEHOLDER.fullmatch(word)) or ("|" in word and not word.startswith("-"))


def words_of(text: str) -> list[str]:
    """Shell words of one command line; a `<placeholder with spaces>` stays one word, brackets come off."""
    text = re.sub(r"<([^<>\n]*)>", lambda m: "<" + "_".join(m.group(1).split()) + ">", text)
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose: the words as they are
        words = text.split()
    return [w.lstrip("[").rstrip("]") for w in words if w.strip("[]")]


def _without_prefixes(words: list[str]) -> list[str]:
    """The command after a prompt, `time`, `nice [-n N]`, `taskset -c N`, `env` and VAR=value prefixes."""
    while words:
        if words[0] in ("$", "time", "env", "sudo") or _ASSIGNMENT.fullmatch(words[0]):
            words = words[1:]
        elif words[0] == "nice":
            words = words[3:] if words[1:2] == ["-n"] else words[2:] if words[1:2] and words[1].startswith("-") \
                else words[1:]
        elif words[0] == "taskset":
            words = words[3:]
        else:
            return words
    return words


def module_file(module: str) -> Path | None:
    """The file `python -m module` runs, when the module is the repository's."""
    parts = module.split(".")
    for root in MODULE_ROOTS:
        base = root.joinpath(*parts)
        if (base / "__main__.py").is_file():
            return base / "__main__.py"
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
    return None


def is_repository_module(module: str) -> bool:
    """Whether the module's top package or module is one of the repository's (not venv, pip, pytest)."""
    top = module.split(".")[0]
    return any((root / top).is_dir() or (root / f"{top}.py").is_file() for root in MODULE_ROOTS)


def script_file(word: str) -> Path | None:
    """The repository's script a word names: a path from the root, or a file name found once in the tree."""
    if not word.endswith(".py"):
        return None
    if (ROOT / word).is_file():
        return ROOT / word
    found = [p for top in ("bench", "containers", "e2e", "functions", "inference_fleet", "tools", "tests")
             for p in (ROOT / top).rglob(Path(word).name)]
    return found[0] if len(found) == 1 and "/" not in word else None


def fleet_commands() -> set[str]:
    """The subcommands of `python -m inference_fleet`, from its parser."""
    from inference_fleet.cli import _parser

    return {name for action in _parser()._subparsers._group_actions for name in action.choices}


def _is_command(words: list[str]) -> bool:
    first = words[0]
    if first in PYTHONS or first in ("make", "cdk", "node") or words[:2] == ["npx", "cdk"]:
        return True
    # A bare script or module with arguments (`bench_placement.py --trials 5`, `bench.x --config unit`).
    return len(words) > 1 and (script_file(first) is not None or ("." in first and module_file(first) is not None))


def _fenced_lines(text: str) -> list[tuple[int, str]]:
    """Each command line of the fenced blocks, continuations joined, with its first line's number."""
    lines: list[tuple[int, str]] = []
    for block in _FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        pending: tuple[int, str] | None = None
        for offset, line in enumerate(block.group(1).splitlines()):
            start, so_far = pending if pending else (first + offset, "")
            joined = so_far + " " + line.strip()
            pending = (start, joined[:-1]) if joined.endswith("\\") else None
            if pending is None:
                lines.append((start, joined.strip()))
    return lines


def without_fences(text: str) -> str:
    """A page with its fenced blocks blanked, its line numbers kept."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _spans(text: str) -> list[tuple[int, str]]:
    """Each code span outside the fenced blocks, joined onto one line, with its line number."""
    prose = without_fences(text)
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in SPAN.finditer(prose)]


def _shorthand(words: list[str], subcommands: set[str]) -> list[str]:
    """`compile --submit` or `inference_fleet evacuate` in running text is `python -m inference_fleet ...`."""
    if len(words) > 1 and words[0] in subcommands and words[1].startswith("--"):
        return ["python", "-m", "inference_fleet", *words]
    return ["python", "-m", *words] if len(words) > 1 and words[0] == "inference_fleet" else words


def page_commands(page: Path, subcommands: set[str]) -> list[Command]:
    text = page.read_text()
    commands = []
    for line, source, fenced in sorted([(n, s, True) for n, s in _fenced_lines(text)]
                                       + [(n, s, False) for n, s in _spans(text)]):
        for part in _SEPARATOR.split(source):  # `a && b`, `a | b`, `a; b`: each its own command
            words = _shorthand(_without_prefixes(words_of(part)), subcommands)
            if words and _is_command(words):
                complete = fenced or words[0].startswith(".venv/")
                commands.append(Command(str(page.relative_to(ROOT)), line, tuple(words), complete,
                                        written=" ".join(part.split())))
    return commands


def doc_commands() -> list[Command]:
    subcommands = fleet_commands()
    return [c for page in pages() for c in page_commands(page, subcommands)]


def pages() -> list[Path]:
    """The operator docs and the READMEs (the repository's, and each container's and the e2e's)."""
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md", *sorted(ROOT.glob("containers/*/README.md")),
            ROOT / "e2e" / "README.md"]
