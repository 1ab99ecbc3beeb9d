"""Launch plans: the exact argv, environment and files of the engine on one node of a unit.

The plan is rendered with jinja2 from the unit spec (templates/engine.j2 lists the engine
arguments and environment, templates/config.pbtxt.j2 is Triton's model configuration), so
operators can read the rules in one place and `python -m unit_launcher plan` prints the
same plan that `run` executes.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jinja2

from unit_launcher.spec import UnitSpec, triton_model_for

Role = Literal["leader", "follower"]

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("unit_launcher", "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    autoescape=False,
)

# vLLM's --dtype takes storage types only; FP8 weights are a quantization on top of bf16.
_ENGINE_DTYPE = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "float8_e4m3": "bfloat16",
}


class PlanError(ValueError):
    """A plan cannot be made for the given role and rank."""


@dataclass(frozen=True)
class LaunchPlan:
    """What one node starts: argv, the environment it adds, and files to write first."""

    role: Role
    rank: int
    argv: list[str]
    env: dict[str, str]
    engine_args: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    # Neuron: the NeuronConfig this node loads with (its rank slice), written into its view
    # of the compiled layout by the launcher before the engine starts.
    neuron_config: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "rank": self.rank,
            "argv": self.argv,
            "env": self.env,
            "engine_args": self.engine_args,
            "files": self.files,
            "neuron_config": self.neuron_config,
        }

    def to_text(self) -> str:
        lines = [f"# role={self.role} rank={self.rank}", "argv:", "  " + shlex.join(self.argv), "env:"]
        lines += [f"  {k}={v}" for k, v in sorted(self.env.items())]
        if self.neuron_config is not None:
            c = self.neuron_config
            lines += [
                f"neuron rank slice: ranks {c['start_rank_id']}..{c['start_rank_id'] + c['local_ranks_size'] - 1} "
                f"of {c['world_size']} (start_rank_id={c['start_rank_id']}, local_ranks_size={c['local_ranks_size']})",
                "neuron config: " + json.dumps(c, sort_keys=True),
            ]
        for path, content in self.files.items():
            lines += [f"file {path}:", *("  " + line for line in content.rstrip("\n").splitlines())]
        return "\n".join(lines) + "\n"


def neuron_config(spec: UnitSpec, rank: int) -> dict[str, Any]:
    """The NxD Inference NeuronConfig of one node: the unit's layout and this node's rank slice.

    The same keys as the planner's (`inference_fleet` `neuron_config`; a test compares them),
    each a field of NxD Inference's NeuronConfig (docs/neuron-multi-node.md).
    """
    local = spec.instance.cores_per_node
    return {
        "tp_degree": spec.neuron.tp_degree,
        "cp_degree": spec.neuron.cp_degree,
        "attention_dp_degree": spec.neuron.attention_dp_degree,
        "world_size": spec.neuron.world_size,
        "start_rank_id": rank * local,
        "local_ranks_size": local,
        "logical_nc_config": spec.instance.lnc,
        "batch_size": spec.engine.max_num_seqs,
        "seq_len": spec.model.max_seq_len,
        "max_context_length": spec.model.max_seq_len,
        "torch_dtype": spec.model.dtype,
        "sequence_parallel_enabled": spec.neuron.sequence_parallel_enabled,
        # vllm-neuron's default (continuous batching iff batch > 1); NxD Inference needs it
        # for attention data parallelism.
        "is_continuous_batching": spec.engine.max_num_seqs > 1,
    }


def layout_dir(spec: UnitSpec) -> str | None:
    """Local directory of the fetched Neuron-compiled layout of this unit."""
    if spec.engine.device != "neuron" or not spec.model.layout:
        return None
    return str(Path(spec.model.local_dir) / "neuron" / spec.model.layout)


def compiled_dir(spec: UnitSpec, rank: int) -> str | None:
    """This node's view of the layout (its own rank slice), what NEURON_COMPILED_ARTIFACTS names."""
    base = layout_dir(spec)
    return None if base is None else f"{base}.node{rank}"


def _parse_lines(text: str) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    args: dict[str, Any] = {}
    flags: list[str] = []
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        kind, _, rest = line.partition(" ")
        if kind == "arg":
            name, _, value = rest.partition("=")
            args[name] = json.loads(value)
        elif kind == "flag":
            flags.append(rest)
        elif kind == "env":
            name, _, value = rest.partition("=")
            env[name] = value
        else:
            raise PlanError(
                f"engine.j2 line {number}: unknown kind {kind!r} in {raw!r}; allowed: arg, flag, env"
            )
    return args, flags, env


def _cli(name: str, value: Any) -> list[str]:
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        # vLLM's boolean engine arguments are argparse BooleanOptionalAction (vLLM 0.16
        # engine/arg_utils.py:287-289): `--no-x` sets x false, which an absent flag may not (a None default).
        return [option] if value else ["--no-" + option[2:]]
    if isinstance(value, dict | list):
        return [f"{option}={json.dumps(value, separators=(',', ':'))}"]
    return [f"{option}={value}"]


def extra_args_to_engine_args(extra: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Map `--name value`, `--name=value` and `--switch` to model.json keys (Triton)."""
    result: dict[str, Any] = {}
    items = list(extra)
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise PlanError(
                f"engine.extra_args: {item!r} is not an option; Triton's model.json takes --name[=value]"
            )
        name, eq, value = item[2:].partition("=")
        if not eq:
            if i + 1 < len(items) and not items[i + 1].startswith("--"):
                value, i = items[i + 1], i + 1
            else:
                value = "true"
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        if name.startswith("no-") and parsed is True:
            # `vllm serve`'s boolean options are argparse BooleanOptionalAction: `--no-x` sets x false.
            name, parsed = name[3:], False
        # The spec refuses the launcher's own options and --disable-log-stats (spec.extra_arg_options).
        result[name.replace("-", "_")] = parsed
        i += 1
    return result


def build_plan(
    spec: UnitSpec,
    role: Role,
    rank: int,
    *,
    leader_addr: str,
    host_ip: str,
    session_id: str = "plan",
    step_dir: str | None = None,
) -> LaunchPlan:
    """Render the launch plan of one node. The leader is always rank 0."""
    if role not in ("leader", "follower"):
        raise PlanError(f"role {role!r} not allowed; allowed: leader, follower")
    if role == "leader" and rank != 0:
        raise PlanError(f"the leader is rank 0, not {rank}")
    if role == "follower" and not 1 <= rank < spec.size:
        raise PlanError(
            f"follower rank {rank} out of range: unit {spec.unit_id} of size {spec.size} "
            f"has ranks 1..{spec.size - 1}"
        )
    context = {
        "spec": spec,
        "rank": rank,
        "leader": role == "leader",
        "leader_addr": leader_addr,
        "host_ip": host_ip,
        "model_path": spec.model.local_dir,
        "engine_dtype": _ENGINE_DTYPE[spec.model.dtype],
        "neuron_config": neuron_config(spec, rank),
        "compiled_dir": compiled_dir(spec, rank),
        "session_id": session_id,
        "step_dir": step_dir or f"/tmp/unit-steps/{spec.unit_id}-{session_id}",
        # vLLM's own wait for a step's answer, a little above the launcher's step bound, so
        # that the launcher declares the unit lost first (its watchdog looks every 0.5 s).
        "engine_step_timeout": int(spec.rendezvous.step_timeout_seconds + 10),
    }
    args, flags, env = _parse_lines(_TEMPLATES.get_template("engine.j2").render(context))
    env.update(spec.engine.extra_env)
    files: dict[str, str] = {}
    if role == "leader" and spec.engine.frontend == "triton":
        model_json = {k: v for k, v in args.items() if k not in ("host", "port")}
        model_json.update(extra_args_to_engine_args(spec.engine.extra_args))
        repo = Path(spec.engine.triton_model_repository) / triton_model_name(spec)
        files[str(repo / "config.pbtxt")] = render_triton_config(spec)
        files[str(repo / "1" / "model.json")] = json.dumps(model_json, indent=2, sort_keys=True) + "\n"
        argv = [
            *spec.engine.triton_command,
            f"--model-repository={spec.engine.triton_model_repository}",
            f"--backend-directory={spec.engine.triton_backend_directory}",
            f"--http-address={spec.engine.host}",
            f"--http-port={spec.engine.port}",
            "--allow-grpc=false",
            "--allow-metrics=true",
            f"--metrics-address={spec.engine.host}",
            f"--metrics-port={spec.engine.triton_metrics_port}",
            # On SIGTERM Triton refuses new requests and waits this long for those in flight before it
            # unloads the model (server.cc Stop); the rest of the stop timeout is for vLLM's shutdown.
            f"--exit-timeout-secs={triton_exit_timeout(spec)}",
        ]
    else:
        model = args.pop("model")
        argv = [*spec.engine.command, "serve", model]
        for name, value in args.items():
            argv += _cli(name, value)
        argv += ["--" + f for f in flags]
        # Last: none sets an option rendered above (the spec refuses those, spec.LAUNCHER_ARGS).
        argv += list(spec.engine.extra_args)
    node_config = context["neuron_config"] if spec.engine.device == "neuron" else None
    return LaunchPlan(
        role=role, rank=rank, argv=argv, env=env, engine_args=args, files=files, neuron_config=node_config
    )


def triton_exit_timeout(spec: UnitSpec) -> int:
    """Triton's wait for in-flight requests on SIGTERM: three quarters of the engine's stop timeout."""
    return max(1, int(spec.engine.stop_timeout_seconds * 0.75))


def triton_model_name(spec: UnitSpec) -> str:
    """Triton model names are directory names: keep the last path part of the served name."""
    return triton_model_for(spec.model.name)


def render_triton_config(spec: UnitSpec) -> str:
    return _TEMPLATES.get_template("config.pbtxt.j2").render(name=triton_model_name(spec))


def check_triton_config(text: str) -> Any:
    """Parse config.pbtxt against Triton's ModelConfig protobuf schema (from tritonclient).

    Returns the parsed message, or None when tritonclient is not installed (the check is
    then skipped and the server's own validation is the only one).
    """
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return None
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as error:
        raise PlanError(f"config.pbtxt does not match Triton's model-config schema: {error}") from None


def write_files(plan: LaunchPlan) -> None:
    for path, content in plan.files.items():
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
