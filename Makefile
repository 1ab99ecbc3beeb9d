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
# No AWS call is ever needed to synthesize or test: make sure none is attempted.
export AWS_EC2_METADATA_DISABLED := true

.PHONY: setup venv cli tools synth test snapshot-update plan plan-rollout bench bench-proxy bench-unit bench-placement simulate-scaling e2e clean-e2e clean

setup: venv cli

# Debian packages the tests use, installed when missing: shellcheck checks every script the
# templates ship (tests/test_template_scripts.py).
tools:
	@command -v shellcheck > /dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck; \
	  else echo "shellcheck is missing: install it (apt-get install shellcheck, as root)" >&2; exit 1; fi; }

# The venv is rebuilt when a pin changes.
venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt $(foreach p,$(CONTAINER_PACKAGES),$(p)/pyproject.toml) pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv==0.13.8
	$(BIN)/uv pip install --quiet --python $(BIN)/python -r requirements.txt
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e . $(foreach p,$(CONTAINER_PACKAGES),-e $(p))
	touch $@

cli: node_modules/.installed
node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Synthesizes every stack of the fleet offline with every policy check on.
synth: setup
	rm -rf $(CDK_OUT)
	$(CDK) synth --no-lookups --quiet --output $(CDK_OUT) $(if $(CONFIG),-c config=$(CONFIG))
	@echo "templates in $(CDK_OUT):"; ls -1 $(CDK_OUT)/*.template.json

test: setup tools
	$(BIN)/ruff check .
	$(BIN)/hadolint --failure-threshold error containers/inference/Dockerfile containers/proxy/Dockerfile
	$(BIN)/python -m pytest

snapshot-update: setup
	$(BIN)/python -m pytest tests --snapshot-update

PLAN_ARGS ?=
plan: venv
	$(BIN)/python -m inference_fleet plan $(if $(CONFIG),--config $(CONFIG)) $(PLAN_ARGS)

plan-rollout: venv
	$(BIN)/python -m inference_fleet plan-rollout $(if $(CONFIG),--config $(CONFIG))

# Benchmarks print their figures (ratios against a baseline measured in the same run).
# The proxy benchmark installs nginx and wrk with apt-get when they are missing.
BENCH_ARGS ?=
bench: bench-proxy bench-unit bench-placement
bench-proxy: venv
	$(BIN)/python -m bench.proxy_bench $(BENCH_ARGS)
bench-unit: venv
	$(BIN)/python containers/inference/bench_unit.py --sizes 2 4 --runs 3
bench-placement: venv
	$(BIN)/python functions/placement/bench_placement.py

# Replays a day's traffic (and a spike) through the unit autoscaler's decision code
# (docs/autoscaling.md). SIM_ARGS=--help lists the knobs.
SIM_ARGS ?=
simulate-scaling: venv
	$(BIN)/python functions/autoscaler/simulate_scaling.py $(SIM_ARGS)

# End to end with a real vLLM engine on CPU (its own environment under .e2e/, cached).
E2E_ARGS ?=
e2e: venv
	$(BIN)/python e2e/run_e2e.py $(E2E_ARGS)

clean-e2e:
	rm -rf .e2e e2e-report.json

clean:
	rm -rf $(VENV) node_modules cdk.out .pytest_cache
