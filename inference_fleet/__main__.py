"""`python -m inference_fleet`: see cli.py."""

import sys

from inference_fleet.cli import main

sys.exit(main())
