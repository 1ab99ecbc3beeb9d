"""Parallelism planner (placeholder until issue 8 lands)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise SystemExit("plan is not implemented yet (issue 8)")
