"""`python -m inference_fleet evacuate --cell NAME [--undo]`: take a cell out of its routers' choice (issue 26).

An evacuated cell gets no new request at any router that fronts it; streams in flight on it
finish (the router agent sets it `drain`, `unit_proxy.router`). Where the routers read the
evacuated set from (docs/router.md "Evacuation"):

- on AWS, one SSM parameter per router, `/inference-fleet/<Fleet>/router/<region>/evacuated`,
  a String holding `{"evacuated": [cell, ...]}`. Every router task polls it with GetParameter
  (default Parameter Store throughput: 40 transactions/s per account and region, shared by
  GetParameter, GetParameters and PutParameter:
  https://docs.aws.amazon.com/systems-manager/latest/APIReference/API_GetParameter.html and
  the Systems Manager quotas, https://docs.aws.amazon.com/general/latest/gr/ssm.html); a
  router task polling every 2 s costs 0.5/s. PutParameter with Overwrite replaces the value
  (https://docs.aws.amazon.com/systems-manager/latest/APIReference/API_PutParameter.html).
  This command reads the parameter, adds or removes the cell and writes it back; two
  operators evacuating at the same instant race (last write wins; Parameter Store has no
  conditional write), so the command reads it back and says what it holds.
- locally (`--local FILE`), the router's ROUTER_EVACUATION_FILE, written atomically
  (rename); with `--status-url` the command waits until the router reports the cell empty.

A router would be left with no cell to send to: refused (exit 7), unless `--force`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from inference_fleet import exit_codes
from inference_fleet.checks import load_fleet
from inference_fleet.config import FleetConfig, RouterConfig

HELP = "evacuate a cell at every router that fronts it (no new request; streams in flight finish), or undo it"


class EvacuateError(Exception):
    """The evacuation cannot be done as asked; the message says why and what to do."""


def parameter_name(fleet: FleetConfig, router: RouterConfig) -> str:
    return f"/inference-fleet/{fleet.name}/router/{router.region}/evacuated"


def updated(current: set[str], cell: str, undo: bool) -> list[str]:
    return sorted(current - {cell} if undo else current | {cell})


def _check_left(router_cells: tuple[str, ...], evacuated: list[str], where: str, force: bool) -> None:
    if not force and not set(router_cells) - set(evacuated):
        raise EvacuateError(f"{where}: every cell it fronts ({', '.join(router_cells)}) would be evacuated and it "
                            "would answer 503 to every request; undo another evacuation first, or pass --force")


def read_parameter(ssm: Any, name: str) -> set[str]:
    try:
        value = ssm.get_parameter(Name=name)["Parameter"]["Value"]
    except ssm.exceptions.ParameterNotFound:
        return set()
    doc = json.loads(value)
    return set(doc.get("evacuated", []))


def evacuate_on_aws(fleet: FleetConfig, cell: str, undo: bool, force: bool, ssm_for: Any) -> list[str]:
    """Write every fronting router's parameter; `ssm_for(region)` gives an SSM client. Returns lines to print."""
    routers = [r for r in fleet.routers if cell in r.cells]
    if not routers:
        fronted = sorted({c for r in fleet.routers for c in r.cells})
        raise EvacuateError(f"no router fronts cell {cell!r} (routers: in the fleet file; routed cells: {fronted})")
    lines = []
    for router in routers:
        ssm, name = ssm_for(router.region), parameter_name(fleet, router)
        wanted = updated(read_parameter(ssm, name), cell, undo)
        _check_left(router.cells, wanted, f"the router in {router.region}", force)
        ssm.put_parameter(Name=name, Value=json.dumps({"evacuated": wanted}), Type="String", Overwrite=True)
        holds = sorted(read_parameter(ssm, name))
        lines.append(f"{router.region}: {name} = {holds}")
        if holds != wanted:
            lines.append(f"{router.region}: another evacuation was written at the same time; run this again")
    return lines


def write_local(path: Path, cell: str, undo: bool, force: bool, cells: tuple[str, ...] | None) -> list[str]:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cell", required=True, help="the cell to evacuate (cells[].name)")
    parser.add_argument("--undo", action="store_true", help="send new requests to the cell again")
    parser.add_argument("--local", type=Path, metavar="FILE",
                        help="write a local router's evacuation file (ROUTER_EVACUATION_FILE) instead of AWS")
    parser.add_argument("--status-url", metavar="URL",
                        help="with --local: the router's admin URL; wait until it reports the cell empty")
    parser.add_argument("--timeout", type=float, default=900.0, help="longest wait for --status-url (s)")
    parser.add_argument("--force", action="store_true", help="evacuate even the last cell of a router")


def run(args: argparse.Namespace, ssm_for: Any = None) -> int:
    try:
        if args.local is not None:
            evacuated = write_local(args.local, args.cell, args.undo, args.force, None)
            print(f"{args.local}: evacuated {evacuated}")
            if args.status_url and not args.undo:
                print(f"cell {args.cell} empty after {wait_empty(args.status_url, args.cell, args.timeout):.1f} s")
            return exit_codes.OK
        fleet = load_fleet(args.config)
        if ssm_for is None:
            import boto3  # only on this path: --local and the tests need no AWS SDK session

            def ssm_for(region: str) -> Any:
                return boto3.client("ssm", region_name=region)
        for line in evacuate_on_aws(fleet, args.cell, args.undo, args.force, ssm_for):
            print(line)
        if not args.undo:
            print(f"each router task drains {args.cell} within its poll interval; its log says "
                  f'{{"event": "cell_empty", "cell": "{args.cell}"}} once no stream is left')
        return exit_codes.OK
    except EvacuateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_codes.EVACUATE
