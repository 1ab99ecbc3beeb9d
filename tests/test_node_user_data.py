"""Issue 20 items 1 and 7: the Trainium node's user data, as synthesized, run under bash on a fake node.

The script is read from the cell template's launch template (`Fn::Base64` of `Fn::Join`, the
cluster `Ref` filled in), written to a file and run with `bash`, as cloud-init runs user data on
Amazon Linux 2023. Each run is one boot of a fake node, in its own mount namespace (`unshare -m`):
overlays over /etc, /usr/local, /var/lib and /opt play the root volume (they persist from one
boot to the next), a fresh tmpfs is /run, a file stands in for /dev/console, and the commands
that touch hardware or the system are fakes on PATH (lsblk, mdadm, mkfs.xfs, mount, umount,
iptables, systemctl, systemd-cat, dnf, curl). The file system "made" by the fake mkfs.xfs is a
directory that the fake mount binds onto /opt/models, so /proc/self/mounts, the cache marker and
the fstab lines are real. A reboot is a second run of what the installed node-setup.service
executes, with /run emptied, no mounts and no firewall rules; a stop and start also blanks the
instance-store disks. /dev is a fresh tmpfs holding the basic nodes and, as character devices, the
Neuron and EFA devices the node has (by default every one the unit task definitions pass; a test
takes some away). shellcheck runs on the user data and on the script it installs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from cell_constructs.trainium_capacity import NODE_SETUP_SCRIPT, without_comment_lines
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.config import DEFAULT_CONFIG
from tests.conftest import synth_fleet

DEV = "Rufus-Cell-dev"
CLUSTER = "Rufus-Cell-dev-Cluster"
# The pinned installer of the default fleet (config/default.yaml, cited there).
PINNED_VERSION = "1.41.0"
PINNED_SHA256 = "3506354cdfbe31ff552fe75f5d0d9bb7efd29cf79bd99457347d29c751c38f9f"
INSTANCE_STORE = "Amazon EC2 NVMe Instance Storage"
ROOT_DISK = "/dev/nvme0n1 Amazon Elastic Block Store"
CACHE = "/opt/models"
MARKER = f"{CACHE}/.instance-store"
# What the default fleet's unit tasks are given: every Neuron and EFA device of its instance type.
TASK_DEVICES = load_fleet(DEFAULT_CONFIG).unit.instance.task_devices


def resolve(value: object) -> str:
    """A CloudFormation string expression as the instance sees it: Refs become fixed names."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join(resolve(part) for part in parts)
    if isinstance(value, dict) and "Ref" in value:
        return CLUSTER if value["Ref"].startswith("Cluster") else f"ref-{value['Ref']}"
    raise AssertionError(f"unexpected expression in user data: {value!r}")


def user_data_of(template: dict) -> str:
    (template_resource,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::EC2::LaunchTemplate"]
    return resolve(template_resource["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"])


# -- the fakes --------------------------------------------------------------------------

# A host that does not answer until the fake clock reaches the time in $FAKE_STATE/outage-<host>.
_OUTAGE = ('if [ -e "$FAKE_STATE/outage-{host}" ] && [ "$(cat "$FAKE_STATE/clock" 2>/dev/null || echo 0)" -lt '
           '"$(cat "$FAKE_STATE/outage-{host}")" ]; then {error}; fi\n')

_FAKES = {
    "systemd-cat": 'cat >> "$FAKE_STATE/journal"\n',
    "udevadm": 'echo "udevadm $*" >> "$FAKE_STATE/calls"\n',
    # No time passes, but a fake clock (seconds) moves on; devices udev would make late (a line "path major
    # minor" each) appear now.
    "sleep": 'echo "sleep $*" >> "$FAKE_STATE/calls"\n'
    'echo $(( $(cat "$FAKE_STATE/clock" 2>/dev/null || echo 0) + $1 )) > "$FAKE_STATE/clock"\n'
    'if [ -e "$FAKE_STATE/late-devices" ]; then\n'
    '  while read -r path major minor; do mkdir -p "${path%/*}"; mknod "$path" c "$major" "$minor"; done '
    '< "$FAKE_STATE/late-devices"\n  rm "$FAKE_STATE/late-devices"\nfi\n',
    # `show` prints what $FAKE_STATE/show holds (the ECS agent's unit state a test gives it). Units enabled
    # ($FAKE_STATE/enabled-<unit>, on the root volume) and active this boot ($FAKE_STATE/boot/active-<unit>): start,
    # stop, enable [--now], disable [--now]; options such as --no-block are skipped.
    "systemctl": 'echo "systemctl $*" >> "$FAKE_STATE/calls"\n'
    '[ "$1" = show ] && cat "$FAKE_STATE/show" 2>/dev/null\n'
    '[ "$1" = start ] && [ -e "$FAKE_STATE/fail-start-$2" ] && exit 1\n'
    'verb=; now=; units=()\nfor arg in "$@"; do case $arg in --now) now=1 ;; -*) ;; '
    '*) if [ -z "$verb" ]; then verb=$arg; else units+=("$arg"); fi ;; esac; done\n'
    'for unit in "${units[@]}"; do case $verb in\n'
    '  start) touch "$FAKE_STATE/boot/active-$unit" ;;\n  stop) rm -f "$FAKE_STATE/boot/active-$unit" ;;\n'
    '  enable) touch "$FAKE_STATE/enabled-$unit"; [ -z "$now" ] || touch "$FAKE_STATE/boot/active-$unit" ;;\n'
    '  disable) rm -f "$FAKE_STATE/enabled-$unit"; [ -z "$now" ] || rm -f "$FAKE_STATE/boot/active-$unit" ;;\n'
    'esac; done\nexit 0\n',
    "iptables": 'echo "iptables $*" >> "$FAKE_STATE/calls"\nrules="$FAKE_STATE/boot/iptables"\n'
    'op=$1; shift\ncase $op in\n  -C) grep -qxF -- "$*" "$rules" 2>/dev/null ;;\n'
    '  -I) [ -e "$FAKE_STATE/iptables-broken" ] && exit 1; echo "$*" >> "$rules" ;;\n  *) exit 2 ;;\nesac\n',
    "lsblk": 'echo "lsblk $*" >> "$FAKE_STATE/calls"\ncat "$FAKE_STATE/lsblk"\n',
    "mdadm": 'echo "mdadm $*" >> "$FAKE_STATE/calls"\ncase $1 in\n'
    '  --create) touch "$FAKE_STATE/md-superblock" "$FAKE_STATE/boot/md-active" ;;\n'
    '  --detail) echo "ARRAY /dev/md/models metadata=1.2 name=models UUID=00000000:00000000:00000000:00000001" ;;\n'
    '  --assemble) [ -e "$FAKE_STATE/md-superblock" ] && grep -q "^ARRAY /dev/md/models" /etc/mdadm.conf '
    '&& touch "$FAKE_STATE/boot/md-active" ;;\n'
    '  --stop) rm -f "$FAKE_STATE/boot/md-active" ;;\n  *) exit 2 ;;\nesac\n',
    # mkfs.xfs [-f] [-L label] device: a fresh directory is the device's file system.
    "mkfs.xfs": 'echo "mkfs.xfs $*" >> "$FAKE_STATE/calls"\nlabel=\n'
    'while [ $# -gt 1 ]; do case $1 in -L) label=$2; shift ;; esac; shift; done\n'
    'dev=$1; label=${label:-$(basename "$dev")}\n'
    'rm -rf "$FAKE_STATE/fs/$label"; mkdir -p "$FAKE_STATE/fs/$label"\necho "$dev $label" > "$FAKE_STATE/fs-device"\n'
    # With `systemd-mounts`: systemd's own mount unit of an fstab line without noauto, waiting for the
    # label (its device timeout), mounts the new file system as soon as the label appears.
    'if [ -e "$FAKE_STATE/systemd-mounts" ]; then\n'
    '  mp=$(awk -v spec="LABEL=$label" \'$1 == spec && $4 !~ /(^|,)noauto(,|$)/ {print $2}\' /etc/fstab | tail -n 1)\n'
    '  [ -n "$mp" ] && /usr/bin/mount --bind "$FAKE_STATE/fs/$label" "$mp"\nfi\nexit 0\n',
    # mount <mount point> (its fstab entry) or mount [-o options] <device> <mount point>: the device's
    # file system bound onto the mount point, when the device is there (a RAID must be assembled).
    "mount": 'echo "mount $*" >> "$FAKE_STATE/calls"\n'
    'read -r dev label < "$FAKE_STATE/fs-device" || exit 32\n'
    'if [ $# -eq 1 ]; then mp=$1\n'
    '  spec=$(awk -v mp="$mp" \'$2 == mp {print $1}\' /etc/fstab | tail -n 1)\n'
    '  [ "$spec" = "LABEL=$label" ] || exit 32\n'
    'else\n  mp=${*: -1}; [ "${*: -2:1}" = "$dev" ] || exit 32\nfi\n'
    # As mount(8): a file system already mounted there is an error (exit 32).
    'if awk -v mp="$mp" \'$2 == mp {found=1} END {exit !found}\' /proc/self/mounts; then\n'
    '  echo "mount: $mp: already mounted" >&2; exit 32\nfi\n'
    '[ -d "$FAKE_STATE/fs/$label" ] || exit 32\n'
    'case $dev in /dev/md*) [ -e "$FAKE_STATE/boot/md-active" ] || exit 32 ;; esac\n'
    'exec /usr/bin/mount --bind "$FAKE_STATE/fs/$label" "$mp"\n',
    "umount": 'echo "umount $*" >> "$FAKE_STATE/calls"\nexec /usr/bin/umount "$@"\n',
    "dnf": 'echo "dnf $*" >> "$FAKE_STATE/calls"\n[ -e "$FAKE_STATE/dnf-fails" ] && exit 1\n' + _OUTAGE.format(
        host="repository", error="echo \"Error: Failed to download metadata for repo \'amazonlinux\'\" >&2; exit 1")
    + 'case " $* " in *" mdadm "*) cp "$FAKE_STATE/mdadm.package" "$FAKE_BIN/mdadm" ;; esac\n',
    # The EFA installer download, IMDS and CloudWatch for the failure report, and the ECS agent's introspection API
    # (what $FAKE_STATE/agent-metadata holds; no file: the agent does not answer, connection refused).
    "curl": 'echo "curl $*" >> "$FAKE_STATE/calls"\nargs=("$@"); out=; url=\n'
    'while [ $# -gt 0 ]; do case $1 in -o) out=$2; shift ;; http*) url=$1 ;; esac; shift; done\n'
    'case $url in\n'
    '  https://efa-installer.amazonaws.com/*) ' + _OUTAGE.format(
        host="efa-installer",
        error='echo "curl: (6) Could not resolve host: efa-installer.amazonaws.com" >&2; exit 6')
    + '    [ -e "$FAKE_STATE/efa-tarball" ] || exit 22\n'
    '    cp "$FAKE_STATE/efa-tarball" "$out" ;;\n'
    '  http://localhost:51678/v1/metadata) cat "$FAKE_STATE/agent-metadata" 2>/dev/null || exit 7 ;;\n'
    '  */api/token) echo TOKEN ;;\n  */placement/region) echo us-east-2 ;;\n'
    '  */services/domain) echo amazonaws.com ;;\n  */iam/security-credentials/) echo node-role ;;\n'
    '  */iam/security-credentials/node-role) printf \'{\\n  "Code" : "Success",\\n  "AccessKeyId" : "ASIAKEY",'
    '\\n  "SecretAccessKey" : "SECRET",\\n  "Token" : "SESSION"\\n}\\n\' ;;\n'
    '  https://monitoring.*) grep "^curl " "$FAKE_STATE/calls" | tail -n 1 > "$FAKE_STATE/putmetric"\n'
    # With an endpoint on loopback, the real curl sends the signed request there instead.
    '    if [ -e "$FAKE_STATE/monitoring-endpoint" ]; then\n'
    '      exec /usr/bin/curl "${args[@]/$url/$(cat "$FAKE_STATE/monitoring-endpoint")}"; fi\n'
    '    ;;\n'
    '  *) exit 6 ;;\nesac\n',
}

_BOOT = """set -e
for d in etc usr/local var/lib opt; do
  mkdir -p "$NODE_ROOT/upper/$d" "$NODE_ROOT/work/$d"
  /usr/bin/mount -t overlay overlay -o "lowerdir=/$d,upperdir=$NODE_ROOT/upper/$d,workdir=$NODE_ROOT/work/$d" "/$d"
done
/usr/bin/mount -t tmpfs tmpfs /run
/usr/bin/mount -t tmpfs tmpfs /sys/fs/cgroup
/usr/bin/mount -t tmpfs -o mode=0755 tmpfs /dev
for node in null:3 zero:5 random:8 urandom:9; do mknod -m 0666 "/dev/${node%:*}" c 1 "${node#*:}"; done
ln -s /proc/self/fd /dev/fd
: > "$FAKE_STATE/console"
touch /dev/console
/usr/bin/mount --bind "$FAKE_STATE/console" /dev/console
while read -r path major minor; do
  mkdir -p "${path%/*}"
  if [ "$major" = file ]; then : > "$path"; else mknod "$path" c "$major" "$minor"; fi
done < "$FAKE_STATE/devices"
# timers.target: every timer enabled on the root volume starts at boot.
for enabled in "$FAKE_STATE"/enabled-*.timer; do
  if [ -e "$enabled" ]; then touch "$FAKE_STATE/boot/active-${enabled##*/enabled-}"; fi
done
set +e
"$@"
"""


def efa_installer_tarball() -> bytes:
    """A stand-in aws-efa-installer tarball whose efa_installer.sh makes fi_info find an efa provider."""
    # Like the real one, it installs its dependencies from the distribution's repository first.
    installer = b"#!/bin/bash\ndnf install -y kernel-devel pciutils rpmdevtools || exit 1\n" \
                b"mkdir -p /opt/amazon/efa/bin\nprintf '#!/bin/sh\\nexit 0\\n' > " \
                b"/opt/amazon/efa/bin/fi_info\nchmod 0755 /opt/amazon/efa/bin/fi_info\n"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("aws-efa-installer/efa_installer.sh")
        info.size, info.mode, info.mtime = len(installer), 0o755, 0
        tar.addfile(info, io.BytesIO(installer))
    return gzip.compress(raw.getvalue(), mtime=0)


def device_lines(paths: Sequence[str]) -> str:
    """Lines "path major minor" for the fake /dev: the Neuron driver's major for neuronN, uverbs' (231) for EFA."""
    lines = []
    for path in paths:
        number = int(re.sub(r"\D", "", path.rsplit("/", 1)[1]))
        lines.append(f"{path} 231 {192 + number}" if "uverbs" in path else f"{path} 245 {number}")
    return "".join(f"{line}\n" for line in lines)


class Node:
    """A fake Trainium node: a root volume that survives reboots, instance-store disks, its Neuron and EFA
    devices (default: every one the unit tasks are given), fakes on PATH."""

    def __init__(self, base: Path, *, disks: int = 4, ami_has_efa: bool = True, mdadm_in_ami: bool = True,
                 devices: Sequence[str] = tuple(TASK_DEVICES)) -> None:
        self.root, self.state, self.bin = base / "root", base / "state", base / "bin"
        for path in (self.root, self.state / "boot", self.bin):
            path.mkdir(parents=True, exist_ok=True)
        for name, body in _FAKES.items():
            if name == "mdadm" and not mdadm_in_ami:
                (self.state / "mdadm.package").write_text("#!/bin/bash\n" + body)
                (self.state / "mdadm.package").chmod(0o755)
                continue
            (self.bin / name).write_text("#!/bin/bash\n" + body)
            (self.bin / name).chmod(0o755)
        lines = [ROOT_DISK] + [f"/dev/nvme{i + 1}n1 {INSTANCE_STORE}" for i in range(disks)]
        (self.state / "lsblk").write_text("\n".join(lines) + "\n")
        (self.state / "devices").write_text(device_lines(devices))
        if ami_has_efa:
            fi_info = self.root / "upper/opt/amazon/efa/bin/fi_info"
            fi_info.parent.mkdir(parents=True)
            fi_info.write_text("#!/bin/sh\nexit 0\n")
            fi_info.chmod(0o755)
        (self.root / "user-data").parent.mkdir(parents=True, exist_ok=True)

    def boot(self, *command: str) -> subprocess.CompletedProcess:
        """One boot: fresh /run, no mounts, no firewall rules; `command` runs as root on the node."""
        shutil.rmtree(self.state / "boot")
        (self.state / "boot").mkdir()
        for name in ("calls", "journal"):
            (self.state / name).unlink(missing_ok=True)
        env = {"PATH": f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
               "NODE_ROOT": str(self.root), "FAKE_STATE": str(self.state), "FAKE_BIN": str(self.bin)}
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", _BOOT, "boot",
                               *command], env=env, capture_output=True, text=True, timeout=120, check=False)

    def exec_start(self) -> list[str]:
        """The command of the installed node-setup.service: what systemd runs at boot before the ECS agent."""
        unit = self.file("/etc/systemd/system/node-setup.service")
        assert unit is not None, "no node-setup.service installed: nothing sets the node up again after a reboot"
        (command,) = re.findall(r"^ExecStart=(.+)$", unit, flags=re.M)
        return command.split()

    def reboot(self) -> subprocess.CompletedProcess:
        return self.boot(*ready_probe(*self.exec_start()))

    def stop_and_start(self) -> subprocess.CompletedProcess:
        """A stop and start: the instance store comes back blank."""
        for name in ("fs", "md-superblock", "fs-device"):
            path = self.state / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return self.reboot()

    def file(self, path: str) -> str | None:
        """A file of the root volume as the node left it (None: absent)."""
        top = path.strip("/").split("/")
        for depth in (2, 1):
            upper = "/".join(top[:depth])
            if upper in ("etc", "usr/local", "var/lib", "opt"):
                candidate = self.root / "upper" / upper / "/".join(top[depth:])
                return candidate.read_text() if candidate.is_file() else None
        raise AssertionError(f"{path} is not on the fake root volume")

    def text(self, name: str) -> str:
        path = self.state / name
        return path.read_text() if path.exists() else ""

    @property
    def calls(self) -> str:
        return self.text("calls")

    @property
    def console(self) -> str:
        return self.text("console")

    def active(self, unit: str) -> bool:
        """Whether `unit` was left running at the end of the last boot's command (the fake systemctl's record)."""
        return (self.state / "boot" / f"active-{unit}").exists()

    def enabled(self, unit: str) -> bool:
        """Whether `unit` is enabled, so that the next boot starts it."""
        return (self.state / f"enabled-{unit}").exists()

    def ready(self, result: subprocess.CompletedProcess) -> bool:
        """Whether ecs.service may start after this boot: its drop-in's ConditionPathExists file exists."""
        return "READY=yes" in result.stdout


def ready_probe(*command: str) -> tuple[str, ...]:
    """`command`, then a line saying whether /run/node-setup/ready exists (the ECS agent's condition)."""
    return ("bash", "-c", '"$@"; rc=$?; [ -e /run/node-setup/ready ] && echo READY=yes; '
            'mountpoint -q /opt/models && [ -e /opt/models/.instance-store ] && echo CACHE=mounted; exit $rc',
            "probe", *command)


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_user_data(synth_default) -> str:
    return user_data_of(synth_default.template_json(DEV))


def _fleet_user_data(tmp_path_factory: pytest.TempPathFactory, node: dict) -> str:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["node"] = node
    result = synth_fleet(parse_fleet(data, "node"), tmp_path_factory.mktemp("cdk-node"))
    return user_data_of(result.template_json(DEV))


@pytest.fixture(scope="module")
def installer_user_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default fleet with the stand-in installer's checksum pinned instead."""
    sha = hashlib.sha256(efa_installer_tarball()).hexdigest()
    return _fleet_user_data(tmp_path_factory, {"efa_installer_version": "9.9.9", "efa_installer_sha256": sha})


@pytest.fixture(scope="module")
def ami_efa_only_user_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _fleet_user_data(tmp_path_factory, {"efa_installer_sha256": None})


def run_user_data(node: Node, user_data: str) -> subprocess.CompletedProcess:
    script = node.root / "user-data"
    script.write_text(user_data)
    return node.boot(*ready_probe("bash", str(script)))


def assert_out_of_service(node: Node, result: subprocess.CompletedProcess, reason: str) -> None:
    """A failed setup: reason on the console and recorded, no power-off, ECS agent kept off, report timer on."""
    assert "poweroff" not in node.calls, f"the node powered itself off, so Auto Scaling replaces it: {node.console}"
    assert f"node-setup: FAILED: {reason}" in node.console, node.console + result.stderr
    assert reason in (node.file("/var/lib/node-setup/failed") or "")
    assert not node.ready(result)
    assert "systemctl enable --now node-setup-report.timer" in node.calls


# -- item 1: the default fleet gets EFA; a failed node stays out of service ---------------


def test_default_node_with_efa_in_the_ami_sets_up_and_lets_the_ecs_agent_start(default_user_data, tmp_path) -> None:
    node = Node(tmp_path)
    result = run_user_data(node, default_user_data)
    assert node.ready(result) and "CACHE=mounted" in result.stdout, node.console + result.stderr
    assert "node-setup: done" in node.console
    assert "mdadm --create /dev/md/models --name=models --run --level=0 --raid-devices=4 " \
           "/dev/nvme1n1 /dev/nvme2n1 /dev/nvme3n1 /dev/nvme4n1" in node.calls
    assert "curl" not in node.calls  # the AMI's EFA: nothing downloaded
    assert "ECS_ENABLE_TASK_IAM_ROLE_NETWORK_HOST=true" in node.file("/etc/ecs/ecs.config")
    assert "ECS_ENABLE_AWSLOGS_EXECUTIONROLE_OVERRIDE=true" in node.file("/etc/ecs/ecs.config").splitlines()
    assert f"ECS_CLUSTER={CLUSTER}" in node.file("/etc/ecs/ecs.config")
    assert node.text("boot/iptables").splitlines() == [
        "OUTPUT -d 169.254.169.254/32 -m cgroup --path ecstasks.slice -j REJECT"]
    assert "systemctl start ecstasks.slice" in node.calls


def test_a_node_pins_the_task_cgroup_the_imds_rule_matches(default_user_data, tmp_path) -> None:
    """A defect hunt (thirty-third session): the IMDS rule matches ecstasks.slice, where the ECS agent puts task
    containers only with task cgroups on; left at its default, the agent turns them off by itself (an old Docker,
    a cgroup it cannot set up, old tasks in its state) and starts tasks anyway (aws/amazon-ecs-agent at 8dfceca6
    agent/app/agent_capability.go, agent_unix.go cgroupInit, agent_compatibility_linux.go). Set explicitly, it
    refuses to start instead, as the compile host's does. Old code: the setting missing from ecs.config."""
    node = Node(tmp_path)
    result = run_user_data(node, default_user_data)
    assert node.ready(result), node.console + result.stderr
    assert "ECS_ENABLE_TASK_CPU_MEM_LIMIT=true" in node.file("/etc/ecs/ecs.config").splitlines()


def test_default_fleet_installs_the_pinned_efa_installer_when_the_ami_has_none(default_user_data, tmp_path) -> None:
    """Old code: `the AMI has no EFA and node.efa_installer_sha256 is not set`, then power-off."""
    node = Node(tmp_path, ami_has_efa=False)
    (node.state / "efa-tarball").write_bytes(efa_installer_tarball())  # not the real installer
    result = run_user_data(node, default_user_data)
    assert f"https://efa-installer.amazonaws.com/aws-efa-installer-{PINNED_VERSION}.tar.gz" in node.calls, \
        node.console
    # The download is checked against the pinned checksum before anything runs: this stand-in fails it.
    assert_out_of_service(node, result, f"EFA installer checksum mismatch (aws-efa-installer-{PINNED_VERSION}.tar.gz")
    assert PINNED_SHA256 in node.file("/etc/node-setup/node-setup.conf")


def test_installer_with_a_matching_checksum_gives_the_node_efa(installer_user_data, tmp_path) -> None:
    node = Node(tmp_path, ami_has_efa=False)
    (node.state / "efa-tarball").write_bytes(efa_installer_tarball())
    result = run_user_data(node, installer_user_data)
    assert node.ready(result), node.console + result.stderr
    assert node.file("/opt/amazon/efa/bin/fi_info") is not None  # made by the (stand-in) installer


def test_efa_download_failure_keeps_the_node_out_of_service(installer_user_data, tmp_path) -> None:
    node = Node(tmp_path, ami_has_efa=False)  # no tarball: the download fails
    result = run_user_data(node, installer_user_data)
    assert_out_of_service(node, result, "EFA installer download failed")


# -- a first boot outlasts a network that does not answer yet -----------------------------------
#
# On a first boot the NAT gateway's route, the EFA security group's rules or a repository mirror may not answer yet,
# and a failed setup is final: the node passes its status checks, Auto Scaling never replaces it, and a unit of two
# nodes never forms. The fakes keep a host from answering until the fake clock (moved only by `sleep`) reaches the
# outage's end.


def outage(node: Node, host: str, seconds: int) -> None:
    (node.state / f"outage-{host}").write_text(f"{seconds}\n")


def slept(node: Node) -> int:
    return int(node.text("clock") or 0)


def test_a_first_boot_outlasts_the_efa_installer_host_unreachable_for_a_minute(installer_user_data,
                                                                               tmp_path) -> None:
    """Old code: `curl --retry 3` retries a connect that times out (three times, seconds apart), not a host it cannot
    resolve (here) or a refused connection; the setup failed for good."""
    node = Node(tmp_path, ami_has_efa=False)
    (node.state / "efa-tarball").write_bytes(efa_installer_tarball())
    outage(node, "efa-installer", 60)
    result = run_user_data(node, installer_user_data)
    assert node.ready(result), node.console + result.stderr
    assert node.calls.count("https://efa-installer.amazonaws.com/") == 2
    assert "node-setup: EFA installer download failed (try 1); trying again in 60s (480s of retries left)" \
        in node.console
    assert node.file("/var/lib/node-setup/failed") is None


def test_a_first_boot_outlasts_the_package_repository_unreachable_for_a_minute(installer_user_data,
                                                                               tmp_path) -> None:
    """The installer's own package installs, then mdadm's: old code failed the setup at the first."""
    node = Node(tmp_path, ami_has_efa=False, mdadm_in_ami=False)
    (node.state / "efa-tarball").write_bytes(efa_installer_tarball())
    outage(node, "repository", 60)
    result = run_user_data(node, installer_user_data)
    assert node.ready(result), node.console + result.stderr
    assert node.calls.count("dnf install -y kernel-devel") == 2  # the installer, run again
    assert "node-setup: EFA install failed (try 1); trying again in 60s" in node.console
    # mdadm's install (a node whose AMI has EFA): the repository down for a minute when it comes to it.
    again = Node(tmp_path / "mdadm", mdadm_in_ami=False)
    outage(again, "repository", 60)
    result = run_user_data(again, installer_user_data)
    assert again.ready(result), again.console + result.stderr
    assert again.calls.count("dnf install -y mdadm") == 2
    assert "node-setup: mdadm install failed (try 1); trying again in 60s" in again.console


def test_a_network_that_stays_down_fails_the_setup_after_about_ten_minutes(installer_user_data, tmp_path) -> None:
    node = Node(tmp_path, ami_has_efa=False)
    (node.state / "efa-tarball").write_bytes(efa_installer_tarball())
    outage(node, "efa-installer", 24 * 3600)
    result = run_user_data(node, installer_user_data)
    assert_out_of_service(node, result, "EFA installer download failed (aws-efa-installer-9.9.9.tar.gz; "
                                        "10 tries, the setup's retry time spent)")
    assert node.calls.count("https://efa-installer.amazonaws.com/") == 10
    assert slept(node) == 9 * 60  # bounded: 9 waits between 10 tries


def test_the_retry_time_is_one_budget_for_the_whole_setup(installer_user_data, tmp_path) -> None:
    """Cold review (helper-141): per step, three steps could each add 9 minutes of waits to a boot. The installer's
    host down for 4 minutes, then the repository for a day: the installer gets what the download left (5 waits), and
    fails the setup, at 9 minutes of waits in all."""
    node = Node(tmp_path, ami_has_efa=False)
    (node.state / "efa-tarball").write_bytes(efa_installer_tarball())
    outage(node, "efa-installer", 240)
    outage(node, "repository", 24 * 3600)
    result = run_user_data(node, installer_user_data)
    assert_out_of_service(node, result, "EFA install failed (6 tries, the setup's retry time spent)")
    assert node.calls.count("https://efa-installer.amazonaws.com/") == 5
    assert slept(node) == 9 * 60


def test_a_wrong_checksum_is_not_retried(default_user_data, tmp_path) -> None:
    """A download that arrived but is not the pinned installer will not become it: one try, no wait."""
    node = Node(tmp_path, ami_has_efa=False)
    (node.state / "efa-tarball").write_bytes(efa_installer_tarball())
    result = run_user_data(node, default_user_data)
    assert_out_of_service(node, result, "EFA installer checksum mismatch")
    assert node.calls.count("https://efa-installer.amazonaws.com/") == 1 and "sleep" not in node.calls


def test_no_efa_and_no_installer_keeps_the_node_out_of_service(ami_efa_only_user_data, tmp_path) -> None:
    node = Node(tmp_path, ami_has_efa=False)
    result = run_user_data(node, ami_efa_only_user_data)
    assert_out_of_service(node, result, "the AMI has no EFA and node.efa_installer_sha256 is null")
    assert "curl" not in node.calls


def test_no_instance_store_disk_keeps_the_node_out_of_service(default_user_data, tmp_path) -> None:
    """Old code: `systemctl poweroff --force`; Auto Scaling then launches another node, again and again."""
    node = Node(tmp_path, disks=0)
    result = run_user_data(node, default_user_data)
    assert_out_of_service(node, result, "no NVMe instance-store disk for the model cache")
    # It stays out across a reboot: an operator clears the record to try again.
    rebooted = node.reboot()
    assert rebooted.returncode == 1 and not node.ready(rebooted)
    assert "an earlier setup failed" in node.console


def test_imds_rule_failure_keeps_the_node_out_of_service(default_user_data, tmp_path) -> None:
    node = Node(tmp_path)
    (node.state / "iptables-broken").touch()
    result = run_user_data(node, default_user_data)
    assert_out_of_service(node, result, "cannot block IMDS for task containers")


def test_mdadm_comes_from_the_repository_and_its_failure_is_a_failed_setup(default_user_data, tmp_path) -> None:
    node = Node(tmp_path / "a", mdadm_in_ami=False)
    assert node.ready(run_user_data(node, default_user_data)), node.console
    assert "dnf install -y mdadm" in node.calls
    broken = Node(tmp_path / "b", mdadm_in_ami=False)
    (broken.state / "dnf-fails").touch()
    assert_out_of_service(broken, run_user_data(broken, default_user_data), "mdadm install failed")


def test_a_failed_node_reports_to_cloudwatch_with_the_instance_role(default_user_data, tmp_path) -> None:
    node = Node(tmp_path, disks=0)
    run_user_data(node, default_user_data)
    timer = node.file("/etc/systemd/system/node-setup-report.timer")
    assert "OnUnitActiveSec=180s" in timer  # every 5-minute alarm period holds a data point
    (command,) = re.findall(r"^ExecStart=(.+)$", node.file("/etc/systemd/system/node-setup-report.service"), re.M)
    result = node.boot(*command.split())
    assert result.returncode == 0, result.stderr
    put = node.text("putmetric")
    for part in ("--aws-sigv4 aws:amz:us-east-2:monitoring", "--user ASIAKEY:SECRET", "x-amz-security-token: SESSION",
                 "Action=PutMetricData", "Namespace=Rufus/Node", "MetricName=NodeSetupFailed",
                 "Dimensions.member.1.Name=Cell", "Dimensions.member.1.Value=dev",
                 "https://monitoring.us-east-2.amazonaws.com/"):
        assert part in put, (part, put)


def test_the_failure_report_is_a_sigv4_request_cloudwatch_would_accept(default_user_data, tmp_path) -> None:
    """The real curl signs the report; botocore's SigV4 signer, given what arrived, computes the same signature."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    received: dict = {}

    class Monitoring(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.update(headers=dict(self.headers.items()), path=self.path,
                            body=self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Monitoring)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        node = Node(tmp_path, disks=0)
        run_user_data(node, default_user_data)
        (node.state / "monitoring-endpoint").write_text(f"http://127.0.0.1:{server.server_port}/")
        result = node.boot("/usr/local/sbin/node-setup", "report")
    finally:
        server.shutdown()
    assert result.returncode == 0 and received, result.stderr
    form = dict(urllib.parse.parse_qsl(received["body"].decode()))
    assert form == {"Action": "PutMetricData", "Version": "2010-08-01", "Namespace": "Rufus/Node",
                    "MetricData.member.1.MetricName": "NodeSetupFailed", "MetricData.member.1.Value": "1",
                    "MetricData.member.1.Dimensions.member.1.Name": "Cell",
                    "MetricData.member.1.Dimensions.member.1.Value": "dev"}
    headers = {k.lower(): v for k, v in received["headers"].items()}
    assert headers["x-amz-security-token"] == "SESSION"
    match = re.fullmatch(r"AWS4-HMAC-SHA256 Credential=ASIAKEY/(\d{8})/us-east-2/monitoring/aws4_request, "
                         r"SignedHeaders=([a-z0-9;-]+), Signature=([0-9a-f]{64})", headers["authorization"])
    assert match, headers["authorization"]
    _, signed, signature = match.groups()
    request = AWSRequest(method="POST", url=f"http://{headers['host']}{received['path']}", data=received["body"],
                         headers={name: headers[name] for name in signed.split(";")})
    request.context["timestamp"] = headers["x-amz-date"]
    signer = SigV4Auth(Credentials("ASIAKEY", "SECRET", "SESSION"), "monitoring", "us-east-2")
    canonical = signer.canonical_request(request)
    assert signer.signature(signer.string_to_sign(request, canonical), request) == signature, canonical


def test_a_healthy_node_reports_nothing(default_user_data, tmp_path) -> None:
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    node.boot("/usr/local/sbin/node-setup", "report")
    assert "monitoring" not in node.calls


# -- a node set up whose ECS agent never registers ------------------------------------------

# The agent's introspection answer once registered (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/
# ecs-agent-introspection.html), as Go's encoding/json writes it: no spaces.
REGISTERED = ('{"Cluster":"Rufus-Cell-dev-Cluster","ContainerInstanceArn":"arn:aws:ecs:us-east-2:111111111111:'
              'container-instance/Rufus-Cell-dev-Cluster/0123456789abcdef0123456789abcdef",'
              '"Version":"Amazon ECS Agent - v1.89.0 (abcdef12)"}')
# The agent's terminal exit (5, ecs.service's RestartPreventExitStatus) as `systemctl show -p ...` prints it.
AGENT_EXITED = "ActiveState=failed\nExecMainStatus=5\nNRestarts=0\n"


def _unit_command(node: Node, unit: str) -> str:
    (command,) = re.findall(r"^ExecStart=(.+)$", node.file(f"/etc/systemd/system/{unit}") or "", flags=re.M)
    return command


def boot_then_report(node: Node, ready_seconds_ago: int, *between: str) -> subprocess.CompletedProcess:
    """A boot: node-setup.service's run, its ready file dated `ready_seconds_ago`, then node-setup-report.service's
    run after each shell step of `between` (none: one report)."""
    setup, report = _unit_command(node, "node-setup.service"), _unit_command(node, "node-setup-report.service")
    steps = [f"{setup} || exit 9", f'touch -d "@$(( $(date +%s) - {ready_seconds_ago} ))" /run/node-setup/ready',
             *[f"{step}; {report}" for step in between or (":",)]]
    return node.boot("bash", "-c", "\n".join(steps))


def test_a_node_set_up_starts_its_report_timer(default_user_data, tmp_path) -> None:
    """The timer that reports runs on every node, not only on a failed one: an ECS agent may fail after the setup.
    Old code: enabled only by a failed setup."""
    node = Node(tmp_path)
    result = run_user_data(node, default_user_data)
    assert node.ready(result) and "systemctl enable --now node-setup-report.timer" in node.calls, node.calls
    assert "OnUnitActiveSec=180s" in node.file("/etc/systemd/system/node-setup-report.timer")


@pytest.mark.parametrize("metadata", [None, '{"Cluster":"Rufus-Cell-dev-Cluster","ContainerInstanceArn":null}'],
                         ids=["agent-not-answering", "answering-without-an-arn"])
def test_a_node_whose_ecs_agent_never_registers_reports_it(default_user_data, tmp_path, metadata: str | None) -> None:
    """Set up, ready 10 min ago, and no container instance ARN from the agent: NodeAgentUnregistered with the
    instance role, and ecs.service's state on the console. Old code: nothing reported (no failed setup)."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    if metadata is not None:
        (node.state / "agent-metadata").write_text(metadata)
    (node.state / "show").write_text(AGENT_EXITED)
    result = boot_then_report(node, 600)
    assert result.returncode == 0, result.stderr
    put = node.text("putmetric")
    for part in ("--aws-sigv4 aws:amz:us-east-2:monitoring", "Namespace=Rufus/Node",
                 "MetricName=NodeAgentUnregistered", "Dimensions.member.1.Value=dev"):
        assert part in put, (part, put)
    assert "node-setup: ECS agent not registered: ActiveState=failed ExecMainStatus=5 NRestarts=0" in node.console
    assert "systemctl show -p ActiveState,ExecMainStatus,NRestarts ecs" in node.calls


def test_an_agent_within_its_grace_is_not_reported(default_user_data, tmp_path) -> None:
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    boot_then_report(node, 540)
    assert "localhost:51678/v1/metadata" in node.calls  # asked, not registered, but within the grace
    assert "monitoring" not in node.calls and "not registered" not in node.console


def test_an_agent_seen_registered_is_not_reported_again_until_the_next_boot(default_user_data, tmp_path) -> None:
    """Once registered, an agent that stops answering (its update, a restart) is the placement controller's to judge
    (`agent-disconnected-since`), not a node that never registered; the next boot is judged anew."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    (node.state / "agent-metadata").write_text(REGISTERED)
    boot_then_report(node, 3600, ":", 'rm "$FAKE_STATE/agent-metadata"')
    assert node.calls.count("localhost:51678") == 1 and "monitoring" not in node.calls, node.calls
    boot_then_report(node, 3600)
    assert "MetricName=NodeAgentUnregistered" in node.text("putmetric")


def test_a_setup_run_again_in_the_same_boot_judges_the_agent_anew(default_user_data, tmp_path) -> None:
    """An operator's re-run of the setup (after a repair) clears the boot's registration record: an agent that does
    not come back is reported once its grace has passed. Old code: the record of the agent before the re-run kept the
    node silent until the next boot."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    (node.state / "agent-metadata").write_text(REGISTERED)
    setup, report = _unit_command(node, "node-setup.service"), _unit_command(node, "node-setup-report.service")
    node.boot("bash", "-c", "\n".join([
        f"{setup} || exit 9", report, 'rm "$FAKE_STATE/agent-metadata"', f"{setup} || exit 9",
        'touch -d "@$(( $(date +%s) - 600 ))" /run/node-setup/ready', report]))
    assert node.calls.count("localhost:51678") == 2, node.calls
    assert "MetricName=NodeAgentUnregistered" in node.text("putmetric")


REPORT_TIMER = "node-setup-report.timer"


def test_a_registered_node_stops_its_report_timer_until_the_next_boot(default_user_data, tmp_path) -> None:
    """Once the agent's ARN is recorded there is nothing left to report this boot: the timer stops instead of running
    `node-setup report` every 3 minutes for good. Stopped, not disabled: the record is on /run, so the next boot
    starts the timer again (timers.target) and judges its agent anew. Old code: the timer ran on forever."""
    node = Node(tmp_path)
    assert node.ready(run_user_data(node, default_user_data)) and node.active(REPORT_TIMER)
    (node.state / "agent-metadata").write_text(REGISTERED)
    boot_then_report(node, 60)
    assert not node.active(REPORT_TIMER), node.calls
    assert node.enabled(REPORT_TIMER) and "monitoring" not in node.calls
    assert "node-setup: ECS agent registered" in node.console
    (node.state / "agent-metadata").unlink()
    boot_then_report(node, 600, ":", ":")
    assert node.active(REPORT_TIMER) and node.calls.count("https://monitoring.") == 2, node.calls
    assert "MetricName=NodeAgentUnregistered" in node.text("putmetric")


def test_a_node_registered_then_failed_in_the_same_boot_reports_the_failure(default_user_data, tmp_path) -> None:
    """The registration record does not silence a setup that fails later in the boot (an operator's re-run): the failed
    setup starts the timer again and the failure, checked first, is reported on every run."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    (node.state / "agent-metadata").write_text(REGISTERED)
    boot_then_report(node, 60, ":", 'touch "$FAKE_STATE/fail-start-ecstasks.slice"; /usr/local/sbin/node-setup', ":")
    assert node.active(REPORT_TIMER) and node.calls.count("https://monitoring.") == 2, node.calls
    assert "MetricName=NodeSetupFailed" in node.text("putmetric")


@pytest.mark.parametrize(("disks", "ready_seconds_ago", "puts"), [(0, 0, 2), (4, 600, 2), (4, 540, 0)],
                         ids=["failed-setup", "agent-unregistered", "agent-within-its-grace"])
def test_a_node_with_something_to_report_keeps_its_timer(default_user_data, tmp_path, disks: int,
                                                         ready_seconds_ago: int, puts: int) -> None:
    """A failed node and one whose agent has not registered report on every run (each alarm needs a data point in
    every 5-minute period); one within its grace is asked again on the next run."""
    node = Node(tmp_path, disks=disks)
    run_user_data(node, default_user_data)
    setup, report = _unit_command(node, "node-setup.service"), _unit_command(node, "node-setup-report.service")
    if disks:
        boot_then_report(node, ready_seconds_ago, ":", ":")
    else:
        node.boot("bash", "-c", f"{setup}; {report}; {report}")
    assert node.active(REPORT_TIMER) and node.enabled(REPORT_TIMER), node.calls
    assert node.calls.count("https://monitoring.") == puts, node.calls


def test_a_failed_setup_reports_that_and_not_the_agent(default_user_data, tmp_path) -> None:
    node = Node(tmp_path, disks=0)
    run_user_data(node, default_user_data)
    node.boot("/usr/local/sbin/node-setup", "report")
    assert "MetricName=NodeSetupFailed" in node.text("putmetric") and "51678" not in node.calls


# -- every device the unit tasks are given is on the node before the ECS agent starts ---------


def without(*paths: str) -> list[str]:
    return [path for path in TASK_DEVICES if path not in paths]


def test_a_node_short_of_an_efa_device_stays_out_of_service(default_user_data, tmp_path) -> None:
    """Old code: fi_info finds the efa provider on 15 of 16 devices, the agent starts, every unit task fails at
    container creation (Docker: no such device) and nothing quarantines the host."""
    node = Node(tmp_path, devices=without("/dev/infiniband/uverbs15"))  # uverbs0..14 of 16; fi_info succeeds
    result = run_user_data(node, default_user_data)
    assert_out_of_service(node, result, "task device(s) missing: /dev/infiniband/uverbs15 (the unit tasks pass "
                                        f"all {len(TASK_DEVICES)} to Docker")
    assert "udevadm settle --timeout=60" in node.calls
    assert node.calls.count("sleep 5") == 12  # a bounded wait (60 s) for udev, then the failed setup


def test_every_missing_device_is_named_and_a_file_is_not_a_device(default_user_data, tmp_path) -> None:
    """Docker takes only device nodes (moby DevicesFromPath: a regular file is not a device): neither does setup."""
    node = Node(tmp_path, devices=without("/dev/neuron0", "/dev/neuron3"))
    (node.state / "devices").write_text((node.state / "devices").read_text() + "/dev/neuron3 file -\n")
    result = run_user_data(node, default_user_data)
    assert_out_of_service(node, result, "task device(s) missing: /dev/neuron0 /dev/neuron3 (")


def test_a_device_udev_makes_late_is_waited_for(default_user_data, tmp_path) -> None:
    node = Node(tmp_path, devices=without("/dev/infiniband/uverbs15"))
    (node.state / "late-devices").write_text(device_lines(["/dev/infiniband/uverbs15"]))
    result = run_user_data(node, default_user_data)
    assert node.ready(result), node.console + result.stderr
    assert node.calls.count("sleep 5") == 1


def test_a_reboot_checks_efa_only_after_udev_has_made_the_devices(default_user_data, tmp_path) -> None:
    """A defect hunt (thirty-third session): on a later boot node-setup.service runs after network-online.target,
    and `ensure_efa` asked fi_info (libfabric's efa provider opens each /dev/infiniband/uverbsN) before udev's
    queue was waited for: a verbs device not made yet sent the node to download and run the EFA installer again,
    and with the download not answering, out of service for good. Old code: the installer's download tried."""
    node = Node(tmp_path)
    assert node.ready(run_user_data(node, default_user_data)), node.console
    # fi_info as libfabric's efa provider behaves: no verbs device node, no efa provider.
    fi_info = node.root / "upper/opt/amazon/efa/bin/fi_info"
    fi_info.write_text("#!/bin/sh\n[ -c /dev/infiniband/uverbs0 ] || { echo 'fi_getinfo: -61' >&2; exit 1; }\n")
    # This boot the EFA driver binds while udev works through its queue: the nodes exist once `udevadm settle`
    # returns (the fake settle makes them), as task_devices assumes.
    efa = [d for d in node.text("devices").splitlines() if "uverbs" in d]
    (node.state / "devices").write_text("".join(f"{d}\n" for d in node.text("devices").splitlines() if d not in efa))
    (node.state / "late-devices").write_text("".join(f"{d}\n" for d in efa))
    (node.bin / "udevadm").write_text(
        '#!/bin/bash\necho "udevadm $*" >> "$FAKE_STATE/calls"\n'
        'if [ "$1" = settle ] && [ -e "$FAKE_STATE/late-devices" ]; then\n'
        '  while read -r path major minor; do mkdir -p "${path%/*}"; mknod "$path" c "$major" "$minor"; done '
        '< "$FAKE_STATE/late-devices"\n  rm "$FAKE_STATE/late-devices"\nfi\n')
    result = node.reboot()
    assert node.ready(result), node.console + result.stderr
    assert "efa-installer.amazonaws.com" not in node.calls


def test_the_node_checks_exactly_the_devices_the_task_definitions_pass(synth_default, default_user_data,
                                                                        tmp_path) -> None:
    node = Node(tmp_path)
    assert node.ready(run_user_data(node, default_user_data)), node.console
    (line,) = [x for x in node.file("/etc/node-setup/node-setup.conf").splitlines() if x.startswith("TASK_DEVICES=")]
    checked = line.removeprefix("TASK_DEVICES=").strip("'").split()
    resources = synth_default.template_json(DEV)["Resources"].values()
    tasks = [r for r in resources if r["Type"] == "AWS::ECS::TaskDefinition"]
    passed = [[d["HostPath"] for d in c.get("LinuxParameters", {}).get("Devices", [])]
              for t in tasks for c in t["Properties"]["ContainerDefinitions"]]
    passed = [devices for devices in passed if devices]
    assert passed and all(devices == checked for devices in passed), (checked, passed)
    assert checked == TASK_DEVICES and len(checked) == 32  # trn2.48xlarge: 16 Neuron chips, 16 EFA interfaces


# -- item 7: a reboot keeps the cache mount, the RAID and the IMDS rule ------------------------


def test_reboot_brings_back_the_cache_mount_raid_and_imds_rule(default_user_data, tmp_path) -> None:
    """Old code: nothing runs at boot; /opt/models is a root-volume directory and IMDS is open to tasks."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    assert "node-setup" in node.console and "done" in node.console, node.console
    _, label = node.text("fs-device").split()
    (node.state / "fs" / label / "some-model.bin").write_text("cached")

    result = node.reboot()
    assert node.ready(result) and "CACHE=mounted" in result.stdout, node.console + result.stderr
    assert "mdadm --assemble --scan" in node.calls and "mkfs.xfs" not in node.calls  # the cache survived
    assert (node.state / "fs" / label / "some-model.bin").read_text() == "cached"
    assert node.text("boot/iptables").splitlines() == [
        "OUTPUT -d 169.254.169.254/32 -m cgroup --path ecstasks.slice -j REJECT"]
    # What systemd itself reads at boot: the fstab line (noauto: node-setup alone mounts it; nofail: a
    # missing RAID does not stop the boot) and the array in mdadm.conf.
    assert "LABEL=models /opt/models xfs noatime,noauto,nofail 0 2" in node.file("/etc/fstab")
    assert node.file("/etc/mdadm.conf").startswith("ARRAY /dev/md/models ")
    # The ECS agent starts only after this, and only when it succeeded.
    drop_in = node.file("/etc/systemd/system/ecs.service.d/50-node-setup.conf")
    assert drop_in is not None, "ecs.service does not wait for the node's setup"
    for line in ("Requires=node-setup.service", "After=node-setup.service",
                 "ConditionPathExists=/run/node-setup/ready"):
        assert line in drop_in.splitlines()
    assert "Before=ecs.service" in node.file("/etc/systemd/system/node-setup.service")


def test_reboot_without_the_raid_keeps_the_ecs_agent_off(default_user_data, tmp_path) -> None:
    """The array cannot be assembled and no disk is left to make a new one: no agent, and the reason."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    (node.state / "md-superblock").unlink()
    (node.state / "lsblk").write_text(ROOT_DISK + "\n")
    result = node.reboot()
    assert result.returncode == 1 and not node.ready(result)
    assert "node-setup: FAILED: no NVMe instance-store disk for the model cache" in node.console


def test_a_second_run_changes_nothing(default_user_data, tmp_path) -> None:
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    setup = " ".join(node.exec_start())
    result = node.boot(*ready_probe("bash", "-c", f"{setup} && {setup}"))
    assert node.ready(result)
    assert node.text("boot/iptables").count("REJECT") == 1
    assert node.file("/etc/fstab").count("LABEL=models ") == 1
    assert node.file("/etc/ecs/ecs.config").count("ECS_ENABLE_TASK_IAM_ROLE=true") == 1


def test_stop_and_start_makes_the_cache_anew_on_the_blank_instance_store(default_user_data, tmp_path) -> None:
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    result = node.stop_and_start()
    assert result.returncode == 0, node.console + result.stderr
    assert "mkfs.xfs -f -L models /dev/md/models" in node.calls
    assert node.file("/etc/fstab").count("LABEL=models ") == 1
    assert (node.state / "fs/models/.instance-store").is_file()


def test_systemds_own_mount_of_the_new_cache_does_not_fail_a_stop_and_start(default_user_data, tmp_path) -> None:
    """After a stop and start the disks are blank and the fstab line of the first boot is still there.
    Without `noauto`, systemd makes its own mount unit of it, which waits for the label (its device
    timeout, 90 s by default) while `nofail` keeps local-fs.target from waiting for it (systemd.mount(5),
    "nofail"); node-setup, ordered only after local-fs.target, makes the file system, systemd's job
    mounts it as the label appears, and node-setup's own mount failed "already mounted": the node out
    of service on every boot (the eighteenth session's cold review found it)."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    (node.state / "systemd-mounts").touch()
    result = node.stop_and_start()
    assert node.ready(result), node.console + result.stderr
    assert "mkfs.xfs -f -L models /dev/md/models" in node.calls
    assert (node.state / "fs/models/.instance-store").is_file()


def test_a_journal_that_cannot_be_written_does_not_fail_the_setup(default_user_data, tmp_path) -> None:
    node = Node(tmp_path)
    (node.bin / "systemd-cat").write_text("#!/bin/bash\ncat > /dev/null\nexit 1\n")
    result = run_user_data(node, default_user_data)
    assert node.ready(result), node.console + result.stderr
    assert "node-setup: done" in node.console


def test_single_disk_cache_needs_no_raid(default_user_data, tmp_path) -> None:
    node = Node(tmp_path, disks=1)
    result = run_user_data(node, default_user_data)
    assert node.ready(result), node.console
    assert "mdadm" not in node.calls and "mkfs.xfs -f -L models /dev/nvme1n1" in node.calls


# -- the script itself ----------------------------------------------------------------------


def test_user_data_fits_ec2s_limit(default_user_data) -> None:
    # EC2 refuses user data over 16 KB before base64 (AWS EC2 user guide, "Run commands at launch").
    assert len(default_user_data.encode()) <= 16 * 1024


def _bash_function_of(script: str) -> str:
    """`script` as bash parses it: the body of a function bash prints back, which holds no comment but every
    string and here-document as read."""
    result = subprocess.run(["bash", "-c", 'eval "f() {\n$1\n}" && declare -f f', "parse", script],
                            capture_output=True, text=True, check=True)
    return result.stdout


def test_the_installed_script_is_the_repository_file_without_its_comment_lines(default_user_data, tmp_path) -> None:
    """User data embeds node_setup.sh without its full-line comments and blank lines (the shebang and shellcheck's
    directives kept), and bash parses the two alike: no dropped line was data of a string or here-document. Old
    code: embedded whole, 4.9 KB of comments in EC2's 16 KB."""
    node = Node(tmp_path)
    assert node.ready(run_user_data(node, default_user_data))
    installed, original = node.file("/usr/local/sbin/node-setup"), NODE_SETUP_SCRIPT.read_text()
    kept = [line for number, line in enumerate(original.splitlines())
            if line.strip() and (number == 0 or not line.lstrip().startswith("#")
                                 or line.lstrip().startswith("# shellcheck "))]
    assert installed.splitlines() == kept
    assert installed.startswith("#!/bin/bash\n") and len(original) - len(installed) > 4000
    (tmp_path / "installed").write_text(installed)
    syntax = subprocess.run(["bash", "-n", str(tmp_path / "installed")], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
    assert _bash_function_of(installed) == _bash_function_of(original)


def test_the_parse_comparison_sees_a_dropped_line_that_was_data() -> None:
    """The check above would catch a comment-like line inside a multi-line string (dropped, it changes the string)."""
    script = 'echo "one\n# data, not a comment\ntwo"\n# a comment\n'
    dropped = 'echo "one\ntwo"\n'
    assert _bash_function_of(script) != _bash_function_of(dropped)
    assert _bash_function_of(script) == _bash_function_of('echo "one\n# data, not a comment\ntwo"\n')


def test_a_script_with_a_here_document_is_not_stripped() -> None:
    """A here-document's lines are data, comment-like or not: such a script must be embedded whole."""
    with pytest.raises(ValueError, match="here-document"):
        without_comment_lines("#!/bin/bash\ncat <<EOF\n# data\nEOF\n")
    assert without_comment_lines('#!/bin/bash\n# why\n\n  # indented\ngrep -q x <<<"$y"  # kept\n') == (
        '#!/bin/bash\ngrep -q x <<<"$y"  # kept')


def test_a_hung_report_does_not_stop_the_timer_for_the_boot(default_user_data, tmp_path) -> None:
    """A oneshot has no start timeout by default (systemd.service(5), TimeoutStartSec=): a report hung on a stalled
    connection would keep the unit activating, and the timer would start no other run. Old code: no timeout."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    (timeout,) = re.findall(r"^TimeoutStartSec=(\d+)$", node.file("/etc/systemd/system/node-setup-report.service"),
                            flags=re.M)
    (period,) = re.findall(r"^OnUnitActiveSec=(\d+)s$", node.file("/etc/systemd/system/node-setup-report.timer"),
                           flags=re.M)
    assert 0 < int(timeout) < int(period)


def test_shellcheck_is_clean_on_the_user_data_and_the_installed_script(default_user_data, tmp_path) -> None:
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed (apt-get install -y shellcheck; see the Makefile's setup)"
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    installed = tmp_path / "node-setup"
    installed.write_text(node.file("/usr/local/sbin/node-setup"))
    for script in (node.root / "user-data", installed):
        result = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(script)],
                                capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("metric", ["NodeSetupFailed", "NodeAgentUnregistered"])
def test_the_node_alarms_are_in_the_rollout_gate(synth_default, metric: str) -> None:
    template = synth_default.template_json(DEV)
    alarms = {k: v for k, v in template["Resources"].items() if v["Type"] == "AWS::CloudWatch::Alarm"}
    (alarm_id,) = [k for k, v in alarms.items() if v["Properties"].get("MetricName") == metric]
    props = alarms[alarm_id]["Properties"]
    assert props["Namespace"] == "Rufus/Node" and props["Dimensions"] == [{"Name": "Cell", "Value": "dev"}]
    assert props["Period"] == 300 and props["Statistic"] == "Maximum" and props["Threshold"] == 1
    (gate,) = [v for v in template["Resources"].values() if v["Type"] == "AWS::CloudWatch::CompositeAlarm"]
    assert alarm_id in json.dumps(gate["Properties"]["AlarmRule"])
    # The node may put that metric, in that namespace only.
    policies = [v for v in template["Resources"].values() if v["Type"] == "AWS::IAM::ManagedPolicy"]
    assert any('"cloudwatch:namespace": "Rufus/Node"' in json.dumps(p) for p in policies)


def test_nodes_launch_after_their_security_groups_self_rules_and_their_report_policy(synth_default) -> None:
    """CloudFormation orders only what a reference or DependsOn ties: the launch template names the EFA security
    group and the role, not the group's self rules (the EFA installer's self test needs them) nor the policy a
    failed setup reports with. Old code: neither was in the group's DependsOn."""
    resources = synth_default.template_json(DEV)["Resources"]
    (group,) = [v for v in resources.values() if v["Type"] == "AWS::AutoScaling::AutoScalingGroup"]
    efa_group = next(k for k, v in resources.items() if v["Type"] == "AWS::EC2::SecurityGroup"
                     and "EFA" in v["Properties"]["GroupDescription"])
    self_rules = {k for k, v in resources.items()
                  if v["Type"] in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress")
                  and v["Properties"].get("GroupId") == {"Fn::GetAtt": [efa_group, "GroupId"]}
                  and {"Fn::GetAtt": [efa_group, "GroupId"]} in (v["Properties"].get("SourceSecurityGroupId"),
                                                                 v["Properties"].get("DestinationSecurityGroupId"))}
    (policy,) = [k for k, v in resources.items() if v["Type"] == "AWS::IAM::ManagedPolicy"
                 and "NodeSetupFailed" in v["Properties"].get("Description", "")]
    assert len(self_rules) == 2 and self_rules | {policy} <= set(group["DependsOn"]), group["DependsOn"]


def test_fakes_are_not_left_on_the_build_machine() -> None:
    # The runs above write only below their temporary directories: /etc stays as it was.
    assert not os.path.exists("/etc/node-setup") and not os.path.exists("/usr/local/sbin/node-setup")


def test_the_launcher_checks_the_marker_the_node_writes(synth_default, default_user_data, tmp_path) -> None:
    """Item 7: every unit container's spec names the file node-setup writes on the instance-store mount."""
    node = Node(tmp_path)
    run_user_data(node, default_user_data)
    _, label = node.text("fs-device").split()
    assert (node.state / "fs" / label / ".instance-store").is_file()  # on the instance store, not the root volume
    template = synth_default.template_json(DEV)
    tasks = [r for r in template["Resources"].values() if r["Type"] == "AWS::ECS::TaskDefinition"]
    specs = [json.loads(e["Value"]) for t in tasks for c in t["Properties"]["ContainerDefinitions"]
             for e in c.get("Environment", []) if e["Name"] == "UNIT_SPEC"]
    assert specs and all(spec["model"]["cache_marker"] == MARKER for spec in specs)
