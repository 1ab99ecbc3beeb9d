"""Launch plans and the spec: Neuron multi-node settings, cpu plans, Triton model repository, errors."""

from __future__ import annotations

import argparse
import json
from pathlib import PurePosixPath

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from unit_launcher import plan as plans
from unit_launcher.spec import (
    LAUNCHER_ARGS,
    LAUNCHER_ENV,
    LAUNCHER_ENV_PREFIX,
    SpecError,
    load_spec_from_env,
    parse_spec,
)


def neuron_spec(**overrides) -> dict:
    spec = {
        "cell": "dev",
        "unit_id": "u1",
        "size": 2,
        "revision": "r1",
        "region": "us-east-2",
        "model": {
            "name": "meta-llama/Llama-3.1-405B-Instruct",
            "artifacts_s3_uri": "s3://bucket/llama/",
            "local_dir": "/opt/models/llama",
            "layout": "L1",
            "max_seq_len": 16384,
        },
        "instance": {
            "type": "trn2.48xlarge",
            "cores_per_node": 64,
            "lnc": 2,
            "lnc_configurable": True,
            "neuron_devices": 16,
            "efa_interfaces": 16,
        },
        "neuron": {"tp_degree": 128, "cp_degree": 4, "attention_dp_degree": 4, "world_size": 128},
        "engine": {"max_num_seqs": 32},
        "discovery": {"namespace": "dev.rufus.internal", "leader_service": "leader-u1"},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def test_neuron_follower_plan_runs_the_unit_executor_with_its_rank_slice():
    """vLLM's world is one worker per node (the unit executor broadcasts each step to it);
    the node's rank slice comes from its own view of the compiled layout; nothing that the
    pinned engine ignores is rendered (docs/neuron-multi-node.md names the sources)."""
    spec = parse_spec(neuron_spec())
    node = plans.build_plan(
        spec, "follower", 1, leader_addr="10.0.0.5", host_ip="10.0.0.6", session_id="s1", step_dir="/tmp/st"
    )
    assert node.argv[:3] == ["vllm", "serve", "/opt/models/llama"]
    for arg in (
        "--tensor-parallel-size=2",
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=10.0.0.5",
        "--master-port=29500",
        "--headless",
        "--max-num-seqs=32",
        "--max-model-len=16384",
    ):
        assert arg in node.argv
    assert not any(a.startswith(("--port", "--additional-config", "--distributed-executor-backend")) for a in node.argv)
    assert node.env == {
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.5:62182",
        "NEURON_LOGICAL_NC_CONFIG": "2",
        "NEURON_RT_VIRTUAL_CORE_SIZE": "2",
        "NEURON_COMPILED_ARTIFACTS": "/opt/models/llama/neuron/L1.node1",
        # vllm-neuron's compile fallback off (unit_executor/no_compile.py): compiled artifacts or nothing.
        "UNIT_REQUIRE_COMPILED": "1",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "FI_EFA_FORK_SAFE": "1",
        "VLLM_HOST_IP": "10.0.0.6",
        "UNIT_EXECUTOR": "1",
        "UNIT_BASE_PLATFORM": "vllm_neuron.platform.NeuronPlatform",
        "VLLM_PLUGINS": "unit",
        "UNIT_STEP_DIR": "/tmp/st",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "40",
        "UNIT_RANK": "1",
        "UNIT_SESSION_ID": "s1",
    }
    # The rank slice the launcher writes into the node's view of the layout.
    config = plans.neuron_config(spec, 1)
    assert (config["start_rank_id"], config["local_ranks_size"], config["world_size"]) == (64, 64, 128)


def vllm_cache_args(argv: list[str]) -> tuple[bool | None, int | None]:
    """--enable-prefix-caching and --block-size as vLLM 0.16's `vllm serve` parses them: a
    BooleanOptionalAction whose default is None (engine/arg_utils.py:937-942, 287-289) and an int
    whose default is None (config/cache.py:42)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    known, _ = parser.parse_known_args(argv)
    return known.enable_prefix_caching, known.block_size


def neuron_block_size(enable_prefix_caching: bool | None, block_size: int | None, max_model_len: int) -> int:
    """The KV block size the engine gets on Neuron. vLLM 0.16 first turns an unset prefix caching on for a
    decoder model (engine/arg_utils.py:1967-1968; config/model.py:1669-1671), then vllm-neuron's platform
    hook runs (whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b vllm_neuron/platform.py:378-387,
    copied): max_model_len (one contiguous block a sequence, the compiled layout) when it is off."""
    if enable_prefix_caching is None:
        enable_prefix_caching = True
    if not enable_prefix_caching:
        return max_model_len
    assert block_size is not None, "When prefix caching is enabled, block_size must be set."
    return block_size


@pytest.mark.parametrize("frontend", ["openai", "triton"])
def test_every_neuron_engine_turns_prefix_caching_off_so_the_neuron_platform_accepts_it(frontend):
    """vLLM 0.16 turns prefix caching on by default and vllm-neuron then asserts a block size that no Neuron
    plan sets: every engine died at start. Off on the leader (argv, or Triton's model.json) and on followers,
    the plugin gives each sequence one block of max_model_len, the contiguous layout the compile job builds."""
    spec = parse_spec(neuron_spec(engine={"max_num_seqs": 32, "frontend": frontend}))
    leader = plans.build_plan(spec, "leader", 0, leader_addr="10.0.0.5", host_ip="10.0.0.5")
    follower = plans.build_plan(spec, "follower", 1, leader_addr="10.0.0.5", host_ip="10.0.0.6")
    nodes = {"follower": vllm_cache_args(follower.argv)}
    if frontend == "triton":
        (model_json,) = (json.loads(text) for path, text in leader.files.items() if path.endswith("/model.json"))
        nodes["leader"] = (model_json.get("enable_prefix_caching"), model_json.get("block_size"))
    else:
        nodes["leader"] = vllm_cache_args(leader.argv)
    for role, (prefix_caching, block_size) in nodes.items():
        assert neuron_block_size(prefix_caching, block_size, spec.model.max_seq_len) == 16384, role
    assert "--no-enable-prefix-caching" in follower.argv
    if frontend == "triton":
        assert model_json["enable_prefix_caching"] is False
    else:
        assert "--no-enable-prefix-caching" in leader.argv


def test_the_cpu_plan_leaves_prefix_caching_to_vllm():
    """The CPU platform sets its own block size (128), so the e2e unit keeps vLLM's default."""
    spec = parse_spec(neuron_spec(engine={"device": "cpu", "command": ["vllm"], "max_num_seqs": 4}))
    node = plans.build_plan(spec, "leader", 0, leader_addr="127.0.0.1", host_ip="127.0.0.1")
    assert not any("prefix-caching" in a for a in node.argv) and "enable_prefix_caching" not in node.engine_args


def test_neuron_plan_without_a_compiled_layout_passes_the_config_the_plugin_compiles_with():
    spec = parse_spec(neuron_spec(model={"layout": None}))
    node = plans.build_plan(spec, "follower", 1, leader_addr="10.0.0.5", host_ip="10.0.0.6")
    additional = json.loads(next(a for a in node.argv if a.startswith("--additional-config=")).split("=", 1)[1])
    assert additional == {"override_neuron_config": plans.neuron_config(spec, 1)}
    assert "NEURON_COMPILED_ARTIFACTS" not in node.env


def test_leader_serves_http_on_loopback_and_extra_args_and_env_are_appended():
    spec = parse_spec(
        neuron_spec(
            engine={
                "max_num_seqs": 8,
                "port": 8001,
                "extra_args": ["--uvicorn-log-level=warning"],
                "extra_env": {"NEURON_RT_LOG_LEVEL": "WARNING"},
            }
        )
    )
    node = plans.build_plan(spec, "leader", 0, leader_addr="10.0.0.5", host_ip="10.0.0.5")
    assert "--host=127.0.0.1" in node.argv and "--port=8001" in node.argv and "--headless" not in node.argv
    assert node.argv[-1] == "--uvicorn-log-level=warning"
    assert node.env["UNIT_RANK"] == "0" and node.env["NEURON_RT_LOG_LEVEL"] == "WARNING"


def _rendered_env_names() -> set[str]:
    """Every environment name the launcher renders, over the variants of engine.j2's branches."""
    variants = [
        neuron_spec(),  # trn2, two nodes, compiled layout, EFA, LNC configurable
        neuron_spec(model={"layout": None}, size=1, instance={"efa_interfaces": 0},
                    neuron={"tp_degree": 64, "cp_degree": 1, "attention_dp_degree": 1, "world_size": 64}),
        neuron_spec(engine={"max_num_seqs": 4, "frontend": "triton"}),
        neuron_spec(engine={"device": "cpu", "max_num_seqs": 4}),
    ]
    names: set[str] = set()
    for variant in variants:
        spec = parse_spec(variant)
        for role, rank in (("leader", 0), ("follower", 1))[: spec.size]:
            names |= set(plans.build_plan(spec, role, rank, leader_addr="10.0.0.5", host_ip="10.0.0.6").env)
    return names


def test_the_reserved_environment_is_exactly_what_the_launcher_renders():
    """`engine.extra_env` may not replace what engine.j2 renders: a name added to the template and not to
    LAUNCHER_ENV (or UNIT_*) could be overridden again; a name in LAUNCHER_ENV the template no longer
    renders would refuse an operator's variable for nothing."""
    rendered = _rendered_env_names()
    assert {n for n in rendered if not n.startswith(LAUNCHER_ENV_PREFIX)} == set(LAUNCHER_ENV)


def _rendered_option_names() -> set[str]:
    """Every engine option the launcher renders (`--name` without dashes), over the variants of engine.j2's branches:
    the options of each `vllm serve` argv (`--no-x` is x) and the keys of the Triton leader's model.json."""
    variants = [
        neuron_spec(),  # two nodes, compiled layout
        neuron_spec(model={"layout": None, "dtype": "float8_e4m3"}),  # --additional-config, --quantization
        neuron_spec(engine={"max_num_seqs": 4, "frontend": "triton"}),
        neuron_spec(engine={"device": "cpu", "max_num_seqs": 4}),
    ]
    names: set[str] = set()
    for variant in variants:
        spec = parse_spec(variant)
        for role, rank in (("leader", 0), ("follower", 1)):
            node = plans.build_plan(spec, role, rank, leader_addr="10.0.0.5", host_ip="10.0.0.6")
            for path, text in node.files.items():
                if path.endswith("/model.json"):
                    names |= {key.replace("_", "-") for key in json.loads(text)}
            if node.argv[0] == "vllm":
                options = [a[2:].split("=", 1)[0] for a in node.argv if a.startswith("--")]
                names |= {o[3:] if o.startswith("no-") else o for o in options}
    return names


def test_the_reserved_options_are_exactly_what_the_launcher_renders():
    """spec.LAUNCHER_ARGS is read from engine.j2's `arg`/`flag` lines: each option rendered is in it (so none can
    be replaced through engine.extra_args), and each in it is rendered by some unit (none is refused for nothing)."""
    assert _rendered_option_names() == set(LAUNCHER_ARGS)


@pytest.mark.parametrize("extra", [
    ["--enable-prefix-caching"],  # vllm-neuron asserts a block size: every Neuron engine dies at start
    ["--host=0.0.0.0"],  # the leader's engine answers on the host's address, around the proxy
    ["--node-rank=0"],  # every follower claims rank 0
    # The other forms vLLM's own parser reads as one of the launcher's options (vLLM 0.32.0, e2e/tests).
    ["--enforce-eager", "--host", "0.0.0.0"],
    ["--ho=0.0.0.0"],  # argparse's abbreviation
    ["--node_rank=0"],  # vLLM reads _ as -
    ["-r0"], ["-r", "0"], ["-n", "3"], ["-t", "4"], ["-tp=4"], ["-qawq"],
    ["--no-enable-prefix-caching"], ["--no-enable-prefix"],
    ["--additional-config.override_neuron_config.tp_degree=8"],  # merged into --additional-config's JSON
    ["--headless"], ["--nnodes=4"], ["--model", "/elsewhere"],
])
def test_extra_args_may_not_replace_what_the_launcher_renders(extra):
    """engine.extra_env may not replace a variable the launcher renders (spec.LAUNCHER_ENV, refused by name), but
    engine.extra_args, appended after the rendered options (or merged into Triton's model.json), replaced them
    silently: argparse keeps the last value, so `--host=0.0.0.0` made the leader's engine answer on the host's
    address, around the proxy's gate. Found by the thirty-fourth session's defect hunt; refused when the spec is
    read."""
    for frontend in ("openai", "triton"):
        with pytest.raises(SpecError, match=r"extra_args: .* sets --[a-z-]+.* renders itself.*allowed: options other"):
            parse_spec(neuron_spec(engine={"max_num_seqs": 32, "frontend": frontend, "extra_args": extra}))


def test_prefix_caching_on_neuron_is_refused_with_its_reason():
    """On Neuron the launcher turns it off (docs/neuron-multi-node.md, "Prefix caching off"); on cpu, where it leaves
    it to vLLM, the option is still the launcher's (one set of options for every unit, as LAUNCHER_ENV)."""
    with pytest.raises(SpecError, match=r"'--enable-prefix-caching' sets --enable-prefix-caching, .*neuron asserts"):
        parse_spec(neuron_spec(engine={"max_num_seqs": 32, "extra_args": ["--enable-prefix-caching"]}))
    with pytest.raises(SpecError, match=r"sets --enable-prefix-caching, .*renders itself") as cpu:
        parse_spec(neuron_spec(engine={"device": "cpu", "max_num_seqs": 4, "extra_args": ["--enable-prefix-caching"]}))
    assert "vllm-neuron" not in str(cpu.value)


@pytest.mark.parametrize("frontend", ["openai", "triton"])
@pytest.mark.parametrize("extra", [["--disable-log-stats"], ["--disable_log_stats"], ["--disable-log-st"]])
def test_disable_log_stats_is_refused_with_either_front_end(frontend, extra):
    """--disable-log-stats stops vLLM's stat loggers (vLLM 0.16.0 v1/engine/async_llm.py:159-168,228,255), so the
    vllm:num_requests_waiting gauge the proxy's load report and QueueDepth read (unit_proxy/health.py QUEUE_METRIC)
    is never set. The plan refused it with frontend triton only and rendered it into `vllm serve` with frontend
    openai (the thirty-fourth session's defect hunt); now the spec refuses it for both, in one place."""
    with pytest.raises(SpecError, match=r"engine\.extra_args: .* is --disable-log-stats: it stops vLLM's stat"):
        parse_spec(neuron_spec(engine={"max_num_seqs": 32, "frontend": frontend, "extra_args": extra}))


@pytest.mark.parametrize("extra", [["--config", "/etc/serve.yaml"], ["--config=/etc/serve.yaml"],
                                   ["--conf", "/etc/serve.yaml"]])
def test_a_config_file_in_extra_args_is_refused(extra):
    """vLLM reads a `--config` file's options as command-line ones (0.32.0 `_pull_args_from_config`): a file with
    `disable-log-stats: true` passed every check (a cold review, thirty-fourth session; seen failing: no SpecError).
    `--config-format` and other options that only begin alike are not refused."""
    with pytest.raises(SpecError, match=r"is --config: vLLM reads a config file's options"):
        parse_spec(neuron_spec(engine={"max_num_seqs": 32, "extra_args": extra}))
    parse_spec(neuron_spec(engine={"max_num_seqs": 32, "extra_args": ["--config-format", "auto"]}))


def test_extra_args_that_are_not_the_launchers_are_rendered_after_its_own():
    """What the e2e unit passes, and options that merely look like the launcher's, go through unchanged."""
    extra = ["--enforce-eager", "--shutdown-timeout", "60", "-O3", "-pp", "1", "--no-disable-log-stats",
             "--max-num-batched-tokens=512", "--hf-overrides.max_position_embeddings=4096"]
    spec = parse_spec(neuron_spec(engine={"device": "cpu", "max_num_seqs": 4, "extra_args": extra}))
    node = plans.build_plan(spec, "follower", 1, leader_addr="10.0.0.5", host_ip="10.0.0.6")
    assert node.argv[-len(extra):] == extra and "--node-rank=1" in node.argv


@pytest.mark.parametrize("name", ["NEURON_RT_ROOT_COMM_ID", "VLLM_PLUGINS", "FI_PROVIDER", "UNIT_RANK", "UNIT_OTHER"])
def test_extra_env_may_not_replace_what_the_launcher_renders(name):
    """Applied after the rendered environment, such an entry replaced it: NEURON_RT_ROOT_COMM_ID pointed the
    unit's collectives elsewhere, VLLM_PLUGINS dropped the unit executor. Refused when the spec is read."""
    with pytest.raises(SpecError, match=rf"engine\.extra_env\.{name}: reserved by the launcher"):
        parse_spec(neuron_spec(engine={"max_num_seqs": 4, "extra_env": {name: "x", "NEURON_RT_LOG_LEVEL": "INFO"}}))


def test_extra_env_may_not_pin_visible_cores_on_neuron():
    """vllm-neuron's import rewrites NEURON_RT_ROOT_COMM_ID when NEURON_RT_VISIBLE_CORES is set
    (docs/neuron-sources.md): each node would bootstrap its collectives against itself. On cpu it means nothing."""
    extra = {"extra_env": {"NEURON_RT_VISIBLE_CORES": "0-63"}, "max_num_seqs": 4}
    with pytest.raises(SpecError, match=r"engine\.extra_env\.NEURON_RT_VISIBLE_CORES: not allowed on neuron"):
        parse_spec(neuron_spec(engine=extra))
    spec = parse_spec(neuron_spec(engine={**extra, "device": "cpu"}))
    node = plans.build_plan(spec, "leader", 0, leader_addr="10.0.0.5", host_ip="10.0.0.5")
    assert node.env["NEURON_RT_VISIBLE_CORES"] == "0-63"


def test_trn1_single_node_has_no_lnc_and_no_multinode_settings():
    spec = parse_spec(
        neuron_spec(
            size=1,
            instance={
                "type": "trn1.32xlarge",
                "cores_per_node": 32,
                "lnc": 1,
                "lnc_configurable": False,
                "efa_interfaces": 8,
            },
            neuron={"tp_degree": 32, "cp_degree": 1, "attention_dp_degree": 1, "world_size": 32},
        )
    )
    node = plans.build_plan(spec, "leader", 0, leader_addr="10.0.0.5", host_ip="10.0.0.5")
    assert "NEURON_LOGICAL_NC_CONFIG" not in node.env and "NEURON_RT_ROOT_COMM_ID" not in node.env
    assert not any(a.startswith(("--nnodes", "--node-rank", "--master-addr")) for a in node.argv)


def test_cpu_plan_is_generic_vllm_without_neuron_settings():
    spec = parse_spec(
        neuron_spec(
            engine={
                "device": "cpu",
                "command": ["python", "-m", "vllm.entrypoints.cli.main"],
                "max_num_seqs": 4,
                "extra_args": ["--enforce-eager"],
            }
        )
    )
    node = plans.build_plan(spec, "follower", 1, leader_addr="127.0.0.1", host_ip="127.0.0.1")
    assert node.argv[:5] == ["python", "-m", "vllm.entrypoints.cli.main", "serve", "/opt/models/llama"]
    assert "--tensor-parallel-size=2" in node.argv and "--distributed-executor-backend=mp" in node.argv
    assert not any("neuron" in a for a in node.argv)
    assert not any(k.startswith(("NEURON_", "FI_")) for k in node.env)
    assert (node.env["UNIT_EXECUTOR"], node.env["UNIT_BASE_PLATFORM"]) == ("1", "vllm.platforms.cpu.CpuPlatform")


def test_triton_leader_renders_a_model_repository_that_matches_tritons_schema():
    spec = parse_spec(
        neuron_spec(
            engine={
                "max_num_seqs": 32,
                "frontend": "triton",
                "extra_args": ["--seed", "7"],
            }
        )
    )
    node = plans.build_plan(spec, "leader", 0, leader_addr="10.0.0.5", host_ip="10.0.0.5")
    assert node.argv[0] == "tritonserver" and "--model-repository=/opt/triton/models" in node.argv
    assert "--http-port=8000" in node.argv
    config_text = node.files["/opt/triton/models/Llama-3.1-405B-Instruct/config.pbtxt"]
    config = plans.check_triton_config(config_text)
    assert config.backend == "vllm" and config.model_transaction_policy.decoupled
    assert [i.name for i in config.input] == [
        "text_input",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
        "return_finish_reason",
        "return_num_input_tokens",
        "return_num_output_tokens",
    ]
    assert all(i.optional for i in config.input[1:]) and not config.input[0].optional
    assert config.output[0].name == "text_output" and config.output[0].data_type == model_config_pb2.TYPE_STRING
    assert [o.name for o in config.output] == ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens"]
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_MODEL
    model_json = json.loads(node.files["/opt/triton/models/Llama-3.1-405B-Instruct/1/model.json"])
    assert model_json["model"] == "/opt/models/llama" and model_json["tensor_parallel_size"] == 2
    assert (model_json["nnodes"], model_json["node_rank"], model_json["master_addr"]) == (2, 0, "10.0.0.5")
    assert node.env["NEURON_COMPILED_ARTIFACTS"].endswith("/L1.node0")
    assert model_json["enable_prefix_caching"] is False and model_json["seed"] == 7
    assert "port" not in model_json
    # Followers of a Triton unit run the headless vLLM engine.
    follower = plans.build_plan(spec, "follower", 1, leader_addr="10.0.0.5", host_ip="10.0.0.6")
    assert follower.argv[:2] == ["vllm", "serve"] and "--headless" in follower.argv and not follower.files


@pytest.mark.parametrize("name", ["org/..", "org/.", "..", "/", "org/a b"])
def test_a_triton_model_name_that_is_no_directory_of_its_own_is_refused_by_name(name):
    """The last path part of model.name is the Triton model's directory in the model repository. Until the
    thirty-fourth session's defect hunt it was used unchecked: 'org/..' wrote config.pbtxt and 1/model.json outside
    the repository, 'org/.' wrote config.pbtxt into its root, and the unit never formed. Refused by name now; the
    OpenAI server takes the name as a string only (--served-model-name), so it is not checked there."""
    raw = neuron_spec(engine={"max_num_seqs": 4, "frontend": "triton"})
    raw["model"]["name"] = name
    with pytest.raises(SpecError, match=r"model\.name = .*: with engine\.frontend triton .*allowed: 1 to 255 ASCII"):
        parse_spec(raw)
    raw["engine"]["frontend"] = "openai"
    assert parse_spec(raw).model.name == name


@pytest.mark.parametrize(("name", "said"), [
    ("meta-llama/Llama\x00-3", "holds '\\x00' (U+0000), a control or invisible character"),
    ("meta-llama/Llama-3\nInstruct", "holds '\\n' (U+000A), a control or invisible character"),
    ("Llama\u200b3", "holds '\\u200b' (U+200B)"),
    ("\U0001F999" * 200, "would be a name of 800 bytes in UTF-8, longer than Linux allows (NAME_MAX)"),
])
@pytest.mark.parametrize("frontend", ["openai", "triton"])
def test_a_model_name_no_engine_command_line_takes_is_refused_by_the_launcher(name: str, said: str,
                                                                             frontend: str) -> None:
    """Regression (thirty-eighth session): the fleet file refused such a model.name (inference_fleet/checks.py) but
    a spec written by hand reached the engine's --served-model-name=NAME, where an argv string holds no NUL (the
    engine's exec fails with ValueError: embedded null byte) and a newline splits the launcher's log lines. The
    launcher now applies the same rule, the one function (unit_launcher/spec.py model_name_problem)."""
    raw = neuron_spec(engine={"max_num_seqs": 4, "frontend": frontend})
    raw["model"]["name"] = name
    with pytest.raises(SpecError) as error:
        parse_spec(raw)
    (line,) = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    assert line.startswith("  - model.name: ") and said in line and "allowed: printable characters" in line, line


@pytest.mark.parametrize(
    ("name", "model"),
    [("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct"), ("Qwen/Qwen2.5-7B", "Qwen2.5-7B"),
     ("gpt2", "gpt2")],
)
def test_every_triton_file_stays_in_its_model_directory(name, model):
    """Hugging Face names are accepted, and the launcher writes exactly the model's two files inside its directory."""
    raw = neuron_spec(engine={"max_num_seqs": 4, "frontend": "triton"})
    raw["model"]["name"] = name
    spec = parse_spec(raw)
    node = plans.build_plan(spec, "leader", 0, leader_addr="10.0.0.1", host_ip="10.0.0.1")
    repo = PurePosixPath(spec.engine.triton_model_repository)
    assert sorted(PurePosixPath(path).relative_to(repo).parts for path in node.files) == [
        (model, "1", "model.json"), (model, "config.pbtxt")]
    assert f'name: "{model}"' in node.files[str(repo / model / "config.pbtxt")]


def test_triton_leader_runs_the_images_backends_with_metrics_and_a_drain_within_the_stop_timeout():
    """The image's Triton (containers/inference/Dockerfile): its backends folder, where this package's `vllm`
    backend is; metrics on their own port (the proxy's load report reads them); on SIGTERM Triton waits for
    requests in flight for less than the launcher's stop timeout, so vLLM has time to stop before SIGKILL."""
    spec = parse_spec(neuron_spec(engine={"max_num_seqs": 32, "frontend": "triton", "stop_timeout_seconds": 120}))
    node = plans.build_plan(spec, "leader", 0, leader_addr="10.0.0.5", host_ip="10.0.0.5")
    assert "--backend-directory=/opt/triton/dist/pytriton/tritonserver/backends" in node.argv
    # The default model control ("none"): no load/unload API over HTTP.
    assert not any(a.startswith(("--model-control-mode", "--load-model")) for a in node.argv)
    assert {"--allow-metrics=true", "--metrics-address=127.0.0.1", "--metrics-port=8002"} <= set(node.argv)
    assert "--exit-timeout-secs=90" in node.argv
    assert "--allow-grpc=false" in node.argv and not any(a.startswith("--strict-readiness") for a in node.argv)
    # The unit executor is active in Triton's stub as under `vllm serve`: the same environment.
    openai = plans.build_plan(parse_spec(neuron_spec(engine={"max_num_seqs": 32})), "leader", 0,
                              leader_addr="10.0.0.5", host_ip="10.0.0.5")
    assert node.env == openai.env and node.env["UNIT_EXECUTOR"] == "1"


def test_triton_metrics_port_must_differ_from_the_units_other_ports():
    with pytest.raises(SpecError, match=r"engine\.triton_metrics_port = 29400: same as rendezvous\.port"):
        parse_spec(neuron_spec(engine={"max_num_seqs": 4, "frontend": "triton", "triton_metrics_port": 29400}))
    # The OpenAI server has no such port: not checked then.
    parse_spec(neuron_spec(engine={"max_num_seqs": 4, "triton_metrics_port": 29400}))


def test_schema_check_rejects_a_config_that_triton_would_refuse():
    broken = plans.render_triton_config(parse_spec(neuron_spec())).replace("TYPE_STRING", "TYPE_TEXT", 1)
    with pytest.raises(plans.PlanError, match="model-config schema"):
        plans.check_triton_config(broken)
    # The same text with the valid enum parses: the failure above is the schema's, not the parser's.
    text_format.Parse(broken.replace("TYPE_TEXT", "TYPE_STRING"), model_config_pb2.ModelConfig())


@pytest.mark.parametrize(
    ("role", "rank", "message"),
    [
        ("leader", 1, "the leader is rank 0"),
        ("follower", 0, "ranks 1..1"),
        ("follower", 2, "ranks 1..1"),
        ("worker", 1, "allowed: leader, follower"),
    ],
)
def test_plan_refuses_impossible_roles_and_ranks(role, rank, message):
    with pytest.raises(plans.PlanError, match=message):
        plans.build_plan(parse_spec(neuron_spec()), role, rank, leader_addr="a", host_ip="b")


def test_spec_errors_name_the_field_and_the_rule():
    with pytest.raises(SpecError) as error:
        parse_spec(neuron_spec(neuron={"world_size": 64, "cp_degree": 3}, engine={"port": 29400, "max_num_seqs": 1}))
    text = str(error.value)
    assert "neuron.world_size = 64: must be size (2) x instance.cores_per_node (64) = 128" in text
    assert "neuron.cp_degree = 3: must divide neuron.tp_degree (128)" in text
    assert "rendezvous.port = 29400: same as engine.port; host networking needs distinct ports" in text
    with pytest.raises(SpecError, match=r"engine\.device: Input should be 'neuron' or 'cpu' \(got 'gpu'\)"):
        parse_spec(neuron_spec(engine={"device": "gpu", "max_num_seqs": 1}))
    with pytest.raises(SpecError, match=r"engine\.bogus: Extra inputs are not permitted"):
        parse_spec(neuron_spec(engine={"bogus": 1, "max_num_seqs": 1}))
    with pytest.raises(SpecError, match=r"rendezvous\.port = 8000: same as engine\.port"):
        parse_spec(neuron_spec(rendezvous={"port": 8000}))
    with pytest.raises(SpecError, match="invalid unit spec from UNIT_SPEC"):
        parse_spec("{not json")
    with pytest.raises(SpecError, match="set UNIT_SPEC"):
        load_spec_from_env({})
    assert load_spec_from_env({"UNIT_SPEC": json.dumps(neuron_spec())}).unit_id == "u1"


def test_triton_extra_args_take_no_prefixes():
    """`--no-x` is `vllm serve`'s way to set a boolean x false; model.json must say x: false, not no_x: true."""
    assert plans.extra_args_to_engine_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"]) == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 512}
