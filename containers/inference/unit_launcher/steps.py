"""Step-level liveness and lockstep, read from the unit executor's step records.

The engine's processes write their records (`unit_executor.steps`) into the session's
step directory; this module is the launcher's reading of them:

- on every node, `local_states` gives what this node's workers executed (followers send it
  with each heartbeat);
- on the leader, `executor_state` shows a step broadcast but not completed within the
  step bound, and `laggards` names the members that had not executed it, so the session
  ends as "unit lost" with the culprit named instead of hanging in a collective;
- `lockstep` says whether every worker of every node executed exactly the steps the
  leader broadcast (same count, same digest chain);
- `divergence` says whether a node sampled other tokens than the leader's node: its output
  chain differs from the leader's at a count both have (a checkpoint or the current count).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unit_executor.steps import ENGINE_DEAD_RECORD, EXECUTOR_RECORD, StepState, read_dir, read_record

EXECUTOR = "executor"


def step_dir(unit_id: str, session_id: str, rank: int) -> Path:
    """Where the engine of this node writes its step records for one session (per rank, so
    that nodes sharing a host in tests keep their records apart)."""
    return Path(tempfile.gettempdir()) / "unit-steps" / f"{unit_id}-{session_id}-rank{rank}"


def local_states(directory: Path) -> dict[str, dict[str, Any]]:
    """This node's records as JSON (for /status and heartbeats)."""
    return {name: state.to_json() for name, state in read_dir(directory).items()}


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting for its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): the signal said it exists
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def engine_dead(directory: Path) -> str | None:
    """What a front end wrote when its in-process vLLM engine died (unit_executor.steps.mark_engine_dead)."""
    try:
        return (directory / ENGINE_DEAD_RECORD).read_text().strip() or "no reason given"
    except OSError:
        return None


def executor_state(directory: Path) -> StepState | None:
    """The leader executor's record (None before the engine wrote one)."""
    return read_record(directory / EXECUTOR_RECORD)


def workers_of(states: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {name: s for name, s in states.items() if name.startswith("worker-")}


def laggards(broadcast: int, members: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """Members (by description) some worker of which had completed fewer than `broadcast` steps.

    Completed, not started: a worker hung inside the step it started is the one behind."""
    behind = []
    for who, states in members.items():
        workers = workers_of(states)
        if not workers:
            behind.append(f"{who} (no step record)")
            continue
        done = min(int(w.get("completed", w["steps"])) for w in workers.values())
        if done < broadcast:
            behind.append(f"{who} (completed {done} of {broadcast} steps)")
    return behind


def lockstep(executor: Mapping[str, Any] | None, members: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> bool | None:
    """True when every worker of every member has the executor's step count and chain.

    None when there is nothing to compare yet (no executor record, or a member without one).
    """
    if executor is None:
        return None
    for states in members.values():
        workers = workers_of(states)
        if not workers:
            return None
        for worker in workers.values():
            if (worker["steps"], worker["chain"]) != (executor["steps"], executor["chain"]):
                return False
    return True


def _outputs(worker: Mapping[str, Any]) -> dict[int, str]:
    """A worker's output chain by sample count: its checkpoints and its current value."""
    known = {int(count): chain for count, chain in (worker.get("out_checkpoints") or {}).items()}
    if "sampled" in worker and "out_chain" in worker and int(worker["sampled"]) > 0:
        known[int(worker["sampled"])] = worker["out_chain"]
    return known


def divergence(leader: Mapping[str, Mapping[str, Any]], member: Mapping[str, Mapping[str, Any]]) -> str | None:
    """How `member`'s sampled tokens differ from the leader's node's, or None when they agree as far
    as both records go. Compared at the highest sample count both have."""
    reference = {}
    for worker in workers_of(leader).values():
        reference.update(_outputs(worker))
    for name, worker in sorted(workers_of(member).items()):
        common = set(reference) & set(own := _outputs(worker))
        if common and own[(at := max(common))] != reference[at]:
            return f"{name} sampled other tokens than the leader's node by sample {at}"
    return None
