"""Which requests reach the engine: the route table of each front end, with its methods.

`unit_proxy.haproxy_config` turns this table into HAProxy ACLs on the decoded path
(`path,url_dec`), default deny. Each route answers only the methods it needs (405 with
`Allow` otherwise); routes of the engine that change its state are never forwarded (404),
whatever the spelling of the path (`/v1/%6coad_lora_adapter` decodes to a denied route).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from unit_proxy.settings import OPENAI_ROUTES, TRITON_ROUTES

GET_HEAD = ("GET", "HEAD")
GET = ("GET",)
POST = ("POST",)
API = ("GET", "HEAD", "POST")

# Engine routes under the allowed prefixes that manage the engine rather than serve it.
OPENAI_DENIED = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_OPENAI_METHODS = {"/v1/": API, "/version": GET_HEAD}

# Triton (FRONTEND=triton): default deny; only TRITON_ROUTES pass. Sources, pinned:
# triton-inference-server/server at e1db8a603d863b1317ee859bdeea2be19959462e (2.73.0), its
# docs/protocol/*.md and src/http_server.cc, whose router (HTTPAPIServer::Handle, 4855-4953)
# matches the whole path against
#   server_regex_  /v2(?:/health/(live|ready))?
#   model_regex_   /v2/models/([^/]+)(?:/versions/([0-9]+))?
#                  (?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?
# (http_server.cc:1182-1191). The model routes here use the same segment shapes, so what the
# proxy allows is what Triton routes to metadata, readiness or generation, and nothing else.
# Refused by default deny (never listed), each for its reason:
# - /v2/repository/index, /v2/repository/models/<m>/load|unload: load and unload models
#   (docs/protocol/extension_model_repository.md, "HTTP/REST").
# - /v2/logging (GET, POST): reads and changes the server's log settings (extension_logging.md).
# - /v2/trace/setting and /v2/models/<m>/trace/setting: start tracing, name the trace file
#   (extension_trace.md).
# - /v2/systemsharedmemory/..., /v2/cudasharedmemory/...: register host or CUDA memory regions
#   the server then reads and writes (extension_shared_memory.md).
# - /v2/models/stats, /v2/models/<m>[/versions/<n>]/stats: per-model counts and timings of all
#   traffic (extension_statistics.md); /v2/models/stats is taken by Triton's router before the
#   model routes (http_server.cc:4860), so it is denied by name although it has a model's shape.
# - /v2/models/<m>[/versions/<n>]/config: the model's whole configuration (backend, instance
#   groups, parameters: extension_model_configuration.md), backend details a client does not
#   need; the metadata route gives the inputs and outputs.
# - /v2/models/<m>[/versions/<n>]/infer: the unit's model is decoupled (config.pbtxt.j2,
#   vLLM streams), and Triton's HTTP infer refuses decoupled models
#   (docs/user_guide/decoupled_models.md, "Decoupled models and HTTP"; http_server.cc:3278-3292
#   CheckTransactionPolicy); it would also open the binary-data and shared-memory request
#   parameters (extension_binary_data.md, extension_shared_memory.md) for no use.
TRITON_DENIED = (
    "/v2/repository",
    "/v2/logging",
    "/v2/trace",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
)
TRITON_DENIED_EXACT = ("/v2/models/stats",)
# One model path segment, and Triton's version segment (digits only, model_regex_).
_MODEL_SEGMENT = "[^/]+"
_VERSION = "(/versions/[0-9]+)?"


@dataclass(frozen=True)
class Route:
    prefix: str  # ends with "/": a prefix; starts with "^": a PCRE of the whole path; else the exact path
    methods: tuple[str, ...]

    @property
    def is_prefix(self) -> bool:
        return self.prefix.endswith("/")


@dataclass(frozen=True)
class RouteTable:
    routes: tuple[Route, ...]
    denied: tuple[str, ...]  # exact paths, and everything under them
    denied_exact: tuple[str, ...] = ()  # these paths only


def triton_route(template: str) -> Route:
    """A Triton route from its template: exact without `{model}`; else an anchored regex in
    which `{model}` is one path segment followed by an optional `/versions/<digits>`. The end
    is `\\z`, not `$` (PCRE's `$` also matches before a final newline, which `%0a` decodes to)."""
    methods = POST if template.endswith(("/generate", "/generate_stream")) else GET
    if "{model}" not in template:
        return Route(template, methods)
    head, tail = template.split("{model}")
    return Route("^" + re.escape(head) + _MODEL_SEGMENT + _VERSION + re.escape(tail) + r"\z", methods)


def route_table(frontend: str) -> RouteTable:
    """The engine routes of one front end ('openai' or 'triton')."""
    if frontend == "openai":
        return RouteTable(tuple(Route(p, _OPENAI_METHODS.get(p, POST)) for p in OPENAI_ROUTES), OPENAI_DENIED)
    # Triton's health and metadata handlers answer GET only (405 otherwise, http_server.cc
    # HandleServerHealth, HandleModelReady, HandleModelMetadata, HandleServerMetadata).
    return RouteTable(tuple(triton_route(t) for t in TRITON_ROUTES), TRITON_DENIED, TRITON_DENIED_EXACT)
