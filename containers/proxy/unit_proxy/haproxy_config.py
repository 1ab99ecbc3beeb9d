"""The HAProxy 2.6 configuration of the data path: a pure function of the settings.

`render(settings, paths)` returns the text of `haproxy.cfg`; the agent (`unit_proxy.agent`)
writes it into its runtime directory and starts `haproxy -W -db -f <cfg>`. Everything the
data path decides per request is here, in HAProxy's own terms; the agent only feeds it the
unit's state through the runtime API (`set map` on the gate map, see `GateMap`).

Sections cited below are of the HAProxy 2.6 configuration manual,
https://docs.haproxy.org/2.6/configuration.html (the same text ships as
/usr/share/doc/haproxy/configuration.txt.gz in Debian's haproxy 2.6.12-1+deb12u3), and of
the management guide https://docs.haproxy.org/2.6/management.html ("9.3. Unix Socket
commands").

Request order in the `data` frontend (HAProxy evaluates `http-request` rules in declaration
order, 4.2 "http-request"; `use_backend` after all of them):
  the request's date (REQUEST_DATE_VAR) -> framing and target checks (400, 405 CONNECT,
  OPTIONS *, 411 chunked, 400 no Host, NUL,
  Connection) -> header size (431) -> path checks (400) -> /health to the agent ->
  allowlist on the path decoded once into txn.path (404) -> methods (405 with Allow) ->
  unit gate (503 unit_unavailable) -> Content-Length over the limit (413) -> body read
  (wait-for-body: the whole body, as it fits the buffer) -> admission (429) -> the engine.
The gate is checked before the body is read and admission after it, so neither a refused
request nor a slow body ever holds an engine slot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from unit_proxy.routes import GET_HEAD, RouteTable, route_table
from unit_proxy.settings import Settings

# The largest request header block (all header lines) admitted; a larger one that still
# fits HAProxy's buffer gets 431, one that does not gets HAProxy's own 400 (docs/contracts.md).
MAX_HEADER_BYTES = 64 * 1024
# The largest request target (old proxy: 8190, nginx's large_client_header_buffers default).
MAX_TARGET_BYTES = 8190
# Header lines per request (4.2 global "tune.http.maxhdr"; HAProxy answers 400 beyond).
MAX_HEADERS = 128
# Headers never forwarded in either direction: RFC 9110 7.6.1 hop-by-hop headers, and
# HTTP/2-over-cleartext upgrade ones (RFC 9113 3.1 removed h2c; an engine must not see it).
HOP_BY_HOP = (
    "Connection",
    "Keep-Alive",
    "Proxy-Connection",
    "Proxy-Authenticate",
    "Proxy-Authorization",
    "TE",
    "Trailer",
    "Upgrade",
    "HTTP2-Settings",
)
# The variable HAProxy's own engine-error answers set (their status), read by the frontend's
# `http-after-response` rules. Set by the `set-var` converter (7.3.1) inside the answer's
# own body format, so nothing runs for an engine's answer; it was a response header
# (X-Unit-Proxy-Error) deleted by one more rule on every response (callgrind, docs/proxy.md).
ERROR_VAR = "txn.herr"
# The unit_unavailable outcome, set for the log line (LOG_FORMAT) by the `set-var` converter
# inside the refusal's own body, where the body names its type: one rule less on every
# request than a `set-var` rule with the refusal's condition repeated.
OUTCOME_UNAVAILABLE = "%[str(unit_unavailable),set-var(txn.outcome)]"
# The response header naming the unit that answered a stream (settings.unit_id; docs/contracts.md): the
# acceptance kit's 7b tells the stopped unit's streams from the others' by it, as the router's
# X-Served-By-Cell names the cell (router_config.SERVED_BY_HEADER).
SERVED_BY_UNIT_HEADER = "X-Served-By-Unit"
# The ring HAProxy logs each request to (3.9 "Rings"): 4 MiB, about 80,000 lines of lag.
LOG_RING = "agentlog"
LOG_RING_BYTES = 4 * 1024 * 1024
# The variable that holds the wall-clock date (ms) at which the request's headers were taken in:
# the frontend's first rule (`frontend`), the start of the request's time to first token.
REQUEST_DATE_VAR = "txn.rq"
# The variable that holds a streamed answer's time to first token, ms: the wall-clock date at
# which its first body byte reached HAProxy minus REQUEST_DATE_VAR (sse_first_byte_rules).
FIRST_BYTE_VAR = "txn.fb"
# Log line fields, space separated (8.2.6 "Custom log format"; parsed by unit_proxy.haproxy_log).
# The ninth field is FIRST_BYTE_VAR ("-" when unset: not a streamed answer). Both of its dates
# are the wall clock (7.3.2 "date", the thread's `date`): it was %Ta minus the first byte's
# date to the log's, and %Ta is HAProxy's `now`, which does not advance over a poll that
# returned more than 100 ms after its timeout (2.6 src/clock.c `clock_update_date`, "big
# jump forwards"), where `date` does: a HAProxy starved for a second during a stream (measured
# with SIGSTOP) had that second taken out of its TTFT, 0 for a first event at 0.5 s.
# The tenth field is the latency on the same wall clock: the log line's date minus the request's
# ("-" for a request refused before the frontend's rules: no REQUEST_DATE_VAR). %Ta lost the
# stalls the same way (a loaded machine starves HAProxy: 0.28 s for a 0.5 s answer, and a
# stream's TTFT, dated at the log line minus the latency, dated 0.9 s late); the agent takes
# the larger of the two (haproxy_log.latency_ms), as %Ta also counts the request head's arrival.
LOG_FORMAT = ("%ST %Ta %Td %Tr %B %tsc %b %[var(txn.outcome)] %[var(" + FIRST_BYTE_VAR + ")]"
              " %[date(0,ms),sub(" + REQUEST_DATE_VAR + ")]")
# HAProxy's command-line options besides the config file (management guide 3 "Starting
# HAProxy", "-dM"): its process-wide pool of freed objects on. A buffer is `tune.bufsize`
# (1.1 MB by default here, REQUEST_BUFFER_BYTES), twice the per-thread object cache of 2.6
# (CONFIG_HAP_POOL_CACHE_SIZE 524288, include/haproxy/defaults.h:435-437 of the 2.6.12
# release). Each buffer freed into that cache overflows it, which evicts the thread's oldest
# objects of every pool (src/pool.c:537-559, 506-528); with the global pool off, as it is by
# default on glibc 2.26 and later (include/haproxy/compat.h:266-269, defaults.h:430-432,
# src/pool.c:52-54; `haproxy -dMhelp` marks `no-global` set), evicted objects go to free()
# (src/pool.c:433-480, include/haproxy/pool.h:148-153), so every request and every streamed
# token paid malloc/free and page faults of a 1.1 MB buffer. With `global` they go to the
# shared pool, kept up to 1.25x the recent need (pool.h:160-161). Measured on 2.6.12
# (docs/proxy.md "Measured"): 2.7 page faults and ~10 us of CPU per small request and
# 0.9 faults and ~3 us per streamed token before, none and about as with 16 KiB buffers after;
# memory after bursts of 500 KB prompts about as before (glibc kept the freed heap too).
HAPROXY_OPTIONS = ("-dMglobal",)


@dataclass(frozen=True)
class Paths:
    """Where the agent and HAProxy meet: files and Unix sockets in one runtime directory,
    and the listening socket the agent bound and HAProxy inherits."""

    runtime_dir: str
    listen_fd: int

    def _file(self, name: str) -> str:
        return str(Path(self.runtime_dir) / name)

    @property
    def config(self) -> str:
        return self._file("haproxy.cfg")

    @property
    def admin_socket(self) -> str:
        return self._file("admin.sock")

    @property
    def master_socket(self) -> str:
        return self._file("master.sock")

    @property
    def agent_socket(self) -> str:
        return self._file("agent.sock")

    @property
    def lua(self) -> str:
        return self._file("engine_health.lua")

    @property
    def gate_map(self) -> str:
        return self._file("gate.map")


class GateMap:
    """The keys of the gate map, which the agent sets with `set map` after every check round
    (management guide 9.3 "set map"; read per request with the `map` converter, 7.3.1):

    - `unit`: `open` while the launcher's latest check says the unit is whole; else the
      reason in general terms (the data port's 503 body names it, so no addresses).
    - `down`: `yes` while the unit is going down (gate closed, engine unhealthy, draining):
      engine errors are then answered 503 unit_unavailable instead of 502/504.
    - `err502`, `err503`, `err504`: the JSON body of HAProxy's own answer to an engine
      failure (its 503 is a refused connection, re-statused 502); unit_unavailable bodies
      while `down` is yes.
    """

    UNIT = "unit"
    DOWN = "down"
    ERRORS = ("err502", "err503", "err504")


def error_body(status: int, message: str, kind: str) -> str:
    """An OpenAI-style JSON error body (the proxy's contract, docs/contracts.md)."""
    return json.dumps({"error": {"message": message, "type": kind, "code": status}})


UNIT_UNAVAILABLE_PREFIX = "inference unit is not whole, not serving: "
ENGINE_FAILED = "engine connection failed before the answer"
ENGINE_TIMED_OUT = "engine did not answer in time (before the answer)"


def unit_unavailable_body(reason: str) -> str:
    return error_body(503, f"{UNIT_UNAVAILABLE_PREFIX}{reason}; retry", "unit_unavailable")


def engine_error_bodies(down_reason: str | None) -> dict[str, str]:
    """The bodies of HAProxy's own answers to engine failures (GateMap.ERRORS)."""
    if down_reason is not None:
        body = unit_unavailable_body(down_reason)
        return dict.fromkeys(GateMap.ERRORS, body)
    return {
        "err502": error_body(502, ENGINE_FAILED, "upstream_error"),
        "err503": error_body(502, "engine refused the connection or is unreachable", "upstream_unavailable"),
        "err504": error_body(504, ENGINE_TIMED_OUT, "upstream_timeout"),
    }


def initial_map(gated: bool) -> dict[str, str]:
    """The gate map HAProxy starts with: closed until the agent's first check round when the
    unit is gated (LAUNCHER_STATUS_URL set), else open."""
    reason = "no launcher check has completed yet" if gated else None
    doc = {GateMap.UNIT: reason or "open", GateMap.DOWN: "yes" if gated else "no"}
    doc.update(engine_error_bodies(reason))
    return doc


# A Lua action (HAProxy 2.6 is built with Lua 5.3, `haproxy -vv`; configuration manual 3.1
# "lua-load", 4.2 "http-response lua.<name>"; Lua API `core.register_action`,
# `core.httpclient`, https://docs.haproxy.org/2.6/lua-api/index.html): after an engine
# answer of 5xx, ask the engine's own health endpoint now (vLLM answers 503 once its engine
# died), so a dying unit's 500 becomes 503 unit_unavailable before the next check round.
ENGINE_HEALTH_LUA = """\
-- unit_proxy: the engine's health, asked after one of its 5xx answers (txn.engine_ok).
core.register_action("engine_health", {"http-res"}, function(txn, url)
    local ok, res = pcall(function() return core.httpclient():get{url=url, timeout=1000} end)
    txn:set_var("txn.engine_ok", ok and res ~= nil and res.status == 200)
end, 1)
"""


def map_file(entries: dict[str, str]) -> str:
    """A map file: one `key value` per line, the value being the rest of the line (7.3.1 "map")."""
    return "".join(f"{key} {value}\n" for key, value in entries.items())


# -- the rendering ---------------------------------------------------------------------------


def _q(text: str) -> str:
    """A single-quoted config word: no escape, variable or comment processing inside
    (2.2 "Quoting and escaping"); a single quote itself cannot appear."""
    if "'" in text or "\n" in text:
        raise ValueError(f"cannot single-quote {text!r}")
    return f"'{text}'"


def _lf(text: str) -> str:
    """Literal text inside a log-format string: '%' is written '%%' (8.2.6)."""
    return text.replace("%", "%%")


def _seconds(value: float) -> str:
    """A timeout in milliseconds (2.5 "Time format"), at least 1 ms."""
    return f"{max(1, round(value * 1000))}ms"


def _json_return(status: int, kind: str, message_lf: str, headers: dict[str, str] | None = None) -> str:
    """An `http-request return` of a JSON error whose message is a log-format string
    (4.2 "http-request return": `content-type`, `lf-string`, `hdr`); `kind` is literal text
    or a log-format expression that prints it (OUTCOME_UNAVAILABLE)."""
    body = '{"error": {"message": "' + message_lf + '", "type": "' + kind + '", "code": ' + str(status) + "}}"
    extra = "".join(f" hdr {name} {_q(value)}" for name, value in (headers or {}).items())
    return f"return status {status} content-type application/json lf-string {_q(body)}{extra}"


def _method_acl(methods: tuple[str, ...]) -> str:
    """An inline ACL on the method (7.3.6 "method": a list of names, matched by its enum)."""
    return "{ method " + " ".join(methods) + " }"


# The data port's own GET /health (answered by the agent, `use_backend agent_health`): a
# GET/HEAD route like the engine's, so its 405 comes from that group's rule. It had a rule
# of its own, one more ACL term (about 420 instructions) on every request (callgrind).
HEALTH_PATH = "/health"


def _route_groups(table: RouteTable) -> dict[tuple[str, ...], list[str]]:
    """The route prefixes by method set, in the table's order (`routes_<n>` is the n-th),
    with HEALTH_PATH in the GET/HEAD set (added last when the table has none)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for route in table.routes:
        groups.setdefault(route.methods, []).append(route.prefix)
    groups.setdefault(GET_HEAD, []).append(HEALTH_PATH)
    return groups


def _route_acls(table: RouteTable) -> list[str]:
    """ACLs on the path decoded once into txn.path (7.3.1 "url_dec"; 7.1.3 `-m str`, `-m beg`):
    one per method set (`routes_<n>`: its exact paths in one `-m str` list, an indexed lookup,
    and its prefixes in one `-m beg` list), `route_denied` for the management routes (as
    prefixes: everything under them, and longer names, is refused too). Declarations of one
    ACL name are ORed (7.1 "Using ACLs and fetching samples"). Per request each is a variable
    read and one lookup, not a decode."""
    groups = _route_groups(table)
    lines: list[str] = []
    for index, prefixes in enumerate(groups.values()):
        exact = [p for p in prefixes if not p.endswith("/") and not p.startswith("^")]
        begins = [p for p in prefixes if p.endswith("/")]
        if begins:
            lines.append(f"acl routes_{index} var(txn.path) -m beg {' '.join(begins)}")
        if exact:
            lines.append(f"acl routes_{index} var(txn.path) -m str {' '.join(exact)}")
        # Triton's model routes (routes.triton_route): anchored PCRE2 patterns of the whole
        # decoded path (7.1.3 "-m reg").
        regexes = [_q(p) for p in prefixes if p.startswith("^")]
        if regexes:
            lines.append(f"acl routes_{index} var(txn.path) -m reg {' '.join(regexes)}")
    lines.append(f"acl route_denied var(txn.path) -m beg {' '.join(table.denied)}")
    if table.denied_exact:
        lines.append(f"acl route_denied var(txn.path) -m str {' '.join(table.denied_exact)}")
    return lines


def _route_rules(table: RouteTable, frontend: str) -> list[str]:
    """404 for a path no route takes or a denied one, 405 with Allow for a method the route
    does not take. The most used method set (the API prefix) comes first, so the common
    allowed request stops each rule's condition at its first term (an AND stops at its first
    false term, 7.2): its route in the 404 rule, its method in its own 405 rule (every ACL
    term costs about 700 instructions a request, callgrind)."""
    groups = _route_groups(table)
    names = [f"routes_{index}" for index in range(len(groups))]
    unknown = " ".join(f"!{name}" for name in names)
    message = "no route %[path,bytes(0,200),json(ascii)] on this " + frontend + " front end"
    lines = [
        f"http-request {_json_return(404, 'not_found', message)} if {unknown} or route_denied",
    ]
    for index, (name, methods) in enumerate(zip(names, groups, strict=True)):
        allow = ", ".join(methods)
        text = "method %[method] is not allowed here; allowed: " + allow
        terms = [name, f"!{_method_acl(methods)}"]
        lines.append(
            f"http-request {_json_return(405, 'method_not_allowed', text, {'Allow': allow})}"
            f" if {' '.join(reversed(terms) if index == 0 else terms)}"
        )
    return lines


def _global(settings: Settings, paths: Paths) -> list[str]:
    return [
        "global",
        # 3.1 "lua-load": the engine health action (ENGINE_HEALTH_LUA).
        f"    lua-load {paths.lua}",
        # 3.2 "nbthread": the data path's threads (PROXY_WORKERS).
        f"    nbthread {settings.workers}",
        # 3.1 "stats socket" with "level admin" (5.1 bind options "level", "mode"): the
        # runtime API the agent uses for `set map` and `show stat`; only its user may connect.
        f"    stats socket {paths.admin_socket} mode 600 level admin",
        # 3.1 "log" to a ring buffer (3.9 "Rings"), without the syslog header ("format raw"):
        # the agent follows it on the runtime API (`show events <ring> -w -n`) for the request
        # metrics. Not a Unix datagram socket: the kernel queues at most
        # net.unix.max_dgram_qlen (10) datagrams there, and HAProxy dropped lines under load
        # (measured: 23 of 4,000 at 2,900 requests/s).
        f"    log ring@{LOG_RING} len 1024 format raw local0 info",
        # 3.2 "tune.bufsize": the request body read before the engine is contacted is at most
        # this (wait-for-body stops when the buffer is full); headers must fit in it too.
        f"    tune.bufsize {settings.request_buffer_bytes}",
        # 3.2 "tune.http.maxhdr": more header lines than this is 400.
        f"    tune.http.maxhdr {MAX_HEADERS}",
        # 3.2 "tune.pattern.cache-size": no LRU cache of pattern matches. It pays off for
        # costly matches repeated on the same input; ours are string lists and tree lookups,
        # and the two regexes run only behind substring prefilters, so hashing every sample
        # for the cache cost more than it saved (callgrind: about 600 instructions a request).
        "    tune.pattern.cache-size 0",
        # 3.1 "hard-stop-after": after the soft stop (SIGUSR1, the drain), streams still open
        # this long are closed.
        f"    hard-stop-after {_seconds(settings.drain_timeout_seconds)}",
    ]


def client_timeout(settings: Settings) -> float:
    """HAProxy's `timeout client`: see _defaults."""
    return max(settings.write_timeout_seconds, settings.keepalive_timeout_seconds)


def _ring() -> list[str]:
    return [f"ring {LOG_RING}", "    format raw", "    maxlen 1024", f"    size {LOG_RING_BYTES}"]


def _defaults(settings: Settings) -> list[str]:
    return [
        "defaults",
        "    mode http",
        "    log global",
        # 8.2.6 "Custom log format".
        f"    log-format {_q(LOG_FORMAT)}",
        # No "option http-buffer-request" (4.2): it would read the body (and send 100 Continue)
        # before the frontend's rules; "http-request wait-for-body" (4.2) does the same at the
        # chosen point, after the gate and the Content-Length limit.
        # 4.2 "option abortonclose": a client that leaves while its request waits for a
        # connection or in the queue is dropped, not sent to the engine.
        "    option abortonclose",
        # 4.2 "option http-no-delay": no Nagle/MSG_MORE coalescing: every SSE token goes
        # out as it arrives.
        "    option http-no-delay",
        # 4.2 "timeout connect": engine connect timeout (UPSTREAM_CONNECT_TIMEOUT_SECONDS).
        f"    timeout connect {_seconds(settings.upstream_connect_timeout_seconds)}",
        # 4.2 "timeout server": longest engine silence (UPSTREAM_READ_TIMEOUT_SECONDS) -> 504.
        f"    timeout server {_seconds(settings.upstream_read_timeout_seconds)}",
        # 4.2 "timeout client": the client side's inactivity while it must send or read: a
        # client that reads nothing loses its stream after it. HAProxy 2.6 also closes idle
        # keep-alive connections after it whatever "timeout http-keep-alive" says (measured,
        # docs/proxy.md; https://github.com/haproxy/haproxy/issues/2334), and the proxy's
        # keep-alive must outlast the ALB's idle timeout, so it is the larger of
        # WRITE_TIMEOUT_SECONDS and KEEPALIVE_TIMEOUT_SECONDS (docs/contracts.md); the agent
        # cuts a client that reads nothing after WRITE_TIMEOUT_SECONDS (slow_readers.py).
        f"    timeout client {_seconds(client_timeout(settings))}",
        # 4.2 "timeout http-request": the request's headers must arrive within this
        # (BODY_READ_TIMEOUT_SECONDS) -> 408; the body's wait is wait-for-body's own `time`
        # (4.2 "http-request wait-for-body"), set to the same value below.
        f"    timeout http-request {_seconds(settings.body_read_timeout_seconds)}",
        # 4.2 "timeout http-keep-alive": idle time between requests (KEEPALIVE_TIMEOUT_SECONDS;
        # "timeout client" still applies at the lower level, see docs/proxy.md).
        f"    timeout http-keep-alive {_seconds(settings.keepalive_timeout_seconds)}",
        # 4.2 "timeout queue": a request over the engine server's maxconn waits at most this.
        f"    timeout queue {_seconds(settings.upstream_connect_timeout_seconds)}",
        # 4.2 "timeout client-fin" / "timeout server-fin": half-closed connections.
        "    timeout client-fin 5s",
        "    timeout server-fin 5s",
    ]


def _own_errors(settings: Settings) -> list[tuple[int, str, str]]:
    return [
        (400, "malformed request: HTTP/1.1 framing, header syntax, or headers over the buffer or the count limit",
         "bad_request"),
        (408, f"request not received within {settings.body_read_timeout_seconds:g} s", "timeout"),
        (500, "internal proxy error", "internal_error"),
        (501, "not implemented", "bad_request"),
        (502, ENGINE_FAILED, "upstream_error"),
        (503, "service unavailable", "unavailable"),
        (504, ENGINE_TIMED_OUT, "upstream_timeout"),
    ]


def _frontend(settings: Settings, paths: Paths, table: RouteTable) -> list[str]:
    gate = paths.gate_map
    retry = str(settings.retry_after_seconds)
    api = "GET, HEAD, POST"
    rules = [
        # 4.2 "http-error": HAProxy's own answers in the contract's JSON shape, not its HTML.
        *[
            f"    http-error status {status} content-type application/json"
            f" string {_q(error_body(status, message, kind))}"
            for status, message, kind in _own_errors(settings)
        ],
        # 4.2 "bind" with the address 'fd@<n>' (11.1 "Address family prefixes"): the socket the agent
        # bound (a clear error if the port is taken) and HAProxy inherits.
        f"    bind fd@{paths.listen_fd}",
        # The request's start for its time to first token (LOG_FORMAT, sse_first_byte_rules): the first
        # rule, run once the headers are in (4.2 "http-request set-var"; 7.3.2 "date").
        f"    http-request set-var({REQUEST_DATE_VAR}) date(0,ms)",
        # 7.4 "Pre-defined ACLs": METH_CONNECT, METH_OPTIONS, METH_GET (GET and HEAD).
        f"    http-request {_json_return(405, 'method_not_allowed', _lf('CONNECT is not served: this is not a forward proxy'), {'Allow': api})} if METH_CONNECT",  # noqa: E501
        "    http-request return status 200 content-type application/json"
        f" string {_q(json.dumps({'allow': ['GET', 'HEAD', 'POST']}))} hdr Allow {_q(api)} if METH_OPTIONS {{ url * }}",
        # An absolute-form target (`GET http://x/v1/models`) is refused, as an origin-form
        # one is all a reverse proxy behind the ALB gets (7.3.6 "url_beg").
        f"    http-request {_json_return(400, 'bad_request', 'request target must be a path')} if !{{ url_beg / }}",
        # RFC 9112 2.3: HTTP/1.x only (7.3.6 "req.ver"); HAProxy reads `HTTP/2.0` on an
        # HTTP/1 connection as a version it forwards (measured:
        # test_adversarial.py's HTTP/2.0 request line gets this 505).
        f"    http-request {_json_return(505, 'bad_request', 'HTTP version not supported: HTTP/1.0 and HTTP/1.1 only')}"
        " if !{ req.ver -m beg 1. }",
        # RFC 9110 10.1.1: 100-continue is the only expectation; others get 417.
        f"    http-request {_json_return(417, 'expectation_failed', 'only Expect: 100-continue is supported')}"
        " if { req.hdr_cnt(expect) gt 0 } !{ req.fhdr(expect) -m str -i 100-continue }",
        # A chunked request body is refused (RFC 9112 6.3: a server MAY refuse a request without
        # Content-Length with 411; OpenAI clients send Content-Length): HAProxy 2.6 forwards a
        # chunked body's trailer fields as trailers (no rule drops them), and vLLM's
        # uvicorn+httptools merges trailers into the request's headers (docs/contracts.md).
        # Any Transfer-Encoding that reaches this rule is `chunked` alone: HAProxy's parser
        # already refuses a request whose last coding is not chunked or that applies chunked
        # twice, in one header or several (400: h1_parse_xfer_enc_header, src/h1.c:105-160, and
        # 973-990 of v2.6.0), and any coding besides chunked (422: src/mux_h1.c:1624-1638 of
        # v2.6.0; measured on 2.6.12: test_haproxy_rules.py, gzip/xchunked/chunked twice).
        # So one rule (411) and one header lookup per request; the former second rule (400 for
        # "any other Transfer-Encoding") could not fire and cost ~600 instructions a request.
        f"    http-request {_json_return(411, 'length_required', 'a request body must be sent with Content-Length, not chunked')}"  # noqa: E501
        " if { req.hdr_cnt(transfer-encoding) gt 0 }",
        # RFC 9112 3.2: an HTTP/1.1 request without exactly one Host is 400 (HAProxy's parser
        # refuses two; 7.3.6 "req.hdr_cnt", "req.ver").
        f"    http-request {_json_return(400, 'bad_request', 'an HTTP/1.1 request must carry one Host header')}"
        " if !{ req.hdr_cnt(host) eq 1 } !{ req.ver 1.0 }",
        # RFC 9110 5.5: a NUL in a field value is refused (HAProxy 2.6's parser lets it through:
        # measured, test_data_path.py::test_a06_nul_or_bare_cr_in_a_header_never_reaches_the_engine).
        # One PCRE2 (JIT) search for the byte on the header block (7.1.3 "-m reg"; the subject
        # is passed with its length, so a NUL in it is matched, not an end): cheaper than
        # URL-encoding the block and searching for %00 (callgrind: 1,250 instructions a
        # request against 2,000).
        f"    http-request {_json_return(400, 'bad_request', 'a request header contains a NUL byte')}"
        " if { req.hdrs -m reg " + _q(r"\x00") + " }",
        # RFC 9110 7.6.1: a proxy removes the fields that Connection names; `del-header` takes
        # only fixed names (4.2), so a request naming any field other than the hop-by-hop ones
        # deleted in the engine backend (HOP_BY_HOP) or `close` is refused (req.hdr splits
        # Connection at commas, 7.3.6). The usual `keep-alive` or `close` never gets here: HAProxy's
        # H1 parser drops those words from Connection, and the header once empty
        # (H1_MF_CLEAN_CONN_HDR, src/h1.c:271-322 and 1002-1007 of the 2.6.12 release), so a
        # request without Connection pays one header lookup and no regex.
        "    acl conn_named_other req.hdr(connection) -m reg -i "
        + _q("^(?!(" + "|".join(name.lower() for name in (*HOP_BY_HOP, "close")) + ")$)"),
        f"    http-request {_json_return(400, 'bad_request', 'Connection may name only close, keep-alive, te, trailer, upgrade, http2-settings')}"  # noqa: E501
        " if conn_named_other",
        # The header block's size (7.3.6 "req.hdrs", 7.3.1 "length").
        f"    http-request {_json_return(431, 'bad_request', f'request headers exceed {MAX_HEADER_BYTES} bytes')}"
        f" if {{ req.hdrs,length gt {MAX_HEADER_BYTES} }}",
        f"    http-request {_json_return(414, 'bad_request', f'request target exceeds {MAX_TARGET_BYTES} bytes')}"
        f" if {{ url,length gt {MAX_TARGET_BYTES} }}",
        # Paths an engine could read as another path than the one checked: encoded dots,
        # slashes, backslashes or NUL, bad escapes, backslashes, empty segments, dot-segments.
        # All on the raw path: a dot-segment of the decoded path is one of the raw path or
        # comes from an encoded dot or slash, refused here anyway. One substring match first
        # (7.1.3 "-m sub"); the PCRE2 regex (7.1.3 "-m reg") only runs for a path with a '%',
        # a backslash, '//' or '/.' in it, so the common path costs one test.
        "    acl path_odd path -m sub % " + _q("\\") + " // /.",
        "    acl path_bad path -m reg -i " + _q(r"\\|//|%(2e|2f|5c|00)|%(?![0-9a-f]{2})|/\.\.?(/|$)"),
        f"    http-request {_json_return(400, 'bad_request', _lf('request path must not contain dot-segments, empty segments, backslashes, encoded dots or separators, or bad escapes'))}"  # noqa: E501
        " if path_odd path_bad",
        # The decoded path, once (7.3.1 "url_dec", 4.2 "http-request set-var").
        "    http-request set-var(txn.path) path,url_dec",
        # GET /health: the agent's answer (its internal listener), GET and HEAD only.
        # GET /health is answered by the agent (use_backend below); its methods are checked
        # with the GET/HEAD routes (HEALTH_PATH).
        f"    acl is_health var(txn.path) -m str {HEALTH_PATH}",
        *[f"    {line}" for line in _route_acls(table)],
        *[f"    {line}" for line in _route_rules(table, settings.frontend)],
    ]
    if settings.launcher_status_url:
        # The unit gate (7.3.1 "map"): the agent's verdict, and the agent itself answering
        # its checks (7.3.2 "nbsrv"): a hung agent closes the gate too. The usually false term
        # comes first in each condition (an AND stops at its first false term, 7.2), so an open
        # gate costs one test per rule.
        unit = f"str({GateMap.UNIT}),map({gate},closed)"
        rules += [
            f"    acl gate_open {unit} -m str open",
            "    acl agent_alive nbsrv(agent_gate) gt 0",
            # The log's outcome is set by the body itself (OUTCOME_UNAVAILABLE), not by a
            # set-var rule that repeated both conditions on every request.
            f"    http-request {_json_return(503, OUTCOME_UNAVAILABLE, _lf(UNIT_UNAVAILABLE_PREFIX) + 'the unit proxy agent is not answering; retry', {'Retry-After': retry})}"  # noqa: E501
            " if !agent_alive !is_health",
            f"    http-request {_json_return(503, OUTCOME_UNAVAILABLE, _lf(UNIT_UNAVAILABLE_PREFIX) + '%[' + unit + ']; retry', {'Retry-After': retry})}"  # noqa: E501
            " if !gate_open !is_health",
        ]
    limit = settings.max_body_bytes
    rules += [
        # 413 by Content-Length before the body is read (7.3.6 "req.body_size": the announced
        # length, or what arrived of a chunked body).
        f"    http-request {_json_return(413, 'too_large', f'request body exceeds the limit of {limit} bytes')}"
        f" if {{ req.body_size gt {limit} }} !is_health",
        # 4.2 "http-request wait-for-body": the body is read (up to the buffer) before the
        # admission check, so a slow body holds no engine slot. The settings keep
        # MAX_BODY_BYTES + the header reserve within the buffer (settings.BUFFER_RESERVE_BYTES),
        # so every admitted body is read whole here, never streamed on while it arrives. No
        # condition: a request without a body (GET /health) passes at once.
        f"    http-request wait-for-body time {_seconds(settings.body_read_timeout_seconds)}",
        # Admission (7.3.2 "srv_conn", "srv_queue"): the engine's connections now, or any request
        # queued at its maxconn -> 429 beyond MAX_INFLIGHT. The server's count, not the
        # backend's (be_conn): a stream whose engine side the agent cut (slow_readers.py) holds
        # no engine slot, but stays in the backend until its client takes what is buffered
        # (measured: backend scur 1, server scur 0; HAProxy 2.6 src/stream.c:1847-1855). Two
        # `acl` lines of one name are ORed (7.2). The log line of this 429 carries no outcome:
        # the agent counts a 429 answered by the frontend itself (the log's backend field is
        # then the frontend's name, `data`) as rejected (haproxy_log.record), which saves a rule
        # evaluation on every request.
        f"    acl unit_full srv_conn(engine/vllm) ge {settings.max_inflight}",
        "    acl unit_full srv_queue(engine/vllm) gt 0",
        # And a ceiling on the whole backend: cut streams still hold their buffers (about
        # 1.1 MB each) until their clients read or `timeout client` (905 s). Without it,
        # clients that never read could pile up MAX_INFLIGHT cut streams every
        # WRITE_TIMEOUT_SECONDS (about 1,900 at 64 over 905 s); with it, at most as many as
        # the engine's own slots.
        f"    acl unit_full be_conn(engine) ge {2 * settings.max_inflight}",
        f"    http-request {_json_return(429, 'overloaded', f'unit at its in-flight limit ({settings.max_inflight}); retry', {'Retry-After': retry})}"  # noqa: E501
        " if unit_full !is_health",
        # Engine failures answered by HAProxy itself set ERROR_VAR (backend engine's
        # http-error lines): while the unit goes down they become 503 unit_unavailable (the
        # body, Retry-After and the log's outcome already come from the gate map, see
        # _engine_backend), else HAProxy's 503 (connection refused) is the contract's 502
        # (4.2 "http-after-response": runs on HAProxy's own answers too). Two rules, each
        # testing the status first (a field of the response already parsed): an engine's
        # answer pays two status tests (it paid five rules before, and a header deletion).
        f"    acl going_down str({GateMap.DOWN}),map({gate},yes) -m str yes",
        f"    acl haproxy_error var({ERROR_VAR}) -m found",
        "    http-after-response set-status 503 if { status 502 504 } haproxy_error going_down",
        "    http-after-response set-status 502 if { status 503 } haproxy_error !going_down",
        "    use_backend agent_health if is_health",
        "    default_backend engine",
    ]
    return ["frontend data", *rules]


def _names_regex(names: tuple[str, ...]) -> str:
    """A regex matching exactly these header names, as HAProxy stores them (lower case)."""
    return _q("^(" + "|".join(name.lower() for name in names) + ")$")


def _engine_backend(settings: Settings, paths: Paths) -> list[str]:
    host, port = settings.upstream_address
    gate = paths.gate_map
    retry = str(settings.retry_after_seconds)
    lines = ["backend engine"]
    # 4.2 "http-request del-header" / "http-response del-header": hop-by-hop headers never
    # travel (HAProxy manages the connection itself), nor `Expect` (HAProxy answers it).
    # One rule each way with `-m reg` (one pass over the headers,
    # not one per name: callgrind, about 2,800 instructions a request less); HAProxy stores
    # header names in lower case (htx_add_header, include/haproxy/htx.h:487 of 2.6.12).
    lines += [f"    http-request del-header {_names_regex((*HOP_BY_HOP, 'Expect'))} -m reg"]
    lines += [f"    http-response del-header {_names_regex(HOP_BY_HOP)} -m reg"]
    # A dying unit's engine answers 5xx (vLLM 0.32 on CPU, make e2e step 3): while the unit
    # is going down such answers are the half unit's, not the model's (4.2 "http-response return").
    # Triton's generate extension answers a model's error with 400 whatever its code (measured with
    # Triton 2.51.0: a decoupled Python model's TritonError UNAVAILABLE came back as HTTP 400; the
    # triton branch's e2e-triton step T4), so for Triton an engine error is any status from 400 on.
    error_from = 500 if settings.frontend == "openai" else 400
    lines += [
        f"    acl going_down str({GateMap.DOWN}),map({gate},yes) -m str yes",
        f"    acl engine_5xx status ge {error_from}",
    ]
    down = "engine_5xx going_down"
    if settings.launcher_status_url:
        # The unit is whole as of the last round: ask the engine now (ENGINE_HEALTH_LUA).
        lines += [
            f"    http-response lua.engine_health {settings.engine_health_url} if engine_5xx !going_down",
            "    acl engine_ok var(txn.engine_ok) -m bool",
        ]
        down += " or engine_5xx !engine_ok"
    lines += [
        # The log's outcome is set by the body (OUTCOME_UNAVAILABLE): one rule, not two.
        f"    http-response {_json_return(503, OUTCOME_UNAVAILABLE, _lf(UNIT_UNAVAILABLE_PREFIX) + 'the unit is going down; retry', {'Retry-After': retry})}"  # noqa: E501
        f" if {down}",
    ]
    # 4.2 "http-error": HAProxy's own answers to engine failures, bodies from the gate map.
    # The body's format also sets ERROR_VAR (its status; `bytes(9)` leaves nothing of it in
    # the body) and, while the unit goes down, the log's outcome; `Retry-After` is sent only
    # while it goes down (a header whose format gives nothing is not added:
    # http_reply_to_htx, src/http_ana.c:4787-4794 of v2.6.0). These formats run only when
    # HAProxy answers an engine failure itself.
    down_only = f"%[str({GateMap.DOWN}),map({gate},yes),regsub(^no$,),regsub(^yes$,{{}})"
    for status in (502, 503, 504):
        mark = f"%[str({status}),set-var({ERROR_VAR}),bytes(9)]"
        outcome = down_only.format("unit_unavailable") + ",set-var(txn.outcome),bytes(99)]"
        lines.append(
            f"    http-error status {status} content-type application/json"
            f" lf-string {_q(mark + outcome + f'%[str(err{status}),map({gate})]')}"
            f" hdr Retry-After {_q(down_only.format(retry) + ']')}"
        )
    lines += sse_first_byte_rules(settings)
    # 5.2 "maxconn": the hard bound behind the srv_conn admission check (a race between
    # threads queues, never exceeds).
    lines.append(f"    server vllm {host}:{port} maxconn {settings.max_inflight}")
    return lines


def first_byte_wait(settings: Settings) -> float:
    """The `time` of the SSE answers' wait for their first body byte: longer than `timeout
    server`, so the engine's silence limit ends a wait, never this one (sse_first_byte_rules)."""
    return settings.upstream_read_timeout_seconds + 1


def sse_first_byte_rules(settings: Settings) -> list[str]:
    """The time of a streamed answer's first body byte, taken in the data path (docs/proxy.md
    "Time to first token"). vLLM answers a stream with Starlette's StreamingResponse
    (vllm/entrypoints/openai/chat_completion/api_router.py at vllm-project/vllm c0bc59655a40,
    media type text/event-stream), which sends `http.response.start` before it iterates the
    generator (starlette/responses.py StreamingResponse.stream_response, encode/starlette
    02aa6eb9588f), and uvicorn writes the headers then: they leave before the first token
    exists (measured by the cold review: curl saw them at 3 ms, the first token at 3 s), so
    they say nothing of it. Triton's generate_stream answers `text/event-stream;
    charset=utf-8` (src/http_server.cc:4487-4491 at triton-inference-server/server e1db8a603d86).

    Every engine answer is held until its first body byte (4.2 "http-response wait-for-body",
    `at-least 1`: the wait ends once one byte of payload, the whole payload or a full buffer
    is there, and at once for an answer without a body, src/http_ana.c:4222-4256 of 2.6.12);
    then, for an answer whose Content-Type is text/event-stream (RFC 9110 8.3.1: case-
    insensitive) and that has a body byte (7.3.6 "res.body_len": the wait also ends, with
    nothing, when either side closed first, src/http_ana.c:4264-4269, as when the client
    leaves during the prefill), FIRST_BYTE_VAR takes the date (7.3.2 "date", "ms": the thread's date of the
    poll loop's wake-up that brought the byte, src/clock.c:150-196) minus the request's
    (REQUEST_DATE_VAR; 7.3.1 "sub", whose argument may name a variable). The headers leave with
    the first event, so the client's first token comes no later than before. The wait has no
    condition: an answer that came whole (every non-streamed one measured) passes it at once,
    for about 100 instructions, where testing the Content-Type costs about 1,000 (callgrind,
    docs/proxy.md); the date, which needs the test, is taken for streams only.

    The wait's own timeout answers 504 and ends the request (src/http_ana.c:4258-4262 and
    4283-4292), so it is longer than `timeout server` (first_byte_wait): an engine silent for
    UPSTREAM_READ_TIMEOUT_SECONDS before its first body byte gets HAProxy's 504 either way; it
    was a 200 whose body was cut, as the headers had left."""
    rules = [
        f"    http-response wait-for-body time {_seconds(first_byte_wait(settings))} at-least 1",
        f"    http-response set-var({FIRST_BYTE_VAR}) date(0,ms),sub({REQUEST_DATE_VAR})"
        " if { res.fhdr(content-type) -m beg -i text/event-stream } { res.body_len gt 0 }",
    ]
    if settings.unit_id:
        # The same streams name their unit (SERVED_BY_UNIT_HEADER), tested by the variable the rule above set: on
        # every answer, the header cost about 1,600 instructions a request (3 % of a completion), the test about
        # 180 (callgrind, docs/proxy.md). `add-header`: the engine sends no such header of its own.
        rules.append(f"    http-response add-header {SERVED_BY_UNIT_HEADER} {_q(settings.unit_id)}"
                     f" if {{ var({FIRST_BYTE_VAR}) -m found }}")
    return rules


def _agent_backends(settings: Settings, paths: Paths) -> list[str]:
    interval = _seconds(settings.health_interval_seconds)
    return [
        # The data port's GET /health, answered by the agent on its internal listener.
        "backend agent_health",
        f"    timeout server {_seconds(settings.health_timeout_seconds + 1)}",
        "    http-error status 503 content-type text/plain string 'unhealthy: proxy agent not answering'",
        "    http-error status 502 content-type text/plain string 'unhealthy: proxy agent not answering'",
        "    http-error status 504 content-type text/plain string 'unhealthy: proxy agent not answering'",
        "    http-response del-header Server",
        f"    server agent {paths.agent_socket}",
        # The agent's liveness (4.2 "option httpchk", 5.2 "check", "inter", "fall", "rise";
        # 4.2 "timeout check"): its /gate answers 200 while its check rounds are fresh. A dead
        # or hung agent fails the check, nbsrv(agent_gate) drops to 0 and the gate closes.
        "backend agent_gate",
        "    option httpchk GET /gate",
        f"    timeout check {_seconds(settings.health_timeout_seconds)}",
        f"    server agent {paths.agent_socket} check inter {interval} fall 3 rise 1",
    ]


def render(settings: Settings, paths: Paths) -> str:
    """The whole haproxy.cfg for these settings."""
    table = route_table(settings.frontend)
    sections = [
        _global(settings, paths),
        _ring(),
        _defaults(settings),
        _frontend(settings, paths, table),
        _engine_backend(settings, paths),
        _agent_backends(settings, paths),
    ]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"
