"""The inference image's Dockerfile, read as Docker reads it: the instructions its final stage ends with."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[1] / "Dockerfile"
# The base image's last line (aws-neuron/deep-learning-containers@1424d186d24085df0234d3c7e1be9223b5191a2f
# vllm/inference/0.16.0/Dockerfile.neuronx): what an image built FROM it runs unless it says otherwise.
BASE_HEALTHCHECK = "HEALTHCHECK CMD curl --fail http://localhost:8080/ping || exit 1"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comment lines dropped (also inside a continued instruction, as
    Docker does), lines ending in the escape character `\\` joined with the next. No parser directive in
    this file changes the escape character (its only one is `syntax`)."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return result


def final_stage(steps: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (keyword, _) in enumerate(steps) if keyword == "FROM"]
    assert starts, "no FROM"
    return steps[starts[-1]:]


def test_the_parser_reads_continuations_comments_and_stages():
    text = "FROM a AS b\nRUN x \\\n  # note\n  && y\nFROM b\nhealthcheck --interval=5s \\\n CMD true\n"
    assert final_stage(instructions(text)) == [("FROM", "b"), ("HEALTHCHECK", "--interval=5s  CMD true")]
    assert instructions(BASE_HEALTHCHECK)[0] == ("HEALTHCHECK", BASE_HEALTHCHECK.removeprefix("HEALTHCHECK "))


def test_the_image_turns_off_the_base_images_health_check():
    """The Neuron vLLM DLC's HEALTHCHECK curls localhost:8080/ping. ECS gives a container a Docker health check
    only from its task definition, so without `HEALTHCHECK NONE` the leader's engine container curled the
    proxy's data port every 30 s (a 404 counted as a request) and a follower's drain guard showed unhealthy.
    Only the last HEALTHCHECK counts (Docker's reference: "If you list more than one then only the last
    HEALTHCHECK will take effect")."""
    stage = final_stage(instructions(DOCKERFILE.read_text()))
    checks = [args for keyword, args in stage if keyword == "HEALTHCHECK"]
    assert checks, f"no HEALTHCHECK: the image inherits the base image's `{BASE_HEALTHCHECK}`"
    assert re.fullmatch(r"NONE", checks[-1], re.IGNORECASE), f"the image's health check is {checks[-1]!r}, not NONE"
