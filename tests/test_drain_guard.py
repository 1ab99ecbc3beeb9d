"""The follower's drain guard, executed as ECS runs it: read from the synthesized template, run by dash.

Each run is a fresh PID namespace with its own /proc (`unshare --pid --fork --mount-proc`,
root needed), like the follower task's shared namespace (pidMode task). PID 1 is a small
dash script standing in for the task: it starts what the test asks for (a stand-in
launcher whose command line is the image's, `/opt/unit-launcher/bin/python -m unit_launcher
run`, which reports each SIGUSR1 it gets; decoys that only mention the launcher), starts
the guard as `/bin/sh -c <script>` with the container's environment, sends it SIGTERM as
ECS does, and reports, from /proc/uptime, how long the guard took to exit.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from cell_constructs.inference_unit import ENGINE_STOP_TIMEOUT, LAUNCHER_MODULE, LAUNCHER_PYTHON
from tests.conftest import ROOT
from tests.shipped_scripts import (
    CAN_RUN_AS_IN_A_TASK,
    WHY_NOT,
    ShippedScript,
    fake_launcher_package,
    one,
    run_as_in_a_task,
    shipped_scripts,
)

DEV = "Rufus-Cell-dev"
GUARD = "UnitFollowerTask/drain-guard/Command"
# Longest a test waits for a guard that should have exited: far below any real bound.
PATIENCE_SECONDS = 20

pytestmark = pytest.mark.skipif(not CAN_RUN_AS_IN_A_TASK, reason=WHY_NOT)

# The follower task: the launcher and decoys asked for, then the guard as ECS starts it
# (`/bin/sh -c <script>`, the container's environment); SIGTERM once each has its handler in place
# (the guard's TERM trap, the Python stand-ins' SIGUSR1: SigCgt in /proc/<pid>/status); how long
# the guard took to exit, from /proc/uptime. Not a fixed `sleep 1`: a stand-in that had not yet
# installed its handler was ended by the guard's SIGUSR1 (seen with its start-up slowed by 1.2 s, as
# a loaded machine slows Python's), and a decoy so ended would hide a guard that signals it.
_TASK = r"""
catches() {  # pid signal
  mask=$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null)
  [ -n "$mask" ] && [ $(( (0x$mask >> ($2 - 1)) & 1 )) -eq 1 ]
}
ready() {  # pid signal: wait until pid handles signal, 10 s at most
  n=0
  until catches "$1" "$2"; do
    n=$((n + 1)); [ "$n" -lt 1000 ] || { echo "NOT_READY pid=$1 signal=$2"; exit 94; }
    sleep 0.01
  done
}
if [ -n "$LAUNCHER_SECONDS" ]; then "$LAUNCHER_PYTHON" -m unit_launcher run & launcher=$!; fi
if [ -n "$DECOYS" ]; then
  "$LAUNCHER_PYTHON" -m unit_launcher.health_file --joining-seconds 1800 & decoy=$!
  /bin/sh -c 'sleep 600; echo unit_launcher' &
fi
/bin/sh -c "$GUARD_SCRIPT" &
guard=$!
ready "$guard" 15
if [ -n "$LAUNCHER_SECONDS" ]; then ready "$launcher" 10; fi
if [ -n "$DECOYS" ]; then ready "$decoy" 10; fi
read -r sent _ < /proc/uptime
kill -TERM "$guard"
wait "$guard"
status=$?
read -r done _ < /proc/uptime
echo "GUARD_EXIT status=$status sent=$sent done=$done"
"""


@pytest.fixture(scope="module")
def guard(synth_default) -> ShippedScript:
    return one(shipped_scripts(DEV, synth_default.template_json(DEV)), GUARD)


@pytest.fixture(scope="module")
def fake_launcher_path(tmp_path_factory) -> Path:
    return fake_launcher_package(tmp_path_factory.mktemp("fake-launcher"))


def run_guard(
    guard: ShippedScript, fake_launcher_path: Path, *, launcher_seconds: float | None = None, decoys: bool = False,
    environment: dict[str, str] | None = None,
) -> float:
    """Seconds from SIGTERM to the guard's exit, in a fresh PID namespace; fails past PATIENCE_SECONDS."""
    return run_guard_output(guard, fake_launcher_path, launcher_seconds=launcher_seconds, decoys=decoys,
                            environment=environment)[0]


def run_guard_output(
    guard: ShippedScript, fake_launcher_path: Path, *, launcher_seconds: float | None = None, decoys: bool = False,
    environment: dict[str, str] | None = None,
) -> tuple[float, dict[str, str], str]:
    """As `run_guard`, with the task's exit fields (sent, done: /proc/uptime) and its whole output."""
    env = {
        **dict(guard.environment),
        **(environment or {}),
        "GUARD_SCRIPT": guard.text,
        "LAUNCHER_SECONDS": "" if launcher_seconds is None else str(launcher_seconds),
        "DECOYS": "1" if decoys else "",
    }
    try:
        done = run_as_in_a_task(_TASK, env, package=fake_launcher_path, timeout=PATIENCE_SECONDS + 5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the guard was still running {PATIENCE_SECONDS} s after SIGTERM")
    line = next((x for x in done.stdout.splitlines() if x.startswith("GUARD_EXIT")), None)
    assert line, f"no exit reported: {done.stdout!r} {done.stderr!r}"
    fields = dict(f.split("=") for f in line.split()[1:])
    assert fields["status"] == "0", done.stdout + done.stderr
    return float(fields["done"]) - float(fields["sent"]), fields, done.stdout + done.stderr


def test_guard_tells_the_launcher_its_task_is_stopping_and_only_the_launcher(guard, fake_launcher_path) -> None:
    """On SIGTERM the guard sends SIGUSR1 to the launcher it matched (which then asks its leader to
    drain and exits once the session ended: here 2 s later); the decoys get nothing."""
    waited, fields, output = run_guard_output(
        guard, fake_launcher_path, launcher_seconds=600, decoys=True, environment={"LAUNCHER_EXIT_AFTER_USR1": "2"}
    )
    got = [line for line in output.splitlines() if line.startswith("LAUNCHER_GOT_USR1")]
    assert len(got) == 1, output
    received = float(dict(f.split("=") for f in got[0].split()[1:])["uptime"])
    assert 0 <= received - float(fields["sent"]) < 1.5, output
    assert "DECOY_GOT_USR1" not in output
    assert "told the launcher" in output
    # The guard then waits for the launcher, which exits 2 s after the signal (the guard polls each second).
    assert 1.5 <= waited < 6, f"the guard released the engine {waited:.1f} s after SIGTERM; the launcher lived 2 s"


def test_guard_releases_at_once_without_a_launcher(guard, fake_launcher_path) -> None:
    """After a unit failure the launcher has exited: the engine must not wait (it waited 750 s)."""
    waited = run_guard(guard, fake_launcher_path)
    assert waited < 2, f"the guard waited {waited:.1f} s with no launcher"


def test_guard_is_not_fooled_by_processes_that_only_name_the_launcher(guard, fake_launcher_path) -> None:
    """The follower's health check (`python -m unit_launcher.health_file`) and any `sh -c` mentioning it."""
    waited = run_guard(guard, fake_launcher_path, decoys=True)
    assert waited < 2, f"the guard waited {waited:.1f} s for decoys"


def test_guard_holds_the_engine_until_the_launcher_exits(guard, fake_launcher_path) -> None:
    """The launcher exits 5 s after its start: some 4-5 s after the guard's SIGTERM, which waits for every stand-in's
    handler (a loaded machine starts the decoy's Python later than the launcher's: that time comes off the
    launcher's remaining life, and at 4 s a second of it would break the lower bound). The guard follows it,
    within its poll (1 s). Far below the guard's own bound, which PATIENCE_SECONDS does not reach."""
    waited = run_guard(guard, fake_launcher_path, launcher_seconds=5, decoys=True)
    assert 3 <= waited < 8, f"the guard released the engine {waited:.1f} s after SIGTERM, the launcher lived 4-5 s"


def test_guard_gives_up_at_its_bound(guard, fake_launcher_path) -> None:
    """A launcher that never exits: the guard releases the engine at the bound it is given."""
    (name,) = [k for k, _ in guard.environment]
    waited = run_guard(guard, fake_launcher_path, launcher_seconds=600, environment={name: "3"})
    assert 3 <= waited < 5, f"bound 3 s, the guard waited {waited:.1f} s"


# The same task on a fake clock: /proc/uptime is a file the test owns (bind-mounted over the
# kernel's), set so that SIGTERM comes late in a second (100.98); each `sleep 1` sleeps 1 s and
# moves the clock 1.01 s, as a real sleep overruns a little. Whole-second arithmetic released a
# 3 s bound after 2.02 s here, as it did once in CI (seen failing on the old script); the fields
# are read from the fake clock.
_TASK_ON_A_FAKE_CLOCK = r"""
printf '100.98 0.00\n' > /tmp/uptime && mount --bind /tmp/uptime /proc/uptime || exit 93
mkdir -p /tmp/bin && cat > /tmp/bin/sleep <<'SLEEP'
#!/bin/sh
if [ "$1" = 1 ]; then
  read -r up _ < /proc/uptime; f=${up#*.}; cs=$(( ${up%.*} * 100 + ${f#0} + 101 ))
  printf '%d.%02d 0.00\n' $(( cs / 100 )) $(( cs % 100 )) > /tmp/uptime
  exec /bin/sleep 1
fi
exec /bin/sleep "$@"
SLEEP
chmod +x /tmp/bin/sleep && export PATH="/tmp/bin:$PATH"
""" + _TASK


def test_guard_bound_is_not_shortened_by_whole_seconds(guard, fake_launcher_path) -> None:
    """A SIGTERM late in a second: the bound still counts whole seconds from it (CI once saw 2.02 s of 3)."""
    (name,) = [k for k, _ in guard.environment]
    env = {**dict(guard.environment), name: "3", "GUARD_SCRIPT": guard.text, "LAUNCHER_SECONDS": "600", "DECOYS": ""}
    done = run_as_in_a_task(_TASK_ON_A_FAKE_CLOCK, env, package=fake_launcher_path, timeout=PATIENCE_SECONDS)
    line = next((x for x in done.stdout.splitlines() if x.startswith("GUARD_EXIT")), None)
    assert line, f"no exit reported: {done.returncode} {done.stdout!r} {done.stderr!r}"
    fields = dict(f.split("=") for f in line.split()[1:])
    waited = float(fields["done"]) - float(fields["sent"])
    assert 3 <= waited < 4.5, f"bound 3 s, released after {waited:.2f} s (fake clock): {done.stdout}{done.stderr}"


def _bound(guard: dict) -> int:
    """The guard's bound: its environment's, or (before issue 20) the number inlined in its script."""
    environment = {e["Name"]: e["Value"] for e in guard.get("Environment", [])}
    if "DRAIN_GUARD_MAX_SECONDS" in environment:
        return int(environment["DRAIN_GUARD_MAX_SECONDS"])
    inline = re.search(r"-lt (\d+)", guard["Command"][0])
    assert inline, f"no bound found in the guard: {guard['Command'][0]!r}"
    return int(inline.group(1))


def _container(task: dict, name: str) -> dict:
    return next(c for c in task["Properties"]["ContainerDefinitions"] if c["Name"] == name)


@pytest.mark.parametrize("fleet", ["synth_default", "synth_large", "synth_elastic"])
def test_bound_covers_deregistration_then_the_leaders_drain(fleet, request) -> None:
    """ECS waits the deregistration delay before the leader's SIGTERM: the follower's bound starts earlier."""
    synthesized = request.getfixturevalue(fleet)
    serving = synthesized.fleet.serving
    for stack, template in ((s, synthesized.template_json(s)) for s in synthesized.templates):
        tasks = {k: v for k, v in template["Resources"].items() if v["Type"] == "AWS::ECS::TaskDefinition"}
        followers = [v for k, v in tasks.items() if "FollowerTask" in k]
        leaders = [v for k, v in tasks.items() if "LeaderTask" in k]
        groups = [v for v in template["Resources"].values() if v["Type"] == "AWS::ElasticLoadBalancingV2::TargetGroup"]
        if not followers:
            continue
        (group,) = groups
        attributes = {a["Key"]: a["Value"] for a in group["Properties"]["TargetGroupAttributes"]}
        deregistration = int(attributes["deregistration_delay.timeout_seconds"])
        assert deregistration == serving.unit_deregistration_delay_seconds
        leader_drain = _container(leaders[0], "proxy")["StopTimeout"]
        leader_engine = _container(leaders[0], "inference")["StopTimeout"]
        assert leader_engine == ENGINE_STOP_TIMEOUT.to_seconds()
        needed = deregistration + leader_drain + leader_engine + serving.follower_loss_seconds
        for follower in followers:
            guard = _container(follower, "drain-guard")
            bound = _bound(guard)
            assert bound >= needed, f"{stack}: the guard's bound {bound} s < {needed} s (deregistration + drain ...)"
            # ECS kills the guard only after its stop timeout: never before the bound.
            assert guard["StopTimeout"] > bound
            assert guard["DependsOn"] == [{"ContainerName": "inference", "Condition": "START"}]


def test_the_guard_looks_for_the_command_line_the_image_runs(synth_default) -> None:
    """The guard finds the launcher by an argument of the image's ENTRYPOINT, which the tasks keep."""
    dockerfile = (ROOT / "containers" / "inference" / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.MULTILINE).group(1))
    assert entrypoint == [LAUNCHER_PYTHON, "-m", LAUNCHER_MODULE]
    template = synth_default.template_json(DEV)
    for logical_id, resource in template["Resources"].items():
        if resource["Type"] == "AWS::ECS::TaskDefinition":
            engine = resource["Properties"]["ContainerDefinitions"][0]
            assert "EntryPoint" not in engine and "Command" not in engine, f"{logical_id} overrides the launcher"
