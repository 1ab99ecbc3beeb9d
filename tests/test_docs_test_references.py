"""Every test the docs (docs/*.md, the READMEs) cite as evidence exists, read from the test files, never run.

A renamed or deleted test leaves a page claiming evidence that is no longer there. The references, in code
spans (tests/doc_commands.py's pages and span syntax) or, for a path, in running text:
- `tests/test_x.py::test_y`: a path from the repository's root (or from a README's own folder);
- `test_x.py::test_y`: the one test file of that name under pyproject's testpaths;
- `test_x.py::test_y[case]`: the same (the case id is not checked);
- `::test_y`: the file named last before it on the page;
- a bare `test_y`: in the file named last before it in its paragraph (a list item, a table row), or, with
  none named there, in some test file of the repository;
- `tests/test_x.py` or `test_x.py` alone: the file exists.
A file name that two test folders hold (test_handler.py) is the one whose folder (functions/placement) the
paragraph names; else every such file must agree on the test (all have it), or the page must give the path.
A test is a function named test* at a test file's top level or in its classes, found with `ast`.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.doc_commands import ROOT, SPAN, pages, without_fences

TEST_DIRS: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
    "testpaths"]
# Tests of other projects that the pages cite, with why they are not this repository's.
NOT_OURS = {
    "contrib/models/Llama-2-7b-hf/test/integration/test_model.py": "NxDI's own test (neuron-sources.md)",
    "test_sfn_start_execution": "LocalStack's test of its Step Functions snapshot (compiled-artifacts.md)",
}
_PATH = r"(?<![\w./-])(?:[\w.-]+/)*test_\w+\.py"
# In a span: a path or file name with an optional `::Class::test[case]`, or `::test` alone.
_REFERENCE = re.compile(rf"(?P<file>{_PATH})?(?:::(?:\w+::)?(?P<test>test_\w+)(?:\[[^\]]*\])?)?")
_BARE_TEST = re.compile(r"(?P<test>test_\w+)(?:\[[^\]]*\])?")
# A span, or a path in running text (`tests/test_bad_fleets.py` written without backticks).
_CITATION = re.compile(rf"{SPAN.pattern}|(?<![\w/`.-])(?:[\w.-]+/)+test_\w+\.py(?![\w`])")
_BLOCK_START = re.compile(r"\s*$|\s*(?:[-*+]|\d+\.)\s|#|\|")


@dataclass(frozen=True)
class Reference:
    page: str
    line: int
    written: str  # the span (or path) as the page writes it
    file: str | None  # as written: a path, a file name, or None (`::test`, a bare test)
    test: str | None
    continued: bool  # `::test`: continues the file named before it
    paragraph: str  # the text of its paragraph, list item or table row

    def where(self) -> str:
        return f"{self.page}:{self.line}: `{self.written}`"


# -- extraction -----------------------------------------------------------------------------------------


def _paragraphs(lines: list[str]) -> list[int]:
    """The paragraph number of each line: a blank line, a list item, a heading or a table row starts one."""
    numbers, number = [], 0
    for line in lines:
        number += bool(_BLOCK_START.match(line))
        numbers.append(number)
    return numbers


def _references_in(citation: str, is_span: bool) -> list[tuple[str | None, str | None, bool]]:
    """(file, test, continued) of each reference in a span or running-text path."""
    text = re.sub(r"::\s+", "::", " ".join(citation.split()))  # a span broken after `::` across lines
    if is_span and (bare := _BARE_TEST.fullmatch(text)):
        return [(None, bare["test"], False)]
    return [(m["file"], m["test"], m["test"] is not None and m["file"] is None)
            for m in _REFERENCE.finditer(text) if m["file"] or m["test"]]


def page_references(page: str, text: str) -> list[Reference]:
    """The test references of one page, in the order written (fenced blocks are commands, not citations)."""
    prose = without_fences(text)
    lines = prose.split("\n")
    numbers = _paragraphs(lines)
    texts: dict[int, str] = {}
    for line, number in zip(lines, numbers, strict=True):
        texts[number] = f"{texts.get(number, '')} {line}"
    found = []
    for citation in _CITATION.finditer(prose):
        line = prose.count("\n", 0, citation.start()) + 1
        is_span = citation.group(1) is not None
        written = " ".join((citation.group(1) if is_span else citation.group(0)).split())
        for file, test, continued in _references_in(written, is_span):
            found.append(Reference(page, line, written, file, test, continued, texts[numbers[line - 1]]))
    return found


def doc_references() -> list[Reference]:
    return [r for page in pages() for r in page_references(str(page.relative_to(ROOT)), page.read_text())]


# -- the repository's tests -------------------------------------------------------------------------------


@cache
def repository_test_files() -> tuple[Path, ...]:
    return tuple(sorted(p for folder in TEST_DIRS for p in (ROOT / folder).rglob("test_*.py")))


def _tests_in(body: list[ast.stmt]) -> Iterator[str]:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            yield node.name
        elif isinstance(node, ast.ClassDef):
            yield from _tests_in(node.body)


@cache
def names_of_tests(file: Path) -> frozenset[str]:
    """The tests pytest would collect by name from the file: its test* functions, top level or in classes."""
    return frozenset(_tests_in(ast.parse(file.read_text(), str(file)).body))


def _shown(file: Path) -> str:
    return str(file.relative_to(ROOT))


def _named_in(file: Path, paragraph: str) -> bool:
    """Whether the paragraph names the part of the test file's path that tells it from another of its name:
    its folder (functions/placement) or that folder's last word ("placement"); `tests/` for the root's."""
    folder = next(f for f in TEST_DIRS if file.is_relative_to(ROOT / f)).removesuffix("/tests")
    patterns = [r"(?<![\w/.-])tests/"] if folder == "tests" else [
        rf"(?<![\w.-]){re.escape(word)}(?![\w-])" for word in (folder, folder.split("/")[-1])]
    return any(re.search(pattern, paragraph, re.IGNORECASE) for pattern in patterns)


# -- resolution ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Files:
    """The files a written name may be; several when the name is ambiguous and the paragraph does not say."""
    candidates: tuple[Path, ...]
    problem: str = ""


def resolve(written: str, paragraph: str, page: str) -> Files:
    """The file a reference names: a path from the page's folder (a container's README) or the root, or a
    test file's name."""
    if "/" in written:
        found = [base / written for base in ((ROOT / page).parent, ROOT) if (base / written).is_file()]
        return Files(tuple(found[:1])) if found else Files((), f"no file {written}")
    named = tuple(p for p in repository_test_files() if p.name == written)
    if not named:
        return Files((), f"no test file {written} in {', '.join(TEST_DIRS)}")
    said = tuple(p for p in named if _named_in(p, paragraph))
    return Files(said if len(said) == 1 else named)


def _test_problem(test: str, files: Files) -> str:
    having = [p for p in files.candidates if test in names_of_tests(p)]
    shown = ", ".join(_shown(p) for p in files.candidates)
    if not having:
        return f"no test {test} in {shown}"
    if len(having) < len(files.candidates):
        return (f"ambiguous: the file is any of {shown}, and only {', '.join(_shown(p) for p in having)} has "
                f"{test}; write its path")
    return ""


def _anywhere_problem(test: str) -> str:
    return "" if any(test in names_of_tests(p) for p in repository_test_files()) else f"no test {test} in any test file"


def problems(references: list[Reference]) -> list[str]:
    """What is wrong with each reference, in order. `::test` continues the file named last on the page; a
    bare test, the file named last in its paragraph."""
    found: list[str] = []
    on_page: Files | None = None
    in_paragraph: tuple[str, Files | None] = ("", None)
    for ref in references:
        if in_paragraph[0] != ref.paragraph:
            in_paragraph = (ref.paragraph, None)
        if ref.file in NOT_OURS or ref.test in NOT_OURS:
            continue
        if ref.file:
            on_page = resolve(ref.file, ref.paragraph, ref.page)
            in_paragraph = (ref.paragraph, on_page)
        problem = _problem(ref, on_page if ref.file or ref.continued else in_paragraph[1])
        found += [f"{ref.where()}: {problem}"] if problem else []
    return found


def _problem(ref: Reference, files: Files | None) -> str:
    if files is not None and files.problem:
        return files.problem if ref.file else ""  # said once, where the file is named
    if ref.test is None:
        return ""
    if files is None:
        return f"`::{ref.test}` continues no file named before it on the page" if ref.continued \
            else _anywhere_problem(ref.test)
    return _test_problem(ref.test, files)


# -- the checks -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references() -> list[Reference]:
    return doc_references()


def test_the_docs_cite_tests_in_every_form(references: list[Reference]) -> None:
    """The extraction finds each form (a broken extractor would pass the check below with nothing checked)."""
    forms = {
        "path::test": [r for r in references if r.file and "/" in r.file and r.test],
        "file::test": [r for r in references if r.file and "/" not in r.file and r.test],
        "::test": [r for r in references if r.continued],
        "bare test": [r for r in references if r.file is None and not r.continued],
        "file alone": [r for r in references if r.file and r.test is None],
        "test[case]": [r for r in references if r.test and f"{r.test}[" in r.written],
    }
    counts = {form: len(found) for form, found in forms.items()}
    assert all(counts.values()) and len(references) >= 500, counts
    cited = {name for r in references for name in (r.file, r.test)}
    assert not set(NOT_OURS) - cited, f"NOT_OURS names what no page cites any more: {set(NOT_OURS) - cited}"


def test_every_test_the_docs_cite_exists(references: list[Reference]) -> None:
    found = problems(references)
    assert not found, f"{len(found)} stale test references (`git log -S <name>` finds where one went):\n" + \
        "\n".join(found)


# -- the checker itself, on pages written for it ---------------------------------------------------------


def _check(text: str) -> list[str]:
    return problems(page_references("x.md", text))


def test_a_renamed_test_is_named_with_its_page_and_line() -> None:
    text = ("Intro.\n\nEvidence: `tests/test_docs_test_references.py::test_every_test_the_docs_cite_exists`,\n"
            "`::test_no_longer_here[case]`, `test_docs_commands.py::test_the_docs_name_commands_of_every_kind`.\n")
    assert _check(text) == ["x.md:4: `::test_no_longer_here[case]`: no test test_no_longer_here in "
                            "tests/test_docs_test_references.py"]


def test_a_bare_test_is_looked_for_in_the_file_named_before_it_in_its_paragraph() -> None:
    text = ("- `test_docs_commands.py`: `test_the_docs_name_commands_of_every_kind`,\n"
            "  `test_every_test_the_docs_cite_exists`\n"
            "- no file named: `test_every_test_the_docs_cite_exists`, `test_nowhere_at_all`\n")
    assert _check(text) == [
        "x.md:2: `test_every_test_the_docs_cite_exists`: no test test_every_test_the_docs_cite_exists in "
        "tests/test_docs_commands.py",
        "x.md:3: `test_nowhere_at_all`: no test test_nowhere_at_all in any test file"]


def test_an_ambiguous_file_name_is_the_one_the_paragraph_names_else_all_must_agree() -> None:
    placement_only = "test_a_spare_whose_new_spare_task_is_fetching_again_is_not_taken_for_cached"
    assert placement_only not in names_of_tests(ROOT / "functions/autoscaler/tests/test_handler.py")
    said = f"In functions/placement: `test_handler.py::{placement_only}`.\n"
    unsaid = f"Spares: `test_handler.py::{placement_only}`, `test_missing.py`, `::test_x`, `tests/test_gone.py`.\n"
    assert _check(said) == []
    assert _check(unsaid) == [
        f"x.md:1: `test_handler.py::{placement_only}`: ambiguous: the file is any of "
        "functions/autoscaler/tests/test_handler.py, functions/placement/tests/test_handler.py, and only "
        f"functions/placement/tests/test_handler.py has {placement_only}; write its path",
        f"x.md:1: `test_missing.py`: no test file test_missing.py in {', '.join(TEST_DIRS)}",
        "x.md:1: `tests/test_gone.py`: no file tests/test_gone.py"]


def test_a_continuation_needs_a_file_before_it_and_tests_in_classes_count() -> None:
    assert _check("Text `::test_x` here.\n") == ["x.md:1: `::test_x`: `::test_x` continues no file named before "
                                                  "it on the page"]
    assert names_of_tests(ROOT / "tests/test_docs_test_references.py") >= {"test_every_test_the_docs_cite_exists"}
    assert "test_inside" in frozenset(_tests_in(ast.parse("class TestA:\n    def test_inside(self): ...\n").body))
