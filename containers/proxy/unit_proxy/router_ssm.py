"""The cell router's evacuation on AWS: the SSM parameters it reads and writes (issue 26, docs/contracts.md).

One shared definition of the names, used by the router agent (this image) and by
`python -m inference_fleet evacuate` and the pipeline (which import this module; the image
never imports inference_fleet). Per router (one per region), under
`/inference-fleet/<Fleet>/router/<region>`:

- `<prefix>/evacuated`: `{"evacuated": [cell, ...]}`, written by the evacuate command
  (PutParameter, Overwrite), read by every router task with GetParameter every
  ROUTER_SSM_POLL_SECONDS. Not a CloudFormation resource, on purpose: a stack update would write
  its template value back over an evacuation.
- `<prefix>/tasks/<task id>`: each router task's report, `TaskReport` below: the version of
  `evacuated` it applied, the cells it fronts and which evacuated cells have no stream left on it. Written when that
  changes and at least every REPORT_HEARTBEAT_SECONDS (each write is a new version; Parameter Store
  keeps the 100 newest and deletes the oldest unlabelled one: botocore's SSM reference,
  ParameterMaxVersionLimitExceeded); deleted when the task exits cleanly, after the write in
  flight if any has landed (unit_proxy.router.SsmSource.delete_report). A Standard parameter holds 4 KB:
  hence MAX_FRONTED_CELLS; a write refused is logged once (`evacuation_report_error`). The
  evacuate command's `--wait` reads them all (GetParametersByPath) and counts a task whose report
  is older than REPORT_STALE_SECONDS as gone.

SSM's API: GetParameter returns `Parameter.Value` and `Parameter.Version`, PutParameter returns the
new `Version` (https://docs.aws.amazon.com/systems-manager/latest/APIReference/API_GetParameter.html,
API_PutParameter.html), GetParametersByPath returns each parameter's `LastModifiedDate`
(API_GetParametersByPath.html). botocore is imported only by `SsmClient`, so the names and the
report format need no AWS SDK.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

PREFIX_FORMAT = "/inference-fleet/{fleet}/router/{region}"
EVACUATED = "evacuated"
TASKS = "tasks"
# A task rewrites its report at least this often, so the evacuate command can tell a live task from one
# gone without deleting its report (SIGKILL, a lost host): a report older than REPORT_STALE_SECONDS.
REPORT_HEARTBEAT_SECONDS = 60.0
REPORT_STALE_SECONDS = 3 * REPORT_HEARTBEAT_SECONDS
# Parameter names: letters, digits and `_.-/` (PutParameter's Name constraints).
_NAME_PART = re.compile(r"[^a-zA-Z0-9_.-]")
# A Standard parameter's value holds 4 KB (botocore 1.44.18's SSM model, PutParameterRequest.Value: "Standard
# parameters have a value limit of 4 KB"); the agent writes its report without a Tier, so in the default Standard
# tier a longer one is refused (ValidationException) and the task has no report for `evacuate --wait` to read.
# json.dumps writes ASCII (non-ASCII escaped), so characters are bytes here.
STANDARD_VALUE_MAX = 4096
# The most cells a router fronts (the fleet file's `routers[].cells`, checked by inference_fleet.config): a report
# names every fronted cell in `fronts`, and again in `evacuated` and `empty` when all are evacuated and drained.
# With 40 names of 24 characters (CELL_NAME's longest), a 72-character task id (the host-name fallback of
# router.task_id; an ECS task id has 32) and a 19-digit version that report is 3,514 characters, 582 under
# STANDARD_VALUE_MAX: room for a new field; 47 cells would pass it (a cold review in the thirty-fourth session;
# containers/proxy/tests/test_router_ssm.py::test_the_report_of_a_router_at_its_most_cells_fits_a_standard_parameter).
MAX_FRONTED_CELLS = 40


class EvacuationValueError(ValueError):
    """An evacuation document that cannot be used; the message says why (the last good state is kept)."""


def parameter_prefix(fleet: str, region: str) -> str:
    return PREFIX_FORMAT.format(fleet=fleet, region=region)


def evacuation_parameter(prefix: str) -> str:
    return f"{prefix}/{EVACUATED}"


def reports_path(prefix: str) -> str:
    return f"{prefix}/{TASKS}"


def report_parameter(prefix: str, task_id: str) -> str:
    return f"{reports_path(prefix)}/{_NAME_PART.sub('-', task_id)}"


def parse_evacuated(text: str, cells: set[str], where: str) -> tuple[frozenset[str], list[str]]:
    """The cells named in an evacuation document (`{"evacuated": [...]}`; empty text is none: a missing
    parameter or evacuation file, as on a router no evacuation has been written for yet) that this router
    fronts, and the names it does not front. Those are ignored, not an error: a cell evacuated, then removed
    from `routers[].cells` and the router redeployed, stays named in the parameter, and an error here would
    keep every new task from ever reading its evacuation (and, with SSM, from becoming ready)."""
    if not text.strip():
        return frozenset(), []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvacuationValueError(f"{where}: not JSON ({exc.msg})") from None
    names = doc.get("evacuated") if isinstance(doc, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise EvacuationValueError(f'{where}: expected {{"evacuated": ["cell", ...]}}')
    return frozenset(set(names) & cells), sorted(set(names) - cells)


@dataclass(frozen=True)
class TaskReport:
    """What one router task says about evacuation: the `evacuated` version it applied (0: the parameter
    does not exist), the cells it drains, those of them with no stream left on it, and the cells it fronts
    (its ROUTER_CELLS). `fronts` tells `evacuate --wait` a cell this task does not front, so never drains
    (parse_evacuated ignores its name), from one an evacuation written since has restored. None: a report
    written by a router agent older than the field (thirty-fourth session), which fronts cells unknown here."""

    task: str
    version: int
    evacuated: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    fronts: list[str] | None = None

    def to_json(self) -> str:
        doc = asdict(self)
        if self.fronts is None:  # the older agent's format, as it wrote it
            del doc["fronts"]
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TaskReport:
        """The report in `text`; ValueError (or KeyError, TypeError) when it is not one, which `evacuate --wait`
        reads as unreadable and waits on."""
        doc = json.loads(text)
        if not isinstance(doc, dict):  # `doc.get` below raised AttributeError, which `--wait` did not catch
            raise ValueError(f"a report is a JSON object, not {type(doc).__name__}")
        fronts = doc.get("fronts")
        return cls(task=str(doc["task"]), version=int(doc["version"]), evacuated=_names(doc, "evacuated"),
                   empty=_names(doc, "empty"), fronts=None if fronts is None else _names(doc, "fronts"))


def _names(doc: dict[str, Any], key: str) -> list[str]:
    """A list of cell names (absent: none). `list()` of a string made one name per character, so a `fronts` of
    "dev,prod" read as a task fronting neither dev nor prod: empty for `--wait` (a cold review in the
    thirty-fourth session)."""
    names = doc.get(key, [])
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"report field {key!r}: expected a list of cell names, got {names!r:.60}")
    return list(names)


class SsmClient:
    """The agent's three calls, blocking (run them in a thread). botocore's default credential chain
    (on ECS, the task role from the container credentials endpoint) and endpoint resolution: the
    region from AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_SSM honoured (the tests point it at
    a local SSM). Short timeouts and few retries: the poll comes back soon anyway."""

    def __init__(self, region: str) -> None:
        import botocore.session  # only here: the names above need no SDK
        from botocore.config import Config

        config = Config(connect_timeout=2, read_timeout=5, retries={"mode": "standard", "total_max_attempts": 2})
        self._client: Any = botocore.session.get_session().create_client("ssm", region_name=region, config=config)

    def read(self, name: str) -> tuple[str, int]:
        """The parameter's value and version; ("", 0) when it does not exist (nothing evacuated yet)."""
        try:
            parameter = self._client.get_parameter(Name=name)["Parameter"]
        except self._client.exceptions.ParameterNotFound:
            return "", 0
        return parameter["Value"], int(parameter["Version"])

    def write(self, name: str, value: str) -> None:
        self._client.put_parameter(Name=name, Value=value, Type="String", Overwrite=True)

    def delete(self, name: str) -> None:
        with contextlib.suppress(self._client.exceptions.ParameterNotFound):
            self._client.delete_parameter(Name=name)
