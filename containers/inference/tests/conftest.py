"""Fixtures of the launcher tests: unit specs on loopback and launcher nodes as real processes."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loopback_ports import held_port

STANDIN = Path(__file__).with_name("standin_engine.py")
# A loopback port nothing listens on (tcpmux): where the launchers' self-check looks for IMDS in tests.
CLOSED_LOOPBACK_PORT = "127.0.0.1:1"
# What a loopback Cloud Map (LoopbackCloudMap) answers with no answer: the request is held until it stops.
HANG = "hang"


def free_ports(count: int) -> list[int]:
    """Loopback ports nobody else is handed before this test's processes bind them (seconds later on a loaded
    machine): loopback_ports.held_port. Found free and closed, a port went to the next bind to port 0 anywhere:
    another xdist worker's server or launcher took one once (test_leader_gone.py's `_no_leader`). Every binder
    here sets SO_REUSEADDR, as a held port needs: the leader's aiohttp site, moto's werkzeug server, the slow
    link's http.server; the stand-in engine binds none of its ports."""
    return [held_port() for _ in range(count)]


def cpu_spec(size: int, *, record_dir: Path, revision: str = "rev-a", **rendezvous: Any) -> dict[str, Any]:
    """A cpu-device unit spec whose engine is the stand-in; every port is a free loopback port."""
    engine_port, master_port, rdzv_port, rt_port = free_ports(4)
    return {
        "cell": "test",
        "unit_id": "u0",
        "size": size,
        "revision": revision,
        "model": {"name": "tiny", "local_dir": str(record_dir), "max_seq_len": 256},
        # Each test keeps its own unit history (restart backoff), not its neighbours'.
        "state_dir": str(record_dir / ".unit-state"),
        "instance": {
            "type": "cpu",
            "cores_per_node": 1,
            "lnc": 1,
            "lnc_configurable": False,
            "neuron_devices": 1,
            "efa_interfaces": 0,
        },
        "neuron": {"tp_degree": size, "world_size": size, "rt_root_comm_port": rt_port},
        "engine": {
            "device": "cpu",
            "command": [sys.executable, str(STANDIN)],
            "port": engine_port,
            "master_port": master_port,
            "max_num_seqs": 4,
            "stop_timeout_seconds": 5,
            "extra_env": {"STANDIN_RECORD_DIR": str(record_dir)},
        },
        "rendezvous": {
            "port": rdzv_port,
            "join_timeout_seconds": 20,
            "follower_loss_seconds": 3.0,
            "heartbeat_interval_seconds": 0.3,
            **rendezvous,
        },
        "discovery": {"namespace": "test.fleet.internal", "leader_service": "leader-u0"},
    }


class Node:
    """One launcher process (`python -m unit_launcher run`) on loopback."""

    def __init__(
        self,
        spec: dict[str, Any],
        role: str,
        instance_id: str,
        log_dir: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.spec, self.role, self.instance_id = spec, role, instance_id
        self.log_path = log_dir / f"{instance_id}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UNIT_", "ECS_", "AWS_"))}
        env.update(
            {
                "UNIT_ROLE": role,
                "UNIT_SPEC": json.dumps(spec),
                "UNIT_HOST_IP": "127.0.0.1",
                "UNIT_INSTANCE_ID": instance_id,
                "UNIT_LEADER_ADDR": "127.0.0.1",
                "UNIT_BIND_ADDR": "127.0.0.1",
                "AWS_EC2_METADATA_DISABLED": "true",
                # The self-check's IMDS connect goes to a closed loopback port (unit_launcher.self_check).
                "UNIT_SELF_CHECK_IMDS": CLOSED_LOOPBACK_PORT,
                "PYTHONUNBUFFERED": "1",
                # The launcher's health file (unit_launcher/health_file.py), per node, never the host's /tmp.
                "UNIT_HEALTH_FILE": str(log_dir / f"{instance_id}.state"),
                **(extra_env or {}),
            }
        )
        self.started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "unit_launcher", "run"], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.instance_id} still running after {timeout} s; log:\n{self.log}") from None

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait_catches(self, sig: int, timeout: float = 30.0) -> None:
        """Until the launcher handles `sig` (`python -m unit_launcher`'s first lines ran). A fixed sleep before an
        early signal is no such wait: 0.3 s after the start, a loaded machine had not yet run them (CI: -10)."""
        deadline = time.monotonic() + timeout
        while not catches(self.process.pid, sig):
            assert time.monotonic() < deadline and self.process.poll() is None, f"never started; log:\n{self.log}"
            time.sleep(0.001)  # at once: the tests signal it while it still imports its modules

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask of /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (sig - 1) & 1)


def get_status(port: int, timeout: float = 1.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=timeout) as response:
            return json.loads(response.read())
    except OSError:
        return None


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str | Callable[[], str], interval: float = 0.05
) -> Any:
    """`predicate`'s first true value within `timeout` s. `what` names what was awaited; a callable is called only
    on a timeout, so that what it reads (a node's log) is read then, not before the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")


@pytest.fixture(autouse=True)
def _private_health_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower run in-process writes its health file under the test's directory, not the host's /tmp."""
    monkeypatch.setenv("UNIT_HEALTH_FILE", str(tmp_path / "unit-launcher.state"))


@pytest.fixture
def unit_nodes(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Start launcher nodes; every process still running at the end is killed."""
    nodes: list[Node] = []

    def start(spec: dict[str, Any], role: str, instance_id: str, **kwargs: Any) -> Node:
        node = Node(spec, role, instance_id, tmp_path, **kwargs)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()
    # Stand-in engines left by a launcher that was killed outright must have died with it.
    # So must a child a stand-in left behind (STANDIN_ORPHAN_SECONDS).
    for record in tmp_path.glob("*.json"):
        started = json.loads(record.read_text())
        for pid in (started["pid"], started.get("orphan_pid")):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def h() -> types.SimpleNamespace:
    """The helpers above, for test modules (conftest is not importable under --import-mode=importlib)."""
    return types.SimpleNamespace(
        cpu_spec=cpu_spec, free_ports=free_ports, get_status=get_status, wait_for=wait_for, standin=STANDIN
    )


SLOW_LINK = Path(__file__).resolve().parents[3] / "e2e" / "slow_link.py"


class LoopbackS3:
    """moto's S3 server on 127.0.0.1 behind a slowed link (e2e/slow_link.py): both real
    processes; the launchers reach it through AWS_ENDPOINT_URL_S3, as boto3 does."""

    BUCKET = "models"

    def __init__(self, log_dir: Path, rate: float, match: str, cut: int | None = None, flip: int | None = None,
                 part_min: int | None = None) -> None:
        import boto3

        moto_port, link_port = free_ports(2)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        # moto's smallest multipart part (5 MiB, as S3's, unless set): small parts keep a multipart object small.
        moto_env = {**env, **({"S3_UPLOAD_PART_MIN_SIZE": str(part_min)} if part_min is not None else {})}
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
                             env=moto_env, stdout=(log_dir / "moto.log").open("wb"), stderr=subprocess.STDOUT),
            subprocess.Popen([sys.executable, str(SLOW_LINK), "--upstream", f"http://127.0.0.1:{moto_port}",
                              "--port", str(link_port), "--rate", str(rate), "--match", match,
                              *(["--cut", str(cut)] if cut is not None else []),
                              *(["--flip", str(flip)] if flip is not None else [])], env=env,
                             stdout=(log_dir / "slow-link.log").open("wb"), stderr=subprocess.STDOUT),
        ]
        self.url = f"http://127.0.0.1:{link_port}"
        self.client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto_port}", region_name="us-east-1",
                                   aws_access_key_id="test", aws_secret_access_key="test")
        wait_for(lambda: _answers(f"http://127.0.0.1:{moto_port}/") and _answers(self.url + "/"), 30, "loopback S3")
        self.client.create_bucket(Bucket=self.BUCKET)

    def put(self, objects: dict[str, bytes], prefix: str = "m") -> str:
        for key, body in objects.items():
            self.client.put_object(Bucket=self.BUCKET, Key=f"{prefix}/{key}", Body=body)
        return f"s3://{self.BUCKET}/{prefix}/"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_REGION": "us-east-1"}

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@pytest.fixture
def slow_s3(tmp_path: Path) -> Iterator[Callable[..., LoopbackS3]]:
    """Start a loopback S3 whose matching objects come through a slowed link."""
    started: list[LoopbackS3] = []

    def start(rate: float, match: str = r"_sharded_checkpoint", cut: int | None = None, flip: int | None = None,
              part_min: int | None = None) -> LoopbackS3:
        s3 = LoopbackS3(tmp_path, rate, match, cut, flip, part_min)
        started.append(s3)
        return s3

    yield start
    for s3 in started:
        s3.stop()


class LoopbackCloudMap:
    """Cloud Map's DiscoverInstances for launcher processes, on 127.0.0.1.

    The launchers reach it as their HTTP proxy (`HTTP_PROXY`: botocore sends an http endpoint's
    requests through it), the endpoint being an http name under `.invalid` that nothing resolves:
    botocore puts DiscoverInstances' `data-` host prefix before the endpoint's host, so a loopback
    address as the endpoint would become the name `data-127.0.0.1`. `answers` is what the requests
    get in turn, the last one repeated: a list of leader addresses (empty: no leader registered),
    or HANG (the request gets no answer until the fake stops)."""

    ENDPOINT = "http://cloudmap.invalid"

    def __init__(self, answers: list[list[str] | str]) -> None:
        self.answers, self.requests = answers, 0
        self.asked = threading.Condition()
        self.stopping = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answer = fake._next(self.headers.get("X-Amz-Target", ""))
                if answer == HANG:
                    fake.stopping.wait()
                    return
                body = json.dumps({"Instances": [
                    {"InstanceId": f"task-{ip}", "Attributes": {"AWS_INSTANCE_IPV4": ip}} for ip in answer
                ]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def _next(self, target: str) -> list[str] | str:
        assert target.endswith(".DiscoverInstances"), f"the fake Cloud Map answers DiscoverInstances only: {target}"
        with self.asked:
            answer = self.answers[min(self.requests, len(self.answers) - 1)]
            self.requests += 1
            self.asked.notify_all()
        return answer

    def wait_for_requests(self, count: int, timeout: float) -> None:
        with self.asked:
            if not self.asked.wait_for(lambda: self.requests >= count, timeout):
                raise AssertionError(f"{self.requests} DiscoverInstances request(s) after {timeout} s, not {count}")

    def env(self) -> dict[str, str]:
        """A launcher's environment for this fake: Cloud Map discovery (no UNIT_LEADER_ADDR; empty reads as unset)."""
        proxy = {name: self.url for name in ("HTTP_PROXY", "http_proxy")}
        return {"UNIT_LEADER_ADDR": "", "AWS_ENDPOINT_URL_SERVICEDISCOVERY": self.ENDPOINT, **proxy,
                "NO_PROXY": "", "no_proxy": "", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_REGION": "us-east-1"}

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cloud_map() -> Iterator[Callable[[list[list[str] | str]], LoopbackCloudMap]]:
    """Start a loopback Cloud Map (LoopbackCloudMap) with the given answers."""
    started: list[LoopbackCloudMap] = []

    def start(answers: list[list[str] | str]) -> LoopbackCloudMap:
        fake = LoopbackCloudMap(answers)
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()


# A task metadata endpoint that holds its answers (the ECS agent lagging): the early-stop tests' fixture.
class _HeldMetadata:
    """A task metadata endpoint (v4) that takes requests and answers none within `hold` seconds."""

    def __init__(self, hold: float = 30.0) -> None:
        asked = self.asked = threading.Event()
        released = self.released = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                asked.set()
                released.wait(hold)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v4/container"

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def held_metadata() -> Iterator[_HeldMetadata]:
    server = _HeldMetadata()
    yield server
    server.stop()
