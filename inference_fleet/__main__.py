"""`python -m inference_fleet`: see cli.py."""

import sys

from inference_fleet import exit_codes

try:
    # Ctrl-C can come while the modules load (a second or more): no traceback then either.
    from inference_fleet.cli import main
except KeyboardInterrupt:
    exit_codes.end_interrupted()

sys.exit(main())
