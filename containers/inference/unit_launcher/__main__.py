"""`python -m unit_launcher run|plan`: the container entry point and the operators' plan printer."""

from unit_launcher.cli import main

raise SystemExit(main())
