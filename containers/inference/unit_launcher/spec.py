"""The unit spec: everything one node of a multi-node inference unit needs to know.

The cell stack builds it from the fleet file (`inference_fleet.unit_spec.build_unit_spec`)
and passes it to every container of the unit as the `UNIT_SPEC` JSON variable; the
launcher validates it here before doing anything. The image installs only this package,
so the model lives here and the fleet code produces plain dicts that this model accepts.
"""

from __future__ import annotations

import json
import os
import re
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

Port = Annotated[int, Field(ge=1024, le=65535)]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


# The engine environment the launcher renders (templates/engine.j2): the unit's bootstrap, its step broadcast and its
# compiled layout depend on each, so `engine.extra_env` may not replace one (tests/test_plan.py renders every variant
# against this set). UNIT_* is the launcher's and the unit executor's own namespace.
LAUNCHER_ENV = frozenset({
    "NEURON_RT_ROOT_COMM_ID", "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VIRTUAL_CORE_SIZE", "NEURON_COMPILED_ARTIFACTS",
    "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE",
    "VLLM_HOST_IP", "VLLM_PLUGINS", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
})
LAUNCHER_ENV_PREFIX = "UNIT_"


def _rendered_options() -> frozenset[str]:
    """Every engine option engine.j2 can render (its `arg name=` and `flag name` lines, over all its branches)."""
    text = files("unit_launcher").joinpath("templates", "engine.j2").read_text()
    return frozenset(name.replace("_", "-") for name in re.findall(r"^(?:arg|flag) ([a-z_]+)\b", text, re.MULTILINE))


# The engine options the launcher renders, `--name` without its dashes (tests/test_plan.py renders every variant
# against this set). engine.extra_args come after them on `vllm serve`'s command line, whose parser keeps the last
# value, and with frontend triton they are merged into the same model.json: so an extra arg may not set one, in any
# form vLLM's parser reads (below). Refused for every unit, as LAUNCHER_ENV is: the options are the launcher's.
LAUNCHER_ARGS = _rendered_options()
# vLLM's short forms of those (vLLM 0.16.0 engine/arg_utils.py:670,796-797,799; 0.32.0 :967,1145-1146,1177).
LAUNCHER_ARG_SHORT = {"-q": "quantization", "-n": "nnodes", "-r": "node-rank", "-tp": "tensor-parallel-size"}
# Stops vLLM's stat loggers, Prometheus's included (vLLM 0.16.0 v1/engine/async_llm.py:159-168,228,255;
# entrypoints/openai/api_server.py:309): the vllm: gauges the unit proxy's load report and QueueDepth read
# (unit_proxy/health.py QUEUE_METRIC) are never set. With either front end.
STATS_OFF_ARG = "disable-log-stats"
# vLLM reads `--config <file.yaml>`'s options as if given before the command line's (0.32.0 utils/argparse_utils.py
# `_pull_args_from_config`): the launcher's own options still win, but the file could set what extra_args may not
# (--disable-log-stats; an option the launcher renders only for other units). A cold review, thirty-fourth session.
CONFIG_FILE_ARG = "config"


def _long_option_names(key: str) -> list[str]:
    """The refused long options `--key` sets, as vLLM's parser reads it: exactly, as `--no-key` of a launcher
    option (argparse BooleanOptionalAction), or abbreviated (argparse's allow_abbrev, on in vLLM's parser: 0.32.0
    parses `--ho=0.0.0.0` as `--host`; no vLLM option is a proper prefix of a launcher option, e2e/tests)."""
    def matching(stem: str, names: frozenset[str]) -> list[str]:
        return [stem] if stem in names else sorted(n for n in names if n.startswith(stem))

    refused = LAUNCHER_ARGS | {STATS_OFF_ARG, CONFIG_FILE_ARG}
    if found := matching(key, refused):
        return found
    return matching(key[3:], LAUNCHER_ARGS) if key.startswith("no-") and len(key) > 3 else []


def extra_arg_options(token: str) -> list[str]:
    """The refused options (LAUNCHER_ARGS, STATS_OFF_ARG; `--name` without its dashes) that one engine.extra_args
    item sets, as vLLM's `vllm serve` parser reads it; [] for other options and for values."""
    if token.startswith("--"):
        # vLLM reads `_` as `-` in a name and `--name.key=v` as part of --name's JSON (vLLM 0.16.0
        # utils/argparse_utils.py:228-231,314; 0.32.0 :339-342,425).
        key = token[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        return _long_option_names(key) if key else []
    if not token.startswith("-") or len(token) < 2:
        return []
    key = token.split("=", 1)[0]
    # argparse: `-r0` is -r with the value 0, and `-t` abbreviates -tp (vLLM 0.32.0 parses both so).
    return [name for short, name in LAUNCHER_ARG_SHORT.items()
            if short.startswith(key) or (len(short) == 2 and key.startswith(short))]


# model.name goes, as it is, to the engine's command line (`--served-model-name=NAME`, templates/engine.j2: an argv
# string holds no NUL, execve refuses it), to the node's cache folder (one path component: NAME with '/' as '--',
# inference_fleet/unit_spec.py; Linux NAME_MAX, 255 bytes), to the cell stack's Description (CloudFormation: at most
# 1024 bytes, docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/template-description-structure.html; with a
# folder within 255 bytes the description stays under 400), to the launcher's log lines and to the `model` of OpenAI
# requests (JSON: any string). No resource name, tag or metric dimension holds it. A control or invisible character
# (NUL, newline, tab, a zero-width space) would fail the command line or hide in a log line and a client's request:
# refused. One rule for both readers: the fleet file's check (inference_fleet/checks.py, which imports this package's
# rules, never the other way) and this spec's, for a spec written by hand.
MODEL_FOLDER_MAX_BYTES = 255
MODEL_NAME_ALLOWED = ("printable characters (no control or invisible ones: NUL, newline, tab, zero-width), whose cache "
                      f"folder, the name with '/' as '--', is at most {MODEL_FOLDER_MAX_BYTES} bytes in UTF-8, e.g. "
                      "meta-llama/Llama-3.1-8B-Instruct")
MODEL_CACHE = "/opt/models"  # the nodes' model cache (the cell stack's inference_fleet/unit_spec.py MODEL_CACHE_PATH)


def model_name_problem(name: str, cache: str = MODEL_CACHE) -> str | None:
    """Why model.name cannot be served under that name by every use above, or None."""
    if bad := next((char for char in name if not char.isprintable()), None):
        return f"holds {bad!r} (U+{ord(bad):04X}), a control or invisible character; allowed: {MODEL_NAME_ALLOWED}"
    folder = name.replace("/", "--")
    if (size := len(folder.encode("utf-8"))) > MODEL_FOLDER_MAX_BYTES:
        return (f"its folder on the nodes, {cache}/<name with '/' as '--'>, would be a name of {size} "
                f"bytes in UTF-8, longer than Linux allows (NAME_MAX); allowed: {MODEL_NAME_ALLOWED}")
    return None


# With frontend triton the model is served under the last path part of model.name (triton_model_for), and that name
# is its directory in Triton's model repository: Triton takes each subdirectory of the repository as a model, and a
# config.pbtxt `name` must match its directory. Sources, pinned (2.73.0; the image's 2.51.0 not read):
# triton-inference-server/server@e1db8a603d863b1317ee859bdeea2be19959462e docs/user_guide/model_repository.md:36-74
# and docs/user_guide/model_configuration.md:72-74; triton-inference-server/core@
# 73aad7c3348d040c7087d57837d75822c488495e src/model_repository_manager/model_repository_manager.cc:1219-1221, whose
# local file system lists every entry but "." and ".." (src/filesystem/implementations/local.h:156-160).
# Triton documents no character set for model names; this one is conservative: the characters of Hugging Face
# repository names (ASCII letters, digits, '.', '_', '-'; huggingface_hub 2.4.0 utils/_validators.py
# validate_repo_id), no leading '.' (so never '.', '..' or a hidden directory) or '-', at most 255 characters (Linux
# NAME_MAX), none of which needs escaping in config.pbtxt or in Triton's /v2/models/<m>/... routes (server
# src/http_server.cc:1183-1184).
TRITON_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
TRITON_MODEL_NAME_ALLOWED = (
    "1 to 255 ASCII letters, digits, '.', '_' and '-', not starting with '.' or '-' (meta-llama/Llama-3.1-8B-Instruct "
    "is served as Llama-3.1-8B-Instruct)"
)


def triton_model_for(served_name: str) -> str:
    """The Triton model name of a served model name (model.name of the fleet file; the kit's too)."""
    return served_name.rstrip("/").rsplit("/", 1)[-1]


def triton_model_name_problem(served_name: str) -> str | None:
    """Why the Triton model name of `served_name` cannot be a model directory of Triton's repository; None if it can."""
    name = triton_model_for(served_name)
    if TRITON_MODEL_NAME.fullmatch(name):
        return None
    return (
        f"its last path part {name!r} is the Triton model's name and its directory in the model repository, where "
        f"the launcher writes config.pbtxt and 1/model.json; allowed: {TRITON_MODEL_NAME_ALLOWED}"
    )


class SpecError(ValueError):
    """The unit spec is missing or invalid; the message names each bad field."""


class _Strict(BaseModel):
    # A spec written by a newer stack must not be half-understood by an older launcher.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """The served model and where its (compiled) artifacts come from."""

    name: Annotated[str, StringConstraints(min_length=1)] = Field(description="Served model name.")
    artifacts_s3_uri: (
        Annotated[str, StringConstraints(pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")] | None
    ) = Field(
        default=None,
        description="S3 prefix to fetch before the engine starts; None: local_dir is used as is.",
    )
    local_dir: Annotated[str, StringConstraints(min_length=1)] = Field(
        default=f"{MODEL_CACHE}/model",
        description="Local copy of the artifacts; the engine loads the model from here.",
    )
    layout: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]+$")] | None = Field(
        default=None,
        description="Key of the compiled layout under <artifacts>/neuron/<layout>/ (Neuron only).",
    )
    artifacts_key: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        default=None,
        description="Key of the compiled artifacts this unit was deployed with (the manifest's `key`, "
        "unit_launcher/artifact_manifest.py); set, a manifest with another key is refused (artifacts_mismatch).",
    )
    require_manifest: bool = Field(
        default=False,
        description="CPU units: refuse to start without a compiled-artifacts manifest beside the artifacts. "
        "On Neuron a manifest is always required, whatever this says.",
    )
    cache_marker: Annotated[str, StringConstraints(min_length=1)] | None = Field(
        default=None,
        description="File the node's setup writes at the root of the instance-store cache; set, the launcher "
        "fetches only when it exists and the file system has room (unit_launcher/cache_check.py).",
    )
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3"] = "bfloat16"
    max_seq_len: int = Field(ge=16)

    @field_validator("name")
    @classmethod
    def _servable_name(cls, name: str) -> str:
        # The fleet file's rule (model_name_problem): a spec written by hand with a NUL or newline in the name must
        # stop here, naming the field, not at the engine's exec or in a split log line.
        if problem := model_name_problem(name):
            raise ValueError(problem)
        return name


class InstanceSpec(_Strict):
    """Facts of the node's instance type that the Neuron settings depend on."""

    type: str
    cores_per_node: int = Field(ge=1, description="Logical NeuronCores per node at the chosen LNC.")
    lnc: int = Field(ge=1, le=2, description="Physical cores per logical NeuronCore.")
    lnc_configurable: bool = Field(description="Whether the runtime takes NEURON_LOGICAL_NC_CONFIG (trn2).")
    neuron_devices: int = Field(ge=1)
    efa_interfaces: int = Field(ge=0)


class NeuronSpec(_Strict):
    """Hybrid parallelism of the unit (NxD Inference neuron config)."""

    tp_degree: int = Field(ge=1)
    cp_degree: int = Field(
        default=1, ge=1, description="Context parallel degree for context encoding (prefill)."
    )
    attention_dp_degree: int = Field(
        default=1, ge=1, description="Attention data parallel degree for decode."
    )
    world_size: int = Field(ge=1)
    rt_root_comm_port: Port = Field(
        default=62182, description="Port of NEURON_RT_ROOT_COMM_ID on the leader."
    )
    config_key: Literal["override_neuron_config", "neuron_config"] = Field(
        default="override_neuron_config",
        description="Key under vLLM's --additional-config that carries the neuron config.",
    )
    sequence_parallel_enabled: bool = False


class EngineSpec(_Strict):
    """How the engine is started."""

    device: Literal["neuron", "cpu"] = "neuron"
    command: tuple[Annotated[str, StringConstraints(min_length=1)], ...] = Field(
        default=("vllm",), min_length=1
    )
    frontend: Literal["openai", "triton"] = "openai"
    host: str = Field(default="127.0.0.1", description="Bind address of the leader's HTTP front end.")
    port: Port = 8000
    master_port: Port = Field(default=29500, description="torch.distributed master port on the leader.")
    max_num_seqs: int = Field(ge=1)
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="vLLM TP size on cpu; default one rank per node. Neuron: one vLLM worker per node.",
    )
    extra_args: tuple[str, ...] = ()
    extra_env: dict[EnvName, str] = Field(default_factory=dict)
    triton_command: tuple[str, ...] = ("tritonserver",)
    triton_model_repository: str = "/opt/triton/models"
    triton_backend_directory: str = Field(
        default="/opt/triton/dist/pytriton/tritonserver/backends",
        description="Triton's backends: python/ (the stub) and vllm/ (this package's model.py); the image's.",
    )
    triton_python: str = Field(
        default="/opt/triton/python/bin/python3",
        description="The Python that Triton's Python stub embeds (named python3: the stub finds it on PATH); "
        "the launcher puts its bin folder first on PATH and its LIBDIR first on LD_LIBRARY_PATH.",
    )
    triton_metrics_port: Port = Field(default=8002, description="Triton's Prometheus metrics port (its default).")
    stop_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)


class RendezvousSpec(_Strict):
    """The leader's rendezvous endpoint and the unit's liveness rules."""

    port: Port = 29400
    join_timeout_seconds: float = Field(
        default=900.0, gt=0, description="Longest wait for the whole unit to form."
    )
    follower_loss_seconds: float = Field(
        default=30.0, gt=0, description="Silence after which a member is lost."
    )
    heartbeat_interval_seconds: float | None = Field(
        default=None, gt=0, description="Default: follower_loss_seconds / 6, between 0.2 and 5 s."
    )
    step_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Lockstep bound: a step not completed by every node within this ends the unit.",
    )
    backoff_base_seconds: float = Field(
        default=15.0, ge=0, le=3600, description="Wait before forming again after the first failure in a row."
    )
    backoff_cap_seconds: float = Field(default=300.0, ge=0, le=3600, description="Longest restart backoff.")
    backoff_reset_seconds: float = Field(
        default=600.0, gt=0, description="A session that served this long resets the backoff."
    )
    member_drain_seconds: float = Field(
        default=750.0,
        gt=0,
        le=7300,
        description="Longest the leader waits for its proxy's drained report after a stopping follower asked "
        "the unit to drain; then it ends the session anyway (the proxy's DRAIN_SECONDS + DRAIN_TIMEOUT_SECONDS "
        "+ 30 s).",
    )

    @property
    def heartbeat_interval(self) -> float:
        if self.heartbeat_interval_seconds is not None:
            return self.heartbeat_interval_seconds
        return min(5.0, max(0.2, self.follower_loss_seconds / 6))

    @property
    def late_seconds(self) -> float:
        """A follower silent this long (two heartbeats) is late: the session is degraded."""
        return 2 * self.heartbeat_interval


class DiscoverySpec(_Strict):
    """Where followers find their leader (AWS Cloud Map)."""

    namespace: str
    leader_service: str
    timeout_seconds: float = Field(default=600.0, gt=0)
    initial_backoff_seconds: float = Field(default=1.0, gt=0)
    max_backoff_seconds: float = Field(default=15.0, gt=0)


class UnitSpec(_Strict):
    """The whole contract between the cell stack and the launcher."""

    cell: str
    unit_id: Annotated[str, StringConstraints(pattern=r"^u[0-9]+$")]
    size: int = Field(ge=1, le=64, description="Nodes in the unit, leader included.")
    revision: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    region: str | None = None
    model: ModelSpec
    instance: InstanceSpec
    neuron: NeuronSpec
    engine: EngineSpec
    rendezvous: RendezvousSpec = RendezvousSpec()
    discovery: DiscoverySpec
    metrics_namespace: str | None = Field(
        default=None, description="CloudWatch namespace of the session-end events' EMF metrics; None: plain JSON."
    )
    state_dir: str | None = Field(
        default=None,
        description="Where the unit's failure history is kept on the instance (survives task restarts); "
        "default: .unit-state beside model.local_dir (the model cache volume).",
    )

    @property
    def history_dir(self) -> str:
        return self.state_dir or str(Path(self.model.local_dir).parent / ".unit-state")

    @model_validator(mode="after")
    def _consistent(self) -> UnitSpec:
        problems = []
        if self.engine.device == "neuron":
            total = self.size * self.instance.cores_per_node
            if self.neuron.world_size != total:
                problems.append(
                    f"neuron.world_size = {self.neuron.world_size}: must be size ({self.size}) x "
                    f"instance.cores_per_node ({self.instance.cores_per_node}) = {total}"
                )
            for name in ("cp_degree", "attention_dp_degree"):
                degree = getattr(self.neuron, name)
                if self.neuron.tp_degree % degree:
                    problems.append(
                        f"neuron.{name} = {degree}: must divide neuron.tp_degree ({self.neuron.tp_degree})"
                    )
        ports = {
            "engine.port": self.engine.port,
            "engine.master_port": self.engine.master_port,
            "rendezvous.port": self.rendezvous.port,
            "neuron.rt_root_comm_port": self.neuron.rt_root_comm_port,
        }
        if self.engine.frontend == "triton":
            ports["engine.triton_metrics_port"] = self.engine.triton_metrics_port
            if problem := triton_model_name_problem(self.model.name):
                problems.append(f"model.name = {self.model.name!r}: with engine.frontend triton {problem}")
        problems += self._extra_env_problems()
        problems += self._extra_args_problems()
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                problems.append(
                    f"{name} = {port}: same as {seen[port]}; host networking needs distinct ports"
                )
            seen.setdefault(port, name)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _extra_env_problems(self) -> list[str]:
        problems = []
        for name in sorted(self.engine.extra_env):
            if name in LAUNCHER_ENV or name.startswith(LAUNCHER_ENV_PREFIX):
                problems.append(
                    f"engine.extra_env.{name}: reserved by the launcher (templates/engine.j2 renders it for the units "
                    f"that need it, and the unit's bootstrap depends on it); allowed: names other than "
                    f"{', '.join(sorted(LAUNCHER_ENV))} and {LAUNCHER_ENV_PREFIX}*"
                )
            elif name == "NEURON_RT_VISIBLE_CORES" and self.engine.device == "neuron":
                # Set, vllm-neuron's import rewrites NEURON_RT_ROOT_COMM_ID to ${MASTER_ADDR:-localhost}:<port>
                # (release-0.5.x vllm_neuron/__init__.py:26-28, utils.py:10-44; docs/neuron-sources.md), and the
                # launcher renders no MASTER_ADDR (it passes --master-addr): every node would bootstrap its
                # collectives against itself.
                problems.append(
                    "engine.extra_env.NEURON_RT_VISIBLE_CORES: not allowed on neuron: vllm-neuron then rewrites "
                    "NEURON_RT_ROOT_COMM_ID (the unit's root communicator) to this node's own address, and the "
                    "node's one worker drives every NeuronCore of the node (instance.cores_per_node)"
                )
        return problems

    def _extra_args_problems(self) -> list[str]:
        problems = []
        for token in self.engine.extra_args:
            names = extra_arg_options(token)
            if names == [CONFIG_FILE_ARG]:
                problems.append(
                    f"engine.extra_args: {token!r} is --{CONFIG_FILE_ARG}: vLLM reads a config file's options as "
                    f"command-line ones, past these checks; give each option in extra_args itself"
                )
            elif names == [STATS_OFF_ARG]:
                problems.append(
                    f"engine.extra_args: {token!r} is --{STATS_OFF_ARG}: it stops vLLM's stat loggers, so the vllm: "
                    f"gauges the unit proxy's load report and QueueDepth read are never set"
                )
            elif names:
                problems.append(
                    f"engine.extra_args: {token!r} sets {' or '.join('--' + n for n in names)}, which the launcher "
                    f"renders itself (templates/engine.j2): coming last, this one would replace the launcher's value "
                    f"(the engine's parser keeps the last value, Triton's model.json the last key)"
                    + self._rendered_option_reason(names)
                )
        if problems:
            options = ", ".join("--" + n for n in sorted(LAUNCHER_ARGS))
            problems.append(
                f"engine.extra_args allowed: options other than {options}, --{STATS_OFF_ARG} and "
                f"--{CONFIG_FILE_ARG}, in none of the "
                f"forms vLLM's parser reads (--name=value, --name value, --no-name, underscores for dashes, "
                f"--name.key=value, an abbreviation, {', '.join(LAUNCHER_ARG_SHORT)})"
            )
        return problems

    def _rendered_option_reason(self, names: list[str]) -> str:
        """The rendered option's own reason, where one more than 'it is the launcher's' matters."""
        if "enable-prefix-caching" in names and self.engine.device == "neuron":
            # docs/neuron-multi-node.md, "Prefix caching off".
            return (" (on neuron it renders --no-enable-prefix-caching: with prefix caching on vllm-neuron asserts a "
                    "block size and every engine dies at start, and with a --block-size the runner uses a block KV "
                    "layout the compile job does not build)")
        return ""

    @property
    def tensor_parallel_size(self) -> int:
        """vLLM's tensor parallel size: its world is one worker per rank of vLLM's own.

        On Neuron one worker process per node drives all of the node's NeuronCores through
        NxD Inference (which runs the model's tensor parallelism, neuron.tp_degree, inside
        its compiled graph), so vLLM's world is one rank per node.
        """
        if self.engine.device == "neuron":
            return self.size
        return self.engine.tensor_parallel_size or self.size


def parse_spec(data: str | bytes | dict, source: str = "UNIT_SPEC") -> UnitSpec:
    """Validate a spec given as JSON text or a dict; raise SpecError naming every bad field."""
    try:
        if isinstance(data, dict):
            return UnitSpec.model_validate(data)
        return UnitSpec.model_validate_json(data)
    except ValidationError as error:
        lines = []
        for e in error.errors(include_url=False):
            where = ".".join(str(p) for p in e["loc"]) or "<spec>"
            value = e.get("input")
            shown = "" if e["type"] == "missing" or isinstance(value, dict) else f" (got {value!r})"
            lines.append(f"  - {where}: {e['msg']}{shown}")
        raise SpecError(f"invalid unit spec from {source}:\n" + "\n".join(lines)) from None


def load_spec_from_env(env: dict[str, str] | None = None) -> UnitSpec:
    """Read the spec from UNIT_SPEC (JSON) or UNIT_SPEC_FILE (path of a JSON file)."""
    env = os.environ if env is None else env
    if env.get("UNIT_SPEC"):
        return parse_spec(env["UNIT_SPEC"], "UNIT_SPEC")
    if env.get("UNIT_SPEC_FILE"):
        return load_spec_file(env["UNIT_SPEC_FILE"])
    raise SpecError("no unit spec: set UNIT_SPEC (JSON) or UNIT_SPEC_FILE (path to a JSON file)")


def load_spec_file(path: str | Path) -> UnitSpec:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"unit spec file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SpecError(f"unit spec file {path} is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise SpecError(f"unit spec file {path} must hold a JSON object, not {type(data).__name__}")
    return parse_spec(data, str(path))
