"""Which requests reach the engine: the request target checked and matched, with methods.

The engine gets exactly the path that was matched: no library between the check and the
upstream request may normalise or decode it. Targets that an engine's router could read
as a different path than the one matched are refused with 400: dot-segments (`/./`,
`/../`), backslashes, and percent-encoded dots, slashes and backslashes (`%2e`, `%2f`,
`%5c`, in any case), so `/v1/../reset_prefix_cache` or `/v1/%2e%2e/metrics` never reach
the engine's admin routes. Each route answers only the methods it needs (405 with
`Allow` otherwise); routes of the engine that change its state are never forwarded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from unit_proxy.settings import OPENAI_ROUTES, TRITON_ROUTES

GET_HEAD = (b"GET", b"HEAD")
POST = (b"POST",)
API = (b"GET", b"HEAD", b"POST")

# Engine routes under the allowed prefixes that manage the engine rather than serve it.
_OPENAI_DENIED = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_TRITON_DENIED = (
    "/v2/repository",
    "/v2/logging",
    "/v2/trace",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
)
_OPENAI_METHODS = {"/v1/": API, "/version": GET_HEAD}
_BAD_PATH = re.compile(r"%(?:2e|2f|5c)|\\|%(?![0-9a-f]{2})", re.IGNORECASE)


class BadTarget(ValueError):
    """A request target refused with 400; the message names the problem."""


@dataclass(frozen=True)
class Route:
    prefix: str  # ends with "/": a prefix; else the exact path
    methods: tuple[bytes, ...]

    def matches(self, path: str) -> bool:
        return path.startswith(self.prefix) if self.prefix.endswith("/") else path == self.prefix


@dataclass(frozen=True)
class Match:
    route: Route | None  # None: no engine route has this path (404)
    path: str
    target: bytes  # what the engine gets: the checked path and the query, byte for byte


class Routes:
    """The engine routes of one front end."""

    def __init__(self, frontend: str) -> None:
        if frontend == "openai":
            self.routes = tuple(Route(p, _OPENAI_METHODS.get(p, POST)) for p in OPENAI_ROUTES)
            self.denied: tuple[str, ...] = _OPENAI_DENIED
        else:
            self.routes = tuple(Route(p, API) for p in TRITON_ROUTES)
            self.denied = _TRITON_DENIED

    def match(self, target: bytes) -> Match:
        """Check an origin-form target and find its route; raises BadTarget."""
        path_bytes, _, _query = target.partition(b"?")
        path = check_path(path_bytes)
        for route in self.routes:
            if route.matches(path):
                if any(path == d or path.startswith(d + "/") for d in self.denied):
                    return Match(None, path, target)
                return Match(route, path, target)
        return Match(None, path, target)


def check_path(raw: bytes) -> str:
    """The path as text if it names one resource unambiguously; raises BadTarget."""
    try:
        path = raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadTarget("request path must be ASCII (percent-encode other bytes)") from None
    if not path.startswith("/"):
        raise BadTarget("request target must be a path")
    if _BAD_PATH.search(path):
        raise BadTarget("request path must not contain encoded dots or separators, backslashes or bad escapes")
    for segment in path.split("/"):
        if segment in (".", ".."):
            raise BadTarget("request path must not contain dot-segments")
    return path
