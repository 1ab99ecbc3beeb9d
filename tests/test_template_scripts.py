"""Every script the templates ship is shellcheck clean and executed by a named test (issue 20).

The default fleet, tests/fleets/elastic.yaml and tests/fleets/large.yaml are synthesized
and walked for scripts (tests/shipped_scripts.py: user data, `sh -c` entry points and
commands, container health checks, buildspec commands). `EXECUTED_BY` names, for each
script identity, the shell that runs it in production and the test that executes it as
extracted from the template; a script found with no entry, or an entry whose test is
gone, fails here. The executions not done elsewhere are below: the follower's and the
spare's health checks, and the pipeline's build commands.
"""

from __future__ import annotations

import ast
import http.server
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest
from unit_launcher import health_file

from inference_fleet.cli import refused_without_fleet_file
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
FOLLOWER_HEALTH = "UnitFollowerTask/inference/HealthCheck"
SPARE_HEALTH = "SparesTask/spare/HealthCheck"
BUILD_COMMANDS = "Build/BuildSpec/build"
VERIFY_INSTALL = "VerifyGateProject/BuildSpec/install"
VERIFY_COMMANDS = "VerifyGateProject/BuildSpec/build"


@dataclass(frozen=True)
class Execution:
    shell: str  # the shell that runs it in production: "dash" (/bin/sh), "bash", "exec" (argv, no shell)
    test_file: str  # relative to the repository
    test: str  # a test function defined in test_file


EXECUTED_BY: dict[str, Execution] = {
    "UnitFollowerTask/drain-guard/Command": Execution(
        "dash", "tests/test_drain_guard.py", "test_guard_releases_at_once_without_a_launcher"),
    FOLLOWER_HEALTH: Execution(
        "exec", "tests/test_template_scripts.py", "test_follower_health_check_judges_the_launchers_record"),
    SPARE_HEALTH: Execution(
        "dash", "tests/test_template_scripts.py", "test_spare_health_check_fails_without_a_launcher"),
    BUILD_COMMANDS: Execution(
        "dash", "tests/test_template_scripts.py", "test_pipeline_build_commands_name_what_exists"),
    VERIFY_INSTALL: Execution(
        "dash", "tests/test_template_scripts.py", "test_verify_gate_commands_run_the_kit_and_fail_on_any_failure"),
    VERIFY_COMMANDS: Execution(
        "dash", "tests/test_template_scripts.py", "test_verify_gate_commands_run_the_kit_and_fail_on_any_failure"),
    # Run under bash on a fake node (fake mdadm, iptables, lsblk on PATH), first boot and reboots.
    "TrainiumLaunchTemplate/UserData": Execution(
        "bash", "tests/test_node_user_data.py",
        "test_default_fleet_installs_the_pinned_efa_installer_when_the_ami_has_none"),
    # The compile instance's one MIME part, under bash on the same fake node: the IMDS rule for the job's cgroup.
    "CompileLaunchTemplate/UserData/1": Execution(
        "bash", "tests/test_compile_host_user_data.py",
        "test_first_boot_installs_exactly_the_imds_rule_and_lets_the_agent_start"),
}


@pytest.fixture(scope="module")
def scripts(synth_default, synth_elastic, synth_large, synth_router) -> list[ShippedScript]:
    found: list[ShippedScript] = []
    for label, synthesized in (("default", synth_default), ("elastic", synth_elastic), ("large", synth_large)):
        for stack in synthesized.templates:
            found.extend(shipped_scripts(f"{label}:{stack}", synthesized.template_json(stack)))
    # The router fleet's router stack (its cells and pipeline are the other fleets' kinds, with other data).
    for stack in (s for s in synth_router.templates if "-Router-" in s):
        found.extend(shipped_scripts(f"router:{stack}", synth_router.template_json(stack)))
    return found


def _distinct(scripts: list[ShippedScript], identity: str) -> list[ShippedScript]:
    seen: dict[str, ShippedScript] = {}
    for script in scripts:
        if script.identity == identity:
            seen.setdefault(script.text, script)
    return list(seen.values())


def test_every_script_has_an_execution_test(scripts) -> None:
    found = {s.identity for s in scripts}
    unregistered = sorted(found - set(EXECUTED_BY))
    assert not unregistered, f"scripts no test executes (add one, and an entry to EXECUTED_BY): {unregistered}"
    stale = sorted(set(EXECUTED_BY) - found)
    assert not stale, f"EXECUTED_BY names scripts the templates no longer ship: {stale}"
    for script in scripts:
        expected = EXECUTED_BY[script.identity].shell
        assert script.shell == expected, f"{script.where}: {script.identity} runs under {script.shell}, not {expected}"


def test_the_walk_finds_each_kind_of_script() -> None:
    """A template with one script of each kind, the shells named as ECS and EC2 are given them."""
    container = {
        "Name": "c", "EntryPoint": ["/bin/sh", "-ec"], "Command": ["echo one"],
        "HealthCheck": {"Command": ["CMD-SHELL", "echo two"]}, "Environment": [{"Name": "A", "Value": "1"}],
    }
    odd = {"Name": "d", "Command": ["bash", "/x.sh"], "HealthCheck": {"Command": ["CMD", "/bin/true"]}}
    template = {"Resources": {
        "Unit7TaskAB12CD34": {"Type": "AWS::ECS::TaskDefinition", "Properties": {"ContainerDefinitions": [
            container, odd]}},
        "LtAB12CD34": {"Type": "AWS::EC2::LaunchTemplate", "Properties": {"LaunchTemplateData": {
            "UserData": {"Fn::Base64": {"Fn::Join": ["", ["#!/bin/bash\necho ", {"Ref": "X"}, "\n"]]}}}}},
        "BuildAB12CD34": {"Type": "AWS::CodeBuild::Project", "Properties": {"Source": {
            "BuildSpec": json.dumps({"version": "0.2", "phases": {"build": {"commands": ["make a", "make b"]}}})}}},
    }}
    found = {(s.identity, s.shell, s.text) for s in shipped_scripts("S", template)}
    assert found == {
        ("UnitTask/c/Command", "dash", "echo one"),
        ("UnitTask/c/HealthCheck", "dash", "echo two"),
        ("UnitTask/d/Command (not understood)", "dash", '["bash", "/x.sh"]'),
        ("UnitTask/d/HealthCheck", "exec", '["/bin/true"]'),
        ("Lt/UserData", "bash", "#!/bin/bash\necho CFN_TOKEN\n"),
        ("Build/BuildSpec/build", "dash", "make a\nmake b\n"),
    }


@pytest.mark.parametrize("identity", sorted(EXECUTED_BY))
def test_the_named_execution_test_exists(identity) -> None:
    execution = EXECUTED_BY[identity]
    path = ROOT / execution.test_file
    assert path.is_file(), f"{identity}: {execution.test_file} is missing (it executes this script)"
    text = path.read_text()
    functions = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
    assert execution.test.startswith("test_") and execution.test in functions, (
        f"{identity}: {execution.test_file} has no test function {execution.test}"
    )


def _shape(text: str) -> str:
    """A script with its data taken out: numbers, and the values of `NAME=value` setting lines."""
    return re.sub(r"(?m)^([A-Z][A-Z0-9_]*)=.*$", r"\1=V", re.sub(r"\d+", "N", text))


def test_units_and_fleets_ship_one_script_per_identity(scripts) -> None:
    """Variants differ in data only (a budget, a count, a setting's value such as the cell's name):
    executing one covers the others' logic."""
    for identity in EXECUTED_BY:
        shapes = {_shape(s.text) for s in _distinct(scripts, identity)}
        assert len(shapes) <= 1, f"{identity} has {len(shapes)} different scripts: give each its execution test"


_SHELLCHECK_DIALECT = {"dash": "dash", "bash": "bash"}


@pytest.mark.parametrize("identity", sorted(i for i, e in EXECUTED_BY.items() if e.shell != "exec"))
def test_shellcheck_is_clean(scripts, identity) -> None:
    assert shutil.which("shellcheck"), "shellcheck is missing: `make setup` installs it"
    findings = []
    for script in _distinct(scripts, identity):
        checked = subprocess.run(
            ["shellcheck", "--shell", _SHELLCHECK_DIALECT[script.shell], "--format", "gcc", "-"],
            input=script.text, capture_output=True, text=True, timeout=60,
        )
        if checked.returncode != 0:
            findings.append(f"{script.where}:\n{checked.stdout}{checked.stderr}")
    assert not findings, "\n".join(findings)


# -- the follower's health check ------------------------------------------------------------

# Runs the check's argv exactly as the template has it, in a task-like namespace (the
# launcher's interpreter at its image path, the container's own /tmp) holding the record.
_HEALTH_TASK = r"""
if [ -n "$RECORD" ]; then printf '%s' "$RECORD" > /tmp/unit-launcher.state; fi
"$@"
"""


def _run_health_check(argv: list[str], record: str | None) -> tuple[int, str, float]:
    package = ROOT / "containers" / "inference" / "unit_launcher"
    started = time.monotonic()
    done = run_as_in_a_task(_HEALTH_TASK, {"RECORD": record or ""}, package=package, timeout=60, args=tuple(argv))
    return done.returncode, done.stderr, time.monotonic() - started


def _record(tmp_path: Path, state: str, *, since_ago: float, updated_ago: float) -> str:
    """A record as the launcher writes it (health_file.HealthFile), its times set in the past."""
    now = time.time()
    times = iter([now, now - since_ago, now - updated_ago])  # created, state entered, written
    writer = health_file.HealthFile(tmp_path / "state", role="follower", clock=lambda: next(times))
    writer.set(state, session_id="s-1")
    return (tmp_path / "state").read_text()


@pytest.mark.skipif(not CAN_RUN_AS_IN_A_TASK, reason=WHY_NOT)
def test_follower_health_check_judges_the_launchers_record(synth_default, tmp_path) -> None:
    template = synth_default.template_json(DEV)
    check = one(shipped_scripts(DEV, template), FOLLOWER_HEALTH)
    argv = json.loads(check.text)
    budget = synth_default.fleet.serving.startup_budget_seconds
    follower = next(v for k, v in template["Resources"].items() if k.startswith("Unit0FollowerTask"))
    timeout = follower["Properties"]["ContainerDefinitions"][0]["HealthCheck"]["Timeout"]
    cases = {
        "joining within the budget": (_record(tmp_path, "joining", since_ago=budget - 60, updated_ago=1), 0, ""),
        "joining past the budget": (
            _record(tmp_path, "joining", since_ago=budget + 60, updated_ago=1), 1,
            f"longer than the start-up budget of {budget} s"),
        "serving, fresh": (_record(tmp_path, "serving", since_ago=3600, updated_ago=10), 0, ""),
        "serving, stale": (_record(tmp_path, "serving", since_ago=3600, updated_ago=600), 1, "last written"),
        "stopping, however old": (_record(tmp_path, "stopping", since_ago=9999, updated_ago=9999), 0, ""),
        "no record": (None, 1, "no launcher state recorded"),
    }
    for case, (record, status, says) in cases.items():
        returned, stderr, seconds = _run_health_check(argv, record)
        assert (returned, says in stderr) == (status, True), f"{case}: exit {returned}, {stderr!r}"
        assert seconds < timeout, f"{case}: the check took {seconds:.1f} s, its timeout is {timeout} s"


# -- the spare's health check ---------------------------------------------------------------

# The check as Docker runs CMD-SHELL (`/bin/sh -c`), with or without a launcher beside it.
_SPARE_TASK = r"""
if [ -n "$WITH_LAUNCHER" ]; then "$LAUNCHER_PYTHON" -m unit_launcher run & sleep 1; fi
/bin/sh -c "$CHECK"
"""


@pytest.mark.skipif(not CAN_RUN_AS_IN_A_TASK, reason=WHY_NOT)
def test_spare_health_check_fails_without_a_launcher(synth_large, tmp_path) -> None:
    stack = "Rufus-Cell-use2-a"
    check = one(shipped_scripts(stack, synth_large.template_json(stack)), SPARE_HEALTH)
    package = fake_launcher_package(tmp_path)
    for with_launcher, status in ((True, 0), (False, 1)):
        done = run_as_in_a_task(
            _SPARE_TASK, {"CHECK": check.text, "WITH_LAUNCHER": "1" if with_launcher else ""}, package=package,
            timeout=30,
        )
        assert done.returncode == status, f"launcher running: {with_launcher}, check exit {done.returncode}"


# -- the pipeline's build commands ------------------------------------------------------------

# CodeBuild runs a phase's commands in one sh (buildspec 0.2). `make` is faked on PATH: it records its
# arguments, checked against the Makefile (nothing is built). The asset publishing runs for real, on the
# cloud assembly the fixture synthesized, against a fake AWS endpoint on loopback (AWS_ENDPOINT_URL):
# STS answers who the build is and denies every AssumeRole, recording which role was asked for.
# One line per call, its arguments tab-separated: an argument with spaces (COMPILE_ARGS="a b") stays one.
_RECORDER = """#!/bin/sh
IFS="$(printf '\\t')"
printf '%s\\n' "$*" >> "$RECORD"
"""
_STS = "https://sts.amazonaws.com/doc/2011-06-15/"
_IDENTITY = (f'<GetCallerIdentityResponse xmlns="{_STS}"><GetCallerIdentityResult>'
             "<Arn>arn:aws:iam::111111111111:role/build</Arn><UserId>AROAFAKE</UserId><Account>111111111111</Account>"
             "</GetCallerIdentityResult><ResponseMetadata><RequestId>1</RequestId></ResponseMetadata>"
             "</GetCallerIdentityResponse>")
_DENIED = (f'<ErrorResponse xmlns="{_STS}"><Error><Type>Sender</Type><Code>AccessDenied</Code>'
           "<Message>denied by the fake</Message></Error><RequestId>1</RequestId></ErrorResponse>")


class _FakeAws(http.server.BaseHTTPRequestHandler):
    """Records each request as (X-Amz-Target or the query's Action, RoleArn); only GetCallerIdentity succeeds."""

    calls: list[tuple[str, str]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        query = urllib.parse.parse_qs(body)
        action = self.headers.get("X-Amz-Target") or query.get("Action", [f"{self.command} {self.path}"])[0]
        self.calls.append((action, query.get("RoleArn", [""])[0]))
        ok = action == "GetCallerIdentity"
        self.send_response(200 if ok else 403)
        self.send_header("Content-Type", "text/xml")
        self.end_headers()
        self.wfile.write((_IDENTITY if ok else _DENIED).encode())

    do_GET = do_PUT = do_HEAD = do_POST

    def log_message(self, *_: object) -> None:
        pass


# Where node is (CodeBuild's images install it outside /usr/bin): the only tool taken from the host's PATH.
_NODE_DIR = str(Path(shutil.which("node") or "/usr/bin/node").parent)


def _publishing_roles(manifest: Path) -> set[str]:
    entries = json.loads(manifest.read_text())
    return {d["assumeRoleArn"].replace("${AWS::Partition}", "aws")
            for kind in ("files", "dockerImages") for asset in entries.get(kind, {}).values()
            for d in asset["destinations"].values()}


def _exported_config(make_arguments: list[str]) -> str | None:
    """CONFIG as the Makefile exports it to its recipes for this make call (make itself says: a `$$` in the
    argument is one `$` there), or None when the call sets none."""
    if not any(a.startswith("CONFIG=") for a in make_arguments):
        return None
    variables = [a for a in make_arguments if "=" in a]
    printed = subprocess.run(["make", "-s", "-C", str(ROOT), *variables, "--eval",
                              'print-config: ; @printf "%s" "$$CONFIG"', "print-config"],
                             capture_output=True, text=True, timeout=60, check=True)
    return printed.stdout


def _fleet_cli_argv(recipe_line: str, make_arguments: list[str]) -> list[str]:
    """The arguments a `make -n` recipe line gives `python -m inference_fleet`, expanded by the shell with
    CONFIG in its environment as make exports it: `${CONFIG:+--config "$CONFIG"}`."""
    config = _exported_config(make_arguments)
    printed = subprocess.run(["/bin/sh", "-c", "printf '%s\\n' " + recipe_line.split("-m inference_fleet ", 1)[1]],
                             env={"PATH": "/usr/bin:/bin", **({"CONFIG": config} if config is not None else {})},
                             capture_output=True, text=True, timeout=10, check=True)
    return printed.stdout.splitlines()


def test_pipeline_build_commands_name_what_exists(synth_default, tmp_path) -> None:
    build = one(shipped_scripts("Rufus-Pipeline", synth_default.template_json("Rufus-Pipeline")), BUILD_COMMANDS)
    fakes = tmp_path / "bin"
    fakes.mkdir()
    (fakes / "make").write_text(_RECORDER)
    (fakes / "make").chmod(0o755)
    for shipped in ("node_modules", "tools"):
        (tmp_path / shipped).symlink_to(ROOT / shipped)
    shutil.copytree(synth_default.outdir, tmp_path / "cdk.out")  # what `make synth` would have written
    record = tmp_path / "calls"
    _FakeAws.calls = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeAws)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", build.text], cwd=tmp_path, capture_output=True, text=True, timeout=300,
            env={"PATH": f"{fakes}:{_NODE_DIR}:/usr/bin:/bin", "HOME": str(tmp_path), "RECORD": str(record),
                 "CI": "true", "AWS_ACCESS_KEY_ID": "AKIAFAKE", "AWS_SECRET_ACCESS_KEY": "fake",
                 "AWS_REGION": "us-east-2",
                 "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}"},
        )
    finally:
        server.shutdown()
    assert done.returncode != 0, "publishing succeeded though the fake denies every role"
    make_calls = [c.split("\t") for c in record.read_text().splitlines()]
    assert make_calls, "no make call recorded"
    for arguments in make_calls:
        dry_run = subprocess.run(
            ["make", "-n", "-C", str(ROOT), *arguments], capture_output=True, text=True, timeout=60
        )
        assert dry_run.returncode == 0, f"make {' '.join(arguments)}: {dry_run.stderr}"
        # The fleet CLI refuses a command that reaches AWS without the fleet file: the build's must name it.
        for line in dry_run.stdout.splitlines():
            if "-m inference_fleet " in line:
                argv = _fleet_cli_argv(line, arguments)
                assert not refused_without_fleet_file(argv), f"make {' '.join(arguments)} runs {argv}"
    # The build role may assume only the publishing roles (pipeline_stack._build_project): publishing
    # must ask for those of every manifest of the deployed stacks, and for no other role or service.
    wanted = set().union(*(_publishing_roles(tmp_path / "cdk.out" / f"{s}.assets.json")
                           for s in ("Rufus-Cell-dev", "Rufus-Compile")))
    asked = {role for action, role in _FakeAws.calls if action == "AssumeRole"}
    assert asked == wanted, f"roles asked for: {sorted(asked)}; stderr: {done.stderr[-2000:]}"
    others = {action for action, _ in _FakeAws.calls} - {"GetCallerIdentity", "AssumeRole"}
    assert not others, f"publishing called more than STS: {sorted(others)}"
    assert "denied by the fake" in done.stderr


# Fleet files whose paths the shell would split (docs/deploying.md's example), unquote or expand, and make
# expand (`$`): the pipeline's commands must hand them to make and to the fleet CLI as one argument, byte for byte.
AWKWARD_FLEET_FILES = ("my fleets/fleet one.yaml", "my fleets/Rufus's fleet (one); $HOME.yaml")
EVACUATION_COMMANDS = "EvacuationProject/BuildSpec/build"


@pytest.fixture(scope="module", params=AWKWARD_FLEET_FILES)
def synth_awkward_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The evacuation test fleet (a build, a verify gate, an evacuation) synthesized as `cdk synth -c
    config=<path>` would (the file need not exist for the synthesis: it is only named): the path and the
    pipeline stack's template."""
    from aws_cdk import App

    from inference_fleet.checks import load_fleet
    from stacks.fleet import build_fleet
    from tests.conftest import CDK_CONTEXT, pin_images

    fleet = pin_images(load_fleet(ROOT / "tests/fleets/pipeline_evacuation.yaml"))
    outdir = tmp_path_factory.mktemp("awkward-path")
    app = App(context={**CDK_CONTEXT, "config": str(ROOT / request.param)}, outdir=str(outdir),
              builtin_cloud_formation_validation=False)
    stacks = build_fleet(app, fleet)
    app.synth()
    template = outdir / f"{stacks[fleet.pipeline_stack_name].artifact_id}.template.json"
    return request.param, json.loads(template.read_text())


@pytest.mark.parametrize("shell", ["/bin/sh", "bash"])  # CodeBuild's sh (dash on Ubuntu), or `env: shell: bash`
def test_pipeline_commands_pass_a_fleet_file_with_spaces_and_shell_characters_as_one_argument(
        synth_awkward_path, tmp_path, shell) -> None:
    """Regression: the build ran `make synth CONFIG=<path> ...` unquoted, so a path with a space reached make as
    several arguments (and a quote was a syntax error); the verify gate and the evacuation passed `--config <path>`
    the same way. Each command is run as extracted, `make`, `node` and the venv's python faked (they record
    their arguments, one per tab-separated field)."""
    path, template = synth_awkward_path
    scripts = shipped_scripts("Rufus-Pipeline", template)
    fakes, venv = tmp_path / "bin", tmp_path / ".venv" / "bin"
    fakes.mkdir()
    venv.mkdir(parents=True)
    for fake in (fakes / "make", fakes / "node", venv / "python"):
        fake.write_text(_RECORDER)
        fake.chmod(0o755)

    def run(identity: str, **variables: str) -> list[list[str]]:
        record = tmp_path / "calls"
        record.unlink(missing_ok=True)
        done = subprocess.run([shell, "-c", one(scripts, identity).text], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60,
                              env={"PATH": f"{fakes}:/usr/bin:/bin", "RECORD": str(record), **variables})
        assert done.returncode == 0, f"{identity} under {shell}: exit {done.returncode}: {done.stderr}"
        return [line.split("\t") for line in record.read_text().splitlines()]

    calls = run(BUILD_COMMANDS)
    make_calls = [c for c in calls if c[0] in ("synth", "compile")]
    escaped = f"CONFIG={path.replace('$', '$$')}"  # make's own escape of `$`
    assert make_calls == [
        ["synth", escaped, "CDK_OUT=cdk.out"],
        ["compile", escaped, "COMPILE_ARGS=--check --request-out compile-request/compile-request.json"],
    ], calls
    for arguments in make_calls:
        assert _exported_config(arguments) == path
        dry_run = subprocess.run(["make", "-n", "-C", str(ROOT), *arguments], capture_output=True, text=True,
                                 timeout=60)
        assert dry_run.returncode == 0, dry_run.stderr
        cli_lines = [line for line in dry_run.stdout.splitlines() if "-m inference_fleet " in line]
        for line in cli_lines:
            argv = _fleet_cli_argv(line, arguments)
            assert argv[argv.index("--config") + 1] == path, argv
    assert all(c[0] == "tools/publish-assets.js" for c in calls if c not in make_calls), calls
    assert run(VERIFY_COMMANDS) == [["-m", "inference_fleet", "verify", "--config", path,
                                     "--cell", "dev"]]
    execution = "11111111-1111-1111-1111-111111111111"
    evacuated = run(EVACUATION_COMMANDS, EVACUATE_MODE="restore", CELL="dev", PIPELINE="Rufus-rollout",
                    PIPELINE_EXECUTION_ID=execution, WAVE_STAGE="Wave canary")
    assert evacuated == [["-m", "inference_fleet", "evacuate", "--config", path, "--cell", "dev",
                          "--undo", "--pipeline", "Rufus-rollout", "--pipeline-execution", execution,
                          "--wave-stage", "Wave canary"]]


def test_publish_tool_reads_the_synthesized_manifests_offline(synth_default, tmp_path) -> None:
    """The pinned tool parses the schema version aws-cdk-lib writes (the cdk-assets CLI 4.7.3 would not)."""
    for stack in ("Rufus-Cell-dev", "Rufus-Compile"):
        manifest = synth_default.outdir / f"{synth_default.stacks[stack].artifact_id}.assets.json"
        listed = subprocess.run(
            ["node", str(ROOT / "tools" / "publish-assets.js"), "ls", str(manifest)], capture_output=True, text=True,
            timeout=60,
            env={"PATH": f"{_NODE_DIR}:/usr/bin:/bin", "HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true"},
        )
        assert listed.returncode == 0, listed.stderr
        entries = json.loads(manifest.read_text())
        for kind in ("files", "dockerImages"):
            for asset_id, asset in entries.get(kind, {}).items():
                for destination in asset["destinations"]:
                    assert f"{asset_id}:{destination} " in listed.stdout
    bad = subprocess.run(["node", str(ROOT / "tools" / "publish-assets.js"), "ls", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 3 and "Cannot read asset manifest" in bad.stderr and "Error:" not in bad.stderr


# The verify gate (stacks/verify_gate.py): `make` and the venv's python faked; the kit's exit status
# must be the build's, for 0 (pass), 6 (a check failed) and 3 (the kit could not read its config).
_FAKE_KIT = """#!/bin/sh
printf '%s\\n' "$*" >> "$RECORD"
exit "${VERIFY_EXIT:-0}"
"""


def test_verify_gate_commands_run_the_kit_and_fail_on_any_failure(synth_default, tmp_path) -> None:
    scripts = shipped_scripts("Rufus-Pipeline", synth_default.template_json("Rufus-Pipeline"))
    install, build = one(scripts, VERIFY_INSTALL), one(scripts, VERIFY_COMMANDS)
    fakes, venv = tmp_path / "bin", tmp_path / ".venv" / "bin"
    fakes.mkdir()
    venv.mkdir(parents=True)
    (fakes / "make").write_text(_RECORDER)
    (venv / "python").write_text(_FAKE_KIT)
    for path in (fakes / "make", venv / "python"):
        path.chmod(0o755)
    record = tmp_path / "calls"
    env = {"PATH": f"{fakes}:/usr/bin:/bin", "RECORD": str(record)}
    done = subprocess.run(["/bin/sh", "-c", install.text], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    (make_call,) = record.read_text().splitlines()
    dry_run = subprocess.run(["make", "-n", "-C", str(ROOT), *make_call.split()], capture_output=True, text=True,
                             timeout=60)
    assert dry_run.returncode == 0, f"make {make_call}: {dry_run.stderr}"
    for status in (0, 6, 3):
        record.unlink()
        done = subprocess.run(["/bin/sh", "-c", build.text], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env={**env, "VERIFY_EXIT": str(status)})
        assert done.returncode == status, f"the kit exited {status}, the build {done.returncode}"
        assert record.read_text().splitlines() == ["-m inference_fleet verify --config config/default.yaml --cell dev"]


def test_verify_gate_command_is_the_kits_cli(synth_default) -> None:
    """The arguments the gate passes are the kit's own (issue 24: `verify --config FILE --cell NAME`)."""
    from inference_fleet import cli

    parser = cli._parser()
    args = parser.parse_args(["verify", "--config", "config/default.yaml", "--cell", "dev"])
    assert (args.config, args.cell) == ("config/default.yaml", "dev")
