# The two commands a newcomer runs are `make synth` and `make test`; each sets
# up what it needs (a Python venv with pinned packages, the pinned CDK CLI).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?=
CDK_OUT ?= cdk.out
CDK := node_modules/.bin/cdk
CONTAINER_PACKAGES := containers/inference containers/inference/executor containers/proxy
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
# No AWS call is ever needed to synthesize or test: make sure none is attempted (botocore then never
# asks the instance metadata service for credentials). The targets that call AWS on purpose, compile
# (--submit, --check, --checkpoint: S3 and Batch) and verify-cell, run their command under
# `$(WITH_AWS)`, which gives the instance metadata back: an instance role's credentials on the
# compile host or the verifying machine (tests/test_makefile.py).
export AWS_EC2_METADATA_DISABLED := true
WITH_AWS := env -u AWS_EC2_METADATA_DISABLED
# The fleet file reaches the commands through the environment and is quoted there
# ("$$CONFIG"), so a path with spaces or shell characters works: make plan CONFIG="my/fleet two.yaml".
export CONFIG SCENARIO SEEDS REPORT CELL

.PHONY: help setup venv cli tools synth test snapshot-update validate plan plan-rollout compile bench bench-proxy bench-unit bench-placement simulate-scaling simulate-cell verify-cell e2e e2e-triton e2e-router clean-e2e clean

# `make help` lists every target with the `## ` comment on its line (tests/test_makefile.py
# checks that each .PHONY target has one).
help: ## list the targets and what each does
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: venv cli ## the venv (.venv) and the pinned CDK CLI (node_modules)

# Debian packages the tests use, installed when missing: shellcheck checks every script the
# templates ship (tests/test_template_scripts.py); haproxy is the proxy's data path
# (containers/proxy), the same Debian version as its image (the Dockerfile's HAPROXY_VERSION);
# nginx and wrk: the proxy benchmark's baseline and load, run in quick mode by the tests.
HAPROXY_VERSION := $(shell sed -n 's/^ARG HAPROXY_VERSION=//p' containers/proxy/Dockerfile)
tools: ## the Debian packages the tests use (shellcheck, haproxy, nginx and wrk for the quick proxy bench), when missing
	@command -v shellcheck > /dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck; \
	  else echo "shellcheck is missing: install it (apt-get install shellcheck, as root)" >&2; exit 1; fi; }
	@command -v haproxy > /dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "haproxy=$(HAPROXY_VERSION)"; \
	  else echo "haproxy is missing: install it (apt-get install haproxy=$(HAPROXY_VERSION), as root)" >&2; exit 1; fi; }
	@{ command -v nginx || test -x /usr/sbin/nginx; } > /dev/null && command -v wrk > /dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light wrk; \
	  else echo "nginx and wrk are missing: install them (apt-get install nginx-light wrk, as root)" >&2; exit 1; fi; }
	@haproxy -v | grep -q "version 2\.6\." || { \
	  echo "haproxy 2.6 is needed (the image's $(HAPROXY_VERSION)); found: $$(haproxy -v | head -1)" >&2; exit 1; }

# The venv is rebuilt when a pin changes.
venv: $(VENV)/.installed ## the Python venv with the pinned packages, rebuilt when a pin changes
$(VENV)/.installed: requirements.txt $(foreach p,$(CONTAINER_PACKAGES),$(p)/pyproject.toml) pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv==0.13.8
	$(BIN)/uv pip install --quiet --python $(BIN)/python -r requirements.txt
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e . $(foreach p,$(CONTAINER_PACKAGES),-e $(p))
	touch $@

cli: node_modules/.installed ## the CDK CLI pinned in package-lock.json
node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Synthesizes every stack of the fleet offline with every policy check on.
synth: setup ## synthesize every stack of the fleet offline, policy checks on [CONFIG=fleet.yaml]
	rm -rf $(CDK_OUT)
	$(CDK) synth --no-lookups --quiet --output $(CDK_OUT) $${CONFIG:+-c "config=$$CONFIG"}
	@echo "templates in $(CDK_OUT):"; ls -1 $(CDK_OUT)/*.template.json

# The suite in TEST_WORKERS processes (pytest-xdist). On the 2-core build machine (twentieth
# session, the same tree, one run each, all passing): 2 workers 13 min 12 s (CPU 130 %: a third of
# the time the tests wait on real processes and deadlines), 3 workers 11 min 0 s (160 %), 4 workers
# 11 min 1 s (178 %). So one worker more than the cores; more only adds contention for the tests
# that run real processes against deadlines. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 3
test: setup tools ## ruff, hadolint and the whole test suite [TEST_WORKERS=3]
	$(BIN)/ruff check .
	$(BIN)/hadolint --failure-threshold error containers/inference/Dockerfile containers/proxy/Dockerfile
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

snapshot-update: setup ## rewrite the snapshot tests' expectations (on purpose only)
	$(BIN)/python -m pytest tests --snapshot-update

# Checks a fleet file as synth would, without CDK: every issue with its field path.
validate: venv ## check a fleet file and list its cells and stacks [CONFIG=fleet.yaml]
	$(BIN)/python -m inference_fleet validate $${CONFIG:+--config "$$CONFIG"}

PLAN_ARGS ?=
plan: venv ## the unit's memory budget and parallel layout [CONFIG=fleet.yaml] [PLAN_ARGS=--suggest]
	$(BIN)/python -m inference_fleet plan $${CONFIG:+--config "$$CONFIG"} $(PLAN_ARGS)

plan-rollout: venv ## waves, bake times and capacity floor of a rollout [CONFIG=fleet.yaml]
	$(BIN)/python -m inference_fleet plan-rollout $${CONFIG:+--config "$$CONFIG"}

# Calls AWS (S3, Batch) unless --dry-run: the instance metadata is allowed back, as for verify-cell.
COMPILE_ARGS ?= --dry-run
compile: venv ## compile the unit layout with NxD Inference, write and upload its manifest [CONFIG=fleet.yaml] [COMPILE_ARGS="--checkpoint DIR" | --submit (AWS Batch) | --check]
	$(WITH_AWS) $(BIN)/python -m inference_fleet compile $${CONFIG:+--config "$$CONFIG"} $(COMPILE_ARGS)

# Benchmarks print their figures (ratios against a baseline measured in the same run).
# The proxy benchmark installs nginx, wrk and haproxy with apt-get when they are missing; it runs
# three whole comparisons by default (issue 25's acceptance); BENCH_ARGS=--quick is the CI check.
BENCH_ARGS ?=
bench: bench-proxy bench-unit bench-placement ## the proxy, unit and placement benchmarks
bench-proxy: venv ## unit proxy against raw nginx and raw HAProxy, 3 runs [BENCH_ARGS=--quick ...]
	$(BIN)/python -m bench.proxy_bench $(BENCH_ARGS)
bench-unit: venv ## unit formation benchmark, 2 and 4 nodes
	$(BIN)/python containers/inference/bench_unit.py --sizes 2 4 --runs 3
bench-placement: venv ## placement controller benchmark
	$(BIN)/python functions/placement/bench_placement.py

# Replays a day's traffic (and a spike) through the unit autoscaler's decision code
# (docs/autoscaling.md). SIM_ARGS=--help lists the knobs.
SIM_ARGS ?=
simulate-scaling: venv ## replay a day of traffic through the autoscaler [SIM_ARGS=--help]
	$(BIN)/python functions/autoscaler/simulate_scaling.py $(SIM_ARGS)

# One cell through a scenario file, the package's own controllers deciding (docs/simulation.md).
# Writes simulate-cell-report.json; exits 4 when an invariant is violated, 3 on a refused file.
SCENARIO ?=
simulate-cell: venv ## simulate one cell through a scenario SCENARIO=simulations/x.yaml [CONFIG=...] [SEEDS=N] [REPORT=...]
	@test -n "$$SCENARIO" || { echo "SCENARIO is not set: make simulate-cell SCENARIO=simulations/follower-killed.yaml" >&2; exit 2; }
	$(BIN)/python -m inference_fleet simulate --scenario "$$SCENARIO" --seeds "$${SEEDS:-1}" \
	  --report "$${REPORT:-simulate-cell-report.json}" $${CONFIG:+--config "$$CONFIG"}

# The first-deploy acceptance kit against a deployed cell, with the caller's AWS credentials
# (docs/verifying.md). It calls AWS: the instance metadata is allowed back (an instance role's
# credentials), and VERIFY_ARGS=--destructive stops tasks. Exit 6: a check failed.
VERIFY_ARGS ?=
CELL ?=
verify-cell: venv ## the acceptance kit against a deployed cell CELL=name CONFIG=fleet.yaml [VERIFY_ARGS=--destructive --report x.json]
	@test -n "$$CELL" || { echo "CELL is not set: make verify-cell CELL=dev" >&2; exit 2; }
	$(WITH_AWS) $(BIN)/python -m inference_fleet verify --cell "$$CELL" \
	  $${CONFIG:+--config "$$CONFIG"} $(VERIFY_ARGS)

# End to end with a real vLLM engine on CPU (its own environment under .e2e/, cached).
E2E_ARGS ?=
e2e: venv ## end to end with a real vLLM engine on CPU [E2E_ARGS=...]
	$(BIN)/python e2e/run_e2e.py $(E2E_ARGS)

# The unit again with the Triton front end (Triton 2.51.0 from a hash-pinned wheel, under .e2e/triton).
e2e-triton: venv ## the e2e unit with frontend triton: form, stream, lose a follower, drain (e2e-triton-report.json)
	$(BIN)/python e2e/run_e2e.py --frontend triton $(E2E_ARGS)

# Two cells (unit proxy + fake engine each) behind the real cell router on loopback; under 2 minutes.
# The quick mode: `make e2e` step 7 runs the same acceptance with the real vLLM unit as cell A.
e2e-router: venv tools ## cell router acceptance: cell A lost under load, cell B evacuated (e2e-router-report.json)
	$(BIN)/python e2e/router_mode.py $(E2E_ROUTER_ARGS)

clean-e2e: ## remove the e2e environment and report
	rm -rf .e2e e2e-report.json e2e-triton-report.json e2e-router-report.json

clean: ## remove the venv, node_modules and cdk.out
	rm -rf $(VENV) node_modules cdk.out .pytest_cache
