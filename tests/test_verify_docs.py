"""The acceptance kit's docs stay true: its claims point at what the docs say, and
docs/verifying.md lists every unverified statement of the README and docs/ with what settles it.

Each claim names a page, a heading anchor of it (GitHub's ids) and words the page holds;
each row of the table in docs/verifying.md quotes words of the file it names; and every
page with such a statement ("unverified", "only on paper", ...) has rows in the table.
"""

from __future__ import annotations

import re
from pathlib import Path

from inference_fleet.verify.claims import CLAIMS

ROOT = Path(__file__).resolve().parents[1]
VERIFYING = ROOT / "docs" / "verifying.md"
UNVERIFIED = re.compile(r"unverified|only on paper|not verified|nothing here has run|not measured on", re.IGNORECASE)
_ROW = re.compile(r"^\| (README\.md|docs/[\w.-]+\.md) \| \"([^\"]+)\"", re.MULTILINE)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _anchors(page: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^#{1,6} ", line):
            heading = line.lstrip("#").replace("`", "").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return anchors


def test_every_claim_names_a_heading_and_words_of_its_page() -> None:
    for claim in CLAIMS:
        path, anchor = claim.doc.split("#")
        page = ROOT / path
        assert page.is_file(), claim
        assert anchor in _anchors(page), f"{claim.check_id}: no heading #{anchor} in {path}"
        assert _flat(claim.sentence) in _flat(page.read_text()), f"{claim.check_id}: {claim.sentence!r} not in {path}"


def test_every_row_of_the_table_quotes_its_file() -> None:
    rows = _ROW.findall(VERIFYING.read_text())
    assert len(rows) >= 40
    for where, quoted in rows:
        text = _flat((ROOT / where).read_text())
        assert _flat(quoted) in text, f"docs/verifying.md quotes {quoted!r}, which {where} does not say"


def test_every_page_with_an_unverified_statement_is_in_the_table() -> None:
    listed = {where for where, _ in _ROW.findall(VERIFYING.read_text())}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    having = {str(p.relative_to(ROOT)) for p in pages if p != VERIFYING and UNVERIFIED.search(p.read_text())}
    missing = sorted(having - listed)
    assert not missing, f"pages with unverified statements missing from docs/verifying.md: {missing}"
