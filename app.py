#!/usr/bin/env python3
"""CDK entry point: `cdk synth` / `cdk deploy <Fleet>-Cell-<name>`.

The fleet file comes from `-c config=path/to/fleet.yaml` (default config/default.yaml).
It is validated before any construct is built: a mistake exits 2 with the field path.
"""

import sys

from aws_cdk import App

from inference_fleet.checks import load_fleet
from inference_fleet.config import ConfigError
from stacks.fleet import build_fleet


def main() -> None:
    app = App()
    try:
        fleet = load_fleet(app.node.try_get_context("config"))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if fleet.builds_images and not fleet.base_images.neuron_vllm_digest:
        # Synth needs no image; deploying one built from containers/inference does.
        print(
            "note: base_images.neuron_vllm_digest is not set: the inference image cannot be built at deploy "
            "time until it is (or pin cells[].images); see docs/deploying.md",
            file=sys.stderr,
        )
    try:
        build_fleet(app, fleet)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    app.synth()


if __name__ == "__main__":
    main()
