"""Which requests reach the engine: the route table of each front end, with its methods.

`unit_proxy.haproxy_config` turns this table into HAProxy ACLs on the decoded path
(`path,url_dec`), default deny. Each route answers only the methods it needs (405 with
`Allow` otherwise); routes of the engine that change its state are never forwarded (404),
whatever the spelling of the path (`/v1/%6coad_lora_adapter` decodes to a denied route).
"""

from __future__ import annotations

from dataclasses import dataclass

from unit_proxy.settings import OPENAI_ROUTES, TRITON_ROUTES

GET_HEAD = ("GET", "HEAD")
POST = ("POST",)
API = ("GET", "HEAD", "POST")

# Engine routes under the allowed prefixes that manage the engine rather than serve it.
OPENAI_DENIED = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
TRITON_DENIED = (
    "/v2/repository",
    "/v2/logging",
    "/v2/trace",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
)
_OPENAI_METHODS = {"/v1/": API, "/version": GET_HEAD}


@dataclass(frozen=True)
class Route:
    prefix: str  # ends with "/": a prefix; else the exact path
    methods: tuple[str, ...]

    @property
    def is_prefix(self) -> bool:
        return self.prefix.endswith("/")


@dataclass(frozen=True)
class RouteTable:
    routes: tuple[Route, ...]
    denied: tuple[str, ...]  # exact paths, and everything under them


def route_table(frontend: str) -> RouteTable:
    """The engine routes of one front end ('openai' or 'triton')."""
    if frontend == "openai":
        return RouteTable(tuple(Route(p, _OPENAI_METHODS.get(p, POST)) for p in OPENAI_ROUTES), OPENAI_DENIED)
    return RouteTable(tuple(Route(p, API) for p in TRITON_ROUTES), TRITON_DENIED)
