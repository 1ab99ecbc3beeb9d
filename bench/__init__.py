"""Benchmarks of the serving path (run with `make bench`)."""
