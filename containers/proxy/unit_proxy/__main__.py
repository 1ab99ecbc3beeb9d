"""`python -m unit_proxy`: run the proxy with settings from the environment."""

import sys

from unit_proxy.server import main

sys.exit(main())
