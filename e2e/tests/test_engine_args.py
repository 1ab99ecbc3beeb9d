"""Rendered engine commands against the installed vLLM's own `vllm serve` parser.

Needs the engine environment (`.e2e/venv`, built by `make e2e` or `e2e/setup_env.py`);
without it the test is skipped here and the same check runs as step 0 of `make e2e`,
which CI runs after `make test`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(E2E))

from harness import ENGINE_PYTHON  # noqa: E402
from unit_mode import neuron_platform_problem, rendered_plans  # noqa: E402

# Both tests read one run of check_engine_args.py (importing vLLM is most of its time), once per xdist worker.
pytestmark = pytest.mark.skipif(not ENGINE_PYTHON.exists(), reason="no .e2e/venv: checked by make e2e step 0")


@pytest.fixture(scope="module")
def vllm_answers() -> tuple[list, dict]:
    """The rendered plans, and vLLM's parse of each with its serve parser's option table, from one process."""
    from inference_fleet.checks import load_fleet
    from inference_fleet.unit_spec import build_unit_spec

    fleet = load_fleet(None)
    spec = build_unit_spec(fleet, fleet.cells[0], 0, revision="t")
    spec["engine"].update(device="cpu", tensor_parallel_size=2)
    plans = rendered_plans(spec)
    done = subprocess.run([str(ENGINE_PYTHON), str(E2E / "check_engine_args.py"), "--with-options"],
                          input=json.dumps([p.argv for _, p in plans]), capture_output=True, text=True,
                          timeout=600, check=True)
    return plans, json.loads(done.stdout)


def test_neuron_and_cpu_commands_parse_as_planned(vllm_answers) -> None:
    plans, answers = vllm_answers
    for (name, node), got in zip(plans, answers["parsed"], strict=True):
        assert "error" not in got, (name, got)
        for key in ("tensor_parallel_size", "nnodes", "node_rank", "master_addr", "max_num_seqs", "max_model_len"):
            if key in node.engine_args:
                assert got[key] == node.engine_args[key], (name, key)
        assert got["headless"] == ("--headless" in node.argv), name
        if not name.startswith("cpu "):
            # What the Neuron platform hook does with the parsed arguments: no assertion, contiguous KV layout.
            assert neuron_platform_problem(got) is None, (name, neuron_platform_problem(got))
            assert got["enable_prefix_caching"] is False, name


def test_extra_args_are_refused_exactly_for_the_options_the_launcher_renders(vllm_answers) -> None:
    """Every option string of the installed vLLM's `vllm serve` parser that sets one of the launcher's rendered
    options (or disable_log_stats, or config: a config file) is refused in engine.extra_args (its short forms
    included), and no other is (no real option is taken for an abbreviation of a launcher's).
    `--no-disable-log-stats` turns stats on: allowed."""
    from unit_launcher.spec import CONFIG_FILE_ARG, LAUNCHER_ARGS, STATS_OFF_ARG, extra_arg_options

    dests = {n.replace("-", "_") for n in LAUNCHER_ARGS | {STATS_OFF_ARG, CONFIG_FILE_ARG}}
    table = vllm_answers[1]["options"]
    expected = {o for o, dest in table if dest in dests} - {"--no-" + STATS_OFF_ARG}
    assert {o for o, _ in table if extra_arg_options(o)} == expected
    assert {n.replace("-", "_") for n in LAUNCHER_ARGS} <= {dest for _, dest in table}
