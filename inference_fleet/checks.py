"""Every rule a fleet must pass, and `load_fleet`: the one way to read a fleet file.

The fleet model (`inference_fleet.config`) checks each field on its own; the rules here
span fields: the unit layout, the cells (names, AZs, CIDRs), the waves, the ports, the
planner's memory and layout fit (`inference_fleet.planner.fit`) and the pipeline's wave
size (`inference_fleet.rollout`), and whether each cell can be deployed on AWS
(`inference_fleet.cell_checks`). Imports go one way: config <- planner, rollout, cell_checks <- checks,
and every entry point (app.py, stacks/fleet.py, `python -m inference_fleet`, the
launcher's `plan --config`, the tests) reads a fleet with `load_fleet` (a file) or
`parse_fleet` (already parsed YAML). Every issue found is reported at once in one
`ConfigError`, each with its field path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from unit_launcher.spec import model_name_problem, triton_model_name_problem

from inference_fleet.catalogue import CATALOGUE
from inference_fleet.cell_checks import (
    check_alarm_defaults,
    check_cells_deployable,
    check_efa_installer_pin,
    check_quarantine,
    check_spares_in_fixed_cells,
    check_startup_budget,
)
from inference_fleet.compile_job import (
    check_artifacts_kms_key,
    check_compile_azs,
    check_compile_dtype,
    check_compile_host,
    check_compile_image,
    check_compile_sdk,
)
from inference_fleet.compile_job import environment as compile_environment
from inference_fleet.config import (
    EPHEMERAL_PORTS,
    NEURON_MAX_PROMPT_TOKENS,
    SERVING_PORT_FIELDS,
    CellConfig,
    ConfigError,
    ConfigIssue,
    FleetConfig,
    ServingConfig,
    az_id_prefix,
    is_az_id,
    parse_model,
    ports_text,
    read_fleet_file,
    repository_path,
    taken_ports,
)
from inference_fleet.planner.fit import check_fit
from inference_fleet.rollout import check_wave_sizes
from inference_fleet.router_checks import check_pipeline_evacuation, check_routers
from inference_fleet.subnets import ALB_SUBNET_MAX_PREFIX, subnet_layout
from inference_fleet.unit_spec import MODEL_CACHE_PATH

FleetCheck = Callable[[FleetConfig], Iterable[ConfigIssue]]



def load_fleet(path: str | Path | None = None) -> FleetConfig:
    """Read a fleet file (None: the embedded default, config/default.yaml) and run every check.

    Raises ConfigError listing every issue with its field path; callers print it and exit 3 (exit_codes.CONFIG).
    """
    data, source = read_fleet_file(path)
    return parse_fleet(data, source)


def check_fleet_file_place(fleet: FleetConfig, fleet_file: str | Path | None) -> None:
    """A fleet with a pipeline is synthesized by the pipeline's build from its checkout: its file must be in the
    repository. Raises ConfigError naming `pipeline` (the default fleet, None, always is)."""
    if fleet.pipeline is None or not fleet_file:
        return
    try:
        repository_path(fleet_file)
    except ValueError as error:
        raise ConfigError(str(fleet_file), [ConfigIssue("pipeline", "(set)", str(error))]) from None


# The account ID of the shipped example fleet (config/default.yaml). A fleet that still holds it synthesizes, so that
# `make synth` and the tests run offline on the example, but it deploys nowhere: `placeholder_warnings` names each
# field that holds it (docs/deploying.md, step 0, "Make the fleet yours").
PLACEHOLDER_ACCOUNT = "111111111111"
# The account as a word of its own (in an ARN, an ECR host, a bucket name), not twelve 1s inside a longer
# run of hex digits or letters such as an image digest.
_PLACEHOLDER_WORD = re.compile(rf"(?<![0-9A-Za-z]){PLACEHOLDER_ACCOUNT}(?![0-9A-Za-z])")
# What to set instead, by field name; any other field holding the account is the same account's resource.
_PLACEHOLDER_FIXES = {
    "account": "your AWS account ID",
    "artifacts_s3_uri": "s3://<bucket>/<prefix>/ of a bucket you created (bucket names are global) in the compile "
                        "stack's region",
    "connection_arn": "the ARN of the CodeConnections connection you created and authorised in the pipeline's "
                      "account and region",
}


def placeholder_warnings(fleet: FleetConfig) -> list[ConfigIssue]:
    """Every field whose value still holds the example fleet's account 111111111111, each with what to set.

    Warnings, not issues: the example fleet must keep synthesizing offline. `validate` and synth print them."""
    found: list[ConfigIssue] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")
        elif isinstance(value, str) and _PLACEHOLDER_WORD.search(value):
            fix = _PLACEHOLDER_FIXES.get(path.rsplit(".", 1)[-1], "the value of your own account's resource")
            found.append(ConfigIssue(
                path, value, f"the example fleet's placeholder account {PLACEHOLDER_ACCOUNT}, not yours: set "
                f"{fix} (docs/deploying.md, step 0)",
            ))

    walk(fleet.model_dump(mode="json", exclude_none=True), "")
    return found


# Amazon VPC's default quotas per account and region (https://docs.aws.amazon.com/vpc/latest/userguide/amazon-vpc-limits.html):
# "VPCs per Region 5" (internet gateways per Region follow it) and "Elastic IP addresses per Region 5"; both
# adjustable. A new account's default VPC holds one VPC and one internet gateway.
VPCS_PER_REGION = 5
ELASTIC_IPS_PER_REGION = 5


def vpc_quota_warnings(fleet: FleetConfig) -> list[ConfigIssue]:
    """Each account and region whose stacks create more VPCs (a cell's, a router's, the compile stack's) or
    Elastic IPs (each cell's NAT gateway, cell_constructs/network.py) than the default quotas allow.

    Warnings, not issues: quotas can be raised, and nothing here can read an account's. `validate` and synth
    print them; the stack that goes over fails at deploy with VpcLimitExceeded or AddressLimitExceeded."""
    vpcs: dict[tuple[str, str], list[str]] = {}
    eips: dict[tuple[str, str], int] = {}
    for cell in fleet.cells:
        vpcs.setdefault((cell.account, cell.region), []).append(f"cell {cell.name}")
        eips[(cell.account, cell.region)] = eips.get((cell.account, cell.region), 0) + 1
    for router in fleet.routers:
        vpcs.setdefault((fleet.router_account(router), router.region), []).append(f"router {router.region}")
    vpcs.setdefault(compile_environment(fleet), []).append("the compile stack")
    found = []
    for (account, region), stacks in sorted(vpcs.items()):
        if len(stacks) + 1 > VPCS_PER_REGION:
            found.append(ConfigIssue(
                f"{account}/{region}", len(stacks),
                f"{len(stacks)} VPCs ({', '.join(stacks)}), {len(stacks) + 1} with the account's default VPC (unless "
                f"deleted): over the default quota of {VPCS_PER_REGION} VPCs per Region; "
                "raise it in Service Quotas (Amazon VPC) before deploying, or the stack that goes over fails "
                "(docs/deploying.md, step 0)"))
        if eips.get((account, region), 0) > ELASTIC_IPS_PER_REGION:
            found.append(ConfigIssue(
                f"{account}/{region}", eips[(account, region)],
                f"{eips[(account, region)]} cells, one NAT gateway and Elastic IP each: over the default quota of "
                f"{ELASTIC_IPS_PER_REGION} Elastic IP addresses per Region; raise it in Service Quotas (Amazon EC2) "
                "before deploying (docs/deploying.md, step 0)"))
    return found


def fleet_warnings(fleet: FleetConfig) -> list[ConfigIssue]:
    """What `validate` and synth warn of: the example's placeholder account, then the default VPC quotas."""
    return [*placeholder_warnings(fleet), *vpc_quota_warnings(fleet)]


def parse_fleet(data: Any, source: str = "<dict>") -> FleetConfig:
    """Validate an already parsed fleet description: the fields first, then every rule."""
    return validate_fleet(parse_model(data, source), source)


# Fields the derived checks build on (DERIVED_CHECKS): an issue on one of them skips those checks.
_UNDERLYING = ("model.", "unit.", *(f"serving.{name}" for name in SERVING_PORT_FIELDS))


def validate_fleet(fleet: FleetConfig, source: str = "<dict>") -> FleetConfig:
    """Run every rule on a fleet model; returns it unchanged or raises ConfigError.

    The planner's fit builds on the model's shape and the unit's layout, so when either is
    wrong it is not run: a wrong num_kv_heads is blamed on num_kv_heads, not on a memory plan
    computed from it. The compile host check also builds the unit spec, which holds the serving
    ports: a refused port is named on its serving.* field, not again in the launcher's words.
    """
    issues = [issue for check in CHECKS for issue in check(fleet)]
    if not any(issue.path.startswith(_UNDERLYING) for issue in issues):
        issues += [issue for check in DERIVED_CHECKS for issue in check(fleet)]
    if issues:
        raise ConfigError(source, issues)
    return fleet


def _check_model(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """The model's shape fits together: every head gets at least one dimension, KV heads group the query heads;
    its context is one the Neuron engine can schedule."""
    model = fleet.model
    if model.max_seq_len > NEURON_MAX_PROMPT_TOKENS:
        yield ConfigIssue(
            "model.max_seq_len", model.max_seq_len,
            f"above {NEURON_MAX_PROMPT_TOKENS} on Neuron: vllm-neuron turns chunked prefill off and fixes the "
            f"scheduler's token budget (max_num_batched_tokens) at {NEURON_MAX_PROMPT_TOKENS}, so a longer prompt "
            "is never scheduled and, while it waits, holds every running request of the unit; allowed: 128 to "
            f"{NEURON_MAX_PROMPT_TOKENS}",
        )
    if model.hidden_size < model.num_attention_heads:
        yield ConfigIssue(
            "model.hidden_size", model.hidden_size,
            f"smaller than model.num_attention_heads ({model.num_attention_heads}): each head gets "
            "hidden_size / num_attention_heads dimensions; check both against the model's config.json",
        )
    if model.num_kv_heads > model.num_attention_heads:
        yield ConfigIssue(
            "model.num_kv_heads", model.num_kv_heads,
            f"more than model.num_attention_heads ({model.num_attention_heads}); grouped-query attention has "
            "at most one KV head per query head",
        )
    # vLLM's Attention layer asserts num_heads % num_kv_heads == 0: vllm-project/vllm
    # tests/kernels/attention/test_attention.py::test_num_heads_not_divisble_by_num_kv_heads
    # at cdfaee716fe64fb97a005fe8dba3e4cbdea31e88 (16 heads, 5 KV heads: AssertionError).
    elif model.num_attention_heads % model.num_kv_heads:
        yield ConfigIssue(
            "model.num_kv_heads", model.num_kv_heads,
            f"must divide model.num_attention_heads ({model.num_attention_heads}): each KV head serves an equal "
            "group of query heads",
        )


def _check_unit(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    unit = fleet.unit
    if unit.instance_type not in CATALOGUE:
        yield ConfigIssue("unit.instance_type", unit.instance_type, f"unknown; allowed: {', '.join(CATALOGUE)}")
        return
    allowed_lnc = unit.instance.logical_nc_configs
    if unit.logical_nc_config is not None and unit.logical_nc_config not in allowed_lnc:
        yield ConfigIssue(
            "unit.logical_nc_config",
            unit.logical_nc_config,
            f"{unit.instance_type} supports logical NeuronCore sizes {list(allowed_lnc)}",
        )
        return
    total = unit.total_cores
    if unit.tp != total:
        yield ConfigIssue(
            "unit.tensor_parallel_degree",
            unit.tp,
            f"tensor parallelism spans every NeuronCore of the unit: must be nodes ({unit.nodes}) x "
            f"logical NeuronCores per node ({unit.cores_per_node}) = {total}",
        )
    for field, degree, phase in (
        ("context_parallel_degree", unit.context_parallel_degree, "prefill"),
        ("data_parallel_degree", unit.data_parallel_degree, "decode"),
    ):
        if total % degree:
            divisors = [d for d in range(1, total + 1) if total % d == 0]
            yield ConfigIssue(
                f"unit.{field}",
                degree,
                f"{phase} runs {degree} groups x (tp / {degree}) cores, which must multiply to the unit's "
                f"{total} NeuronCores; allowed: divisors of {total}: {divisors}",
            )


def _check_cells(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    seen: dict[str, int] = {}
    waves = [w.name for w in fleet.waves]
    for i, cell in enumerate(fleet.cells):
        if cell.name in seen:
            yield ConfigIssue(
                f"cells[{i}].name", cell.name, f"duplicate of cells[{seen[cell.name]}].name; cell names are unique"
            )
        seen.setdefault(cell.name, i)
        if cell.wave not in waves:
            yield ConfigIssue(f"cells[{i}].wave", cell.wave, f"no such wave; waves: {waves}")
        trainium_az_ok = cell.in_region(cell.trainium_az)
        if not trainium_az_ok:
            yield ConfigIssue(
                f"cells[{i}].trainium_az", cell.trainium_az,
                f"must be an AZ of region {cell.region} (a name such as {cell.region}a or an AZ ID such as "
                f"{az_id_prefix(cell.region)}-az1)",
            )
        # Default ALB AZs derive from the Trainium AZ: a wrong one is reported once, above.
        if cell.alb_azs or trainium_az_ok:
            yield from _alb_az_issues(i, cell)
        if cell.certificate_arn and f":acm:{cell.region}:" not in cell.certificate_arn:
            yield ConfigIssue(
                f"cells[{i}].certificate_arn", cell.certificate_arn, f"certificate must be in {cell.region}"
            )
        yield from _unit_count_issues(i, cell)
        if cell.min_units_available is not None and cell.min_units_available > cell.resolved_min_units:
            yield ConfigIssue(
                f"cells[{i}].min_units_available", cell.min_units_available,
                f"at most the cell's {'min_units' if cell.elastic else 'units'} ({cell.resolved_min_units}): "
                "the floor must hold while the cell runs its fewest units",
            )
    for i, a in enumerate(fleet.cells):
        for j in range(i):
            b = fleet.cells[j]
            if (a.account, a.region) == (b.account, b.region) and a.vpc_cidr.overlaps(b.vpc_cidr):
                yield ConfigIssue(
                    f"cells[{i}].vpc_cidr",
                    str(a.vpc_cidr),
                    f"overlaps cells[{j}].vpc_cidr {b.vpc_cidr} ({b.name}) in {a.account}/{a.region}; "
                    "cells of one account and region need disjoint CIDRs",
                )


def _alb_az_issues(i: int, cell: CellConfig) -> Iterable[ConfigIssue]:
    """The ALB's AZs: distinct AZs of the region, written the way trainium_az is, the Trainium AZ among them (the
    VPC has its subnets in exactly these AZs, cell_constructs/network.py), and few enough for the VPC's subnets."""
    azs = cell.resolved_alb_azs
    path, shown = f"cells[{i}].alb_azs", list(azs)
    if len(set(azs)) < 2 or len(set(azs)) < len(azs) or any(not cell.in_region(az) for az in azs):
        yield ConfigIssue(path, shown, f"need >= 2 distinct AZs of region {cell.region}, each once")
        return
    trainium_is_id = is_az_id(cell.trainium_az)
    if any(is_az_id(az) != trainium_is_id for az in azs):
        # An AZ name maps to a different physical zone in each account; an ID to the same one. A mix cannot be
        # told apart from a duplicate or a missing Trainium AZ.
        form = (f"AZ IDs such as {az_id_prefix(cell.region)}-az1" if trainium_is_id
                else f"AZ names such as {cell.region}a")
        yield ConfigIssue(path, shown, f"write every AZ as trainium_az ({cell.trainium_az}) is: {form}; do not mix "
                          "AZ names and AZ IDs")
        return
    if cell.trainium_az not in azs:
        yield ConfigIssue(path, shown, f"must include trainium_az ({cell.trainium_az}): the Trainium subnet is one of "
                          f"the VPC's subnets in these AZs; allowed: {[cell.trainium_az, *azs]}")
        return
    if subnet_layout(cell.vpc_cidr, len(azs)) is None:
        most = max((n for n in range(2, len(azs)) if subnet_layout(cell.vpc_cidr, n)), default=1)
        yield ConfigIssue(path, shown, f"{len(azs)} AZs do not fit in vpc_cidr {cell.vpc_cidr}: each AZ gets a "
                          f"public, an ALB (/{ALB_SUBNET_MAX_PREFIX} or larger) and a Trainium subnet; allowed: at "
                          f"most {most} AZs, or a larger vpc_cidr")


def _unit_count_issues(i: int, cell: CellConfig) -> Iterable[ConfigIssue]:
    """`units` (fixed) or `min_units` + `max_units` (elastic), consistent, and a scaling policy only when elastic."""
    path = f"cells[{i}]"
    bounds = (cell.min_units, cell.max_units)
    if cell.units is not None and bounds != (None, None):
        given = "min_units" if cell.min_units is not None else "max_units"
        yield ConfigIssue(
            f"{path}.{given}", getattr(cell, given),
            f"set either units ({cell.units}: a fixed cell) or min_units and max_units (an elastic cell), not both",
        )
        return
    if cell.units is None and bounds == (None, None):
        yield ConfigIssue(f"{path}.units", None, "required: units (a fixed cell) or min_units and max_units")
        return
    if cell.units is None:
        for name, value in (("min_units", cell.min_units), ("max_units", cell.max_units)):
            if value is None:
                yield ConfigIssue(f"{path}.{name}", None, "an elastic cell needs both min_units and max_units")
        if None in bounds:
            return
        if cell.min_units > cell.max_units:
            yield ConfigIssue(f"{path}.min_units", cell.min_units, f"above max_units ({cell.max_units})")
            return
    if cell.scaling is not None and not cell.elastic:
        yield ConfigIssue(
            f"{path}.scaling", cell.scaling.model_dump(exclude_defaults=True),
            f"the cell has a fixed number of units ({cell.resolved_min_units}): a scaling policy needs "
            "min_units < max_units",
        )


def _check_waves(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    seen: set[str] = set()
    wave_names = {w.name for w in fleet.waves}
    for i, wave in enumerate(fleet.waves):
        if wave.name in seen:
            yield ConfigIssue(f"waves[{i}].name", wave.name, "duplicate wave name")
        seen.add(wave.name)
        cells = fleet.cells_of_wave(wave.name)
        # A cell naming an unknown wave is reported on the cell (_check_cells): its wave being empty is the echo.
        if not cells and all(c.wave in wave_names for c in fleet.cells):
            yield ConfigIssue(f"waves[{i}]", wave.name, "wave has no cells; every wave needs at least one")
        if i == 0 and len(cells) > 1:
            yield ConfigIssue(
                "waves[0]",
                wave.name,
                f"the first wave is the canary and holds exactly one cell, not {len(cells)}: {[c.name for c in cells]}",
            )


def _gate_prefix_issues(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """The gate reads the canary cell's tasks, container instances and log groups by the prefix
    `<stack>-` (CloudFormation names what it names `<stack>-<logical id>-<suffix>`; stacks/verify_gate.py).
    Another cell of the account and region whose name starts with the canary's name and `-` has a stack
    name with that prefix, so the gate could read its resources too: refused, so the scoping holds."""
    canaries = fleet.cells_of_wave(fleet.waves[0].name)
    for j, other in enumerate(fleet.cells):
        for canary in canaries:
            if (other.name.startswith(f"{canary.name}-")
                    and (other.account, other.region) == (canary.account, canary.region)):
                yield ConfigIssue(
                    f"cells[{j}].name", other.name,
                    f"starts with the canary cell's name {canary.name!r} and '-' in {canary.account}/"
                    f"{canary.region}: the verify gate reads the canary's resources by the name prefix "
                    f"{fleet.cell_stack_name(canary)}-, which {fleet.cell_stack_name(other)}'s resources also "
                    f"have; rename one of the two cells (e.g. {canary.name}0), or set pipeline.verify_gate: false",
                )


def _check_model_name(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """model.name names folders on the nodes: the model's copy in the cache (unit_spec.build_unit_spec: '/' as '--')
    on every front end, and with Triton the model's directory in Triton's model repository (its last path part,
    unit_launcher.spec.triton_model_for). A name that is no folder of its own there is refused here, before synth;
    the launcher's spec refuses a bad Triton name too, so such a unit would never form after a deploy."""
    name = fleet.model.name
    if problem := model_name_problem(name, MODEL_CACHE_PATH):
        yield ConfigIssue("model.name", name, problem)
    elif name.startswith("."):
        folder = name.replace("/", "--")
        what = {".": "the model cache itself", "..": "the cache's parent, off the cache volume"}.get(
            folder, "a hidden entry beside the cache's own (.instance-store, .unit-state)")
        yield ConfigIssue(
            "model.name", name,
            f"starts with '.': the node's copy of the model, {MODEL_CACHE_PATH}/{folder}, would be {what}; "
            "allowed: a name that starts with a letter, digit or '_', e.g. meta-llama/Llama-3.1-8B-Instruct",
        )
    elif fleet.serving.frontend == "triton" and (problem := triton_model_name_problem(name)):
        yield ConfigIssue("model.name", name, f"with serving.frontend: triton {problem}")


def _check_verify_gate(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """The gate is a CodeBuild project of the pipeline's account in the canary's VPC, found through an
    SSM parameter: both regional and of one account (stacks/verify_gate.py). Either front end may be
    gated: the kit speaks KServe v2 generate to a Triton cell (inference_fleet/verify/serving_client.py)."""
    pipeline = fleet.pipeline
    if pipeline is None or not pipeline.verify_gate:
        return
    for cell in fleet.cells_of_wave(fleet.waves[0].name):
        if (cell.account, cell.region) != (pipeline.account, pipeline.region):
            yield ConfigIssue(
                "pipeline.verify_gate", True,
                f"the canary cell {cell.name} is in {cell.account}/{cell.region} and the pipeline in "
                f"{pipeline.account}/{pipeline.region}; the verify gate runs in the canary's VPC from the "
                "pipeline's account and region: put the canary cell there, or set pipeline.verify_gate: false "
                "and run `make verify-cell` after the canary deploys",
            )
    yield from _gate_prefix_issues(fleet)
    for i, cell in enumerate(fleet.cells):
        routed = any(cell.name in (r.tls_names or {}) for r in fleet.routers)
        if cell.wave == fleet.waves[0].name and cell.certificate_arn and not cell.tls_name and not routed:
            yield ConfigIssue(
                f"cells[{i}].tls_name", None,
                f"required: the verify gate checks the canary cell {cell.name}'s HTTPS listener and verifies its "
                "certificate against this name (the DNS name the certificate covers; the load balancer's own "
                "amazonaws.com name is never in it)",
            )


def _check_serving(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    s = fleet.serving
    yield from _serving_port_issues(s)
    if s.restart_backoff_cap_seconds < s.restart_backoff_base_seconds:
        yield ConfigIssue(
            "serving.restart_backoff_cap_seconds", s.restart_backoff_cap_seconds,
            f"below serving.restart_backoff_base_seconds ({s.restart_backoff_base_seconds}): the cap is the "
            "longest wait, at least the first one",
        )


def _serving_port_issues(s: ServingConfig) -> Iterable[ConfigIssue]:
    """Unit tasks run with host networking: each serving port needs the instance's port to itself, apart from the
    other serving ports and from the ports every node already uses (config.taken_ports, with their owners)."""
    taken = taken_ports(s.frontend)
    low, high = EPHEMERAL_PORTS
    allowed = (f"allowed: 1024 to {low - 1} or {high + 1} to 65535, except {ports_text(taken)} (with frontend "
               f"{s.frontend}) and the other serving ports")
    owner: dict[int, str] = {}
    for name in SERVING_PORT_FIELDS:
        port = getattr(s, name)
        if port in taken:
            yield ConfigIssue(
                f"serving.{name}", port, f"taken on every node by {taken[port]}; host networking shares the "
                f"instance's ports; {allowed}",
            )
        elif low <= port <= high:
            yield ConfigIssue(
                f"serving.{name}", port, f"in Linux's ephemeral port range {low}-{high}, from which every outbound "
                "connection of the node takes its local port, so the listener may find it held (ECS: do not "
                f"specify a host port there); {allowed}",
            )
        elif port in owner:
            yield ConfigIssue(
                f"serving.{name}", port, f"same as serving.{owner[port]}; host networking needs distinct ports"
            )
        owner.setdefault(port, name)


def _check_frontend(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """A Triton front end needs an image with tritonserver: refused here, not crash-looping on ECS.

    The image built from containers/inference has it (Triton 2.51.0 from the nvidia-pytriton wheel,
    pinned by hash, with this package's `vllm` backend; docs/runtime.md "Triton front end"); a pinned
    image must say it has (images.inference_has_tritonserver), since nothing here can look inside it."""
    if fleet.serving.frontend != "triton":
        return
    for i, cell in enumerate(fleet.cells):
        images = cell.images
        if images.inference is not None and not images.inference_has_tritonserver:
            yield ConfigIssue(
                f"cells[{i}].images.inference_has_tritonserver", False,
                f"serving.frontend is triton and cell {cell.name} pins the inference image {images.inference}: "
                "state that it has tritonserver with a `vllm` backend that runs this package's unit executor "
                "(true), or drop images.inference to deploy the image built from containers/inference (which has "
                "them), or use frontend: openai",
            )


# The order is the order of the messages: the fleet's own rules, then the planner's, then the pipeline's,
# then whether each cell can be deployed and run on AWS (inference_fleet.cell_checks).
CHECKS: tuple[FleetCheck, ...] = (
    _check_model, _check_model_name, _check_unit, _check_cells, _check_waves, _check_verify_gate, _check_serving,
    _check_frontend,
    check_wave_sizes,
    check_cells_deployable, check_startup_budget, check_alarm_defaults, check_quarantine,
    check_spares_in_fixed_cells, check_efa_installer_pin, check_routers, check_pipeline_evacuation,
    check_compile_azs, check_compile_image, check_compile_sdk, check_compile_dtype, check_artifacts_kms_key,
)
# Run only when the model and the unit passed (validate_fleet): the planner computes its plan from both, and the
# compile host's need (compile_job.host_needs) reads the unit's instance type.
DERIVED_CHECKS: tuple[FleetCheck, ...] = (check_fit, check_compile_host)
