"""`python -m unit_launcher run|plan`: the container entry point and the operators' plan printer."""

# First of all: SIGUSR1 ("this node's task is stopping", from the follower's drain guard)
# must never end the launcher, however early it comes (unit_launcher.task_stop).
# So must SIGTERM and SIGINT (ECS's stop): recorded here, acted on once the node's handlers are in place
# (unit_launcher.stop_signals), never fatal during the imports and start-up waits before them.
from unit_launcher import stop_signals, task_stop

task_stop.install()
stop_signals.remember_early()

from unit_launcher.cli import main  # noqa: E402

raise SystemExit(main())
