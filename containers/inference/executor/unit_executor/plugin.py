"""Entry points of the `vllm.platform_plugins` and `vllm.general_plugins` groups (see pyproject.toml).

Kept free of vLLM imports at module level: vLLM calls `activate` while it is still resolving its
platform, when importing most of vLLM would be circular.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

# Under "vllm": vLLM's logging configuration prints its own loggers' INFO (vllm/logger.py DEFAULT_LOGGING_CONFIG),
# each line tagged with its process (make e2e reads it; vLLM 0.32's API server configures logging only after it has
# loaded its general plugins, so its own line is not printed there; 0.16 configures it at import, logger.py:243).
logger = logging.getLogger("vllm.unit_executor.plugin")
WRAPPED = "unit: /v1/responses is checked before its stream (ResponsesRequest.to_sampling_params wrapped)"

# vLLM's Responses request, whose sampling parameters are built before a streamed answer starts (vLLM 0.16.0
# `entrypoints/openai/responses/serving.py:449-451`, inside `try ... except ValueError` :433-513, which answers 400).
RESPONSES_PROTOCOL = "vllm.entrypoints.openai.responses.protocol"


def activate() -> str | None:
    """The unit platform's class name when the launcher asked for it (UNIT_EXECUTOR=1), else None."""
    if os.environ.get("UNIT_EXECUTOR") != "1":
        return None
    return "unit_executor.platform.UnitPlatform"


def check_requests() -> None:
    """Refuse what the unit does not serve on /v1/responses before its stream starts (UNIT_EXECUTOR=1 only).

    The platform's `validate_request` refuses it for every endpoint, but a streamed Responses request
    reaches it only after vLLM has answered 200 and sent `response.created`: the client got a stream cut
    after `response.in_progress` instead of a 400 (twenty-fifth session's cold review). The sampling
    parameters are built earlier, in `ResponsesRequest.to_sampling_params`, where a ValueError is a 400
    in vLLM 0.16 (its own `except ValueError`) and in later ones (the app's ValueError handler). vLLM
    loads general plugins in every process, more than once (vllm/plugins/__init__.py
    `load_general_plugins`): the wrap is made once.
    """
    if os.environ.get("UNIT_EXECUTOR") != "1":
        return
    try:
        request_class = importlib.import_module(RESPONSES_PROTOCOL).ResponsesRequest
    # A vLLM without the Responses API, or one whose import fails in this process: the engine must still start;
    # the platform's validate_request still refuses such a request, only after a streamed answer started.
    except Exception as error:
        logger.warning("unit: no %s.ResponsesRequest (%s): /v1/responses is not checked early", RESPONSES_PROTOCOL,
                       error)
        return
    original = request_class.to_sampling_params
    if getattr(original, "unit_checked", False):
        return
    request_class.to_sampling_params = _checked(original)
    logger.info(WRAPPED)


def _checked(to_sampling_params: Any) -> Any:
    @functools.wraps(to_sampling_params)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        from unit_executor import device_sampling

        params = to_sampling_params(self, *args, **kwargs)
        device_sampling.refuse_unhonoured(params)
        return params

    checked.unit_checked = True  # type: ignore[attr-defined]
    return checked
