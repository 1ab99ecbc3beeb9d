"""Every session-end cause the unit launcher writes is either counted toward host quarantine or
deliberately not, and the controller's lists name no cause the launcher no longer writes.

The launcher is another package (its own image), which the controller must not import, so
its causes are read from its source: every string that can become a session's `cause`
(`cause=` arguments, assignments to `cause`, defaults of `cause` parameters, the
`*_CAUSES` and `NEUTRAL` tuples, and positional arguments of launcher functions with a
`cause` parameter).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from placement_controller.failures import (
    ACCUSING_CAUSES,
    CONTROLLER_CAUSES,
    IMPLICATING_CAUSES,
    IMPLICATING_WITH_EXIT_STATUS,
    NOT_IMPLICATING_CAUSES,
    TASK_FAILED_TO_START,
    failure_from_event,
)

ROOT = Path(__file__).resolve().parents[3]
LAUNCHER = ROOT / "containers" / "inference" / "unit_launcher"
CLASSIFIED = IMPLICATING_CAUSES | IMPLICATING_WITH_EXIT_STATUS | set(NOT_IMPLICATING_CAUSES)


# Module-level string constants of the launcher (e.g. LEADER_UNREACHABLE = "leader_unreachable"),
# filled by launcher_causes before any expression is read.
_CONSTANTS: dict[str, str] = {}


def _values(node: ast.AST | None) -> set[str]:
    """The string literals an expression can evaluate to, a module constant's name included;
    a lookup (`.get("cause")`) or another variable adds nothing: it copies a cause written
    elsewhere."""
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) else set()
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return {_CONSTANTS[node.id]}
    if isinstance(node, ast.IfExp):
        return _values(node.body) | _values(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_values(v) for v in node.values))
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_values(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
        return _values(node.args[0])
    return set()


def _is_cause(target: ast.AST) -> bool:
    return (isinstance(target, ast.Name) and target.id == "cause") or (
        isinstance(target, ast.Attribute) and target.attr == "cause"
    )


def _cause_parameters(trees: list[ast.Module]) -> dict[str, int]:
    """Launcher functions with a `cause` parameter: name -> its position in a call (self not counted)."""
    found = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
                if names and names[0] == "self":
                    names = names[1:]
                if "cause" in names:
                    found[node.name] = names.index("cause")
    return found


def launcher_causes() -> set[str]:
    trees = [ast.parse(path.read_text(), str(path)) for path in sorted(LAUNCHER.glob("*.py"))]
    _CONSTANTS.clear()
    for tree in trees:
        for statement in tree.body:
            if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                    and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id.isupper()
                    and isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)):
                _CONSTANTS[statement.targets[0].id] = statement.value.value
    positions = _cause_parameters(trees)
    causes: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                causes |= set().union(*(_values(k.value) for k in node.keywords if k.arg == "cause"))
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in positions and len(node.args) > positions[name]:
                    causes |= _values(node.args[positions[name]])
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if _is_cause(target):
                        causes |= _values(node.value)
                    elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        for element, value in zip(target.elts, node.value.elts, strict=False):
                            if _is_cause(element):
                                causes |= _values(value)
                    elif isinstance(target, ast.Name) and (target.id.endswith("_CAUSES") or target.id == "NEUTRAL"):
                        causes |= _values(node.value)
            elif isinstance(node, ast.arguments):
                params = node.posonlyargs + node.args
                defaults = [None] * (len(params) - len(node.defaults)) + list(node.defaults)
                for param, default in [*zip(params, defaults, strict=True), *zip(node.kwonlyargs, node.kw_defaults,
                                                                                  strict=True)]:
                    if param.arg == "cause":
                        causes |= _values(default)
    return causes


def test_the_reader_finds_the_launchers_causes():
    # Spread over both modules and every way of writing one: keyword, tuple assignment,
    # conditional, default, positional argument, the `or` fallback.
    assert {"heartbeat_loss", "member_restarted", "member_engine_exit", "member_lost", "form_timeout",
            "deliberate_stop", "member_stopped", "member_left", "leader_unreachable", "session_changed",
            "unknown", "canary_failed"} <= launcher_causes()


def test_every_launcher_cause_is_decided_on():
    causes = launcher_causes()
    assert causes - CLASSIFIED == set(), "decide in placement_controller/failures.py whether these implicate a host"
    assert CLASSIFIED - CONTROLLER_CAUSES - causes == set(), (
        "the launcher no longer writes these: remove them from failures.py"
    )


# Causes no session-end line carries: the fallback no code path reaches, and a follower's history record
# (docs/self-healing.md lists them; the event's contract does not).
NOT_LOGGED = {"unknown", "session_changed"}


def _named(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", text))


def test_the_docs_name_every_cause_the_launcher_writes():
    """Dashboards, alarms and runbooks switch on `cause`: docs/contracts.md (the event's `cause` row),
    docs/runtime.md and docs/self-healing.md (its table) name exactly the causes the launcher writes.
    `engine_start_failed` was missing from the first two (a defect hunt, thirty-fourth session)."""
    causes = launcher_causes()
    docs = ROOT / "docs"
    row = next(line for line in (docs / "contracts.md").read_text().splitlines()
               if line.startswith("| `cause`, `reason` |"))
    assert _named(row) & CLASSIFIED == causes - NOT_LOGGED, "docs/contracts.md, the unit_session_end `cause` row"
    runtime = " ".join((docs / "runtime.md").read_text().split())
    passage = re.search(r"The leader writes the causes (.*?) Each cause, and whether", runtime)
    assert passage and _named(passage.group(1)) & CLASSIFIED == causes - NOT_LOGGED, "docs/runtime.md"
    healing = (docs / "self-healing.md").read_text()
    table = healing[healing.index("| `cause` | meaning |"):].split("\n\n")[0]
    first = {m for line in table.splitlines()[2:] for m in re.findall(r"^\| `([a-z_]+)` \|", line)}
    assert first == causes, "docs/self-healing.md, the table of causes"


def test_the_controllers_own_causes_are_classified_and_never_written_by_the_launcher():
    # A cause both sides wrote would mix two kinds of evidence under one name.
    assert CONTROLLER_CAUSES <= CLASSIFIED
    assert not CONTROLLER_CAUSES & launcher_causes()
    # A unit task ECS could not start on its host is that host's own failure: counted at once, never
    # an accusation that waits for the other side's report.
    assert TASK_FAILED_TO_START in IMPLICATING_CAUSES and TASK_FAILED_TO_START not in ACCUSING_CAUSES


def test_the_groups_do_not_overlap():
    groups = [IMPLICATING_CAUSES, IMPLICATING_WITH_EXIT_STATUS, set(NOT_IMPLICATING_CAUSES)]
    assert sum(len(g) for g in groups) == len(CLASSIFIED)


def _event(cause: str, exit_status: int | None) -> dict:
    return {
        "event": "unit_session_end", "unit_id": "u1", "session_id": "s7", "cause": cause,
        "ended_by": {"rank": 2, "address": "10.0.1.7", "instance_id": "i-0c"},
        "exit_status": exit_status, "ended_at": 1_800_000_000.25,
    }


@pytest.mark.parametrize("cause", sorted(CLASSIFIED))
def test_each_cause_counts_against_the_member_as_decided(cause: str):
    # Whatever the event carries: a member named and an exit status, or no status.
    for exit_status in (139, None):
        failure = failure_from_event(_event(cause, exit_status))
        counts = cause in IMPLICATING_CAUSES or (cause in IMPLICATING_WITH_EXIT_STATUS and exit_status is not None)
        assert (failure is not None) == counts, (cause, exit_status)
        if failure is not None:
            assert (failure.suspect, failure.cause, failure.ended_at) == ("i-0c", cause, 1_800_000_000)


def test_a_follower_engine_crash_the_leader_saw_first_counts_against_the_follower():
    # runner._settle_cause: the follower's engine died (exit 134), the leader's engine
    # failed first on the broken collective, the event names the follower.
    failure = failure_from_event(_event("member_engine_exit", 134))
    assert failure is not None and failure.suspect == "i-0c"
