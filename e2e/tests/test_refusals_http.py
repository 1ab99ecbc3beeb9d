"""Check 0c's verdict on an answer (the check itself runs a real vLLM server in `make e2e`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from refusals_http import ON_DEVICE, verdict

REFUSED = f"logprobs {ON_DEVICE}"
JSON_400 = json.dumps({"error": {"message": f"{REFUSED}, which honour only ...", "type": "BadRequestError",
                                 "param": None, "code": 400}})
# What vLLM 0.32 answered a streamed chat with logprobs before the chat request class was wrapped (check 0c's
# first run): a 200 stream whose one event is an error with no message.
LATE = 'data: {"error": {"message": "", "type": "InternalServerError", "param": null, "code": 500}}\n\n'


@pytest.mark.parametrize(("answer", "ok"), [
    ((400, "application/json", JSON_400), True),
    ((200, "text/event-stream; charset=utf-8", LATE), False),
    ((400, "application/json", json.dumps({"error": {"message": "something else"}})), False),
    ((400, "text/plain", JSON_400), False),
    ((500, "application/json", JSON_400), False),
])
def test_a_refusal_is_a_json_400_naming_what_is_not_served(answer, ok) -> None:
    assert verdict(REFUSED, *answer)[0] is ok


RESPONSES_DONE = ('event: response.created\n'
                  'data: {"type": "response.created", "response": {"status": "in_progress"}}\n\n'
                  'event: response.completed\ndata: {"type": "response.completed", "response": {"error": null}}\n\n')
CUT = 'event: response.created\ndata: {"type": "response.created"}\n\ndata: {"type": "response.in_progress"}\n\n'


@pytest.mark.parametrize(("answer", "ok"), [
    ((200, "text/event-stream; charset=utf-8", 'data: {"choices": []}\n\ndata: [DONE]\n\n'), True),
    ((200, "text/event-stream; charset=utf-8", RESPONSES_DONE), True),  # a null error field is no error
    ((200, "text/event-stream; charset=utf-8", LATE), False),
    ((200, "text/event-stream; charset=utf-8", CUT), False),  # the twenty-fifth session's cut stream
    ((200, "text/event-stream", 'data: {"type": "error", "message": "x"}\n\ndata: [DONE]\n\n'), False),
    ((400, "application/json", JSON_400), False),
])
def test_a_served_request_is_a_stream_with_no_error_event(answer, ok) -> None:
    assert verdict("", *answer)[0] is ok


def test_a_refusal_whose_message_is_not_text_is_reported_not_raised() -> None:
    assert verdict(REFUSED, 400, "application/json", json.dumps({"error": {"message": 42}}))[0] is False
