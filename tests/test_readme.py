"""The README and docs/ stay true and reachable.

The fleet reference in docs/fleet-reference.md is the one generated from the config models;
the README stays short, shows the two commands and links every page of docs/; every
relative link of the README and docs/ points at a file (and heading) that exists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from inference_fleet.checks import load_fleet
from inference_fleet.reference import BEGIN, END, markdown
from tests.conftest import pin_images, synth_fleet

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FLEETS = ROOT / "tests" / "fleets"
FLEET_REFERENCE = DOCS / "fleet-reference.md"
README_MAX_LINES = 250

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_fleet_reference_matches_the_models() -> None:
    text = FLEET_REFERENCE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == markdown(), (
        "run `python -m inference_fleet reference` and paste it into docs/fleet-reference.md"
    )


def test_readme_shows_the_two_commands() -> None:
    text = README.read_text()
    assert "make synth" in text and "make test" in text


def test_readme_is_short_and_links_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {target for target in _LINK.findall(text)}
    missing = [f"docs/{page.name}" for page in sorted(DOCS.glob("*.md")) if f"docs/{page.name}" not in linked]
    assert not missing, f"README does not link {missing}"


def _anchor(heading: str) -> str:
    # GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The heading ids of a page as GitHub makes them: headings inside fenced code are not
    headings, and a repeated heading gets -1, -2 ... appended."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^#{1,6} ", line):
            base = _anchor(line.lstrip("#").replace("`", ""))
            anchor, n = base, 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return anchors


def _pages() -> list[Path]:
    packages = sorted(ROOT.glob("containers/*/README.md"))
    return [README, *sorted(DOCS.glob("*.md")), *packages, ROOT / "e2e" / "README.md"]


# A path in backquotes that climbs out of its folder and names a Markdown file (`../x/y.md`).
_CLIMBING_PATH = re.compile(r"`(\.\./[\w./-]+\.md)`")


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in _pages():
        text = page.read_text()
        for target in _LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto: ...
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {target} (outside the repository)")
            elif not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
        for path in _CLIMBING_PATH.findall(text):
            resolved = (page.parent / path).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: `{path}` (not a file of the repository)")
    assert not broken, broken


def test_the_anchor_rules_are_githubs() -> None:
    page = DOCS / "rollout-pipeline.md"
    assert "what-the-accounts-need-bootstrap-trust" in _anchors(page)
    assert "why-aws_codepipelinepipeline-v2-and-not-cdk-pipelines" in _anchors(page)


# -- the README's commands run as written ---------------------------------------------------------

# Commands of the README's ```bash blocks that this test runs (fast, offline, after `make setup`).
RUN = (r"make help", r"make validate( CONFIG=\S+)?", r"make plan(-rollout)?( CONFIG=\S+)?",
       r"\.venv/bin/python -m inference_fleet .*")
# Commands it does not run, and why.
SKIP = {
    r"make synth.*": "several minutes of synth and cfn-lint; tests/test_snapshots.py and test_cfn_lint.py "
                     "synthesize the same app",
    r"make test": "the whole suite, of which this test is part",
    r"make e2e.*": "12-13 minutes and the local torch wheel; CI runs it",
    r"make bench.*": "benchmarks take minutes and install nginx and wrk",
    r"npx cdk (deploy|bootstrap) .*": "calls AWS",
}


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def readme_commands() -> list[str]:
    commands = []
    for block in _bash_blocks(README.read_text()):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def test_every_readme_command_is_run_or_skipped_with_a_reason() -> None:
    unknown = [c for c in readme_commands()
               if not any(re.fullmatch(p, c) for p in (*RUN, *SKIP))]
    assert not unknown, f"add these README commands to RUN or SKIP in {Path(__file__).name}: {unknown}"
    assert any(re.fullmatch(RUN[0], c) for c in readme_commands()), "the README shows `make help`"


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command: str) -> None:
    reason = next((why for pattern, why in SKIP.items() if re.fullmatch(pattern, command)), None)
    if reason is not None:
        pytest.skip(f"not run here: {reason}")
    if not any(re.fullmatch(p, command) for p in RUN):
        pytest.fail(f"{command!r} is neither in RUN nor in SKIP: classify it before it runs")
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": _path_outside_the_venv()}, check=False)
    assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr and done.stdout.strip()


def _path_outside_the_venv() -> str:
    """PATH as on a fresh shell: nothing of the repository (no activated .venv)."""
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not Path(p).resolve().is_relative_to(ROOT))


# Commands named in running text: `make X`, `npx cdk ...`, `cdk ...`, `python -m M`, `.venv/bin/python -m M`.
_INLINE = re.compile(r"`((?:make|npx|cdk|python3?|\.venv/bin/python) [^`]*)`")


def _inline_problem(command: str) -> str | None:
    """Why `command` would not start as written in a fresh shell, or None."""
    words = command.split()
    env = {**os.environ, "PATH": _path_outside_the_venv()}
    if words[0] == "make":
        target = next((w for w in words[1:] if not w.startswith(("-", "[")) and "=" not in w), "")
        targets = set(re.findall(r"^([a-zA-Z0-9_-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
        return None if not target or target in targets else f"no make target {target!r}"
    if words[0] == "npx":
        return None if words[1] != "cdk" or (ROOT / "node_modules" / ".bin" / "cdk").exists() else "no pinned cdk"
    if words[0] == "cdk":
        return None if shutil.which("cdk", path=env["PATH"]) else "cdk is not on PATH (write `npx cdk`)"
    if len(words) > 2 and words[1] == "-m":
        module = words[2]
        if not words[0].startswith(".venv/") and _is_the_repositorys(module):
            # A fresh clone installs the repository's packages into .venv only (make setup).
            return f"{module} is installed in .venv only: write `.venv/bin/python -m {module}` or a make target"
        python = str(ROOT / words[0]) if words[0].startswith(".venv/") else shutil.which(words[0], path=env["PATH"])
        if python is None:
            return f"{words[0]} is not on PATH"
        done = subprocess.run([python, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60, check=False)
        return None if done.returncode == 0 else f"`{words[0]} -m {module} --help` fails: {done.stderr.strip()[-200:]}"
    return None


def _is_the_repositorys(module: str) -> bool:
    top = module.split(".")[0]
    return any((folder / top).is_dir() for folder in (ROOT, *ROOT.glob("containers/*")))


def test_commands_in_the_readmes_text_start_as_written() -> None:
    problems = []
    for command in sorted(set(_INLINE.findall(README.read_text()))):
        problem = _inline_problem(command)
        if problem:
            problems.append(f"`{command}`: {problem}")
    assert not problems, problems


# A first deploy's order: each step needs the one before (docs/deploying.md "Deploying a cell"): the compile
# stack needs the bootstrap and the image; the cells need the compiled key (a node never compiles); the
# pipeline needs its canary cell. The needles, in the order both pages must name them first.
DEPLOY_ORDER = (
    "cdk bootstrap",
    "neuron_vllm_digest",
    "cdk deploy -c config=fleet.yaml <Fleet>-Compile",
    "compile --config fleet.yaml --submit",
    "SUCCEEDED",
    "--check",
    "model.artifacts_key",
    "cdk deploy -c config=fleet.yaml <Fleet>-Cell-<name>",
    "cdk deploy -c config=fleet.yaml <Fleet>-Pipeline",
)


def _section(page: Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n{heading}\n")
    end = re.search(r"\n#{2,3} ", text[start + len(heading) + 2:])
    return text[start:start + len(heading) + 2 + end.start()] if end else text[start:]


@pytest.mark.parametrize("page", [README, DOCS / "deploying.md"], ids=lambda p: p.name)
def test_deploying_a_cell_names_the_steps_in_the_order_they_can_run(page: Path) -> None:
    section = " ".join(_section(page, "## Deploying a cell").split())  # a command may be wrapped across lines
    missing = [n for n in DEPLOY_ORDER if n not in section]
    assert not missing, f"{page.name} 'Deploying a cell' does not name {missing}"
    firsts = [section.index(n) for n in DEPLOY_ORDER]
    assert firsts == sorted(firsts), [n for _, n in sorted(zip(firsts, DEPLOY_ORDER, strict=True))]


def test_the_docs_state_the_unit_limit_of_a_cell_as_the_fleet_check_computes_it() -> None:
    """A cell's unit limit in the docs (a whole cell, not an example) is
    max_units_per_cell(): 36 (the template size bounds it before the resources do), 16 when the
    pipeline deploys it (a figure of 10 or more)."""
    from inference_fleet.cell_checks import max_units_per_cell

    allowed = {max_units_per_cell(), max_units_per_cell(True), max_units_per_cell(pipeline=True),
               max_units_per_cell(True, pipeline=True)}
    stated = [(page.name, int(n)) for page in (README, *sorted(DOCS.glob("*.md")))
              for n in re.findall(r"(?:at most|up to) \**(\d+)\** units", " ".join(page.read_text().split()))
              if int(n) >= 10]
    assert stated and all(n in allowed for _, n in stated), (stated, allowed)


def test_what_validation_cannot_know_lists_the_five_things_it_promises_together() -> None:
    section = _section(DOCS / "deploying.md", "### What validation cannot know")
    intro, _, rest = section.partition("five things")
    assert intro and rest, "the section no longer says how many things it lists"
    first_list = re.split(r"\n\n(?![-\s])", rest.split("\n\n", 1)[1], maxsplit=1)[0]
    bullets = re.findall(r"^- \*\*(.+?)\*\*", first_list, re.MULTILINE)
    assert len(bullets) == 5, bullets


def test_every_deploy_command_of_the_deploying_guide_names_the_fleet_file() -> None:
    """Without `-c config=` the CDK app falls back to the example fleet, whose account is a placeholder: a
    user following a step literally would deploy (or be refused) the wrong fleet."""
    text = " ".join((DOCS / "deploying.md").read_text().split())
    deploys = re.findall(r"npx cdk deploy[^`]*", text)
    assert deploys and all("-c config=" in d for d in deploys), [d for d in deploys if "-c config=" not in d]


def test_the_endpoint_services_to_check_in_the_trainium_az_are_the_cells_endpoints() -> None:
    from cell_constructs.network import _INTERFACE_ENDPOINTS

    section = " ".join(_section(DOCS / "deploying.md", "### What validation cannot know").split())
    bullet = section[section.index("**The interface endpoints in the Trainium AZ.**"):]
    bullet = bullet[:bullet.index(" - **") if " - **" in bullet else len(bullet)]
    named = {*re.findall(r"`([a-z0-9.-]+)`", bullet), *re.findall(r"com\.amazonaws\.<region>\.([a-z0-9.-]+)", bullet)}
    expected = {service.short_name for service in _INTERFACE_ENDPOINTS.values()}
    assert expected <= named, expected - named


def _cfn_namespaces(template: dict) -> set[str]:
    return {"::".join(r["Type"].split("::")[:2]) for r in template["Resources"].values()
            if r["Type"].startswith("AWS::") and not r["Type"].startswith("AWS::CDK::")}


def _listed_types(paragraph_start: str) -> set[str]:
    text = (DOCS / "rollout-pipeline.md").read_text()
    start = text.index(paragraph_start)
    return set(re.findall(r"`(AWS::[A-Za-z0-9]+)`", text[start:text.index("\n- ", start)]))


def test_the_execution_policy_lists_name_exactly_the_types_the_stacks_create(synth_default, synth_large,
                                                                              synth_elastic,
                                                                              tmp_path_factory) -> None:
    """Regression: the cells' list named WAF but no cell of the fleets checked here used it, so it was dropped, and
    left out Lambda, SQS, SSM and EventBridge; the compile stack's left out Step Functions, Lambda and EventBridge: an
    execution policy written from them fails the first deploy. An internet-facing cell does use WAF (a newcomer's
    walkthrough, thirty-second session), and a router stack is deployed into its cells' account by hand with the
    same bootstrap: both are checked now. The pipeline stack's own types were in no list until the thirty-fourth
    session (its first deploy failed on CodePipeline and CodeBuild)."""
    cells, compiles, pipelines = set(), set(), set()
    more = [synth_fleet(pin_images(load_fleet(FLEETS / name)), tmp_path_factory.mktemp(name))
            for name in ("internet_facing.yaml", "router.yaml", "pipeline_two_routers.yaml")]
    for fleet in (synth_default, synth_large, synth_elastic, *more):
        for cell in fleet.fleet.cells:
            cells |= _cfn_namespaces(fleet.template_json(fleet.fleet.cell_stack_name(cell)))
        for router in fleet.fleet.routers:
            cells |= _cfn_namespaces(fleet.template_json(fleet.fleet.router_stack_name(router)))
        compiles |= _cfn_namespaces(fleet.template_json(f"{fleet.fleet.name}-Compile"))
        for name in fleet.templates:  # the pipeline stack and its support stacks in the other regions
            if name.startswith(f"{fleet.fleet.name}-Pipeline"):
                pipelines |= _cfn_namespaces(fleet.template_json(name))
    assert _listed_types("policies are what CloudFormation may create in the cell") == cells
    assert _listed_types("its execution policies must also allow") == compiles
    # Regression (a defect hunt of the deploy path, thirty-fourth session): CodePipeline and CodeBuild were in no list.
    assert _listed_types("runs CloudFormation as that same `cfn-exec-role`") == pipelines


def test_step_0_names_the_lambda_concurrency_an_elastic_cell_needs(synth_elastic) -> None:
    """Lambda leaves 100 of an account's concurrency unreserved ("You can reserve up to the Unreserved account
    concurrency value that is shown, minus 100", docs.aws.amazon.com/lambda/latest/dg/configuration-concurrency.html),
    so a cell whose functions reserve R needs a quota of 100 + R, which a new account may not have. Step 0 checks the
    quotas a first deploy needs; until a walk of the deploy docs in the thirty-eighth session it left Lambda's out,
    though an elastic cell's autoscaler reserves 1 and Lambda refuses a reservation beyond that floor."""
    template = synth_elastic.template_json(synth_elastic.fleet.cell_stack_name(synth_elastic.fleet.cells[0]))
    reserved = sum(r["Properties"].get("ReservedConcurrentExecutions", 0) for r in template["Resources"].values()
                   if r["Type"] == "AWS::Lambda::Function")
    assert reserved >= 1
    step_0 = " ".join(_section(DOCS / "deploying.md", "## Deploying a cell").split("\n1. ")[0].split())
    assert "--service-code lambda" in step_0 and f"*Concurrent executions* >= {100 + reserved}" in step_0
