"""Unit autoscaler of an elastic cell: activates and drains whole multi-node units.

`decision` is the pure policy (no AWS: the simulator and the hypothesis properties run it),
`aws` the boto3 reads and writes, `counts` the custom resource that hands CloudFormation
the services' current desired counts, and `handler` the Lambda entry point. Only boto3
(part of the Lambda runtime) is needed at run time.
"""
