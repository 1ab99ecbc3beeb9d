"""Placement controller of a cell: groups each unit's Trainium nodes by EC2 network topology.

`topology` holds the network-node arithmetic, `assignment` the pure grouping algorithm
(and the deterministic fallback it is measured against), `aws` the boto3 calls and
`handler` the Lambda entry point that reconciles the cell's ECS `unit` attributes.
Only boto3 (part of the Lambda runtime) is needed at run time.
"""
