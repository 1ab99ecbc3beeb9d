"""The launcher's events from CloudWatch Logs into the controller's FIFO trigger queue.

A subscription filter on the cell's task log group invokes the function with the
launcher's `unit_session_end` and `unit_session_formed` lines and the spare role's
`spare_fetching` and `spare_ready` lines (CloudWatch Logs sends them base64-encoded and gzipped, https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/SubscriptionFilters.html#LambdaFunctionExample).
This path only enqueues: each event becomes one message of the trigger queue's single
message group, so the quarantine is decided by a normal, serialised run and never
overlaps with another. The log event id is the deduplication id (else the body's hash without
`forwarded_at`): a subscription that delivers a batch twice within five minutes enqueues it once.
A session end carries the time it was forwarded (`forwarded_at`, this function's clock, not the
launcher's): the controller trusts the launcher's `ended_at` only within a band before it
(failures.counted_time), and in the body it stays the same when the trigger queue retries the
batch or its dead letters are redriven.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from botocore.client import BaseClient

from placement_controller import aws
from placement_controller.failures import EVENT_DETAIL_TYPE, EVENT_SOURCE

SPARE_DETAIL_TYPE = "Spare Ready"
SPARE_FETCHING_DETAIL_TYPE = "Spare Fetching"
SPARE_EVENTS = {"spare_fetching": SPARE_FETCHING_DETAIL_TYPE, "spare_ready": SPARE_DETAIL_TYPE}
FORMED_DETAIL_TYPE = "Unit Session Formed"

LOG = logging.getLogger(__name__)
MESSAGE_GROUP = "cell"
# What the controller reads of an event; the engine's log tail and step records stay in the log.
# `released_at` with `members[].ready`: a released session's members that had their artifacts (unformed.py).
KEPT_FIELDS = ("event", "cell", "unit_id", "revision", "session_id", "cause", "ended_by", "exit_status", "ended_at",
               "reported_by", "released_at")
REASON_LIMIT = 500


def is_log_delivery(event: Mapping[str, Any]) -> bool:
    return isinstance(event.get("awslogs"), Mapping)


def log_events(event: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The log events of one subscription delivery (none for CloudWatch's control message).

    Each carries its delivery's `logStream` (the payload names it once for all its events)."""
    payload = json.loads(gzip.decompress(base64.b64decode(event["awslogs"]["data"])))
    if payload.get("messageType") != "DATA_MESSAGE":
        return []
    stream = str(payload.get("logStream") or "")
    return [{**e, "logStream": stream} for e in payload.get("logEvents", []) if isinstance(e, Mapping)]


def _spare(document: Mapping[str, Any], log_event: Mapping[str, Any]) -> dict[str, Any]:
    """A spare task's `spare_fetching` or `spare_ready` line: the task is the last part of its awslogs stream name
    (`prefix/container/task-id`, https://docs.aws.amazon.com/AmazonECS/latest/developerguide/using_awslogs.html)."""
    return {
        "event": document.get("event"),
        "cell": document.get("cell"),
        "revision": document.get("revision"),
        "time": document.get("time"),
        "task_id": str(log_event.get("logStream") or "").rsplit("/", 1)[-1],
    }


def _members(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The members' ranks and ids (task ARNs on ECS) and, where the line says it, whether each was ready
    (its artifacts in place: a fetch that worked, placement_controller/unformed.py), nothing else."""
    members = document.get("members")
    return [
        {"rank": m.get("rank"), "instance_id": m.get("instance_id"),
         **({"ready": m["ready"]} if isinstance(m.get("ready"), bool) else {})}
        for m in (members if isinstance(members, list) else [])
        if isinstance(m, Mapping)
    ]


def trigger_message(log_event: Mapping[str, Any], forwarded_at: float | None = None) -> dict[str, Any] | None:
    """The trigger-queue message of one log line, or None when it is none of the launcher's events.

    A session end gets `forwarded_at` (whole Unix seconds) when given: `forward` gives its own clock."""
    try:
        document = json.loads(str(log_event.get("message", "")))
    except ValueError:
        return None
    event_id = str(log_event.get("id", ""))
    if isinstance(document, Mapping) and document.get("event") in SPARE_EVENTS:
        return {"source": EVENT_SOURCE, "detail-type": SPARE_EVENTS[str(document["event"])], "id": event_id,
                "detail": _spare(document, log_event)}
    if isinstance(document, Mapping) and document.get("event") == "unit_session_formed":
        detail = {key: document.get(key) for key in ("event", "cell", "unit_id", "revision", "session_id",
                                                      "released_at")}
        return {"source": EVENT_SOURCE, "detail-type": FORMED_DETAIL_TYPE, "id": event_id,
                "detail": {**detail, "members": _members(document)}}
    if not isinstance(document, Mapping) or document.get("event") != "unit_session_end":
        return None
    detail = {key: document.get(key) for key in KEPT_FIELDS}
    # Who wrote it (the leader, rank 0, unless `reported_by` says): the quarantine reads both
    # sides' reports of a session together (placement_controller/blame.py).
    detail["members"] = _members(document)
    detail["reason"] = str(document.get("reason") or "")[:REASON_LIMIT]
    if forwarded_at is not None:
        detail["forwarded_at"] = int(forwarded_at)
    return {
        "source": EVENT_SOURCE,
        "detail-type": EVENT_DETAIL_TYPE,
        "id": str(log_event.get("id", "")),
        "detail": detail,
    }


def forward(event: Mapping[str, Any], sqs: BaseClient, queue_url: str, retry: aws.Retry) -> dict[str, Any]:
    """Enqueue every session end of the delivery; returns how many."""
    sent = 0
    forwarded_at = time.time()
    for log_event in log_events(event):
        message = trigger_message(log_event, forwarded_at)
        if message is None:
            continue
        retry.call(
            sqs.send_message,
            QueueUrl=queue_url,
            MessageBody=json.dumps(message, sort_keys=True),
            MessageGroupId=MESSAGE_GROUP,
            MessageDeduplicationId=deduplication_id(message),
        )
        sent += 1
    LOG.info("forwarded %d unit session ends and spare reports to the trigger queue", sent)
    return {"forwarded": sent}


def deduplication_id(message: Mapping[str, Any]) -> str:
    """The log event id, else the SHA-256 of the body as the line gave it: without `forwarded_at`,
    which differs between a delivery and its retry a minute later, the one the FIFO queue's 5 min
    deduplication is there to drop. At most 128 characters; a CloudWatch log event id is a 56-digit number."""
    if message["id"]:
        return str(message["id"])[:128]
    detail = {k: v for k, v in message["detail"].items() if k != "forwarded_at"}
    return hashlib.sha256(json.dumps({**message, "detail": detail}, sort_keys=True).encode()).hexdigest()
