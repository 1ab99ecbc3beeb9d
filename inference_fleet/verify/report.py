"""The kit's report: one result per check, printed as a table, written as JSON and Markdown.

The JSON schema is documented in docs/contracts.md ("Acceptance kit report"); `SCHEMA` names
its version. Markdown goes beside the JSON, same stem, `.md`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from inference_fleet.verify.claims import BY_ID

SCHEMA = "inference-fleet/verify-report/v1"
MARKDOWN_TITLE = "# Acceptance kit:"
Status = Literal["pass", "fail", "not_run"]
STATUSES = ("pass", "fail", "not_run")


@dataclass
class Measured:
    """The figure a check measured: a number (or text) and its unit."""

    value: float | int | str | None
    unit: str


@dataclass
class CheckResult:
    check_id: str
    status: Status
    measured: Measured
    detail: str
    # Further figures (name -> value), e.g. the parts of a formation time.
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # how long the check took

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: allowed {STATUSES}")
        if self.check_id not in BY_ID:
            raise ValueError(f"unknown check id {self.check_id!r}")

    def to_json(self) -> dict[str, Any]:
        claim = BY_ID[self.check_id]
        value = self.measured.value
        return {
            "id": self.check_id, "title": claim.title, "status": self.status,
            "measured": {"value": round(value, 3) if isinstance(value, float) else value, "unit": self.measured.unit},
            "detail": self.detail, "figures": self.figures, "claim": {"doc": claim.doc, "sentence": claim.sentence},
            "seconds": round(self.seconds, 2),
        }


def not_run(check_id: str, why: str, unit: str = "") -> CheckResult:
    return CheckResult(check_id, "not_run", Measured(None, unit), why)


@dataclass
class Report:
    cell: str
    adapter: str  # "aws" or "local"
    destructive: bool
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    checks: list[CheckResult] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)  # what the kit ran against (endpoint, stack, units)
    # The units the checks judged and why ({"units", "because", "not_judged", "deactivated", "reactivated"}:
    # judged.Judged; an elastic cell's are read from it, and those a check left out during the run: judged.excuse).
    judged: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No check failed (a check not run does not fail the report; the table says why it did not run)."""
        return not any(c.status == "fail" for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for c in self.checks if c.status == s) for s in STATUSES}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "cell": self.cell, "adapter": self.adapter, "destructive": self.destructive,
            "started_at": self.started_at, "finished_at": self.finished_at, "passed": self.passed,
            "counts": self.counts(), "target": self.target, "judged": self.judged,
            "checks": [c.to_json() for c in self.checks],
        }

    def table(self) -> str:
        """The plain-text table printed at the end of a run."""
        rows = [("check", "status", "measured", "detail")]
        for c in self.checks:
            rows.append((c.check_id, c.status.upper() if c.status == "fail" else c.status,
                         _figure(c.measured), _one_line(c.detail, 90)))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]), r[3]]).rstrip()
                 for r in rows]
        counts = self.counts()
        lines.append(f"{self.cell} ({self.adapter}): {counts['pass']} passed, {counts['fail']} failed, "
                     f"{counts['not_run']} not run")
        if self.judged:
            lines.append(self._judged_line())
        return "\n".join(lines)

    def _judged_line(self) -> str:
        line = f"units judged: {', '.join(self.judged.get('units') or []) or 'none'} ({self.judged.get('because')})"
        for key, words in (("deactivated", "deactivated during the run"),
                           ("reactivated", "deactivated and activated again during the run")):
            if self.judged.get(key):
                line += f"; {words}, not judged: {', '.join(self.judged[key])}"
        return line

    def markdown(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [f"{MARKDOWN_TITLE} cell {self.cell} ({self.adapter}{', destructive' if self.destructive else ''}): "
                 f"{verdict}", ""]
        if self.judged:
            lines += [self._judged_line(), ""]
        lines += ["| check | status | measured | detail | settles |", "|---|---|---|---|---|"]
        for c in self.checks:
            claim = BY_ID[c.check_id]
            lines.append(f"| {c.check_id}: {claim.title} | {c.status} | {_figure(c.measured)} | "
                         f"{_one_line(c.detail, 400).replace('|', '/')} | [{claim.doc}]({claim.doc}) |")
        figures = [(c.check_id, k, v) for c in self.checks for k, v in c.figures.items()]
        if figures:
            lines += ["", "| check | figure | value |", "|---|---|---|"]
            lines += [f"| {cid} | {k} | {str(v).replace('|', '/')} |" for cid, k, v in figures]
        return "\n".join(lines) + "\n"

    def json_text(self) -> str:
        """The JSON report as written to its file (or through a stream: verify/cli.py)."""
        return json.dumps(self.to_json(), indent=2, default=str) + "\n"

    def write(self, path: Path) -> tuple[Path, Path]:
        """The JSON at `path` and the Markdown beside it (same stem, .md); returns both paths.

        Only a previous report is replaced: when `path` or its .md holds anything else (`--report fleet.yaml`),
        both are kept and the report goes beside them, to <stem>.verify-report.json and .md (said on stderr), so
        that a run of many minutes is neither lost nor written over the user's file.
        """
        target = report_path(path)
        if target != path:
            print(f"warning: --report {path}: {path} or {path.with_suffix('.md')} is no report of this kit and is "
                  f"kept; the report is written to {target} instead", file=sys.stderr)
            path = target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.json_text())
        markdown = path.with_suffix(".md")
        markdown.write_text(self.markdown())
        return path, markdown


def report_path(path: Path) -> Path:
    """Where the JSON of `--report path` goes (Report.write): `path`, or <stem>.verify-report.json beside it when
    `path` holds something else; FileExistsError when that does too."""
    if _replaceable(path):
        return path
    fallback = path.with_name(f"{path.stem}.verify-report.json")
    if not _replaceable(fallback):
        raise FileExistsError(f"--report {path} and {fallback} hold files that are no report of this kit; "
                              "give another --report path")
    return fallback


def unwritable(path: Path) -> str | None:
    """Why the report of `--report path` could not be written, or None: checked before a run of many minutes (some
    destructive), which would otherwise end without its report. Makes the folder, as Report.write would. A path that
    is a device or a socket is refused: its <stem>.verify-report.json would be made beside it, in /dev (as root);
    the command's stdout and stderr, a FIFO and the null device are written through before this applies
    (verify/cli.py)."""
    try:
        if path.exists() and not (path.is_file() or path.is_dir()):
            return (f"--report {path} is a device or a socket, not a file; give a file such as verify-report.json, "
                    "/dev/stdout, or a FIFO that a process reads (/dev/null discards the report)")
        target = report_path(path)
    except FileExistsError as error:
        return str(error)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):  # the folder takes a new file
            pass
        # A report of an earlier run is written over in place: it must open for writing too (one left read-only,
        # or owned by another user, lost this run's report after the run: the cold review, helper-185).
        for existing in (target, target.with_suffix(".md")):
            if existing.exists():
                with existing.open("r+"):  # not truncated: the earlier report stays until the run writes its own
                    pass
    except OSError as error:
        return f"--report {path}: the report could not be written there: {error}"
    return None


def _replaceable(path: Path) -> bool:
    """True when the JSON `path` and its Markdown may be written: each absent or a report this kit wrote (JSON of
    its schema; Markdown with its title), and the two distinct (a `.md` path would be its own Markdown)."""
    markdown = path.with_suffix(".md")
    return markdown != path and _holds(path, lambda text: json.loads(text).get("schema") == SCHEMA) and _holds(
        markdown, lambda text: text.startswith(MARKDOWN_TITLE))


def _holds(path: Path, is_report: Callable[[str], bool]) -> bool:
    if not path.exists():
        return True
    try:
        return path.is_file() and is_report(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def _figure(m: Measured) -> str:
    if m.value is None:
        return "-"
    value = f"{m.value:.2f}" if isinstance(m.value, float) else str(m.value)
    return f"{value} {m.unit}".strip()


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
