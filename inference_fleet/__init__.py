"""Multi-node LLM inference on AWS Trainium: fleet configuration, planner and rollout plan.

`inference_fleet.config` is the typed model of the fleet file; `checks` holds every rule
a fleet must pass and `checks.load_fleet(path)`, the one way to read a fleet; `catalogue`
holds the instance facts; `planner` sizes units and chooses the hybrid parallel layout;
`rollout` estimates a cell-by-cell rollout. The CDK constructs live in
`cell_constructs`, the stacks in `stacks`.
"""

# The package version (pyproject.toml's, checked by tests/test_cli.py); `--version` prints it.
__version__ = "0.1.0"
