"""`python -m unit_launcher run|plan`: the container entry point and the operators' plan printer."""

# First of all: SIGUSR1 ("this node's task is stopping", from the follower's drain guard)
# must never end the launcher, however early it comes (unit_launcher.task_stop).
from unit_launcher import task_stop

task_stop.install()

from unit_launcher.cli import main  # noqa: E402

raise SystemExit(main())
