"""The unit spec the cell stack hands to the inference image, and the launch plans it yields.

Every instance type of the catalogue, every logical core size it allows and every
context/data parallel degree the config accepts produce a spec the launcher validates and
a plan with the documented Neuron multi-node settings on every rank.
"""

from __future__ import annotations

import json

import pytest
import yaml
from unit_launcher import plan as plans
from unit_launcher.spec import UnitSpec

from inference_fleet.catalogue import CATALOGUE
from inference_fleet.checks import load_fleet
from inference_fleet.config import DEFAULT_CONFIG, FleetConfig
from inference_fleet.unit_spec import build_unit_spec, container_environment

_DEFAULT = yaml.safe_load(DEFAULT_CONFIG.read_text())


def _fleet(**unit) -> FleetConfig:
    data = json.loads(json.dumps(_DEFAULT))
    data["unit"] = {"max_concurrent_sequences": 8, **unit}
    data["cells"][0]["units"] = 3
    # Structural validation only: fit checks of the planner are about the model, not the plan.
    return FleetConfig.model_validate(data)


def test_default_fleet_spec_is_what_the_launcher_accepts():
    fleet = load_fleet()
    cell = fleet.cell("dev")
    spec = build_unit_spec(fleet, cell, 0, revision="abc123")
    parsed = UnitSpec.model_validate(spec)
    assert json.loads(json.dumps(spec)) == spec
    assert (parsed.unit_id, parsed.size, parsed.revision, parsed.cell) == ("u0", 2, "abc123", "dev")
    assert (
        parsed.discovery.namespace == "dev.rufus.internal" and parsed.discovery.leader_service == "leader-u0"
    )
    assert (parsed.instance.cores_per_node, parsed.instance.lnc, parsed.instance.efa_interfaces) == (
        64,
        2,
        16,
    )
    assert (
        parsed.neuron.tp_degree,
        parsed.neuron.cp_degree,
        parsed.neuron.attention_dp_degree,
        parsed.neuron.world_size,
    ) == (128, 4, 4, 128)
    assert (
        parsed.engine.port == fleet.serving.engine_port
        and parsed.rendezvous.port == fleet.serving.rendezvous_port
    )
    assert parsed.rendezvous.follower_loss_seconds == fleet.serving.follower_loss_seconds
    assert parsed.model.artifacts_s3_uri == fleet.model.artifacts_s3_uri and parsed.engine.device == "neuron"


def test_container_environment_is_complete_and_role_specific():
    fleet = load_fleet()
    cell = fleet.cell("dev")
    env = container_environment(fleet, cell, 0, role="follower", revision="r9")
    assert env["UNIT_ROLE"] == "follower" and env["AWS_REGION"] == "us-east-2"
    assert json.loads(env["UNIT_SPEC"]) == build_unit_spec(fleet, cell, 0, revision="r9")
    assert all(isinstance(v, str) for v in env.values())
    assert container_environment(fleet, cell, 0, role="leader", revision="r9")["UNIT_ROLE"] == "leader"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda f, c: container_environment(f, c, 0, role="worker", revision="r"),
            "role 'worker' not allowed; allowed",
        ),
        (
            lambda f, c: build_unit_spec(f, c, 1, revision="r"),
            "unit_index 1 out of range: cell dev has units 0..0",
        ),
        (lambda f, c: build_unit_spec(f, c, -1, revision="r"), "unit_index -1 out of range"),
        (lambda f, c: build_unit_spec(f, c, 0, revision=""), "revision must be a non-empty string"),
    ],
)
def test_bad_arguments_are_refused(call, message):
    fleet = load_fleet()
    with pytest.raises(ValueError, match=message):
        call(fleet, fleet.cell("dev"))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


COMBINATIONS = [
    (name, lnc, nodes)
    for name, instance in CATALOGUE.items()
    for lnc in instance.logical_nc_configs
    for nodes in (1, 2, 4)
]


@pytest.mark.parametrize(("instance_type", "lnc", "nodes"), COMBINATIONS)
def test_plans_for_every_instance_type_and_parallel_layout(instance_type, lnc, nodes):
    instance = CATALOGUE[instance_type]
    local = instance.physical_neuron_cores // lnc
    total = local * nodes
    checked = 0
    base = _fleet(instance_type=instance_type, nodes=nodes, logical_nc_config=lnc)
    for cp in _divisors(total):
        for dp in _divisors(total):
            fleet = base.model_copy(
                update={
                    "unit": base.unit.model_copy(
                        update={"context_parallel_degree": cp, "data_parallel_degree": dp}
                    )
                }
            )
            spec = UnitSpec.model_validate(build_unit_spec(fleet, fleet.cells[0], 2, revision="r"))
            for rank in range(nodes):
                role = "leader" if rank == 0 else "follower"
                node = plans.build_plan(
                    spec, role, rank, leader_addr="10.0.0.1", host_ip=f"10.0.0.{rank + 1}"
                )
                env, argv = node.env, node.argv
                config = node.neuron_config
                assert config is not None
                assert {k: config[k] for k in ("tp_degree", "cp_degree", "attention_dp_degree")} == {
                    "tp_degree": total,
                    "cp_degree": cp,
                    "attention_dp_degree": dp,
                }
                assert (config["world_size"], config["start_rank_id"], config["local_ranks_size"]) == (
                    total,
                    rank * local,
                    local,
                )
                # Nothing the pinned engine ignores (docs/neuron-multi-node.md, "dead settings").
                assert not {"NEURON_LOCAL_TP", "NEURON_RANK_ID", "WORLD_SIZE", "ENABLE_NEURON_MULTI_NODE",
                            "VLLM_NEURON_FRAMEWORK"} & set(env)
                assert not any(a.startswith("--additional-config") for a in argv)
                assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == (
                    "efa",
                    "1",
                    "1",
                )
                # trn1 has no logical core setting; trn2 always states it (LNC=2 default, 1 allowed).
                assert env.get("NEURON_LOGICAL_NC_CONFIG") == (
                    str(lnc) if len(instance.logical_nc_configs) > 1 else None
                )
                assert f"--tensor-parallel-size={nodes}" in argv
                assert env["NEURON_COMPILED_ARTIFACTS"].endswith(
                    f"/neuron/{instance_type}-n{nodes}-lnc{lnc}-tp{total}-cp{cp}-adp{dp}-seq16384-bs8.node{rank}"
                )
                if nodes > 1:
                    assert env["NEURON_RT_ROOT_COMM_ID"] == f"10.0.0.1:{fleet.serving.neuron_rt_port}"
                    assert f"--nnodes={nodes}" in argv and f"--node-rank={rank}" in argv
                    assert "--master-addr=10.0.0.1" in argv
                else:
                    assert "NEURON_RT_ROOT_COMM_ID" not in env and "--nnodes=1" not in argv
                assert ("--headless" in argv) == (rank > 0)
                assert (f"--port={fleet.serving.engine_port}" in argv) == (rank == 0)
                checked += 1
    assert checked == len(_divisors(total)) ** 2 * nodes


def test_config_refuses_degrees_the_plan_could_not_honour():
    from inference_fleet.checks import parse_fleet
    from inference_fleet.config import ConfigError

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["unit"]["context_parallel_degree"] = 3
    with pytest.raises(ConfigError, match="context_parallel_degree"):
        parse_fleet(data)


def test_launcher_neuron_config_agrees_with_the_planner() -> None:
    """What `make plan` prints is what the launcher hands the engine, rank by rank."""
    from pathlib import Path

    from unit_launcher.plan import neuron_config
    from unit_launcher.spec import parse_spec

    from inference_fleet import planner

    for path in (None, Path(__file__).parent / "fleets" / "large.yaml"):
        fleet = load_fleet(path)
        spec = parse_spec(build_unit_spec(fleet, fleet.cells[0], 0, revision="r1"))
        for rank in range(fleet.unit.nodes):
            launched = neuron_config(spec, rank)
            planned = planner.neuron_config(fleet, rank)
            assert launched == {key: planned[key] for key in launched}, (path, rank)
