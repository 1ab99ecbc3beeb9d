"""`unit-proxy` / `python -m unit_proxy`: settings from the environment, then one serving
process (PROXY_WORKERS=1) or the supervisor and its workers.

Every failure an operator can fix ends in one line on stderr and exit code 2, never a
traceback: a bad setting, a listen address that cannot be bound, a port in use, or
another unit proxy already serving the port.
"""

from __future__ import annotations

import sys

import uvloop

from unit_proxy.server import BindError, claim_port, configure_logging, serve
from unit_proxy.settings import Settings, SettingsError
from unit_proxy.supervisor import supervise


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"unit_proxy: {exc}", file=sys.stderr)
        return 2
    try:
        claim = claim_port(settings)
        try:
            if settings.workers > 1:
                configure_logging("supervisor")
                return supervise(settings)
            configure_logging("single")
            return uvloop.run(serve(settings))
        finally:
            claim.close()
    except BindError as exc:
        print(f"unit_proxy: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
