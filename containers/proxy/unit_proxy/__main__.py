"""`python -m unit_proxy`: run the proxy with settings from the environment."""

import sys

from unit_proxy.main import main

sys.exit(main())
