"""The README and docs/ stay true and reachable.

The fleet reference in docs/fleet-reference.md is the one generated from the config models;
the README stays short, shows the two commands and links every page of docs/; every
relative link of the README and docs/ points at a file (and heading) that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

from inference_fleet.reference import BEGIN, END, markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FLEET_REFERENCE = DOCS / "fleet-reference.md"
README_MAX_LINES = 250

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_fleet_reference_matches_the_models() -> None:
    text = FLEET_REFERENCE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == markdown(), (
        "run `python -m inference_fleet reference` and paste it into docs/fleet-reference.md"
    )


def test_readme_shows_the_two_commands() -> None:
    text = README.read_text()
    assert "make synth" in text and "make test" in text


def test_readme_is_short_and_links_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {target for target in _LINK.findall(text)}
    missing = [f"docs/{page.name}" for page in sorted(DOCS.glob("*.md")) if f"docs/{page.name}" not in linked]
    assert not missing, f"README does not link {missing}"


def _anchor(heading: str) -> str:
    # GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto: ...
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
