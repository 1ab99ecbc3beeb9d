"""Rollout plan (placeholder until issue 7 lands)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise SystemExit("plan-rollout is not implemented yet (issue 7)")
