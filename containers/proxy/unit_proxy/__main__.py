"""`python -m unit_proxy`: run the proxy with settings from the environment."""

import sys

from unit_proxy import stop_signals

# Before the imports below (aiohttp, uvloop: a few hundred ms): a stop signal is never lost.
stop_signals.remember_early()

from unit_proxy.main import main  # noqa: E402 (after the signal handlers, on purpose)

sys.exit(main())
