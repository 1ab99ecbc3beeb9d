"""Parse the cron expression of a wave's deployment window, so a wrong one fails before synth.

The syntax is the one of the CodePipeline DeploymentWindow rule
(https://docs.aws.amazon.com/codepipeline/latest/userguide/rule-reference-DeploymentWindow.html):
six fields and an optional seventh, separated by white space:

    seconds  minutes  hours  day-of-month  month         day-of-week        [year]
    *        0-59     0-23   1-31          1-12/JAN-DEC  1-7/SUN-SAT        1970-2199
             , - * /  , - * / , - * ? / L W , - * /       , - * ? / L #      , - * /

`cron_problem` returns what is wrong with an expression (naming the field), or None.
"""

from __future__ import annotations

import re

_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")

# name, low, high, names (for 1-based symbolic values), special characters beyond , - * /
_FIELDS: tuple[tuple[str, int, int, tuple[str, ...], str], ...] = (
    ("minutes", 0, 59, (), ""),
    ("hours", 0, 23, (), ""),
    ("day-of-month", 1, 31, (), "?LW"),
    ("month", 1, 12, _MONTHS, ""),
    ("day-of-week", 1, 7, _DAYS, "?L#"),
    ("year", 1970, 2199, (), ""),
)
_DOM_SPECIAL = re.compile(r"^(L(-[0-9]{1,2})?|LW|[0-9]{1,2}W)$")
_DOW_SPECIAL = re.compile(r"^([1-7]|SUN|MON|TUE|WED|THU|FRI|SAT)(L|#[1-5])$|^L$")


def _value(text: str, low: int, high: int, names: tuple[str, ...]) -> int | None:
    if text.upper() in names:
        return names.index(text.upper()) + 1
    if text.isdigit() and low <= int(text) <= high:
        return int(text)
    return None


def _atom_problem(atom: str, name: str, low: int, high: int, names: tuple[str, ...], special: str) -> str | None:
    allowed = f"{low}-{high}" + (f" or {names[0]}-{names[-1]}" if names else "")
    if atom == "*" or (atom == "?" and "?" in special):
        return None
    if name == "day-of-month" and _DOM_SPECIAL.match(atom.upper()):
        return None
    if name == "day-of-week" and _DOW_SPECIAL.match(atom.upper()):
        return None
    base, _, step = atom.partition("/")
    if step and not (step.isdigit() and 1 <= int(step) <= high):
        return f"{name}: step {step!r} is not a number from 1 to {high}"
    if base == "*":
        return None
    first, _, last = base.partition("-")
    start = _value(first, low, high, names)
    end = _value(last, low, high, names) if last else start
    if start is None or end is None:
        specials = ", - * /" + (f" {' '.join(special)}" if special else "")
        return f"{name}: {atom!r} is not allowed; values {allowed}, special characters {specials}"
    if end < start:
        return f"{name}: range {base!r} runs backwards"
    return None


def cron_problem(expression: str) -> str | None:
    """What is wrong with a DeploymentWindow cron expression, or None when it parses."""
    fields = expression.split()
    if len(fields) not in (6, 7):
        return (f"cron needs 6 fields and an optional year (seconds minutes hours day-of-month month day-of-week "
                f"[year]), not {len(fields)}; e.g. '* 0-59 9-16 ? * MON-THU'")
    if fields[0] != "*":
        return f"seconds: {fields[0]!r} is not allowed; the DeploymentWindow rule takes only '*'"
    for text, (name, low, high, names, special) in zip(fields[1:], _FIELDS, strict=False):
        for atom in text.split(","):
            problem = _atom_problem(atom, name, low, high, names, special) if atom else f"{name}: empty list item"
            if problem:
                return problem
    if fields[3] != "?" and fields[5] != "?" and "*" not in (fields[3], fields[5]):
        return "day-of-month and day-of-week both name days: set one of them to '?'"
    return None
