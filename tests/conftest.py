"""Shared fixtures: synthesize a fleet the way `cdk synth` does, with the policy checks on.

Tests pass cdk.json's context into the App so feature flags match `cdk synth`, and
turn off aws-cdk-lib's built-in CloudFormation validation (5-8 s a template; `make
synth` keeps it). cdk-nag still runs: a test synth fails on any unacknowledged finding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aws_cdk import App
from aws_cdk.assertions import Template

from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.config import FleetConfig
from stacks.fleet import build_fleet

ROOT = Path(__file__).resolve().parents[1]
FLEETS = Path(__file__).resolve().parent / "fleets"
CDK_CONTEXT: dict = json.loads((ROOT / "cdk.json").read_text())["context"]
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


@dataclass
class SynthesizedFleet:
    fleet: FleetConfig
    stacks: dict  # stack name -> Stack
    templates: dict[str, Template]
    outdir: Path

    def template_path(self, stack_name: str) -> Path:
        # Cross-region support stacks are written under their artifact id, not their name.
        return self.outdir / f"{self.stacks[stack_name].artifact_id}.template.json"

    def template_json(self, stack_name: str) -> dict:
        return json.loads(self.template_path(stack_name).read_text())


def synth_fleet(fleet: FleetConfig, outdir: Path) -> SynthesizedFleet:
    app = App(context=CDK_CONTEXT, outdir=str(outdir), builtin_cloud_formation_validation=False)
    stacks = build_fleet(app, fleet)
    app.synth()
    templates = {name: Template.from_stack(stack) for name, stack in stacks.items()}
    return SynthesizedFleet(fleet=fleet, stacks=stacks, templates=templates, outdir=outdir)


PINNED_IMAGES = {
    "inference": "111111111111.dkr.ecr.us-east-2.amazonaws.com/rufus/inference@sha256:" + "1" * 64,
    "proxy": "111111111111.dkr.ecr.us-east-2.amazonaws.com/rufus/proxy@sha256:" + "2" * 64,
}


def pin_images(fleet: FleetConfig) -> FleetConfig:
    """The fleet with every cell's images pinned, for synths that must not depend on containers/.
    Each cell's images are in its own region's ECR: a router runs its cells' proxy image in
    subnets that reach only their own region's ECR (a fleet check refuses another region's); the
    first cell's inference image in the compile stack's region, for the same reason."""
    data = fleet.model_dump(mode="json", exclude_none=True)
    for cell in data["cells"]:
        cell["images"] = {k: v.replace(".us-east-2.", f".{cell['region']}.") for k, v in PINNED_IMAGES.items()}
    # The compile job runs the first cell's inference image in the compile stack's region (check_compile_image).
    compile_region = (data.get("pipeline") or data["cells"][0])["region"]
    first = data["cells"][0]["images"]
    first["inference"] = PINNED_IMAGES["inference"].replace(".us-east-2.", f".{compile_region}.")
    return parse_fleet(data, "pinned")


@pytest.fixture
def synth(tmp_path: Path):
    """Factory: synth(fleet) -> SynthesizedFleet in a fresh temporary directory."""
    return lambda fleet, *, pinned=False: synth_fleet(pin_images(fleet) if pinned else fleet, tmp_path)


@pytest.fixture(scope="session")
def default_fleet() -> FleetConfig:
    return load_fleet(None)


@pytest.fixture(scope="session")
def large_fleet() -> FleetConfig:
    return load_fleet(FLEETS / "large.yaml")


@pytest.fixture(scope="session")
def synth_default(default_fleet: FleetConfig, tmp_path_factory: pytest.TempPathFactory) -> SynthesizedFleet:
    return synth_fleet(default_fleet, tmp_path_factory.mktemp("cdk-default"))


@pytest.fixture(scope="session")
def synth_large(large_fleet: FleetConfig, tmp_path_factory: pytest.TempPathFactory) -> SynthesizedFleet:
    return synth_fleet(large_fleet, tmp_path_factory.mktemp("cdk-large"))


@pytest.fixture(scope="session")
def elastic_fleet() -> FleetConfig:
    return load_fleet(FLEETS / "elastic.yaml")


@pytest.fixture(scope="session")
def synth_elastic(elastic_fleet: FleetConfig, tmp_path_factory: pytest.TempPathFactory) -> SynthesizedFleet:
    """The elastic test fleet (one cell of 2-12 units), images pinned."""
    return synth_fleet(pin_images(elastic_fleet), tmp_path_factory.mktemp("synth-elastic"))


@pytest.fixture(scope="session")
def router_fleet() -> FleetConfig:
    return load_fleet(FLEETS / "router.yaml")


@pytest.fixture(scope="session")
def synth_router(router_fleet: FleetConfig, tmp_path_factory: pytest.TempPathFactory) -> SynthesizedFleet:
    """The router test fleet (cells dev and prod behind Rufus-Router-us-east-2, cell solo not), images pinned."""
    return synth_fleet(router_fleet, tmp_path_factory.mktemp("cdk-router"))


@pytest.fixture
def local_ssm() -> Iterator[dict[str, str]]:
    """Systems Manager on loopback (moto's server in a thread), its state emptied before and after: moto
    keeps it per process, across servers. Yields the environment that points botocore at it."""
    import urllib.request

    from moto.server import ThreadedMotoServer

    # Port 0, read back once bound: a port picked here and closed could be another process's by the time moto
    # binds it, and then start() waits forever (moto 5.2.5 sets its ready event only after a successful bind).
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"

    def reset() -> None:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10).close()

    reset()
    try:
        yield {"AWS_ENDPOINT_URL_SSM": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_REGION": "us-east-2", "AWS_EC2_METADATA_DISABLED": "true"}
    finally:
        reset()
        server.stop()


@dataclass
class LocalCodePipeline:
    """The two CodePipeline reads the restore makes, answered on loopback from `stages` and `actions`."""

    env: dict[str, str]
    stages: list[dict]  # GetPipelineState's stageStates
    actions: dict[str, list[dict]]  # ListActionExecutions' actionExecutionDetails, by pipelineExecutionId
    calls: list[tuple[str, dict]]
    regions: list[tuple[str, str]] = field(default_factory=list)  # (region signed for, operation)


@pytest.fixture
def local_codepipeline() -> Iterator[LocalCodePipeline]:
    """CodePipeline's GetPipelineState and ListActionExecutions on loopback (moto has neither): its JSON 1.1
    protocol, the operation named by the X-Amz-Target header, so the real botocore client of a real process
    (the build command under sh) serializes the requests and parses the answers. Anything else is a 400."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = LocalCodePipeline({}, [], {}, [])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            operation = self.headers.get("X-Amz-Target", "").rpartition(".")[2]
            state.calls.append((operation, body))
            # SigV4's credential scope: Credential=<key>/<date>/<region>/codepipeline/aws4_request
            scope = self.headers.get("Authorization", "").partition("Credential=")[2].split("/")
            state.regions.append((scope[2] if len(scope) > 2 else "", operation))
            if operation == "GetPipelineState":
                status, answer = 200, {"pipelineName": body["name"], "stageStates": state.stages}
            elif operation == "ListActionExecutions":
                wanted = body.get("filter", {}).get("pipelineExecutionId")
                status, answer = 200, {"actionExecutionDetails": state.actions.get(wanted, [])}
            else:
                status, answer = 400, {"__type": "ValidationException", "message": f"not faked: {operation}"}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-amz-json-1.1")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.env.update({"AWS_ENDPOINT_URL_CODEPIPELINE": f"http://127.0.0.1:{server.server_address[1]}",
                      "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                      "AWS_REGION": "us-east-2", "AWS_EC2_METADATA_DISABLED": "true"})
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
