"""The unit spec and container environment that the cell stack hands to the inference image.

`build_unit_spec` turns the fleet file into the JSON-able spec that the launcher inside
the image validates (`unit_launcher.spec.UnitSpec`); `container_environment` is the whole
environment of the inference container of one unit. The cell stack calls exactly these
two; names follow docs/contracts.md.
"""

from __future__ import annotations

import json
from typing import Any

from inference_fleet.config import CellConfig, FleetConfig
from inference_fleet.planner.plan import neuron_config

ROLES = ("leader", "follower", "spare")

# The model cache: the instance-store RAID0 mounted here on the host (user data) and the
# same path inside the unit's containers, so the cache survives task restarts.
MODEL_CACHE_PATH = "/opt/models"
# Written by the node's setup at the root of the instance-store file system (not on the root
# volume): the launcher fetches only into a cache where it finds this file.
MODEL_CACHE_MARKER = ".instance-store"


def unit_metrics_namespace(fleet: FleetConfig) -> str:
    """CloudWatch namespace of the launcher's unit events (UnitFailures, UnitSessionEnds, ...)."""
    return f"{fleet.name}/Unit"


def namespace_name(fleet: FleetConfig, cell: CellConfig) -> str:
    """Cloud Map private DNS namespace of a cell."""
    return f"{cell.name}.{fleet.name.lower()}.internal"


def leader_service_name(unit_index: int) -> str:
    return f"leader-u{unit_index}"


def layout_key(fleet: FleetConfig) -> str:
    """Name of the compiled layout folder (artifacts/neuron/<layout>/): what a compiled model depends on.

    Host sampling (`unit.on_device_sampling: false`) compiles another graph, so another folder: a flip is
    a layout the pipeline's Compile stage builds, never a replacement of files other cells still serve."""
    unit = fleet.unit
    return (
        f"{unit.instance_type}-n{unit.nodes}-lnc{unit.lnc}-tp{unit.tp}-cp{unit.context_parallel_degree}"
        f"-adp{unit.data_parallel_degree}-seq{fleet.model.max_seq_len}-bs{unit.max_concurrent_sequences}"
        + ("" if unit.on_device_sampling else "-hostsampling")
    )


def _check_unit_index(cell: CellConfig, unit_index: int) -> None:
    if not isinstance(unit_index, int) or not 0 <= unit_index < cell.resolved_max_units:
        raise ValueError(
            f"unit_index {unit_index!r} out of range: cell {cell.name} has units 0..{cell.resolved_max_units - 1}"
        )


def build_unit_spec(
    fleet: FleetConfig, cell: CellConfig, unit_index: int, *, revision: str
) -> dict[str, Any]:
    """The unit spec of unit `unit_index` of `cell`, as a JSON-able dict."""
    _check_unit_index(cell, unit_index)
    if not revision:
        raise ValueError("revision must be a non-empty string (the stack's hash of the unit's settings)")
    unit, model, serving = fleet.unit, fleet.model, fleet.serving
    instance = unit.instance
    safe_name = model.name.replace("/", "--")
    planned = neuron_config(fleet)
    return {
        "cell": cell.name,
        "unit_id": f"u{unit_index}",
        "size": unit.nodes,
        "revision": revision,
        "region": cell.region,
        "model": {
            "name": model.name,
            "artifacts_s3_uri": model.artifacts_s3_uri,
            "local_dir": f"{MODEL_CACHE_PATH}/{safe_name}",
            "cache_marker": f"{MODEL_CACHE_PATH}/{MODEL_CACHE_MARKER}",
            "layout": layout_key(fleet),
            # Only when set: a fleet without it renders the same unit spec (and templates) as before.
            **({"artifacts_key": model.artifacts_key} if model.artifacts_key else {}),
            "dtype": model.dtype,
            "max_seq_len": model.max_seq_len,
        },
        "instance": {
            "type": instance.name,
            "cores_per_node": unit.cores_per_node,
            "lnc": unit.lnc,
            "lnc_configurable": len(instance.logical_nc_configs) > 1,
            "neuron_devices": instance.chips,
            "efa_interfaces": instance.efa_interfaces,
        },
        "neuron": {
            "tp_degree": unit.tp,
            "cp_degree": unit.context_parallel_degree,
            "attention_dp_degree": unit.data_parallel_degree,
            "world_size": unit.total_cores,
            "rt_root_comm_port": serving.neuron_rt_port,
            "sequence_parallel_enabled": planned["sequence_parallel_enabled"],
        },
        "engine": {
            "device": "neuron",
            "command": ["vllm"],
            "frontend": serving.frontend,
            "host": "127.0.0.1",
            "port": serving.engine_port,
            "master_port": serving.master_port,
            "max_num_seqs": unit.max_concurrent_sequences,
        },
        "rendezvous": {
            "port": serving.rendezvous_port,
            "follower_loss_seconds": serving.follower_loss_seconds,
            "step_timeout_seconds": serving.step_timeout_seconds,
            "backoff_base_seconds": serving.restart_backoff_base_seconds,
            "backoff_cap_seconds": serving.restart_backoff_cap_seconds,
            "backoff_reset_seconds": serving.restart_backoff_reset_seconds,
            # Every node fetches and loads the model before it joins: the join wait covers
            # the slowest node's load, bounded by the task's health check grace.
            "join_timeout_seconds": serving.health_check_grace_seconds,
            # A stopping follower's drain: the proxy serves DRAIN_SECONDS (until the load balancer
            # has seen /health fail), lets its streams finish for DRAIN_TIMEOUT_SECONDS, then reports drained.
            "member_drain_seconds": serving.proxy_drain_bound_seconds,
        },
        "discovery": {
            "namespace": namespace_name(fleet, cell),
            "leader_service": leader_service_name(unit_index),
        },
        # The launcher's session-end events (failure evidence) as EMF metrics.
        "metrics_namespace": unit_metrics_namespace(fleet),
    }


def container_environment(
    fleet: FleetConfig, cell: CellConfig, unit_index: int, *, role: str, revision: str
) -> dict[str, str]:
    """The full environment of the inference container (leader, follower or warm spare) of one unit."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} not allowed; allowed: {', '.join(ROLES)}")
    spec = build_unit_spec(fleet, cell, unit_index, revision=revision)
    return {
        "UNIT_ROLE": role,
        "UNIT_SPEC": json.dumps(spec, separators=(",", ":"), sort_keys=True),
        "AWS_REGION": cell.region,
        "AWS_DEFAULT_REGION": cell.region,
        "PYTHONUNBUFFERED": "1",
    }
