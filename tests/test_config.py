"""Fleet file validation: every class of mistake fails before synthesis, naming field, value and what is allowed."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from inference_fleet import cli, compile_job, config, exit_codes
from inference_fleet.checks import fleet_warnings, load_fleet, parse_fleet, placeholder_warnings, vpc_quota_warnings
from inference_fleet.config import DEFAULT_CONFIG, ConfigError, ConfigIssue, parse_model, read_fleet_file
from inference_fleet.reference import markdown
from inference_fleet.simulation.scenario import ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def raw() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG.read_text())


def second_cell(raw: dict, **changes: object) -> dict:
    cell = copy.deepcopy(raw["cells"][0])
    cell.update({"name": "dev2", "vpc_cidr": "10.11.0.0/16", **changes})
    return cell


def error_of(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_fleet(data, "test.yaml")
    return caught.value


def test_default_config_is_valid() -> None:
    fleet = load_fleet(None)
    assert [c.name for c in fleet.cells] == ["dev"]
    assert fleet.unit.nodes == 2 and fleet.unit.instance_type == "trn2.48xlarge"
    assert fleet.unit.tp == 128  # 2 nodes x 64 logical NeuronCores at LNC=2


def test_unknown_instance_type_names_the_field_and_the_allowed_types(raw: dict) -> None:
    raw["unit"]["instance_type"] = "p5.48xlarge"
    error = error_of(raw)
    assert "unit.instance_type = 'p5.48xlarge'" in str(error)
    assert "trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge, trn2u.48xlarge" in str(error)


def test_tensor_parallel_must_span_the_unit(raw: dict) -> None:
    raw["unit"]["tensor_parallel_degree"] = 64
    error = error_of(raw)
    assert "unit.tensor_parallel_degree = 64" in str(error)
    assert "nodes (2) x logical NeuronCores per node (64) = 128" in str(error)


def test_context_parallel_must_divide_the_unit_cores(raw: dict) -> None:
    raw["unit"]["context_parallel_degree"] = 3
    error = error_of(raw)
    assert "unit.context_parallel_degree = 3" in str(error)
    assert "divisors of 128: [1, 2, 4, 8, 16, 32, 64, 128]" in str(error)


def test_lnc2_is_refused_on_trn1(raw: dict) -> None:
    raw["unit"].update(instance_type="trn1.32xlarge", logical_nc_config=2)
    error = error_of(raw)
    assert "unit.logical_nc_config = 2" in str(error)
    assert "trn1.32xlarge supports logical NeuronCore sizes [1]" in str(error)


def test_duplicate_cell_names(raw: dict) -> None:
    raw["cells"].append(second_cell(raw, name="dev"))
    raw["waves"].append({"name": "rest"})
    raw["cells"][1]["wave"] = "rest"
    error = error_of(raw)
    assert "cells[1].name = 'dev': duplicate of cells[0].name" in str(error)


def test_overlapping_cidrs_in_one_account_and_region(raw: dict) -> None:
    raw["waves"].append({"name": "rest"})
    raw["cells"].append(second_cell(raw, vpc_cidr="10.10.128.0/17", wave="rest"))
    error = error_of(raw)
    assert "cells[1].vpc_cidr = '10.10.128.0/17'" in str(error)
    assert "overlaps cells[0].vpc_cidr 10.10.0.0/16 (dev) in 111111111111/us-east-2" in str(error)


def test_same_cidr_in_another_region_is_allowed(raw: dict) -> None:
    raw["waves"].append({"name": "rest"})
    raw["cells"].append(
        second_cell(raw, vpc_cidr="10.10.0.0/16", wave="rest", region="us-west-2", trainium_az="us-west-2a")
    )
    assert len(parse_fleet(raw).cells) == 2


def test_wave_without_cells(raw: dict) -> None:
    raw["waves"].append({"name": "empty", "bake_minutes": 30})
    error = error_of(raw)
    assert "waves[1] = 'empty': wave has no cells" in str(error)


def test_canary_wave_holds_one_cell(raw: dict) -> None:
    raw["cells"].append(second_cell(raw))
    error = error_of(raw)
    assert "waves[0] = 'canary': the first wave is the canary and holds exactly one cell, not 2" in str(error)


def test_cell_of_unknown_wave(raw: dict) -> None:
    raw["cells"][0]["wave"] = "nope"
    assert "cells[0].wave = 'nope': no such wave; waves: ['canary']" in str(error_of(raw))


def test_missing_field_names_its_path(raw: dict) -> None:
    del raw["cells"][0]["vpc_cidr"]
    assert "cells[0].vpc_cidr = None: Field required" in str(error_of(raw))


def test_misspelt_field_is_refused(raw: dict) -> None:
    raw["unit"]["node"] = 2
    assert "unit.node = 2: unknown field: did you mean nodes?" in str(error_of(raw))


def test_an_unknown_field_far_from_any_lists_the_allowed_ones(raw: dict) -> None:
    """A newcomer's walkthrough (thirty-second session): the message named no field, so a user had to go to the
    reference to learn what the place takes."""
    raw["cells"][0]["zzz"] = 1
    message = str(error_of(raw))
    assert "cells[0].zzz = 1: unknown field: allowed here: " in message and "trainium_az" in message


@pytest.mark.parametrize(("where", "value", "words"), [
    ("cells", {"name": "dev"}, "cells = {'name': 'dev'}: a list is needed (YAML: one `- item` line each"),
    ("model", 5, "model = 5: a mapping of fields is needed (YAML: one `name: value` line each"),
])
def test_a_value_of_the_wrong_shape_says_the_yaml_shape_needed(raw: dict, where: str, value: object,
                                                               words: str) -> None:
    """pydantic said "Input should be a valid tuple" or "a valid dictionary or instance of ModelConfig"."""
    raw[where] = value
    assert words in str(error_of(raw))


def test_bad_pattern_says_what_is_allowed(raw: dict) -> None:
    raw["cells"][0]["account"] = "1234"
    error = str(error_of(raw))
    assert "cells[0].account = '1234'" in error and "^[0-9]{12}$" in error


def test_trainium_az_must_be_in_the_cell_region(raw: dict) -> None:
    raw["cells"][0]["trainium_az"] = "us-west-2a"
    assert "cells[0].trainium_az = 'us-west-2a': must be an AZ of region us-east-2" in str(error_of(raw))


@pytest.mark.parametrize(("max_seq_len", "refused"), [(131_072, False), (131_584, True), (1_048_576, True)])
def test_max_seq_len_stays_within_what_the_neuron_scheduler_takes_in_one_step(
    raw: dict, max_seq_len: int, refused: bool
) -> None:
    """vllm-neuron fixes the token budget at 131072 with chunked prefill off: a longer prompt would wait for ever
    and hold every running request of the unit, so the fleet refuses such a context, saying why and what fits.
    (131584: the next length above the limit that is a multiple of 128 x cp, so no other rule names the field.)"""
    raw["model"]["max_seq_len"] = max_seq_len
    try:
        parse_fleet(raw, "test.yaml")
        found = []
    except ConfigError as error:
        found = [issue for issue in error.issues if issue.path == "model.max_seq_len"]
    assert bool(found) == refused
    if refused:
        (issue,) = found
        assert issue.value == max_seq_len and "allowed: 128 to 131072" in issue.problem
        assert "max_num_batched_tokens" in issue.problem and "chunked prefill off" in issue.problem


def test_every_mistake_is_reported_at_once(raw: dict) -> None:
    raw["unit"]["context_parallel_degree"] = 3
    raw["cells"][0]["wave"] = "nope"
    issues = error_of(raw).issues
    assert {i.path for i in issues} >= {"unit.context_parallel_degree", "cells[0].wave"}


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("name: Rufus\nunit: [\n")
    with pytest.raises(ConfigError, match=r"<yaml> = 'line 3, column 1'"):
        load_fleet(bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_fleet(tmp_path / "absent.yaml")


def test_app_refuses_a_bad_fleet_before_synthesis(raw: dict, tmp_path: Path) -> None:
    """`cdk synth -c config=...` runs app.py with the context in CDK_CONTEXT_JSON; nothing is written."""
    raw["unit"]["data_parallel_degree"] = 5
    fleet_file = tmp_path / "bad.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))
    outdir = tmp_path / "out"
    env = {**os.environ, "CDK_CONTEXT_JSON": json.dumps({"config": str(fleet_file)}), "CDK_OUTDIR": str(outdir)}
    result = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3  # a refused fleet file (inference_fleet/exit_codes.py), as the CLI
    assert "unit.data_parallel_degree = 5" in result.stderr
    assert not list(outdir.glob("*.template.json"))


def test_a_triton_fleet_keeps_its_pipeline_verify_gate():
    """The kit speaks Triton's KServe v2 generate on a Triton cell (inference_fleet/verify/serving_client.py), so
    the gate (pipeline.verify_gate, true by default) is allowed with serving.frontend: triton. It was refused
    while the kit spoke only the OpenAI API, which a Triton unit's proxy answers 404 (362c8e1); changed on purpose."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.setdefault("serving", {})["frontend"] = "triton"
    fleet = parse_fleet(data, "test")
    assert fleet.pipeline is not None and fleet.pipeline.verify_gate is True
    assert fleet.serving.frontend == "triton"


def test_triton_front_end_runs_on_the_built_image_and_refuses_a_pinned_image_without_tritonserver():
    """The image built from containers/inference has Triton (issue 28): frontend triton is accepted for it. A
    pinned image is refused unless the fleet states it has tritonserver: refused at load, not crash-looping."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.setdefault("serving", {})["frontend"] = "triton"
    assert parse_fleet(data, "test").serving.frontend == "triton"
    data["cells"][0]["images"] = {"inference": "111111111111.dkr.ecr.us-east-2.amazonaws.com/triton@sha256:" + "a" * 64}
    with pytest.raises(ConfigError) as caught:
        parse_fleet(data, "test")
    (issue,) = caught.value.issues
    assert issue.path == "cells[0].images.inference_has_tritonserver"
    assert "pins the inference image" in issue.problem and "frontend: openai" in issue.problem
    data["cells"][0]["images"]["inference_has_tritonserver"] = True
    assert parse_fleet(data, "test").serving.frontend == "triton"


@pytest.mark.parametrize("name", ["meta-llama/..", "meta-llama/.", "/", "meta-llama/Llama 3", "meta-llama/-x"])
def test_a_triton_fleet_refuses_a_model_name_that_is_no_triton_model_directory(raw: dict, name: str) -> None:
    """With serving.frontend: triton the last path part of model.name is the Triton model's directory in the model
    repository (unit_launcher.plan.triton_model_name). Until the thirty-fourth session's defect hunt only its length
    was checked: 'meta-llama/..' deployed, the launcher wrote config.pbtxt outside the repository and the unit never
    formed. Refused on load now, naming model.name and what is allowed; the OpenAI front end takes the name as is."""
    raw["model"]["name"] = name
    raw.setdefault("serving", {})["frontend"] = "triton"
    (issue,) = error_of(raw).issues
    assert issue.path == "model.name" and issue.value == name
    assert "with serving.frontend: triton" in issue.problem
    assert "allowed: 1 to 255 ASCII letters, digits, '.', '_' and '-', not starting with '.' or '-'" in issue.problem
    raw["serving"]["frontend"] = "openai"
    assert parse_fleet(raw, "test").model.name == name


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B", "gpt2"])
def test_a_triton_fleet_serves_hugging_face_names(raw: dict, name: str) -> None:
    raw["model"]["name"] = name
    raw.setdefault("serving", {})["frontend"] = "triton"
    assert parse_fleet(raw, "test").model.name == name


@pytest.mark.parametrize(("name", "folder"), [(".", "/opt/models/."), ("..", "/opt/models/.."),
                                              (".instance-store", "/opt/models/.instance-store")])
@pytest.mark.parametrize("frontend", ["openai", "triton"])
def test_a_model_name_starting_with_a_dot_is_refused_on_every_front_end(raw: dict, name, folder, frontend) -> None:
    """The node's copy of the model is /opt/models/<model.name, '/' as '--'> (unit_spec.build_unit_spec) on either
    front end: '..' put it off the cache volume, '.' on the cache's root, '.instance-store' on the cache's marker
    file. Found while fixing the Triton name defect of the thirty-fourth session's hunt; refused on load now."""
    raw["model"]["name"] = name
    raw.setdefault("serving", {})["frontend"] = frontend
    (issue,) = error_of(raw).issues
    assert issue.path == "model.name" and f"starts with '.': the node's copy of the model, {folder}," in issue.problem
    assert "allowed: a name that starts with a letter, digit or '_'" in issue.problem


@pytest.mark.parametrize(("name", "said"), [
    ("meta-llama/Llama\x00-3", "holds '\\x00' (U+0000), a control or invisible character"),
    ("meta-llama/Llama-3\nInstruct", "holds '\\n' (U+000A), a control or invisible character"),
    ("Llama\t3", "holds '\\t' (U+0009)"),
    ("Llama\u200b3", "holds '\\u200b' (U+200B)"),
    ("\U0001F999" * 200, "would be a name of 800 bytes in UTF-8, longer than Linux allows (NAME_MAX)"),
    ("\u00e9" * 128, "would be a name of 256 bytes in UTF-8"),
    ("a/" * 85 + "b", "would be a name of 256 bytes in UTF-8"),  # each '/' is the folder's '--'
])
@pytest.mark.parametrize("frontend", ["openai", "triton"])
def test_a_model_name_no_engine_command_line_or_cache_folder_takes_is_refused(raw: dict, name: str, said: str,
                                                                              frontend: str) -> None:
    """Regression (thirty-seventh session): model.name took NUL, newlines and 200 four-byte characters (only its
    length in characters was checked). It is the engine's --served-model-name=NAME (an argv string holds no NUL) and
    the cache folder /opt/models/<NAME, '/' as '--'> (255 bytes, NAME_MAX): refused on load, on either front end."""
    raw["model"]["name"] = name
    raw.setdefault("serving", {})["frontend"] = frontend
    (issue,) = error_of(raw).issues
    assert issue.path == "model.name" and issue.value == name
    assert said in issue.problem and "allowed: printable characters" in issue.problem, issue.problem


@pytest.mark.parametrize("name", ["\u00e9" * 127 + "x", "a/" * 84 + "bcd", "my model v2", "Llama-3-\u00fcber"])
def test_a_model_name_of_printable_characters_whose_folder_fits_is_served(raw: dict, name: str) -> None:
    raw["model"]["name"] = name
    assert len(name.replace("/", "--").encode()) <= 255
    assert parse_fleet(raw, "test").model.name == name


def test_the_fleet_file_and_the_launcher_refuse_a_model_name_by_one_rule(raw: dict) -> None:
    """The launcher's spec (a spec written by hand) applies the fleet file's model.name rule: one function, kept in
    unit_launcher/spec.py because the fleet code imports the launcher's rules and never the other way
    (tests/test_import_graph.py); both say the nodes' cache the same."""
    from unit_launcher import spec

    from inference_fleet import checks, unit_spec

    assert checks.model_name_problem is spec.model_name_problem
    assert unit_spec.MODEL_CACHE_PATH == spec.MODEL_CACHE
    raw["model"]["name"] = "Llama\x003"
    (issue,) = error_of(raw).issues
    assert issue.problem == spec.model_name_problem("Llama\x003")


def test_a_new_efa_installer_version_needs_its_own_checksum() -> None:
    """Pinning another installer version while keeping the default's SHA-256 would fail every node's setup
    (checksum mismatch at boot); refused at load, naming node.efa_installer_sha256."""
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["node"] = {"efa_installer_version": "1.43.2"}
    with pytest.raises(ConfigError) as caught:
        parse_fleet(data, "test")
    (issue,) = [i for i in caught.value.issues if i.path == "node.efa_installer_sha256"]
    assert "aws-efa-installer-1.43.2.tar.gz" in issue.problem and "null" in issue.problem
    data["node"]["efa_installer_sha256"] = "b" * 64
    assert parse_fleet(data, "test").node.efa_installer_sha256 == "b" * 64
    data["node"]["efa_installer_sha256"] = None
    assert parse_fleet(data, "test").node.efa_installer_sha256 is None


def test_a_removed_field_says_what_replaced_it_not_to_check_the_spelling() -> None:
    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.setdefault("serving", {})["deregistration_delay_seconds"] = 120
    with pytest.raises(ConfigError) as caught:
        parse_fleet(data)
    (issue,) = caught.value.issues
    assert issue.path == "serving.deregistration_delay_seconds"
    assert "serving.drain_timeout_seconds" in issue.problem and "spelling" not in issue.problem


def test_a_path_under_a_directory_that_cannot_be_searched_is_refused_alike(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: Path.is_file raised the stat's EACCES (a parent the user cannot search; seen as user nobody under a
    # chmod 000 directory: "input/output failed", exit 8). Faked here since the tests may run as root, whom a mode
    # does not stop. The fleet file and a scenario file are refused by the same function, with the same words.
    locked = tmp_path / "locked" / "fleet.yaml"
    real_stat = Path.stat

    def stat(path: Path, **kwargs: object) -> os.stat_result:
        if path == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_stat(path, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    said = "the path cannot be examined (Permission denied: a directory on it cannot be searched by this user)"
    with pytest.raises(ConfigError) as caught:
        read_fleet_file(locked)
    assert [(issue.path, issue.problem) for issue in caught.value.issues] == [("<file>", said)]
    with pytest.raises(ScenarioError, match=re.escape(f"cannot read the scenario file: {said}; give a scenario")):
        load_scenario(locked)


def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path: Path) -> None:
    # Regression: a directory or a FIFO given as --config was reported as "no such file".
    fifo = tmp_path / "fleet.fifo"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling.yaml"
    dangling.symlink_to(tmp_path / "gone.yaml")
    for path, said in ((tmp_path, "is a directory; give the fleet file"),
                       (fifo, "is a named pipe (FIFO), not a regular file"),
                       (dangling, "is a symbolic link to nothing (dangling)"),
                       (tmp_path / "absent.yaml", "no such file")):
        with pytest.raises(ConfigError) as caught:
            read_fleet_file(path)
        assert [(issue.path, issue.problem.split(";")[0]) for issue in caught.value.issues] == [
            ("<file>", said.split(";")[0])], path


PLACEHOLDER_FIELDS = ["model.artifacts_s3_uri", "cells[0].account", "pipeline.account", "pipeline.connection_arn"]


def test_the_example_fleets_placeholder_account_is_a_warning_naming_each_field(raw: dict) -> None:
    # A fresh account's `cdk deploy` of the example fleet names an account that is not the user's: the fleet still
    # loads (make synth runs offline on it), and each field holding 111111111111 is named with what to set.
    warnings = placeholder_warnings(parse_fleet(raw))
    assert [w.path for w in warnings] == PLACEHOLDER_FIELDS
    fixes = {w.path: w.problem for w in warnings}
    assert "set your AWS account ID" in fixes["cells[0].account"]
    assert "set your AWS account ID" in fixes["pipeline.account"]
    assert "a bucket you created" in fixes["model.artifacts_s3_uri"]
    assert "CodeConnections connection you created" in fixes["pipeline.connection_arn"]
    assert all("docs/deploying.md, step 0" in w.problem for w in warnings)


def test_a_fleet_of_ones_own_account_has_no_placeholder_warning(raw: dict) -> None:
    own = yaml.safe_load(DEFAULT_CONFIG.read_text().replace("111111111111", "210987654321"))
    assert placeholder_warnings(parse_fleet(own)) == []
    raw["waves"].append({"name": "rest"})
    raw["cells"].append(second_cell(raw, account="210987654321", wave="rest"))
    assert [w.path for w in placeholder_warnings(parse_fleet(raw))] == PLACEHOLDER_FIELDS


def test_twelve_ones_inside_an_image_digest_are_not_the_placeholder_account(raw: dict) -> None:
    # tests/fleets/pipeline_large.yaml pins images of accounts 222222222222 and 333333333333 by digests of 1s:
    # each was warned about as "the example fleet's placeholder account 111111111111".
    own = yaml.safe_load(DEFAULT_CONFIG.read_text().replace("111111111111", "210987654321"))
    digest = "sha256:" + "1" * 64
    own["cells"][0]["images"] = {"inference": f"210987654321.dkr.ecr.us-east-2.amazonaws.com/rufus/inference@{digest}",
                                 "proxy": f"210987654321.dkr.ecr.us-east-2.amazonaws.com/rufus/proxy@{digest}"}
    assert placeholder_warnings(parse_fleet(own)) == []
    own["cells"][0]["images"]["proxy"] = f"111111111111.dkr.ecr.us-east-2.amazonaws.com/rufus/proxy@{digest}"
    assert [w.path for w in placeholder_warnings(parse_fleet(own))] == ["cells[0].images.proxy"]


@pytest.mark.parametrize("placeholder", [True, False], ids=["placeholder", "own-account"])
def test_validate_prints_the_placeholder_warnings_and_still_accepts(tmp_path: Path, placeholder: bool) -> None:
    fleet = tmp_path / "fleet.yaml"
    text = DEFAULT_CONFIG.read_text()
    fleet.write_text(text if placeholder else text.replace("111111111111", "210987654321"))
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "validate", "--config", str(fleet)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "Rufus-Cell-dev:" in done.stdout
    named = [line.split(" = ")[0] for line in done.stderr.splitlines() if "placeholder account 111111111111" in line]
    assert named == ([f"warning: {path}" for path in PLACEHOLDER_FIELDS] if placeholder else [])


def test_more_vpcs_or_nat_addresses_than_an_accounts_default_quotas_is_a_warning_before_deploy() -> None:
    """Each cell, router and the compile stack creates a VPC (each cell one NAT gateway with an Elastic IP): five
    cells in one account and region are six VPCs with the compile stack, seven with the default VPC, over the
    default quota of 5, a VpcLimitExceeded after the earlier stacks deployed. Warned at validate and synth."""
    fleet = load_fleet(str(ROOT / "tests" / "fleets" / "fleet20.yaml"))
    warnings = {w.path: w.problem for w in vpc_quota_warnings(fleet)}
    assert "6 VPCs (cell c00, cell c04, cell c08, cell c12, cell c16, the compile stack), 7 with the account's " \
           "default VPC" in warnings["111111111111/us-east-2"]
    assert "5 VPCs per Region" in warnings["111111111111/us-west-2"]
    assert vpc_quota_warnings(load_fleet(str(DEFAULT_CONFIG))) == []
    assert [w.path for w in fleet_warnings(fleet)][-4:] == [
        "111111111111/ap-northeast-1", "111111111111/us-east-1", "111111111111/us-east-2", "111111111111/us-west-2"]


# -- Serving ports a node already uses (found by a defect hunt, thirty-third session) --------------------------------

SERVING_PORTS = ("engine_port", "proxy_port", "rendezvous_port", "master_port", "neuron_rt_port")


def serving_port_issue(raw: dict, **serving: object) -> ConfigIssue:
    raw["serving"] = serving
    (issue,) = error_of(raw).issues
    return issue


@pytest.mark.parametrize("field", SERVING_PORTS)
def test_a_triton_fleet_refuses_tritons_metrics_port_on_the_serving_field(raw: dict, field: str) -> None:
    """The launcher serves Triton's metrics on 8002 of the leader (unit_spec engine.triton_metrics_port); a serving
    port there made `validate`, `plan` and `cdk synth` raise the launcher's SpecError (a traceback, exit 1) naming
    engine.* keys. Refused on the serving.* field; with frontend openai 8002 is free."""
    issue = serving_port_issue(raw, frontend="triton", **{field: 8002})
    assert issue.path == f"serving.{field}"
    assert "Triton's metrics listener" in issue.problem
    assert ("allowed: 1024 to 32767 or 61000 to 65535, except 2375-2376, 8002, 8081, 51678-51680 (with frontend "
            "triton)" in issue.problem)
    raw["serving"]["frontend"] = "openai"
    assert getattr(parse_fleet(raw, "test").serving, field) == 8002


def test_validate_exits_3_without_a_traceback_for_tritons_metrics_port(tmp_path: Path, raw: dict, capsys) -> None:
    raw["serving"] = {"frontend": "triton", "engine_port": 8002}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["validate", "--config", str(path)]) == exit_codes.CONFIG
    err = capsys.readouterr().err
    assert "serving.engine_port = 8002: taken on every node by Triton's metrics listener" in err
    assert "Traceback" not in err and "engine.triton_metrics_port = 8002" not in err  # not in the launcher's words


def test_a_unit_spec_the_launcher_refuses_is_a_config_error(raw: dict, tmp_path: Path, capsys, monkeypatch) -> None:
    """Any refusal of the launcher's model (unit_launcher.spec.SpecError) that the fleet checks do not hold is a
    ConfigError from compile_job.unit_spec, so it cannot escape validate as a traceback: shown by taking Triton's
    port off the fleet's list, which leaves the launcher's own rule to refuse it."""
    raw["serving"] = {"frontend": "triton", "engine_port": 8002}
    with pytest.raises(ConfigError) as caught:
        compile_job.unit_spec(parse_model(raw, "test"))
    (issue,) = caught.value.issues
    assert issue.path == "<unit spec>"
    assert "engine.triton_metrics_port = 8002: same as engine.port" in issue.problem
    monkeypatch.setattr(config, "TRITON_PORTS", {})
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["validate", "--config", str(path)]) == exit_codes.CONFIG
    assert "<unit spec> = 'dev/u0': the launcher (unit_launcher/spec.py) refuses" in capsys.readouterr().err


@pytest.mark.parametrize("field", SERVING_PORTS)
def test_a_serving_port_on_the_proxys_admin_port_is_refused(raw: dict, field: str) -> None:
    issue = serving_port_issue(raw, **{field: 8081})
    assert issue.path == f"serving.{field}"
    assert "the unit proxy's admin listener" in issue.problem
    assert ("allowed: 1024 to 32767 or 61000 to 65535, except 2375-2376, 8081, 51678-51680 (with frontend openai)"
            in issue.problem)


def test_the_proxy_admin_port_on_the_list_is_the_one_every_proxy_listens_on(raw: dict) -> None:
    """The list reads the proxy's default (the cell stack never sets PROXY_ADMIN_PORT), and the proxy started as the
    cell stack starts it (stacks/cell_stack.py `proxy_environment`) with PROXY_PORT on it refuses to start: the
    fleet accepted proxy_port 8081 before, and every unit's proxy then exited."""
    from unit_proxy.settings import Settings, SettingsError

    assert config.PROXY_ADMIN_PORT == 8081 == Settings().admin_port
    fleet = parse_fleet(raw, "test")
    env = {"PROXY_PORT": str(config.PROXY_ADMIN_PORT), "FRONTEND": fleet.serving.frontend,
           "UPSTREAM_URL": f"http://127.0.0.1:{fleet.serving.engine_port}"}
    with pytest.raises(SettingsError, match="PROXY_ADMIN_PORT"):
        Settings.from_env(env)


@pytest.mark.parametrize("field", SERVING_PORTS)
@pytest.mark.parametrize("port", [2375, 2376, 51678, 51679, 51680])
def test_a_serving_port_ecs_reserves_on_every_container_instance_is_refused(raw: dict, field: str, port: int) -> None:
    """ECS reserves 22, 2375, 2376 and 51678-51680 on every container instance (PortMapping.hostPort): a unit task
    mapping one (proxy, rendezvous, engine ports) is never placed, and the agent listens on 51678 and 51679."""
    issue = serving_port_issue(raw, **{field: port})
    assert issue.path == f"serving.{field}"
    assert "reserved by ECS on every container instance" in issue.problem


@pytest.mark.parametrize("field", SERVING_PORTS)
@pytest.mark.parametrize("port", [32768, 40000, 60999])
def test_a_serving_port_in_linuxs_ephemeral_range_is_refused(raw: dict, field: str, port: int) -> None:
    """The cold review of the port rule (helper-186): the same ECS page says not to map a host port in the ephemeral
    range (32768-60999, Linux's default): every outbound socket of a host-network node takes its local port from
    there, so a listener may find its port held. Old code: accepted (DID NOT RAISE)."""
    issue = serving_port_issue(raw, **{field: port})
    assert issue.path == f"serving.{field}"
    assert "ephemeral port range 32768-60999" in issue.problem
    assert "allowed: 1024 to 32767 or 61000 to 65535" in issue.problem


def test_the_ports_next_to_the_ephemeral_range_are_accepted(raw: dict) -> None:
    fleet = parse_fleet({**raw, "serving": {**raw.get("serving", {}), "proxy_port": 32767, "master_port": 61000}}, "t")
    assert (fleet.serving.proxy_port, fleet.serving.master_port) == (32767, 61000)


def test_the_serving_ports_rule_is_in_the_reference() -> None:
    text = markdown()
    for field in SERVING_PORTS:
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{field}` |")]
        assert "Not 2375-2376, 8081, 51678-51680 (taken on every node), not 8002 with frontend triton" in row
        assert "not 32768-60999 (Linux's ephemeral ports)" in row
