#!/usr/bin/env python3
"""CDK entry point: `cdk synth` / `cdk deploy <Fleet>-Cell-<name>`.

The fleet file comes from `-c config=path/to/fleet.yaml` (default config/default.yaml).
It is validated before any construct is built: a mistake exits 3 (as `python -m inference_fleet`
does, inference_fleet/exit_codes.py) with the field path.

Any other exception while building the stacks is a bug (a fleet `validate` accepts synthesizes,
docs/fleet-reference.md): it prints one line asking for a report and exits 1; set
INFERENCE_FLEET_TRACEBACK=1 to see the traceback.
"""

import os
import sys
import traceback

from aws_cdk import App

from inference_fleet import exit_codes
from inference_fleet.checks import fleet_warnings, load_fleet
from inference_fleet.config import ConfigError
from stacks.fleet import build_fleet

TRACEBACK_VARIABLE = "INFERENCE_FLEET_TRACEBACK"


def _internal_error(error: BaseException) -> None:
    """One line for the user, the traceback for the report when asked for; exits 1."""
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    if os.environ.get(TRACEBACK_VARIABLE):
        traceback.print_exception(error, file=sys.stderr)
    print(
        f"error: internal error while building the stacks ({type(error).__name__}: {first_line}); the fleet file "
        "passed its checks, so this is a bug: please report it with the fleet file"
        + ("" if os.environ.get(TRACEBACK_VARIABLE) else f" and the traceback ({TRACEBACK_VARIABLE}=1 prints it)"),
        file=sys.stderr,
    )
    sys.exit(1)


def main() -> None:
    app = App()
    try:
        fleet = load_fleet(app.node.try_get_context("config"))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(exit_codes.CONFIG)
    for issue in fleet_warnings(fleet):
        # The example fleet synthesizes offline; deployed, it names an account that is not yours.
        print(f"warning: {issue}", file=sys.stderr)
    if fleet.builds_images and not fleet.base_images.neuron_vllm_digest:
        # Synth needs no image; deploying one built from containers/inference does.
        print(
            "note: base_images.neuron_vllm_digest is not set: the inference image cannot be built at deploy "
            "time until it is (or pin cells[].images); see docs/deploying.md",
            file=sys.stderr,
        )
    try:
        build_fleet(app, fleet)
        app.synth()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(exit_codes.CONFIG)
    except Exception as error:  # a bug: reported in one line, not as a traceback
        _internal_error(error)


if __name__ == "__main__":
    main()
