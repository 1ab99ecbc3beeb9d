"""The router's evacuation from SSM (`unit_proxy.router_ssm`, issue 26) against a local SSM.

moto's server (ThreadedMotoServer, a real HTTP server on loopback) stands in for Systems Manager;
the agent's botocore client reaches it through AWS_ENDPOINT_URL_SSM, as it would reach SSM's
endpoint on AWS; nothing leaves the machine. The agent runs with HAProxy as its child and two
aiohttp "cells" (test_router.FakeCell): an evacuation written to the parameter drains the cell,
the task's report says when it is empty, an SSM outage or a bad value keeps the last state and
the loop goes on, and the shipped entry deletes its report when it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import boto3
import pytest
import unit_proxy.router as router_module
from aiohttp import web
from botocore.exceptions import ClientError
from moto.server import ThreadedMotoServer
from unit_proxy.router import RouterState, RunningRouter, start, task_id
from unit_proxy.router_config import CELL_NAME, RouterSettings
from unit_proxy.router_ssm import (
    MAX_FRONTED_CELLS,
    STANDARD_VALUE_MAX,
    EvacuationValueError,
    SsmClient,
    TaskReport,
    evacuation_parameter,
    parameter_prefix,
    parse_evacuated,
    report_parameter,
    reports_path,
)
from unit_proxy.settings import SettingsError

from loopback_ports import held_port

from .conftest import first_check_bound
from .test_router import LOOPBACK, NO_ALB, FakeCell, _post, cells  # noqa: F401 - `cells` is a fixture

REGION = "us-east-2"


@pytest.fixture
def ssm_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A local SSM on loopback and the environment that points botocore at it."""
    # Port 0, read back once bound: a port picked and closed here could be another process's by the time moto
    # binds it, and then start() waits forever (moto 5.2.5 sets its ready event only after a successful bind).
    server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    _reset(port)  # moto keeps its state per process, across servers
    env = {"AWS_ENDPOINT_URL_SSM": f"http://{LOOPBACK}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    _warm()
    local = {"server": server, "port": port, "env": env}
    yield local
    _reset(port)
    local["server"].stop()  # the test may have replaced it (a restart on the same port)


def _stop(ssm_env: dict[str, Any]) -> None:
    """Stop the local SSM, its port held until it starts again there (loopback_ports.held_port): free for the
    seconds it is down, the port could go to another bind to port 0, and moto's restart would wait forever."""
    ssm_env["server"].stop()
    held_port(ssm_env["port"])


def _reset(port: int) -> None:
    request = urllib.request.Request(f"http://{LOOPBACK}:{port}/moto-api/reset", method="POST")
    urllib.request.urlopen(request, timeout=10).close()


def _warm() -> None:
    """One SSM call before the test: moto loads its SSM backend on a process's first SSM request (1.9 s at load 7
    here, measured; the state then stays for the process), and the first test of a worker paid it inside its 10 s
    wait for the router's first report, from a test's event loop blocked by each synchronous `_report` (failed 1 of
    3 runs beside two busy loops: 'timed out after 10.0 s waiting for the first report')."""
    client = _client()
    with contextlib.suppress(client.exceptions.ParameterNotFound):
        client.get_parameter(Name="/warm-up")


_CLIENTS: dict[str, Any] = {}


def _client() -> Any:
    """One client per local SSM (a client costs a fraction of a second to make, in the test's event loop)."""
    endpoint = os.environ["AWS_ENDPOINT_URL_SSM"]
    if endpoint not in _CLIENTS:
        _CLIENTS[endpoint] = boto3.client("ssm", region_name=REGION)
    return _CLIENTS[endpoint]


def _report(prefix: str, task: str) -> TaskReport | None:
    client = _client()
    try:
        value = client.get_parameter(Name=report_parameter(prefix, task))["Parameter"]["Value"]
    except client.exceptions.ParameterNotFound:
        return None
    return TaskReport.from_json(value)


async def _until(predicate: Any, timeout: float = 10.0, what: str = "") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.1)


def test_no_parameter_yet_is_nothing_evacuated() -> None:
    """SsmClient.read gives ("", 0) for a parameter not written yet (the router stack does not create it): nothing
    evacuated, not an error (it was one, so a fresh router never counted as having read SSM)."""
    assert parse_evacuated("", {"a"}, "x") == (frozenset(), [])
    with pytest.raises(EvacuationValueError):
        parse_evacuated("{}", {"a"}, "x")


def test_prefix_and_names_are_one_convention() -> None:
    prefix = parameter_prefix("Rufus", REGION)
    assert prefix == "/inference-fleet/Rufus/router/us-east-2"
    assert evacuation_parameter(prefix) == f"{prefix}/evacuated"
    assert report_parameter(prefix, "ip-10-0-1-2.ec2.internal-7") == f"{prefix}/tasks/ip-10-0-1-2.ec2.internal-7"
    assert report_parameter(prefix, "a b:c").startswith(reports_path(prefix) + "/a-b-c")


@pytest.mark.parametrize(("env", "named"), [
    ({"ROUTER_SSM_PREFIX": "/x/y", "ROUTER_EVACUATION_FILE": "/tmp/e.json", "AWS_REGION": REGION},
     "ROUTER_SSM_PREFIX"),
    ({"ROUTER_SSM_PREFIX": "no-slash", "AWS_REGION": REGION}, "ROUTER_SSM_PREFIX"),
    ({"ROUTER_SSM_PREFIX": "/x/y"}, "AWS_REGION"),
    ({"ROUTER_SSM_PREFIX": "/x/y", "AWS_REGION": REGION, "ROUTER_SSM_POLL_SECONDS": "0.1"},
     "ROUTER_SSM_POLL_SECONDS"),
])
def test_bad_ssm_settings_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError) as caught:
        RouterSettings.from_env({"ROUTER_CELLS": "a=http://127.0.0.1:1", **env})
    assert caught.value.name == named


async def test_an_ssm_evacuation_drains_the_cell_reports_it_empty_and_survives_ssm_errors(
        cells: tuple[FakeCell, FakeCell], ssm_env: dict[str, Any]) -> None:  # noqa: F811
    a, b = cells
    prefix = parameter_prefix("Drain", REGION)
    name = evacuation_parameter(prefix)
    settings = RouterSettings.from_env({
        "ROUTER_CELLS": f"a={a.url},b={b.url}", "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0",
        "ROUTER_ADMIN_PORT": "0", "ROUTER_POLL_SECONDS": "0.05", "ROUTER_CHECK_INTERVAL_MS": "1000", **NO_ALB,
        "ROUTER_SSM_PREFIX": prefix, "ROUTER_SSM_POLL_SECONDS": "1", "ROUTER_TASK_ID": "task-1", **ssm_env["env"]})
    router = await start(settings)
    state = router.state
    try:
        # No parameter yet: nothing evacuated, and the task reports version 0.
        await _until(lambda: _report(prefix, "task-1") is not None, what="the first report")
        assert _report(prefix, "task-1") == TaskReport("task-1", 0, [], [], fronts=["a", "b"])
        await _until(lambda: all(c.status == "UP" for c in state.cells.values()), timeout=20, what="both cells UP")
        async with aiohttp.ClientSession() as session:
            b.hold.clear()  # a request stays in flight on b
            pending = []
            for _ in range(200):  # leastconn may send the first ones to a, which answers at once
                pending.append(asyncio.create_task(_post(session, router.port)))
                await asyncio.sleep(0.05)
                if b.posts:
                    break
            assert b.posts, "no request reached b"
            version = _client().put_parameter(Name=name, Value=json.dumps({"evacuated": ["b"]}), Type="String",
                                              Overwrite=True)["Version"]
            await _until(lambda: state.cells["b"].evacuated, what="b drained")
            # The agent writes its report just after it marks the cell evacuated: wait for it.
            await _until(lambda: (_report(prefix, "task-1") or TaskReport("", 0)).version == version,
                         what="the report of the new version")
            assert _report(prefix, "task-1").empty == []  # streams still on b
            posts = b.posts
            assert [await _post(session, router.port) for _ in range(10)] == [(200, "a")] * 10
            assert b.posts == posts
            b.hold.set()
            answers = await asyncio.gather(*pending)
            assert all(status == 200 for status, _ in answers), answers
            await _until(lambda: (_report(prefix, "task-1") or TaskReport("", 0)).empty == ["b"],
                         what="b reported empty")

            # A value the router cannot use: logged, the last state kept, the loop goes on.
            _client().put_parameter(Name=name, Value="not json", Type="String", Overwrite=True)
            await _until(lambda: state.ssm_error is not None, what="the bad value seen")
            assert "not JSON" in state.ssm_error and state.evacuated == frozenset({"b"})
            # SSM unreachable: the same.
            _stop(ssm_env)
            await _until(lambda: state.ssm_error is not None and "not JSON" not in state.ssm_error, what="SSM down")
            assert state.evacuated == frozenset({"b"})
            assert [await _post(session, router.port) for _ in range(5)] == [(200, "a")] * 5
            ssm_env["server"] = ThreadedMotoServer(ip_address=LOOPBACK, port=ssm_env["port"], verbose=False)
            ssm_env["server"].start()
            _client().put_parameter(Name=name, Value=json.dumps({"evacuated": []}), Type="String", Overwrite=True)
            await _until(lambda: not state.cells["b"].evacuated, what="the undo after SSM came back")
            assert state.ssm_error is None
            await state.refresh()
            assert state.cells["b"].status == "UP"
    finally:
        await router.close()
    assert _report(prefix, "task-1") is None  # a clean exit deletes the task's report


async def test_the_shipped_router_reads_ssm_and_deletes_its_report_on_sigterm(
        cells: tuple[FakeCell, FakeCell], ssm_env: dict[str, Any]) -> None:  # noqa: F811
    """`python -m unit_proxy.router` as a process, its botocore pointed at the local SSM."""
    a, b = cells
    prefix = parameter_prefix("Proc", REGION)
    _client().put_parameter(Name=evacuation_parameter(prefix), Value='{"evacuated": ["a"]}', Type="String")
    port, admin = held_port(), held_port()
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/bin"), "ROUTER_CELLS": f"a={a.url},b={b.url}",
           "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": str(port), "ROUTER_ADMIN_PORT": str(admin),
           "ROUTER_CHECK_INTERVAL_MS": "1000", **NO_ALB, "ROUTER_SSM_PREFIX": prefix, "ROUTER_SSM_POLL_SECONDS": "1",
           "ROUTER_TASK_ID": "proc-1", **ssm_env["env"]}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "unit_proxy.router", env=env,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        await _until(lambda: (_report(prefix, "proc-1") or TaskReport("", 0)).empty == ["a"], timeout=20,
                     what="the process's report: a evacuated and empty")
        async with aiohttp.ClientSession() as session:
            # b takes every request only once HAProxy passed a check of it (conftest.cells_checked): its first
            # check timing out (1 s) took it DOWN and the requests below got 503 until it was back.
            await _checked(session, admin, "b", first_check_bound(RouterSettings.from_env(env)))
            assert [await _post(session, port) for _ in range(6)] == [(200, "b")] * 6
            assert a.posts == 0
            # A stream held on b: the soft stop waits for it, and the report must be gone before that wait
            # (Fargate kills the task after its stop timeout; a report left behind reads as a live task).
            b.hold.clear()
            posts = b.posts
            held = asyncio.create_task(_post(session, port))
            await _until(lambda: b.posts > posts, what="the held request on b")
            proc.send_signal(signal.SIGTERM)
            await _until(lambda: _report(prefix, "proc-1") is None, timeout=5,
                         what="the report deleted while the soft stop waits for the stream")
            assert proc.returncode is None and not held.done()
            b.hold.set()
            assert await held == (200, "b")
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        elif proc.returncode:
            print((await proc.stderr.read()).decode())


async def _checked(session: aiohttp.ClientSession, admin: int, name: str, timeout: float) -> None:
    """Until the router process's `GET /status` says HAProxy passed a check of cell `name` (status `UP`)."""
    loop = asyncio.get_running_loop()
    end, status = loop.time() + timeout, None
    while status != "UP":
        assert loop.time() < end, f"timed out after {timeout} s waiting for a passed check of {name}: {status}"
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"http://{LOOPBACK}:{admin}/status") as resp:
                status = (await resp.json())["cells"][name]["status"]
        await asyncio.sleep(0.05)


async def test_the_router_is_not_healthy_before_its_first_ssm_read(
        cells: tuple[FakeCell, FakeCell], ssm_env: dict[str, Any]) -> None:  # noqa: F811
    """SSM unreachable at start: the task does not know which cells are evacuated, so the ALB's check
    (/router/health) fails until a read succeeds, and the task takes no traffic meanwhile: a request sent anyway
    (the ALB fails open when every target is unhealthy) gets 503, it used to be routed with nothing evacuated."""
    a, b = cells
    prefix = parameter_prefix("Ready", REGION)
    _stop(ssm_env)
    settings = RouterSettings.from_env({
        "ROUTER_CELLS": f"a={a.url},b={b.url}", "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0",
        "ROUTER_ADMIN_PORT": "0", "ROUTER_CHECK_INTERVAL_MS": "1000", **NO_ALB, "ROUTER_SSM_PREFIX": prefix,
        "ROUTER_SSM_POLL_SECONDS": "1", "ROUTER_TASK_ID": "ready-1", **ssm_env["env"]})
    router = await start(settings)

    async def health(port: int | None = None) -> int:
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://{LOOPBACK}:{port or router.port}/router/health") as resp:
            return resp.status

    try:
        await _until(lambda: router.state.ssm_error is not None, what="the failed SSM read")
        # On the data port and on the health listener the ALB checks (ROUTER_HEALTH_PORT) alike.
        assert await health() == await health(router.health_port) == 503 and not router.state.ready
        # Nor does a request reach a cell: an ALB whose targets are all unhealthy fails open and sends to them.
        await _until(lambda: all(c.status == "UP" for c in router.state.cells.values()), timeout=20,
                     what="both cells UP")
        async with aiohttp.ClientSession() as session, \
                session.post(f"http://{LOOPBACK}:{router.port}/v1/completions", json={}) as resp:
            assert (resp.status, await resp.text()) == (503, "evacuation not read yet")
        assert a.posts == b.posts == 0
        ssm_env["server"] = ThreadedMotoServer(ip_address=LOOPBACK, port=ssm_env["port"], verbose=False)
        ssm_env["server"].start()
        await _until(lambda: router.state.ready, timeout=15, what="the first SSM read")
        assert await health() == await health(router.health_port) == 200
    finally:
        await router.close()


async def test_a_cell_no_longer_fronted_in_the_parameter_is_ignored_and_the_task_becomes_ready(
        cells: tuple[FakeCell, FakeCell], ssm_env: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """A cell evacuated, then removed from `routers[].cells` and the router redeployed: the parameter still
    names it. It was an error (`unknown cells ['old']`), so every new task kept /router/health 503 forever
    (ECS replacing tasks, the deployment rolled back). Now the name is logged and ignored; the fronted cells
    named there are still drained. The task's report says which cells it fronts, so `evacuate --wait` can tell
    the ignored name from an undo (the thirty-fourth session's defect hunt: without `fronts`, a task that does
    not front the cell read as "another evacuation was written since")."""
    a, b = cells
    prefix = parameter_prefix("Gone", REGION)
    _client().put_parameter(Name=evacuation_parameter(prefix), Value=json.dumps({"evacuated": ["old", "b"]}),
                            Type="String", Overwrite=True)
    settings = RouterSettings.from_env({
        "ROUTER_CELLS": f"a={a.url},b={b.url}", "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0",
        "ROUTER_ADMIN_PORT": "0", "ROUTER_CHECK_INTERVAL_MS": "1000", **NO_ALB, "ROUTER_SSM_PREFIX": prefix,
        "ROUTER_SSM_POLL_SECONDS": "1", "ROUTER_TASK_ID": "gone-1", **ssm_env["env"]})
    caplog.set_level(logging.WARNING, logger="unit_proxy.router")
    router = await start(settings)
    try:
        await _until(lambda: router.state.ready or router.state.ssm_error is not None, what="the first SSM read")
        assert router.state.ssm_error is None and router.state.ready, router.state.ssm_error
        assert router.state.evacuated == frozenset({"b"}) and router.state.ignored == ["old"]
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://{LOOPBACK}:{router.port}/router/health") as resp:
            assert resp.status == 200
        ignored = [r.getMessage() for r in caplog.records if "evacuation_names_ignored" in r.getMessage()]
        assert len(ignored) == 1 and '"old"' in ignored[0], ignored
        await _until(lambda: _report(prefix, "gone-1") is not None, what="the report")
        report = _report(prefix, "gone-1")
        assert (report.evacuated, report.fronts) == (["b"], ["a", "b"]), report
    finally:
        await router.close()


def test_a_report_from_an_agent_older_than_fronts_still_reads() -> None:
    """Reports written by a router image from before the `fronts` field (a rolling deploy, a router not
    redeployed) parse with `fronts` None, which `evacuate --wait` reads as "not known": it may front the cell."""
    old = '{"empty": [], "evacuated": ["b"], "task": "t1", "version": 3}'
    assert TaskReport.from_json(old) == TaskReport("t1", 3, ["b"], [], fronts=None)
    assert TaskReport.from_json(old).to_json() == old  # written back as the older agent wrote it
    new = TaskReport("t1", 3, ["b"], ["b"], fronts=["a", "b"])
    assert TaskReport.from_json(new.to_json()) == new


@pytest.mark.parametrize(("field", "value"), [("fronts", "dev,prod"), ("evacuated", "prod"), ("empty", {"prod": 1}),
                                               ("fronts", ["dev", 5])])
def test_a_report_whose_names_are_not_a_list_of_strings_is_not_read(field: str, value: Any) -> None:
    """Regression (a cold review in the thirty-fourth session): `from_json` took `list(value)`, so a `fronts` of
    "dev,prod" read as the names "d", "e", "v", ... and `evacuate --wait` counted the task as not fronting prod.
    Now ValueError, which the wait reads as an unreadable report (tests/test_evacuate.py); so is a report that is
    not a JSON object (it was AttributeError, which the wait did not catch)."""
    doc = {"task": "t1", "version": 3, "evacuated": ["prod"], "empty": [], "fronts": ["dev", "prod"], field: value}
    with pytest.raises(ValueError, match=f"report field '{field}': expected a list of cell names"):
        TaskReport.from_json(json.dumps(doc))
    for text in ("[]", '"t1"', "5"):
        with pytest.raises(ValueError, match="a report is a JSON object"):
            TaskReport.from_json(text)


class _Idle:
    """The runtime API of a router with no stream on any cell."""

    async def show_stat(self) -> list[dict[str, str]]:
        return []

    async def command(self, command: str) -> str:
        return ""


def _longest_names(count: int) -> list[str]:
    """`count` cell names of the longest length CELL_NAME (the fleet file's pattern) allows."""
    longest = max(n for n in range(1, 64) if CELL_NAME.fullmatch("a" * n))
    names = [f"c{i:03d}".ljust(longest, "x") for i in range(count)]
    assert all(CELL_NAME.fullmatch(name) for name in names) and longest == 24
    return names


def _worst_report(count: int) -> str:
    """The report RouterState writes with `count` cells of the longest names, every one evacuated and empty, the
    version at a 64-bit maximum and a 72-character task id (router.task_id's fallback: a 64-character host name,
    Linux's longest, "-" and a 7-digit pid; an ECS task id has 32)."""
    names = _longest_names(count)
    settings = RouterSettings.from_env({"ROUTER_CELLS": ",".join(f"{n}=http://127.0.0.1:{i + 1}"
                                                                 for i, n in enumerate(names))})
    state = RouterState(settings, _Idle())  # type: ignore[arg-type]
    state.evacuated, state.version = frozenset(names), 2**63 - 1
    for name in names:
        state.cells[name].evacuated = state.cells[name].empty = True
    return state.report("h" * 64 + "-4194304").to_json()


def test_the_report_of_a_router_at_its_most_cells_fits_a_standard_parameter() -> None:
    """Regression (a cold review in the thirty-fourth session): the report names every fronted cell in `fronts`
    (since that session's defect hunt), and PutParameter refuses a Standard parameter over 4 KB (botocore's SSM
    model, PutParameterRequest.Value), so a router of about 48 cells with all but one evacuated, or 146 with one,
    had no report and `evacuate --wait` gave up after 965 s, "no router task reported". The fleet file now allows
    MAX_FRONTED_CELLS under a router (inference_fleet.config, tests/fleets/bad/router-too-many-cells.yaml): its
    worst report, every cell evacuated and empty, fits with room for a new field."""
    worst = len(_worst_report(MAX_FRONTED_CELLS))
    assert worst == 3514 and STANDARD_VALUE_MAX - worst >= 500, worst  # the figures router_ssm's comment gives
    assert len(_worst_report(47)) > STANDARD_VALUE_MAX >= len(_worst_report(46))  # where the limit falls


def _standard_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """SsmClient.write with Parameter Store's Standard-tier limit, which moto (the local SSM) does not apply
    (moto/ssm/models.py put_parameter checks no value size): a value over STANDARD_VALUE_MAX is refused as SSM
    refuses it, a ValidationException (the message as quoted in public reports; unverified word for word)."""
    write = SsmClient.write

    def standard(self: SsmClient, name: str, value: str) -> None:
        if len(value) > STANDARD_VALUE_MAX:
            raise ClientError({"Error": {"Code": "ValidationException", "Message": "Standard tier parameters support "
                                         "a maximum parameter value of 4096 characters."}}, "PutParameter")
        write(self, name, value)

    monkeypatch.setattr(SsmClient, "write", standard)


async def test_a_refused_report_write_is_logged_once_saying_what_it_means(
        cells: tuple[FakeCell, FakeCell], ssm_env: dict[str, Any],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Regression (a cold review in the thirty-fourth session): a router of 60 cells (ROUTER_CELLS is not capped;
    the fleet file is) with 58 evacuated: once they are empty its report passes 4 KB and SSM refuses it. The agent
    logged "router SSM poll failed" and a traceback at every poll, never saying that `evacuate --wait` cannot see
    the task. Now one `evacuation_report_error` naming the parameter, the size and the limit; the task serves on,
    and the next write that lands says so."""
    a, b = cells
    prefix = parameter_prefix("Big", REGION)
    _standard_tier(monkeypatch)
    many = _longest_names(58)
    settings = RouterSettings.from_env({
        "ROUTER_CELLS": ",".join([f"a={a.url}", f"b={b.url}", *(f"{name}={a.url}" for name in many)]),
        "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0", "ROUTER_ADMIN_PORT": "0", "ROUTER_CHECK_INTERVAL_MS": "1000",
        **NO_ALB, "ROUTER_SSM_PREFIX": prefix, "ROUTER_SSM_POLL_SECONDS": "1", "ROUTER_TASK_ID": "big-1",
        **ssm_env["env"]})
    caplog.set_level(logging.WARNING, logger="unit_proxy.router")
    name = evacuation_parameter(prefix)
    _client().put_parameter(Name=name, Value=json.dumps({"evacuated": many}), Type="String")

    def said(event: str) -> list[dict[str, Any]]:
        return [json.loads(r.getMessage()) for r in caplog.records if f'"event": "{event}"' in r.getMessage()]

    router = await start(settings)
    try:
        await _until(lambda: said("evacuation_report_error"), timeout=20, what="the refused report logged")
        await asyncio.sleep(2.5)  # two more polls, each refused again
        [error] = said("evacuation_report_error")
        assert error["parameter"] == report_parameter(prefix, "big-1") and error["chars"] > STANDARD_VALUE_MAX
        assert "ValidationException" in error["error"], error
        assert f"over the {STANDARD_VALUE_MAX} of a Standard SSM parameter" in error["effect"], error
        assert "no router task reported" in error["effect"], error
        assert not [r for r in caplog.records if "router SSM poll failed" in r.getMessage()]
        assert router.state.ready and router.state.evacuated == frozenset(many)  # it serves on, evacuation applied
        # The evacuation undone, the report fits again: written, and the log says so.
        _client().put_parameter(Name=name, Value=json.dumps({"evacuated": []}), Type="String", Overwrite=True)
        await _until(lambda: said("evacuation_report_recovered"), timeout=10, what="the report written again")
        report = _report(prefix, "big-1")
        assert report is not None and report.evacuated == [] and len(report.fronts or []) == 60
    finally:
        await router.close()


async def test_the_task_id_comes_from_the_ecs_task_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """`${ECS_CONTAINER_METADATA_URI_V4}/task` answers the task's `TaskARN` (task metadata endpoint v4); the
    report is named after the id at its end. Unreachable: host name and pid; ROUTER_TASK_ID wins."""
    async def task(request: web.Request) -> web.Response:
        return web.json_response({"Cluster": "c", "TaskARN": "arn:aws:ecs:us-east-2:111111111111:task/c/0f1e2d3c4b5a"})

    app = web.Application()
    app.router.add_get("/v4/abc/task", task)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    settings = RouterSettings.from_env({"ROUTER_CELLS": "a=http://127.0.0.1:1"})
    try:
        monkeypatch.setenv("ECS_CONTAINER_METADATA_URI_V4", f"http://{LOOPBACK}:{runner.addresses[0][1]}/v4/abc")
        assert await task_id(settings) == "0f1e2d3c4b5a"
        monkeypatch.setenv("ECS_CONTAINER_METADATA_URI_V4", f"http://{LOOPBACK}:{held_port()}/v4/abc")
        assert await task_id(settings) == f"{socket.gethostname()}-{os.getpid()}"
        assert await task_id(RouterSettings.from_env({"ROUTER_CELLS": "a=http://127.0.0.1:1",
                                                      "ROUTER_TASK_ID": "mine"})) == "mine"
    finally:
        await runner.cleanup()


def _slow_write(monkeypatch: pytest.MonkeyPatch, seconds: float) -> threading.Event:
    """SsmClient.write takes `seconds` more before it calls the local SSM (a slow SSM); the event is set once a
    write has begun."""
    begun = threading.Event()
    write = SsmClient.write

    def slow(self: SsmClient, name: str, value: str) -> None:
        begun.set()
        time.sleep(seconds)
        write(self, name, value)

    monkeypatch.setattr(SsmClient, "write", slow)
    return begun


async def _router_with_report(a: FakeCell, b: FakeCell, env: dict[str, str], prefix: str) -> RunningRouter:
    return await start(RouterSettings.from_env({
        "ROUTER_CELLS": f"a={a.url},b={b.url}", "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0",
        "ROUTER_ADMIN_PORT": "0", "ROUTER_CHECK_INTERVAL_MS": "1000", **NO_ALB, "ROUTER_SSM_PREFIX": prefix,
        "ROUTER_SSM_POLL_SECONDS": "1", "ROUTER_TASK_ID": "task-1", **env}))


async def test_a_report_write_in_flight_at_the_stop_lands_before_the_delete(
        cells: tuple[FakeCell, FakeCell], ssm_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The stop cancels the SSM loop while its report write runs in a thread: that write must not land after
    the delete, or `evacuate --wait` reads the stopped task as live until its report is stale (180 s).
    Old code: the report was back 0.5 s after the delete."""
    a, b = cells
    prefix = parameter_prefix("Race", REGION)
    begun = _slow_write(monkeypatch, 0.3)
    router = await _router_with_report(a, b, ssm_env["env"], prefix)
    try:
        assert await asyncio.to_thread(begun.wait, 5), "no report write began"
    finally:
        await router.close()
    assert _report(prefix, "task-1") is None, "the report is there right after the stop"
    await asyncio.sleep(0.5)  # the old code's write landed 0.3 s after it began
    assert _report(prefix, "task-1") is None, "the report came back after it was deleted"


async def test_a_hung_report_write_holds_the_stop_no_longer_than_its_bound(
        cells: tuple[FakeCell, FakeCell], ssm_env: dict[str, Any],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A write that hangs past SSM_CALL_SECONDS: the stop deletes the report anyway, says so, and goes on."""
    a, b = cells
    prefix = parameter_prefix("Hung", REGION)
    monkeypatch.setattr(router_module, "SSM_CALL_SECONDS", 0.5)
    # The write hangs 5 s; the stop takes its bound for it and for the delete (0.5 s each) and HAProxy's own
    # stop: 3.5 s leaves a loaded machine 2.5 s for that, where it was 0.8 s against a 2 s write (still
    # well short of the write, which a stop without the bound waits for).
    begun = _slow_write(monkeypatch, 5.0)
    router = await _router_with_report(a, b, ssm_env["env"], prefix)
    assert await asyncio.to_thread(begun.wait, 5), "no report write began"
    loop = asyncio.get_running_loop()
    began = loop.time()
    await router.close()
    assert loop.time() - began < 3.5, "the stop waited for the hung write beyond its bound"
    assert "an SSM report write still runs after 0.5 s" in caplog.text
    assert router.ssm is not None and router.ssm.writing is not None
    await asyncio.wait({router.ssm.writing}, timeout=10)  # the write's thread ends before the local SSM does
