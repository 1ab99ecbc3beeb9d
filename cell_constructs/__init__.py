"""The construct library of a cell: network, Trainium capacity, multi-node units, load balancer.

Named `cell_constructs`, not `constructs`: a top-level package called `constructs` would
shadow the `constructs` library that aws-cdk-lib imports (`python app.py` puts the
repository root first on sys.path).
"""
