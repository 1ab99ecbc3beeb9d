"""`python -m inference_fleet evacuate --cell NAME [--undo] [--wait]`: take a cell out of its routers' choice.

Issue 26. An evacuated cell gets no new request at any router that fronts it; streams in flight on it
finish (the router agent sets it `drain`, `unit_proxy.router`). Where the routers read the
evacuated set from (docs/router.md "Evacuation", docs/contracts.md "Router parameters"):

- on AWS, one SSM parameter per router, `/inference-fleet/<Fleet>/router/<region>/evacuated`
  (the names are `unit_proxy.router_ssm`'s, shared with the router agent), a String holding
  `{"evacuated": [cell, ...]}`. Every router task polls it with GetParameter every 2 s. This
  command reads it, adds or removes the cell and writes it back with PutParameter (Overwrite:
  https://docs.aws.amazon.com/systems-manager/latest/APIReference/API_PutParameter.html); two
  operators evacuating at the same instant race (last write wins; Parameter Store has no
  conditional write), so the command reads it back and says what it holds. With `--wait` it then
  reads every router task's report (`<prefix>/tasks/<id>`, GetParametersByPath) until each live
  task says it applied that version and has no stream left on the cell, or does not front the cell.
- locally (`--local FILE`), the router's ROUTER_EVACUATION_FILE, written atomically
  (rename); with `--status-url` the command waits until the router reports the cell empty.

A router would be left with no cell to send to: refused (exit 7), unless `--force`.

In the rollout pipeline (stacks/evacuation.py) `Restore-<cell>` runs with `--pipeline`, `--pipeline-execution` and
`--wave-stage`: the pipeline runs in SUPERSEDED mode, so a newer execution enters the wave's stage as soon as this one
has left it for its `Restore-<wave>` stage, and may have evacuated the cell for its own deploy by the time this
restore runs. The restore then leaves the cell evacuated (`newer_evacuation`): the newer execution's own restore
follows its bake.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from unit_proxy.router_config import HARD_STOP_SECONDS
from unit_proxy.router_ssm import (
    REPORT_STALE_SECONDS,
    TaskReport,
    evacuation_parameter,
    parameter_prefix,
    reports_path,
)

from inference_fleet import exit_codes
from inference_fleet.checks import load_fleet
from inference_fleet.config import FleetConfig, RouterConfig

HELP = "evacuate a cell at every router that fronts it (no new request; streams in flight finish), or undo it"


class EvacuateError(Exception):
    """The evacuation cannot be done as asked; the message says why and what to do."""


# How often `--wait` reads the task reports (GetParametersByPath shares Parameter Store's default throughput
# with the routers' GetParameter: docs/router.md "Evacuation").
WAIT_POLL_SECONDS = 5.0
# The longest --timeout: a day, 89 times the pipeline's 965 s (stacks/evacuation.py WAIT_SECONDS, in a build of
# 30 min) and under CodeBuild's longest build, 36 h (botocore's CodeBuild model: BuildTimeOut 5-2160 minutes). A
# finite number far beyond it (1e300 s) was a wait that never ended; a longer wait is the command run again.
TIMEOUT_MAX_SECONDS = 86_400.0


def action_name(cell: str, undo: bool) -> str:
    """The rollout pipeline's action that runs this command for a cell (stacks/evacuation.py names them so)."""
    return f"{'Restore' if undo else 'Evacuate'}-{cell}"


# PipelineExecutionId's pattern (CodePipeline API reference, PipelineExecution).
EXECUTION_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class PipelineRun:
    """Where a `Restore-<cell>` action runs: the pipeline, its execution, and the stage of the cell's wave."""

    pipeline: str
    execution_id: str
    wave_stage: str


def router_prefix(fleet: FleetConfig, router: RouterConfig) -> str:
    return parameter_prefix(fleet.name, router.region)


def parameter_name(fleet: FleetConfig, router: RouterConfig) -> str:
    return evacuation_parameter(router_prefix(fleet, router))


def routers_of(fleet: FleetConfig, cell: str) -> list[RouterConfig]:
    return [r for r in fleet.routers if cell in r.cells]


def routers_touched(fleet: FleetConfig, cell: str, undo: bool) -> list[RouterConfig]:
    """Every router whose `evacuated` parameter the command reads and may write for the cell: the routers that
    front it; with --undo every router of the fleet, since one that no longer fronts the cell may still name it
    (_still_named). The pipeline's Evacuation project is granted exactly these (stacks/evacuation.py), so the
    reads and the grant cannot drift apart."""
    return list(fleet.routers) if undo else routers_of(fleet, cell)


@dataclass
class Written:
    """What `evacuate_on_aws` did: lines to print, and per router region the parameter version written."""

    lines: list[str] = field(default_factory=list)
    versions: dict[str, int] = field(default_factory=dict)
    raced: bool = False


def updated(current: set[str], cell: str, undo: bool) -> list[str]:
    return sorted(current - {cell} if undo else current | {cell})


def _check_left(weights: Mapping[str, int], evacuated: list[str], where: str, force: bool) -> None:
    """Refuse to leave a router without a cell of weight above 0: HAProxy never sends to a weight-0 server,
    even when it is the only one left (configuration manual 2.6, 5.2 "weight": "A value of 0 means the
    server will not participate in load-balancing but will still accept persistent connections"), so a
    weight-0 cell left behind is no cell left."""
    if force or {name for name, weight in weights.items() if weight > 0} - set(evacuated):
        return
    fronted = ", ".join(f"{name} (weight {weight})" for name, weight in weights.items())
    raise EvacuateError(f"{where}: every cell it fronts with a weight above 0 ({fronted}) would be evacuated and it "
                        "would answer 503 to every request; undo another evacuation first, or pass --force")


def read_parameter(ssm: Any, name: str) -> tuple[set[str], int]:
    """The evacuated cells and the parameter's version (0 when it does not exist yet)."""
    try:
        parameter = ssm.get_parameter(Name=name)["Parameter"]
    except ssm.exceptions.ParameterNotFound:
        return set(), 0
    try:
        doc = json.loads(parameter["Value"])
        cells = set(doc.get("evacuated", []))
    except (ValueError, AttributeError, TypeError):
        raise EvacuateError(f'{name} holds {parameter["Value"][:80]!r}, not {{"evacuated": [...]}}: write it again '
                            'with `aws ssm put-parameter --overwrite` or delete it') from None
    return cells, int(parameter.get("Version", 0))


def evacuate_on_aws(fleet: FleetConfig, cell: str, undo: bool, force: bool, ssm_for: Any) -> Written:
    """Write every fronting router's parameter; `ssm_for(region)` gives an SSM client."""
    routers = routers_of(fleet, cell)
    leftover = _still_named(fleet, cell, ssm_for) if undo else []
    if not routers and not leftover:
        fronted = sorted({c for r in fleet.routers for c in r.cells})
        also = " and no router's parameter names it" if undo else ""
        raise EvacuateError(f"no router fronts cell {cell!r}{also} (routers: in the fleet file; routed cells: "
                            f"{fronted})")
    written = Written()
    for router in routers + leftover:
        ssm, name = ssm_for(router.region), parameter_name(fleet, router)
        if router in leftover:
            written.lines.append(f"{router.region}: the router no longer fronts {cell}; removing the name left in "
                                 "its parameter (the router ignores it anyway)")
        wanted = updated(read_parameter(ssm, name)[0], cell, undo)
        _check_left({c: router.weight(c) for c in router.cells}, wanted, f"the router in {router.region}", force)
        ssm.put_parameter(Name=name, Value=json.dumps({"evacuated": wanted}), Type="String", Overwrite=True)
        holds, version = read_parameter(ssm, name)
        written.lines.append(f"{router.region}: {name} = {sorted(holds)} (version {version})")
        written.versions[router.region] = version
        if sorted(holds) != wanted:
            written.raced = True
            written.lines.append(f"{router.region}: another evacuation was written at the same time; run this again")
    return written


def _still_named(fleet: FleetConfig, cell: str, ssm_for: Any) -> list[RouterConfig]:
    """The routers that do not front `cell` but whose parameter still names it: a cell evacuated, then removed
    from `routers[].cells`. The router agent ignores such a name (router_ssm.parse_evacuated); `--undo` may
    still remove it, so the parameter says what is evacuated."""
    return [router for router in routers_touched(fleet, cell, undo=True) if cell not in router.cells
            and cell in read_parameter(ssm_for(router.region), parameter_name(fleet, router))[0]]


@dataclass(frozen=True)
class NewerEvacuation:
    """An execution other than the restore's that has started `Evacuate-<cell>` in the wave's stage."""

    execution_id: str
    rollback: bool  # a rollback of the wave's stage (execution type ROLLBACK): no restore stage follows it


def newer_evacuation(codepipeline: Any, run: PipelineRun, cell: str) -> NewerEvacuation | None:
    """The execution that has started `Evacuate-<cell>` in the wave's stage since this one left it, or None.

    A stage holds one execution at a time, and in SUPERSEDED mode a newer execution waiting at a stage's boundary
    takes the place of an older one waiting there ("Superseded" in
    https://docs.aws.amazon.com/codepipeline/latest/APIReference/API_PipelineExecution.html), so an execution in the
    wave's stage other than this one entered it after this one left: a newer one, or a rollback of that stage
    (`latestExecution.type` ROLLBACK). GetPipelineState names it; ListActionExecutions, filtered by its id, says
    whether it has started evacuating the cell. Until it has, its evacuation is still to come: it reads the
    parameter after this restore's write (a CodeBuild action takes tens of seconds to start) and evacuates again."""
    states = codepipeline.get_pipeline_state(name=run.pipeline).get("stageStates", [])
    stage = next((s for s in states if s.get("stageName") == run.wave_stage), None)
    if stage is None:
        raise EvacuateError(f"pipeline {run.pipeline} has no stage {run.wave_stage!r} (stages: "
                            f"{[s.get('stageName') for s in states]}); is --wave-stage the cell's wave stage?")
    latest = stage.get("latestExecution") or {}
    other = latest.get("pipelineExecutionId")
    if not other or other == run.execution_id:
        return None
    evacuate = action_name(cell, undo=False)
    pages = codepipeline.get_paginator("list_action_executions").paginate(
        pipelineName=run.pipeline, filter={"pipelineExecutionId": other})
    for page in pages:
        for detail in page.get("actionExecutionDetails", []):
            if detail.get("stageName") == run.wave_stage and detail.get("actionName") == evacuate:
                return NewerEvacuation(other, rollback=latest.get("type") == "ROLLBACK")
    return None


def task_reports(ssm: Any, path: str) -> list[tuple[str, datetime, str]]:
    """Every report under the path: (name, LastModifiedDate, value), all pages."""
    found, token = [], None
    while True:
        page = ssm.get_parameters_by_path(Path=path, **({"NextToken": token} if token else {}))
        found += [(p["Name"], p["LastModifiedDate"], p["Value"]) for p in page.get("Parameters", [])]
        token = page.get("NextToken")
        if not token:
            return found


def _undone(task: str, report: TaskReport, prefix: str, cell: str) -> EvacuateError:
    """A task at the version written or later that does not drain the cell. With `fronts` in its report the task
    fronts the cell (empty_at skipped it otherwise), so an evacuation written since restored it. A report without
    `fronts` (a router agent older than the field) may also come from a task that does not front the cell: both
    causes are named, and the wait still fails, since an undo would send the cell router traffic again."""
    applied = f"router task {task} applied version {report.version} of {prefix}/evacuated"
    if report.fronts is None:
        return EvacuateError(f"{applied} and does not drain {cell}: another evacuation was written since, or the "
                             f"task does not front {cell} (its report does not say which cells it fronts: a router "
                             "image older than the report's `fronts` field; redeploy the router)")
    return EvacuateError(f"{applied}, which no longer evacuates {cell}: another evacuation was written since")


def empty_at(ssm: Any, prefix: str, cell: str, version: int, now: datetime) -> tuple[bool, list[str]]:
    """Whether every live router task (a report younger than REPORT_STALE_SECONDS) applied `version` or a
    later one and has no stream left on the cell, or does not front it; and what each task says."""
    live, said = 0, []
    for name, modified, value in task_reports(ssm, reports_path(prefix)):
        age = (now - modified).total_seconds()
        task = name.rsplit("/", 1)[-1]
        if age > REPORT_STALE_SECONDS:
            said.append(f"{task}: report {age:.0f} s old, counted as gone")
            continue
        live += 1
        try:
            report = TaskReport.from_json(value)
        except (ValueError, KeyError, TypeError):
            said.append(f"{task}: unreadable report {value[:60]!r}")
            return False, said
        if report.fronts is not None and cell not in report.fronts:
            # Its HAProxy has no server for the cell (ROUTER_CELLS leaves it out: the router stack not yet
            # deployed with the cell, or an old task of a rolling deploy): it carries none of its traffic.
            said.append(f"{task}: does not front {cell}, nothing to drain")
            continue
        if report.version >= version and cell not in report.evacuated:
            raise _undone(task, report, prefix, cell)
        if report.version < version:
            said.append(f"{task}: still at version {report.version}")
            return False, said
        if cell not in report.empty:
            said.append(f"{task}: streams left on {cell}")
            return False, said
        said.append(f"{task}: {cell} empty")
    if not live:
        said.append(f"no router task reported in the last {REPORT_STALE_SECONDS:.0f} s: are the routers running "
                    "with ROUTER_SSM_PREFIX set, and can they write their reports (an `evacuation_report_error` in "
                    "the router's log says why not)?")
    return live > 0, said


def wait_empty_on_aws(fleet: FleetConfig, cell: str, written: Written, ssm_for: Any, timeout: float,
                      clock: Any = time.monotonic, sleep: Any = time.sleep,
                      now: Any = lambda: datetime.now(UTC)) -> float:
    """Until every router task of every fronting router reports the cell empty; returns the seconds it took."""
    if written.raced:
        raise EvacuateError("another evacuation was written at the same time; run this again before waiting")
    start = clock()
    pending = {router.region: router for router in routers_of(fleet, cell)}
    while True:
        said: list[str] = []
        for region, router in sorted(pending.items()):
            done, lines = empty_at(ssm_for(region), router_prefix(fleet, router), cell, written.versions[region],
                                   now())
            said += [f"{region}: {line}" for line in lines]
            if done:
                del pending[region]
        if not pending:
            return clock() - start
        if clock() - start > timeout:
            raise EvacuateError(f"cell {cell} not reported empty by every router task after {timeout:g} s: "
                                + "; ".join(said))
        sleep(WAIT_POLL_SECONDS)


def write_local(path: Path, cell: str, undo: bool, force: bool, cells: Mapping[str, int] | None) -> list[str]:
    """Update the router's local evacuation file atomically; returns the evacuated cells."""
    try:
        current = set(json.loads(path.read_text() or "{}").get("evacuated", []))
    except FileNotFoundError:
        current = set()
    except (OSError, ValueError, AttributeError) as exc:
        raise EvacuateError(f"{path}: cannot be read as the router's evacuation file ({exc})") from None
    wanted = updated(current, cell, undo)
    if cells is not None:
        _check_left(cells, wanted, "the router", force)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".evacuation-")
    with os.fdopen(fd, "w") as handle:
        json.dump({"evacuated": wanted}, handle)
    os.replace(tmp, path)  # the router never reads a half-written file
    return wanted


def wait_empty(status_url: str, cell: str, timeout: float) -> float:
    """Poll the router's GET /status until the cell is evacuated and empty; returns the seconds it took."""
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"{status_url.rstrip('/')}/status", timeout=2) as resp:
                doc = json.load(resp)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise EvacuateError(f"{status_url}: the router's status cannot be read ({exc})") from None
        state = doc.get("cells", {}).get(cell)
        if state is None:
            raise EvacuateError(f"the router at {status_url} does not front cell {cell!r}")
        if doc.get("evacuation_file_error"):
            raise EvacuateError(f"the router refuses its evacuation file: {doc['evacuation_file_error']}")
        if state.get("evacuated") and state.get("empty"):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise EvacuateError(f"cell {cell} still has {state.get('streams')} stream(s) after {timeout:g} s")
        time.sleep(0.2)


def _timeout_seconds(text: str) -> float:
    """--timeout: more than 0 and at most TIMEOUT_MAX_SECONDS. argparse's `float` took `nan`, `inf` and negatives;
    with nan or inf `clock() - start > timeout` is never true and `--wait` never gave up, and 1e300, finite, was
    the same (a cold review in the thirty-fourth session)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= TIMEOUT_MAX_SECONDS:  # nan fails it too
        raise argparse.ArgumentTypeError(f"{text} s is not allowed; allowed: more than 0, at most "
                                         f"{TIMEOUT_MAX_SECONDS:.0f} (a day)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cell", required=True, help="the cell to evacuate (cells[].name)")
    parser.add_argument("--undo", action="store_true", help="send new requests to the cell again")
    parser.add_argument("--local", type=Path, metavar="FILE",
                        help="write a local router's evacuation file (ROUTER_EVACUATION_FILE) instead of AWS")
    parser.add_argument("--status-url", metavar="URL",
                        help="with --local: the router's admin URL; wait until it reports the cell empty")
    parser.add_argument("--wait", action="store_true",
                        help="on AWS: wait until every router task reports the cell empty (its streams finished)")
    parser.add_argument("--timeout", type=_timeout_seconds, default=HARD_STOP_SECONDS + 60.0,
                        help="longest wait for --status-url or --wait (s, more than 0, at most 86400; default: the "
                             "router's 905 s hard stop and a minute)")
    parser.add_argument("--force", action="store_true", help="evacuate even the last cell of a router")
    pipeline = parser.add_argument_group(
        "in the rollout pipeline's Restore-<cell> action (all three, with --undo): leave the cell evacuated when a "
        "newer execution has started evacuating it for its own deploy")
    pipeline.add_argument("--pipeline", metavar="NAME", help="the pipeline's name")
    pipeline.add_argument("--pipeline-execution", metavar="ID", help="this execution's id")
    pipeline.add_argument("--wave-stage", metavar="STAGE", help="the stage of the cell's wave (Wave-<wave>)")


def pipeline_run(args: argparse.Namespace) -> PipelineRun | None:
    """The pipeline position `--pipeline`, `--pipeline-execution` and `--wave-stage` give, all three or none."""
    given = {"--pipeline": args.pipeline, "--pipeline-execution": args.pipeline_execution,
             "--wave-stage": args.wave_stage}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise EvacuateError(f"{', '.join(missing)} missing: --pipeline, --pipeline-execution and --wave-stage go "
                            "together")
    if not args.undo or args.local is not None:
        raise EvacuateError("--pipeline, --pipeline-execution and --wave-stage guard a restore on AWS: use them "
                            "with --undo and without --local")
    if not EXECUTION_ID.fullmatch(args.pipeline_execution):
        # Any other id (the variable left unresolved, a typo) would never be the stage's latest execution: the
        # restore would take its own execution's evacuation for a newer one's and leave the cell evacuated.
        raise EvacuateError(f"--pipeline-execution {args.pipeline_execution!r} is not a pipeline execution id "
                            "(8-4-4-4-12 lowercase hex digits, CodePipeline's #{codepipeline.PipelineExecutionId})")
    return PipelineRun(args.pipeline, args.pipeline_execution, args.wave_stage)


def run(args: argparse.Namespace, ssm_for: Any = None, codepipeline: Any = None) -> int:
    try:
        if args.local is not None and args.wait:
            raise EvacuateError("--wait reads the routers' reports on AWS; with --local, wait with --status-url URL")
        position = pipeline_run(args)
        if args.local is not None:
            evacuated = write_local(args.local, args.cell, args.undo, args.force, None)
            print(f"{args.local}: evacuated {evacuated}")
            if args.status_url and not args.undo:
                print(f"cell {args.cell} empty after {wait_empty(args.status_url, args.cell, args.timeout):.1f} s")
            return exit_codes.OK
        return _run_on_aws(args, load_fleet(args.config), ssm_for, position, codepipeline)
    except EvacuateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.EVACUATE


def _yielded(args: argparse.Namespace, position: PipelineRun, newer: NewerEvacuation) -> str:
    """What a restore that leaves the cell to another execution's evacuation says, and what happens next."""
    by_hand = f"python -m inference_fleet evacuate --config {args.config} --cell {args.cell} --undo"
    evacuate = action_name(args.cell, undo=False)
    if newer.rollback:
        return (f"{args.cell} stays evacuated: a rollback of {position.wave_stage} ({newer.execution_id}) has started "
                f"{evacuate}, and no restore follows a rollback (a rolled-back wave leaves its cells evacuated): "
                f"look at the cell, then `{by_hand}`")
    return (f"{args.cell} stays evacuated: a newer execution of {position.pipeline} ({newer.execution_id}) has "
            f"started {evacuate} in {position.wave_stage}, and its own restore follows its bake. Should it fail or be "
            f"stopped, the cell stays evacuated (as after any failed wave): `{by_hand}`")


def _run_on_aws(args: argparse.Namespace, fleet: FleetConfig, ssm_for: Any, position: PipelineRun | None,
                codepipeline: Any) -> int:
    """The AWS path of `run`; a call AWS refuses or cannot be reached for becomes an EvacuateError (exit 7)."""
    from botocore.exceptions import BotoCoreError, ClientError  # only on this path: --local needs no AWS SDK

    if ssm_for is None:
        import boto3

        def ssm_for(region: str) -> Any:
            return boto3.client("ssm", region_name=region)
    try:
        if position is not None:
            if codepipeline is None:
                if fleet.pipeline is None:
                    raise EvacuateError(f"--pipeline {position.pipeline}: the fleet file has no `pipeline:` section "
                                        "to say the pipeline's region")
                import boto3

                codepipeline = boto3.client("codepipeline", region_name=fleet.pipeline.region)
            newer = newer_evacuation(codepipeline, position, args.cell)
            if newer is not None:
                print(_yielded(args, position, newer), flush=True)
                return exit_codes.OK
        written = evacuate_on_aws(fleet, args.cell, args.undo, args.force, ssm_for)
        for line in written.lines:
            print(line, flush=True)
        if args.undo:
            if written.raced:  # the read-back shows another write: the cell may still be evacuated
                raise EvacuateError(f"another evacuation was written at the same time as this restore of {args.cell}; "
                                    "run it again")
            return exit_codes.OK
        if args.wait:
            took = wait_empty_on_aws(fleet, args.cell, written, ssm_for, args.timeout)
            print(f"cell {args.cell} empty at every router task after {took:.0f} s")
        else:
            print(f"each router task drains {args.cell} within its poll interval; `--wait` waits until every task "
                  "reports it empty")
        return exit_codes.OK
    except (ClientError, BotoCoreError) as exc:
        # ClientError: AWS answered with an error (AccessDenied, throttling); BotoCoreError: no answer or no
        # credentials (EndpointConnectionError, NoCredentialsError). Both are botocore's documented bases:
        # https://boto3.amazonaws.com/v1/documentation/api/latest/guide/error-handling.html
        what = str(exc) if isinstance(exc, ClientError) else f"{type(exc).__name__}: {exc}"  # names code and call
        raise EvacuateError(
            f"{what}. The command needs ssm:GetParameter and ssm:PutParameter on the "
            "`evacuated` parameter of every router it names (with --undo, every router of the fleet), with "
            "--wait ssm:GetParametersByPath on their `tasks` path, and with --pipeline codepipeline:GetPipelineState "
            "and codepipeline:ListActionExecutions on that pipeline; each write is whole and idempotent, so run it "
            "again once fixed") from None
