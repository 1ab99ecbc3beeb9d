"""The scripts the stacks ship, read back from synthesized templates, and a way to run them as production does.

A script is anything a template hands to a shell or runs as a command line: EC2 user data
(bash on AL2023; each text/x-shellscript part of MIME multi-part user data, run by its shebang),
an ECS container's `EntryPoint`/`Command` of the form `sh -c <script>`,
an ECS health check (`CMD-SHELL` runs `/bin/sh -c`, `CMD` runs the argv as is), and the
commands of a CodeBuild buildspec (sh). `/bin/sh` is dash in the Ubuntu-based images (the
inference image's base is `...-ubuntu24.04`, containers/inference/Dockerfile) and here.

Each script gets an identity that is the same in every fleet and every unit
(`<resource kind>/<container>/<field>`, the resource kind being the logical id without
its unit number and hash), so a registry can name the test that executes it.
"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cell_constructs.inference_unit import LAUNCHER_PYTHON

_HASH = re.compile(r"[0-9A-F]{8}$")
_SHELLS = {"sh": "dash", "/bin/sh": "dash", "bash": "bash", "/bin/bash": "bash"}
# A CloudFormation token inside a script (a Ref, a GetAtt) is rendered as a plain word.
TOKEN = "CFN_TOKEN"


@dataclass(frozen=True)
class ShippedScript:
    identity: str  # e.g. "UnitFollowerTask/drain-guard/Command"
    shell: str  # "dash", "bash" or "exec" (an argv run without a shell)
    text: str  # the script; for "exec", the argv as JSON
    where: str  # "<stack>/<logical id>"
    environment: tuple[tuple[str, str], ...] = ()  # the container's environment, when it has one


def resource_kind(logical_id: str) -> str:
    """`Unit3FollowerTaskAE00B590` -> `UnitFollowerTask`: the same for every unit of every fleet."""
    return re.sub(r"\d+", "", _HASH.sub("", logical_id))


def _render(value: Any) -> str:
    """A template string value, tokens (Ref, GetAtt, Join) rendered as words."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join(_render(p) for p in parts)
    if isinstance(value, dict) and "Fn::Base64" in value:
        return _render(value["Fn::Base64"])
    if isinstance(value, dict) and "Fn::Sub" in value:
        body = value["Fn::Sub"] if isinstance(value["Fn::Sub"], str) else value["Fn::Sub"][0]
        return re.sub(r"\$\{[^}!]+\}", TOKEN, body)
    return TOKEN


def _container_scripts(stack: str, logical_id: str, container: dict) -> Iterator[ShippedScript]:
    kind, name = resource_kind(logical_id), container["Name"]
    where = f"{stack}/{logical_id}"
    environment = tuple((e["Name"], _render(e["Value"])) for e in container.get("Environment", []))
    argv = [_render(a) for a in container.get("EntryPoint", []) + container.get("Command", [])]
    if argv and argv[0].rsplit("/", 1)[-1] in ("sh", "bash", "dash"):
        if len(argv) >= 3 and argv[0] in _SHELLS and re.fullmatch(r"-[a-z]*c[a-z]*", argv[1]):
            yield ShippedScript(f"{kind}/{name}/Command", _SHELLS[argv[0]], argv[2], where, environment)
        else:  # a shell started some other way: named so that no registry entry matches it
            yield ShippedScript(f"{kind}/{name}/Command (not understood)", "dash", json.dumps(argv), where, environment)
    check = container.get("HealthCheck", {}).get("Command")
    if check:
        check = [_render(a) for a in check]
        if check[0] == "CMD-SHELL":
            # Docker runs CMD-SHELL with the container's /bin/sh -c.
            yield ShippedScript(f"{kind}/{name}/HealthCheck", "dash", check[1], where, environment)
        else:
            yield ShippedScript(f"{kind}/{name}/HealthCheck", "exec", json.dumps(check[1:]), where, environment)


def _buildspec_scripts(stack: str, logical_id: str, buildspec: str) -> Iterator[ShippedScript]:
    """A buildspec's phase commands (sh: https://docs.aws.amazon.com/codebuild/latest/userguide/build-env-ref-cmd.html)."""
    spec = json.loads(buildspec)
    for phase, body in spec.get("phases", {}).items():
        commands = body.get("commands", [])
        if commands:
            # Version 0.2 runs a phase's commands in one shell instance: one script per phase.
            yield ShippedScript(f"{resource_kind(logical_id)}/BuildSpec/{phase}", "dash", "\n".join(commands) + "\n",
                                f"{stack}/{logical_id}")


def user_data_parts(text: str) -> list[tuple[str, str]] | None:
    """(content type, body) of each part of MIME multi-part user data; None for user data of one script."""
    if not text.startswith(("Content-Type: multipart/", "MIME-Version:")):
        return None
    message = email.message_from_string(text)
    assert message.is_multipart(), f"user data says MIME but is not multi-part: {text[:200]!r}"
    return [(part.get_content_type(), part.get_payload(decode=True).decode()) for part in message.get_payload()]


def _user_data_scripts(stack: str, logical_id: str, text: str) -> Iterator[ShippedScript]:
    """User data: one script, or each shell script part of a MIME archive (cloud-init executes those)."""
    where, kind = f"{stack}/{logical_id}", resource_kind(logical_id)
    parts = user_data_parts(text)
    if parts is None:
        yield ShippedScript(f"{kind}/UserData", "bash" if text.startswith("#!/bin/bash") else "dash", text, where)
        return
    for index, (content_type, body) in enumerate(parts, start=1):
        if content_type == "text/x-shellscript":
            shell = _SHELLS.get(body.split("\n", 1)[0].removeprefix("#!").strip(), "not understood")
            yield ShippedScript(f"{kind}/UserData/{index}", shell, body, where)


def shipped_scripts(stack: str, template: dict) -> list[ShippedScript]:
    """Every script of one synthesized template."""
    found: list[ShippedScript] = []
    for logical_id, resource in template.get("Resources", {}).items():
        props, kind = resource.get("Properties", {}), resource["Type"]
        if kind == "AWS::ECS::TaskDefinition":
            for container in props.get("ContainerDefinitions", []):
                found.extend(_container_scripts(stack, logical_id, container))
        elif kind == "AWS::EC2::LaunchTemplate" and "UserData" in props.get("LaunchTemplateData", {}):
            found.extend(_user_data_scripts(stack, logical_id, _render(props["LaunchTemplateData"]["UserData"])))
        elif kind == "AWS::EC2::Instance" and "UserData" in props:
            text = _render(props["UserData"])
            found.append(ShippedScript(f"{resource_kind(logical_id)}/UserData", "bash", text, f"{stack}/{logical_id}"))
        elif kind == "AWS::CodeBuild::Project" and isinstance(props.get("Source", {}).get("BuildSpec"), str):
            found.extend(_buildspec_scripts(stack, logical_id, props["Source"]["BuildSpec"]))
    return found


def one(scripts: list[ShippedScript], identity: str) -> ShippedScript:
    """The script of `identity` (the first unit's, when every unit has one)."""
    matching = [s for s in scripts if s.identity == identity]
    assert matching, f"no script {identity!r} in the template; found {sorted({s.identity for s in scripts})}"
    return matching[0]


# -- running them -------------------------------------------------------------------------

# Tests that need a PID namespace of their own, a private /opt and /tmp, and dash as /bin/sh.
CAN_RUN_AS_IN_A_TASK = (
    os.geteuid() == 0 and shutil.which("unshare") is not None and Path("/bin/sh").resolve().name == "dash"
)
WHY_NOT = "needs root, unshare and /bin/sh = dash (as in CI: CodeBuild privileged, Ubuntu image)"

# Prepended to every task script: the image's launcher interpreter path exists (a symlink to
# this Python on a private tmpfs over /opt) and /tmp is the task's own, as in a container.
_TASK_PRELUDE = r"""
mount -t tmpfs tmpfs /opt && mkdir -p /opt/python && cp -r "$LAUNCHER_PACKAGE" /opt/python/ || exit 90
mkdir -p "${LAUNCHER_PYTHON%/*}" && ln -s "$REAL_PYTHON" "$LAUNCHER_PYTHON" || exit 91
mount -t tmpfs tmpfs /tmp || exit 92
export PYTHONPATH=/opt/python
"""

# A stand-in for the launcher package: `python -m unit_launcher run` lives LAUNCHER_SECONDS,
# prints `LAUNCHER_GOT_USR1 pid=<pid> uptime=<s>` on each SIGUSR1 and then exits after
# LAUNCHER_EXIT_AFTER_USR1 seconds when that is set (as the real one does once its leader
# ended the session); `python -m unit_launcher.health_file` (a decoy: the health check's
# command line) sleeps and prints `DECOY_GOT_USR1` on a SIGUSR1 it must never get.
_FAKE_LAUNCHER_MAIN = """\
import os, signal, time

deadline = time.monotonic() + float(os.environ.get("LAUNCHER_SECONDS") or 600)


def on_usr1(signum, frame):
    global deadline
    with open("/proc/uptime") as uptime:
        print(f"LAUNCHER_GOT_USR1 pid={os.getpid()} uptime={uptime.read().split()[0]}", flush=True)
    after = os.environ.get("LAUNCHER_EXIT_AFTER_USR1")
    if after:
        deadline = min(deadline, time.monotonic() + float(after))


signal.signal(signal.SIGUSR1, on_usr1)
while time.monotonic() < deadline:
    time.sleep(0.05)
"""
_FAKE_DECOY = """\
import signal, time

signal.signal(signal.SIGUSR1, lambda signum, frame: print("DECOY_GOT_USR1", flush=True))
time.sleep(600)
"""
_FAKE_LAUNCHER = {"__init__.py": "", "__main__.py": _FAKE_LAUNCHER_MAIN, "health_file.py": _FAKE_DECOY}


def fake_launcher_package(root: Path) -> Path:
    """The stand-in `unit_launcher` package (a directory), under root."""
    package = root / "unit_launcher"
    package.mkdir(parents=True, exist_ok=True)
    for name, text in _FAKE_LAUNCHER.items():
        (package / name).write_text(text)
    return package


def run_as_in_a_task(
    task_script: str, environment: dict[str, str], *, package: Path, timeout: float, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`task_script` as PID 1 (dash) of a fresh PID and mount namespace with its own /proc, /opt and /tmp.

    `/opt/unit-launcher/bin/python` runs this interpreter with a copy of `package` (a
    `unit_launcher` package directory, the real one or a stand-in) importable; `args` are
    the script's positional parameters. Raises TimeoutExpired past `timeout`.
    """
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        **environment,
        "LAUNCHER_PYTHON": LAUNCHER_PYTHON,
        "REAL_PYTHON": os.path.realpath(sys.executable),
        "LAUNCHER_PACKAGE": str(package),
    }
    command = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "/bin/sh", "-c",
               _TASK_PRELUDE + task_script, "task", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
