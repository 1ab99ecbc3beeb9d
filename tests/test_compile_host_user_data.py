"""The compile instance's user data, as synthesized, run under bash on a fake node: IMDS refused to the job.

Batch runs the compile job's container in host network mode, where the hop limit of 1 does not keep it from
IMDS; the user data inserts an iptables REJECT of IMDS for the ECS task cgroup (cell_constructs/
compile_host_setup.sh). The MIME archive is read from the Compile stack's launch template, its one shell part
written to a file and run with bash (cloud-init executes a text/x-shellscript part by its shebang), on the fake
node of tests/test_node_user_data.py: its own mount namespace, overlays as the root volume, a fresh /run per
boot, and fakes on PATH that record their arguments (iptables keeps the rules of the boot; ip6tables and nft
here record a call and fail, since nothing should call them). A reboot is a boot that runs what the installed
compile-host-setup.service executes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cell_constructs.compile_batch import ECS_CGROUP_SETTING
from inference_fleet import compile_job
from tests.shipped_scripts import user_data_parts
from tests.test_node_user_data import Node, resolve

RULE = "OUTPUT -d 169.254.169.254/32 -m cgroup --path ecstasks.slice -j REJECT"
READY = "/run/compile-host-setup/ready"
DROP_IN = "/etc/systemd/system/ecs.service.d/50-compile-host-setup.conf"
_UNWANTED = ("ip6tables", "nft")


def launch_template_data(template: dict) -> dict:
    (launch,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::EC2::LaunchTemplate"]
    return launch["Properties"]["LaunchTemplateData"]


def shell_part(template: dict) -> str:
    """The one part of the launch template's MIME user data: a bash script."""
    data = launch_template_data(template)
    assert "UserData" in data, "the compile launch template has no user data: nothing refuses IMDS to the job"
    parts = user_data_parts(resolve(data["UserData"]["Fn::Base64"]))
    assert parts is not None, "Batch needs the launch template's user data as a MIME multi-part archive"
    (part,) = parts
    assert part[0] == "text/x-shellscript" and part[1].startswith("#!/bin/bash\n"), part[:2]
    return part[1]


@pytest.fixture(scope="module")
def compile_user_data(synth_default) -> str:
    return shell_part(synth_default.template_json(compile_job.stack_name(synth_default.fleet)))


def compile_node(base: Path) -> Node:
    node = Node(base)
    for name in _UNWANTED:
        (node.bin / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "$FAKE_STATE/calls"\nexit 3\n')
        (node.bin / name).chmod(0o755)
    return node


def probe(*command: str) -> tuple[str, ...]:
    """`command`, then whether ecs.service's condition holds (the ready file) and the boot's IMDS rules."""
    return ("bash", "-c", f'"$@"; rc=$?; [ -e {READY} ] && echo READY=yes; exit $rc', "probe", *command)


def first_boot(node: Node, user_data: str) -> subprocess.CompletedProcess:
    script = node.root / "user-data"
    script.write_text(user_data)
    return node.boot(*probe("bash", str(script)))


def reboot(node: Node) -> subprocess.CompletedProcess:
    unit = node.file("/etc/systemd/system/compile-host-setup.service")
    assert unit is not None, "no compile-host-setup.service: nothing puts the rule back after a reboot"
    (command,) = re.findall(r"^ExecStart=(.+)$", unit, flags=re.M)
    return node.boot(*probe(*command.split()))


def rules(node: Node) -> list[str]:
    return node.text("boot/iptables").splitlines()


def assert_agent_held(node: Node, result: subprocess.CompletedProcess) -> None:
    """The ECS agent cannot start: its drop-in needs the setup and the ready file, which is absent."""
    assert "READY=yes" not in result.stdout
    drop_in = node.file(DROP_IN) or ""
    assert "Requires=compile-host-setup.service" in drop_in and f"ConditionPathExists={READY}" in drop_in, drop_in


def test_first_boot_installs_exactly_the_imds_rule_and_lets_the_agent_start(compile_user_data, tmp_path) -> None:
    node = compile_node(tmp_path)
    result = first_boot(node, compile_user_data)
    assert result.returncode == 0 and "READY=yes" in result.stdout, result.stderr + node.calls
    assert rules(node) == [RULE]
    calls = node.calls.splitlines()
    # The cgroup exists before the rule that binds it; the unit runs again at every boot.
    assert calls.index("systemctl start ecstasks.slice") < calls.index(f"iptables -I {RULE}")
    assert "systemctl enable compile-host-setup.service" in calls
    assert not [c for c in calls if c.split()[0] in _UNWANTED], calls
    # Task cgroups explicitly on: the agent refuses to start rather than run the job outside the slice.
    assert ECS_CGROUP_SETTING in (node.file("/etc/ecs/ecs.config") or "").splitlines()
    unit = node.file("/etc/systemd/system/compile-host-setup.service") or ""
    assert "Before=ecs.service" in unit and "WantedBy=multi-user.target" in unit
    assert "After=compile-host-setup.service" in (node.file(DROP_IN) or "")
    assert node.file("/etc/systemd/system/ecstasks.slice") is not None


def test_a_rule_iptables_refuses_fails_the_boot_loudly_and_keeps_the_agent_off(compile_user_data, tmp_path) -> None:
    node = compile_node(tmp_path)
    (node.state / "iptables-broken").touch()
    result = first_boot(node, compile_user_data)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (f"compile-host-setup: FAILED: cannot block IMDS for ECS task containers (iptables -I {RULE}); "
            "the ECS agent stays off, so no job runs on this instance") in result.stderr, result.stderr
    assert rules(node) == []
    assert_agent_held(node, result)


def test_a_task_slice_that_cannot_start_fails_before_any_rule(compile_user_data, tmp_path) -> None:
    node = compile_node(tmp_path)
    (node.state / "fail-start-ecstasks.slice").touch()
    result = first_boot(node, compile_user_data)
    assert result.returncode == 1
    assert "compile-host-setup: FAILED: cannot start ecstasks.slice (the cgroup of the ECS task containers)" in (
        result.stderr), result.stderr
    assert "iptables -I" not in node.calls
    assert_agent_held(node, result)


def test_every_boot_puts_the_rule_back_once(compile_user_data, tmp_path) -> None:
    node = compile_node(tmp_path)
    assert first_boot(node, compile_user_data).returncode == 0
    rebooted = reboot(node)  # netfilter rules do not survive a reboot; the unit inserts it again
    assert rebooted.returncode == 0 and "READY=yes" in rebooted.stdout, rebooted.stderr
    assert rules(node) == [RULE]
    again = node.boot(*probe("bash", "-c", "/usr/local/sbin/compile-host-setup && /usr/local/sbin/compile-host-setup"))
    assert again.returncode == 0 and rules(node) == [RULE], node.calls
    assert (node.file("/etc/ecs/ecs.config") or "").splitlines().count(ECS_CGROUP_SETTING) == 1
    # A reboot whose rule fails keeps the agent off too.
    (node.state / "iptables-broken").touch()
    failed = reboot(node)
    assert failed.returncode == 1 and "FAILED: cannot block IMDS" in failed.stderr
    assert_agent_held(node, failed)


def test_the_installed_script_is_shellcheck_clean(compile_user_data, tmp_path) -> None:
    assert shutil.which("shellcheck"), "shellcheck is missing: `make setup` installs it"
    node = compile_node(tmp_path)
    first_boot(node, compile_user_data)
    installed = tmp_path / "compile-host-setup"
    installed.write_text(node.file("/usr/local/sbin/compile-host-setup") or "")
    checked = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(installed)],
                             capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout


def test_ipv6_imds_is_off_and_the_job_cannot_leave_its_cgroup_or_change_the_firewall(synth_default) -> None:
    """IMDS's IPv6 address answers only when HttpProtocolIpv6 is enabled (and the subnets have none), so one
    IPv4 rule is the whole block. The rule holds only while the job's container stays in its cgroup and cannot
    edit netfilter: not privileged, no capability added (Docker's default set has neither NET_ADMIN nor
    SYS_ADMIN)."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    assert launch_template_data(template)["MetadataOptions"]["HttpProtocolIpv6"] == "disabled"
    for subnet in (r for r in template["Resources"].values() if r["Type"] == "AWS::EC2::Subnet"):
        assert "Ipv6CidrBlock" not in subnet["Properties"] and not subnet["Properties"].get("Ipv6Native")
    (job,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::Batch::JobDefinition"]
    container = job["Properties"]["ContainerProperties"]
    assert not container.get("Privileged"), container
    assert not container.get("LinuxParameters", {}).get("Capabilities", {}).get("Add"), container
