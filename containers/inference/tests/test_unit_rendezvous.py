"""Units form, refuse strangers, time out and restart whole: real launcher processes on loopback."""

from __future__ import annotations

import ast
import json
import os
import random
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from unit_launcher import rendezvous

pytestmark = pytest.mark.timeout(90)

EXIT_FORM_TIMEOUT, EXIT_UNIT_LOST = 3, 5
CONTRACTS = Path(__file__).resolve().parents[3] / "docs" / "contracts.md"


def _serving(h, port: int, size: int):
    status = h.get_status(port)
    if (
        status
        and status["state"] == "serving"
        and len(status["members"]) == size
        and all(m["alive"] for m in status["members"])
    ):
        return status
    return None


def _records(h, tmp_path: Path, names: list[str]) -> dict[str, dict]:
    def ready():
        paths = [tmp_path / f"{n}.json" for n in names]
        return all(p.exists() for p in paths) and {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names}

    return h.wait_for(ready, 15, f"engines of {names}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; it belongs to a parent that has not reaped it.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_unit_of_two_forms_starts_the_multinode_plan_and_forms_again_after_a_stop(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes(spec, "follower", "i-follower")
    status = h.wait_for(lambda: _serving(h, spec["rendezvous"]["port"], 2), 20, "unit of 2 serving")
    assert [m["rank"] for m in status["members"]] == [0, 1]
    assert [m["instance_id"] for m in status["members"]] == ["i-leader", "i-follower"]
    records = _records(h, tmp_path, ["i-leader", "i-follower"])
    lead, follow = records["i-leader"], records["i-follower"]
    assert lead["argv"][:2] == ["serve", str(tmp_path)]
    assert "--node-rank=0" in lead["argv"] and "--nnodes=2" in lead["argv"]
    assert f"--port={spec['engine']['port']}" in lead["argv"] and "--headless" not in lead["argv"]
    assert "--node-rank=1" in follow["argv"] and "--headless" in follow["argv"]
    assert f"--master-port={spec['engine']['master_port']}" in follow["argv"]
    assert "--master-addr=127.0.0.1" in follow["argv"]
    # cpu plan: generic vLLM multi-node, no Neuron settings at all.
    assert not any(k.startswith(("NEURON_", "FI_")) for k in lead["env"] | follow["env"])
    assert lead["env"]["UNIT_SESSION_ID"] == follow["env"]["UNIT_SESSION_ID"] == status["session_id"]

    # SIGTERM on the leader stops the engine gracefully and takes the whole unit down; a
    # deliberate stop is a clean exit for every member.
    leader.signal(signal.SIGTERM)
    assert leader.wait(15) == 0, leader.log
    assert follower.wait(15) == 0, follower.log
    assert "ended session" in follower.log
    assert not _pid_alive(lead["pid"]) and not _pid_alive(follow["pid"])

    # ECS restarts the tasks: the unit forms again as a new session with the same ranks.
    for record in tmp_path.glob("*.json"):
        record.unlink()
    unit_nodes(spec, "follower", "i-follower")
    unit_nodes(spec, "leader", "i-leader")
    again = h.wait_for(lambda: _serving(h, spec["rendezvous"]["port"], 2), 20, "restarted unit serving")
    assert again["session_id"] != status["session_id"]
    assert [m["instance_id"] for m in again["members"]] == ["i-leader", "i-follower"]
    records = _records(h, tmp_path, ["i-leader", "i-follower"])
    assert records["i-follower"]["env"]["UNIT_SESSION_ID"] == again["session_id"]


def test_unit_of_four_ranks_are_deterministic_and_a_lost_follower_stops_the_whole_unit(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(4, record_dir=tmp_path)
    port = spec["rendezvous"]["port"]
    followers = ["i-ccc", "i-aaa", "i-ddd"]
    random.Random(7).shuffle(followers)
    leader = unit_nodes(spec, "leader", "i-zzz-leader")
    nodes = {name: unit_nodes(spec, "follower", name) for name in followers}
    status = h.wait_for(lambda: _serving(h, port, 4), 30, "unit of 4 serving")
    # Ranks do not depend on join order: followers sorted by address, then instance id.
    assert [(m["rank"], m["instance_id"]) for m in status["members"]] == [
        (0, "i-zzz-leader"),
        (1, "i-aaa"),
        (2, "i-ccc"),
        (3, "i-ddd"),
    ]
    records = _records(h, tmp_path, ["i-zzz-leader", *followers])
    assert {n: r["env"]["UNIT_RANK"] for n, r in records.items()} == {
        "i-zzz-leader": "0",
        "i-aaa": "1",
        "i-ccc": "2",
        "i-ddd": "3",
    }

    # Kill one follower outright: no goodbye, only missing heartbeats.
    nodes["i-ccc"].process.kill()
    loss = spec["rendezvous"]["follower_loss_seconds"]
    assert leader.wait(loss + 10) == EXIT_UNIT_LOST, leader.log
    assert "follower rank 2 127.0.0.1 (i-ccc) lost" in leader.log
    for name in ("i-aaa", "i-ddd"):
        assert nodes[name].wait(loss + 10) == EXIT_UNIT_LOST, nodes[name].log
    # No partial unit keeps running: the engines of every node are gone, the killed one's too.
    h.wait_for(lambda: not any(_pid_alive(r["pid"]) for r in records.values()), 10, "all engines gone")


def test_follower_of_another_revision_is_refused(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path, revision="rev-new", join_timeout_seconds=3)
    old = json.loads(json.dumps(spec))
    old["revision"] = "rev-old"
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes(old, "follower", "i-old")
    assert follower.wait(20) == EXIT_FORM_TIMEOUT, follower.log
    assert "runs revision rev-old; this leader runs revision rev-new" in follower.log
    status = h.get_status(spec["rendezvous"]["port"])
    if status is not None:  # the leader may already have given up too
        assert [m["instance_id"] for m in status["members"]] == ["i-leader"]
    assert leader.wait(20) == EXIT_FORM_TIMEOUT, leader.log
    assert "refused" in leader.log and not (tmp_path / "i-leader.json").exists()


def test_missing_member_times_out_naming_who_joined_and_how_many_are_missing(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(3, record_dir=tmp_path, join_timeout_seconds=2.5)
    leader = unit_nodes(spec, "leader", "i-leader")
    # The follower's own deadline after the leader's: one that gives up first withdraws its join
    # (a defect hunt, thirty-fourth session), and the leader would count 1/3.
    later = {**spec, "rendezvous": {**spec["rendezvous"], "join_timeout_seconds": 8}}
    follower = unit_nodes(later, "follower", "i-f1")
    assert leader.wait(20) == EXIT_FORM_TIMEOUT, leader.log
    assert "unit u0 did not form within 2.5 s: 2/3 members joined" in leader.log
    assert "127.0.0.1 (i-f1)" in leader.log and "missing 1 follower(s)" in leader.log
    assert follower.wait(20) == EXIT_FORM_TIMEOUT, follower.log
    assert "did not form for 127.0.0.1 (i-f1)" in follower.log
    # Nobody started an engine.
    assert not list(tmp_path.glob("*.json"))


def test_follower_engine_exit_ends_the_unit_at_once_with_its_status(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=30)
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes(spec, "follower", "i-f1", extra_env={"STANDIN_EXIT_AFTER": "1", "STANDIN_EXIT_CODE": "7"})
    assert follower.wait(20) == 7, follower.log
    assert (tmp_path / "i-f1.json").exists()  # the unit had formed and the engine had run
    # Not the 30 s loss limit: the follower said it was leaving, and the leader ended at once.
    assert leader.wait(15) == EXIT_UNIT_LOST, leader.log
    assert "left: engine exited with status 7" in leader.log


def test_leader_loss_stops_the_follower(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes(spec, "follower", "i-f1")
    h.wait_for(lambda: _serving(h, spec["rendezvous"]["port"], 2), 20, "unit serving")
    records = _records(h, tmp_path, ["i-leader", "i-f1"])
    leader.process.kill()
    assert follower.wait(spec["rendezvous"]["follower_loss_seconds"] + 10) == EXIT_UNIT_LOST, follower.log
    assert "unreachable" in follower.log
    # The killed leader's engine died with it (parent-death signal), the follower's was stopped.
    h.wait_for(lambda: not any(_pid_alive(r["pid"]) for r in records.values()), 10, "engines gone")


def test_a_restarted_follower_cannot_rejoin_the_running_session(tmp_path, unit_nodes, h):
    # Loss limit far away: only the restart itself may end the session here.
    spec = h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=60)
    leader = unit_nodes(spec, "leader", "i-leader")
    first = unit_nodes(spec, "follower", "i-f1")
    status = h.wait_for(lambda: _serving(h, spec["rendezvous"]["port"], 2), 20, "unit serving")
    first.process.kill()
    first.wait(10)
    unit_nodes(spec, "follower", "i-f1")  # same instance id, new process: its engine state is gone
    assert leader.wait(30) == EXIT_UNIT_LOST, leader.log
    assert "follower rank 1 127.0.0.1 (i-f1) restarted and asks to join again" in leader.log
    assert status["session_id"] in leader.log


def test_a_replacement_node_ends_a_session_whose_follower_went_silent(tmp_path, unit_nodes, h):
    # Loss limit far away (heartbeats every 5 s, late after 10 s): only the replacement may end it early.
    spec = h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=60)
    leader = unit_nodes(spec, "leader", "i-leader")
    first = unit_nodes(spec, "follower", "i-f1")
    status = h.wait_for(lambda: _serving(h, spec["rendezvous"]["port"], 2), 20, "unit serving")
    first.process.send_signal(signal.SIGSTOP)  # silent, not gone: only its replacement tells
    try:
        replacement = unit_nodes(spec, "follower", "i-f2")
        assert leader.wait(40) == EXIT_UNIT_LOST, leader.log
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert "follower rank 1 127.0.0.1 (i-f1) lost: no heartbeat for" in leader.log
    assert "a new node 127.0.0.1 (i-f2) asks to join in its place" in leader.log
    assert status["session_id"] in leader.log
    assert replacement.process.poll() is None or replacement.process.returncode != 0


def test_a_stray_node_does_not_end_a_session_whose_members_answer(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=60, join_timeout_seconds=5)
    leader = unit_nodes(spec, "leader", "i-leader")
    unit_nodes(spec, "follower", "i-f1")
    status = h.wait_for(lambda: _serving(h, spec["rendezvous"]["port"], 2), 20, "unit serving")
    stray = unit_nodes(spec, "follower", "i-stray")
    h.wait_for(lambda: "cannot join" in stray.log, 15, "the stray refused")
    assert leader.process.poll() is None
    again = _serving(h, spec["rendezvous"]["port"], 2)
    assert again is not None and again["session_id"] == status["session_id"]


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        raw = error.read()
        try:
            return error.code, json.loads(raw)
        except ValueError:
            return error.code, {"raw": raw.decode(errors="replace")[:200]}


def test_a_join_with_a_bad_wait_seconds_is_refused_400_and_not_counted(tmp_path, unit_nodes, h):
    """docs/contracts.md, `POST /join`: bad input is 400 naming the field. A `wait_seconds` that is not a
    number was a 500 from float() after the joiner had been counted: in a unit of 2 it took the follower's
    place and released the unit with a member that never read its release (a defect hunt, thirty-fourth
    session)."""
    spec = h.cpu_spec(2, record_dir=tmp_path)
    port = spec["rendezvous"]["port"]
    unit_nodes(spec, "leader", "i-leader")
    h.wait_for(lambda: h.get_status(port), 20, "the leader's /status")
    join = {"cell": spec["cell"], "unit_id": spec["unit_id"], "revision": spec["revision"], "address": "127.0.0.9",
            "instance_id": "i-ghost", "incarnation": "x"}
    for bad in (None, "soon", "5", -1, True, [5], float("nan"), float("inf")):
        status, doc = _post(port, "/join", {**join, "wait_seconds": bad})
        after = h.get_status(port)
        assert ([m["instance_id"] for m in after["members"]], after["state"], status) == (["i-leader"], "forming",
                                                                                           400), (bad, doc)
        assert "wait_seconds" in doc["error"] and "allowed: a finite number of seconds >= 0, or absent" in \
            doc["error"], doc
    # A number is taken as before (0: answered at once).
    status, doc = _post(port, "/join", {**join, "wait_seconds": 0})
    assert status == 200 and "i-ghost" in [m["instance_id"] for m in doc["members"]], doc


def test_a_join_whose_ids_are_not_text_is_refused_400_and_not_counted(tmp_path, unit_nodes, h):
    """The same pattern as `wait_seconds`: `_body` took a number for any required field, and a numeric
    `instance_id` completing the unit met the release's sort of the followers by address, then instance id:
    TypeError, a 500, and the number counted as a member (found checking the other handlers after the defect
    hunt of the thirty-fourth session)."""
    spec = h.cpu_spec(3, record_dir=tmp_path)
    port = spec["rendezvous"]["port"]
    unit_nodes(spec, "leader", "i-leader")
    h.wait_for(lambda: h.get_status(port), 20, "the leader's /status")
    join = {"cell": spec["cell"], "unit_id": spec["unit_id"], "revision": spec["revision"], "address": "127.0.0.9",
            "incarnation": "x", "wait_seconds": 0}
    # Joined, and the leader has its artifacts: the next member releases the unit.
    h.wait_for(lambda: _post(port, "/join", {**join, "instance_id": "i-f1"})[1]["leader_ready"], 20, "leader ready")
    status, doc = _post(port, "/join", {**join, "instance_id": 7})
    after = h.get_status(port)  # sorts the members the same way: it failed too, for the proxy's unit gate
    assert after is not None and status == 400, (status, doc, after)
    assert [m["instance_id"] for m in after["members"]] == ["i-leader", "i-f1"], after
    assert doc["error"] == "missing or invalid fields: instance_id", doc


def _refusals(function: ast.AST, methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]) -> set[str]:
    """The `reason`s of the 409s `function` answers: the first argument of its `self._refuse(...)` calls, and
    of those of the methods it calls (`self._refuse_withdrawn(...)`)."""
    reasons: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            if node.func.attr == "_refuse" and isinstance(node.args[0], ast.Constant):
                reasons.add(node.args[0].value)
            elif node.func.attr in methods and node.func.attr != function.name:
                reasons |= _refusals(methods[node.func.attr], methods)
    return reasons


def test_the_contract_names_every_refusal_the_rendezvous_endpoint_answers():
    """A client or runbook switches on the 409 `reason`: docs/contracts.md names each one `/join` answers, and
    every other one the endpoint answers. `duplicate` (a join with the leader's own instance id) was missing
    (a defect hunt, thirty-fourth session)."""
    tree = ast.parse(Path(rendezvous.__file__).read_text())
    leader = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LeaderSession")
    methods = {n.name: n for n in leader.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    text = " ".join(CONTRACTS.read_text().split())
    listed = re.search(r"`POST /join` \{.*?409 with `reason` ((?:`\w+`\|?)+)", text)
    assert listed, "docs/contracts.md: no `POST /join` ... 409 with `reason` `a`|`b` list"
    assert set(re.findall(r"`(\w+)`", listed.group(1))) == _refusals(methods["_join"], methods)
    every = set().union(*(_refusals(m, methods) for m in methods.values()))
    assert {"session_changed", "not_serving", "no_drain_requested"} <= every
    assert not {reason for reason in every if f"`{reason}`" not in text}
