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
WRAPPED = "unit: requests are checked before their stream"

# vLLM's OpenAI request classes. Each server builds a request's sampling parameters before it answers or starts a
# stream, where a ValueError is a 400: inside its own `try ... except ValueError` in vLLM 0.16.0
# (`entrypoints/openai/chat_completion/serving.py:379-468`, `completion/serving.py:161-239`,
# `responses/serving.py:433-513`), and through the app's ValueError handler in 0.32
# (`entrypoints/serve/exception_handling/register.py:36`). The platform's `validate_request` comes later for a
# streamed request in 0.32 (inside `AsyncLLM.generate`, after the 200: `make e2e` check 0c saw a streamed chat get
# a 500 event with no message), and in 0.16 for /v1/responses.
PROTOCOLS = {
    "ChatCompletionRequest": "vllm.entrypoints.openai.chat_completion.protocol",
    "CompletionRequest": "vllm.entrypoints.openai.completion.protocol",
    "ResponsesRequest": "vllm.entrypoints.openai.responses.protocol",
}


def activate() -> str | None:
    """The unit platform's class name when the launcher asked for it (UNIT_EXECUTOR=1), else None."""
    if os.environ.get("UNIT_EXECUTOR") != "1":
        return None
    return "unit_executor.platform.UnitPlatform"


def check_requests() -> None:
    """Refuse what the unit does not serve where vLLM builds a request's sampling parameters (UNIT_EXECUTOR=1 only).

    The platform's `validate_request` refuses it for every request, but for a streamed one it may come only after
    vLLM has answered 200 (PROTOCOLS): the client got a stream cut short, or an error event, instead of a 400
    (twenty-fifth session's cold review for /v1/responses; `make e2e` check 0c for chat on vLLM 0.32). vLLM loads
    general plugins in every process, more than once (vllm/plugins/__init__.py `load_general_plugins`): each class
    is wrapped once.
    """
    if os.environ.get("UNIT_EXECUTOR") != "1":
        return
    wrapped = [name for name, module in PROTOCOLS.items() if _wrap(module, name)]
    if wrapped:
        logger.info("%s (%s)", WRAPPED, ", ".join(wrapped))


def _wrap(module: str, name: str) -> bool:
    """Wrap the class's `to_sampling_params` (and `to_beam_search_params`, where it has one); False if not found."""
    try:
        request_class = getattr(importlib.import_module(module), name)
    # A vLLM without the class, or one whose import fails in this process: the engine must still start; the
    # platform's validate_request still refuses such a request, only perhaps after a streamed answer started.
    except Exception as error:
        logger.warning("unit: no %s.%s (%s): its requests are not checked early", module, name, error)
        return False
    for method, check in (("to_sampling_params", _refuse_unhonoured), ("to_beam_search_params", _refuse_beam)):
        original = getattr(request_class, method, None)
        if original is not None and not getattr(original, "unit_checked", False):
            setattr(request_class, method, _checked(original, check))
    # Listed in the log line only when its sampling parameters are checked (a class without the method is not).
    return getattr(getattr(request_class, "to_sampling_params", None), "unit_checked", False)


def _refuse_unhonoured(params: Any) -> None:
    from unit_executor import device_sampling

    device_sampling.refuse_unhonoured(params)


def _refuse_beam(params: Any) -> None:
    from unit_executor import device_sampling

    device_sampling.refuse_beam_search()


def _checked(build: Any, check: Any) -> Any:
    @functools.wraps(build)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = build(self, *args, **kwargs)
        check(params)
        return params

    checked.unit_checked = True  # type: ignore[attr-defined]
    return checked
