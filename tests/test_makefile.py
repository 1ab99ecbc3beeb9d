"""The Makefile as a newcomer uses it: `make help` lists every target, and a fleet file whose
path has spaces works in every target that takes CONFIG (validate, plan, plan-rollout, synth)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"


def make(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-s", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def phony_targets() -> list[str]:
    text = MAKEFILE.read_text().replace("\\\n", " ")
    return [t for line in re.findall(r"^\.PHONY:(.*)$", text, re.MULTILINE) for t in line.split()]


def test_make_help_lists_every_target_with_one_line() -> None:
    done = make("help")
    assert done.returncode == 0, done.stderr
    described = dict(re.findall(r"^  (\S+)\s+(\S.*)$", done.stdout, re.MULTILINE))
    targets = phony_targets()
    assert {"help", "synth", "test", "validate", "plan", "plan-rollout", "simulate-scaling", "e2e"} <= set(targets)
    missing = [t for t in targets if t not in described]
    assert not missing, f"no `## ` description on the line of target(s) {missing}"
    assert len(done.stdout.splitlines()) == len(described), "one line per target"


@pytest.fixture(scope="module")
def spaced_fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fleets") / "my fleets"
    folder.mkdir()
    path = folder / "fleet two.yaml"
    path.write_text((ROOT / "config" / "default.yaml").read_text())
    return path


@pytest.mark.parametrize(("target", "expected"), [
    ("validate", "Rufus-Cell-dev: 1 unit(s)"),
    ("plan", "Rufus"),
    ("plan-rollout", "Rollout plan for fleet Rufus"),
])
def test_config_with_spaces_works(target: str, expected: str, spaced_fleet: Path) -> None:
    done = make(target, f"CONFIG={spaced_fleet}")
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout


def test_a_refused_fleet_fails_the_target_with_the_clis_status(tmp_path: Path) -> None:
    done = make("validate", f"CONFIG={tmp_path / 'no such fleet.yaml'}")
    assert done.returncode != 0 and "no such file" in done.stderr and "Error 3" in done.stderr


def test_synth_passes_a_spaced_config_as_one_argument(spaced_fleet: Path, tmp_path: Path) -> None:
    """`make synth` with the CDK CLI replaced by a script that records its arguments (a real synth
    takes minutes; tests/test_snapshots.py covers it)."""
    record = tmp_path / "argv.json"
    fake = tmp_path / "cdk"
    fake.write_text(
        "#!/usr/bin/env python3\nimport json, pathlib, sys\n"
        f"pathlib.Path({str(record)!r}).write_text(json.dumps(sys.argv[1:]))\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--output') + 1]); out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'Fake.template.json').write_text('{}')\n"
    )
    fake.chmod(0o755)
    done = make("synth", f"CONFIG={spaced_fleet}", f"CDK={fake}", f"CDK_OUT={tmp_path / 'out'}")
    assert done.returncode == 0, done.stderr
    argv = json.loads(record.read_text())
    assert argv[argv.index("-c") + 1] == f"config={spaced_fleet}"


class _FakeAws(BaseHTTPRequestHandler):
    """On one loopback port: the instance metadata service (IMDSv2: a token, then an instance role's
    credentials, as botocore's InstanceMetadataFetcher reads them) and an S3 that has no object."""

    seen: list[tuple[str, str, str]] = []

    def log_message(self, *_: object) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        self.seen.append(("PUT", self.path, ""))
        self._send(200, b"token-1") if self.path == "/latest/api/token" else self._send(404, b"")

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, self.headers.get("Authorization", "")))
        if self.path == "/latest/meta-data/iam/security-credentials/":
            self._send(200, b"compile-host-role")
        elif self.path == "/latest/meta-data/iam/security-credentials/compile-host-role":
            expires = (datetime.now(UTC) + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
            self._send(200, json.dumps({"Code": "Success", "AccessKeyId": "ASIAFAKEINSTANCEROLE",
                                        "SecretAccessKey": "secret", "Token": "token",
                                        "Expiration": expires}).encode())
        else:  # S3 GetObject of the manifest: not there
            self._send(404, b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>", "application/xml")


@pytest.fixture
def fake_aws() -> Iterator[str]:
    _FakeAws.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeAws)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_compile_takes_an_instance_roles_credentials_and_offline_targets_never_ask_for_them(
        fake_aws: str, tmp_path: Path) -> None:
    """`make compile COMPILE_ARGS=--check` on a compile host whose only credentials are its instance role's
    (the instance metadata, here on loopback): they resolve and sign the S3 read. The Makefile turns the
    instance metadata off for everything else (synth, test: offline)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_SERVICE_ENDPOINT=f"{fake_aws}/", AWS_ENDPOINT_URL_S3=fake_aws,
               AWS_DEFAULT_REGION="us-east-2", AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    done = subprocess.run(["make", "--no-print-directory", "-s", "compile", "COMPILE_ARGS=--check",
                           "CONFIG=config/default.yaml"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180, check=False)
    assert "NoCredentialsError" not in done.stderr, done.stderr
    # The S3 read was made, signed, and found no manifest (make reports the CLI's exit 5 as its Error 5).
    assert "artifacts-manifest.json does not exist: compile this layout first" in done.stderr, done.stderr
    assert "Error 5" in done.stderr, done.stderr
    reads = [auth for _, path, auth in _FakeAws.seen if path.endswith("/artifacts-manifest.json")]
    assert reads and "Credential=ASIAFAKEINSTANCEROLE/" in reads[0], _FakeAws.seen
    # Offline targets keep the instance metadata off: the recipe of synth and test has no WITH_AWS.
    for target in ("synth", "test", "validate", "plan"):
        recipe = make("-n", target).stdout
        assert "AWS_EC2_METADATA_DISABLED" not in recipe, (target, recipe)
    printed = make("--eval", "show: ; @echo $$AWS_EC2_METADATA_DISABLED", "show").stdout
    assert printed.strip().endswith("true"), printed
