"""Multi-node LLM inference on AWS Trainium: fleet configuration, planner and rollout plan.

`inference_fleet.config` reads and validates the fleet file; `catalogue` holds the
instance facts; `planner` sizes units and chooses the hybrid parallel layout;
`rollout` estimates a cell-by-cell rollout. The CDK constructs live in
`cell_constructs`, the stacks in `stacks`.
"""
