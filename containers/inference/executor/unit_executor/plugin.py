"""Entry point of the `vllm.platform_plugins` group (see pyproject.toml).

Kept free of vLLM imports: vLLM calls it while it is still resolving its platform, when
importing most of vLLM would be circular.
"""

from __future__ import annotations

import os


def activate() -> str | None:
    """The unit platform's class name when the launcher asked for it (UNIT_EXECUTOR=1), else None."""
    if os.environ.get("UNIT_EXECUTOR") != "1":
        return None
    return "unit_executor.platform.UnitPlatform"
