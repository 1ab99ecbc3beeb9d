"""The cell router's settings (environment) and its HAProxy configuration (issue 26, docs/router.md).

The router is the unit proxy's data path turned one level up: one HAProxy 2.6 backend whose
servers are the cells' load balancers, `balance leastconn` with the fleet file's weights,
active checks of each cell's `GET /health` every second or two, passive ejection on
connection errors and 5xx, one retry on another cell before the first byte of an answer,
and `X-Served-By-Cell` on every answer. The agent beside it (`unit_proxy.router`) starts
HAProxy, applies evacuations through the runtime API and reports when a cell is empty.

Manual sections are of https://docs.haproxy.org/2.6/configuration.html. Settings are
checked at start (`RouterSettings.from_env`): a bad one names the variable, its value and
what is allowed, and the router exits 2 before it listens.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from unit_proxy.settings import MAX_BUFFER_BYTES, MIN_BUFFER_BYTES, SettingsError, _float, _int

# The fleet file's cell names (inference_fleet.config.CellConfig.name): valid HAProxy server names too.
CELL_NAME = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
BACKEND = "cells"
SERVED_BY_HEADER = "X-Served-By-Cell"
# How long a cell keeps its last resolved address while the VPC resolver fails (`_resolvers`).
DNS_HOLD_FAILED = "1h"
# 5.2 "weight": 0 to 256; 0 takes a cell out of the choice (it is still checked).
MAX_WEIGHT = 256
DEFAULT_WEIGHT = 100
# The system CA bundle of Debian (the image and the build machine): the cells' ALB certificates are ACM ones.
SYSTEM_CA_FILE = "/etc/ssl/certs/ca-certificates.crt"
# A SIGTERM lets streams in flight go on this long (`hard-stop-after`), then HAProxy stops; the
# agent waits a little longer for it to exit (router.serve).
HARD_STOP_SECONDS = 905
# The process's connections beyond the data frontend's maxconn: the health listener's and the runtime API's.
CONTROL_CONNECTIONS = 64
# The backend's table of 429s per cell (render): room for every server id; an entry idle this long
# is dropped (its counter starts again from 0, which the agent reads as a new count).
FULL_TABLE_SIZE = 256
FULL_TABLE_EXPIRE_SECONDS = 600


@dataclass(frozen=True, slots=True)
class CellBackend:
    """One cell behind the router: its name, its load balancer's URL and its weight."""

    name: str
    url: str
    weight: int

    @property
    def https(self) -> bool:
        return urlsplit(self.url).scheme == "https"

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def address(self) -> str:
        parts = urlsplit(self.url)
        port = parts.port or (443 if self.https else 80)
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
        return f"{host}:{port}"


def _cells(env: Mapping[str, str]) -> tuple[CellBackend, ...]:
    """ROUTER_CELLS `name=url,name=url` and ROUTER_WEIGHTS `name=weight,...` (default 100 each)."""
    raw = env.get("ROUTER_CELLS", "").strip()
    allowed = "name=URL pairs separated by commas, e.g. a=http://10.1.0.10:80,b=https://cell-b.example:443"
    if not raw:
        raise SettingsError("ROUTER_CELLS", raw, f"at least one cell: {allowed}")
    urls: dict[str, str] = {}
    for item in raw.split(","):
        name, sep, url = (part.strip() for part in item.partition("="))
        if not sep or not CELL_NAME.match(name):
            raise SettingsError("ROUTER_CELLS", raw, f"{allowed}; names as in the fleet file ({CELL_NAME.pattern})")
        if name in urls:
            raise SettingsError("ROUTER_CELLS", raw, f"each cell once; {name} is given twice")
        parts = urlsplit(url)
        try:
            port_ok = parts.port != 0
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.path not in ("", "/") \
                or parts.query or parts.username:
            raise SettingsError("ROUTER_CELLS", raw, f"cell {name}: an http:// or https:// URL of its load balancer, "
                                                     "scheme, host and port only")
        urls[name] = url.rstrip("/")
    weights = _weights(env, set(urls))
    return tuple(CellBackend(name, url, weights.get(name, DEFAULT_WEIGHT)) for name, url in urls.items())


def _weights(env: Mapping[str, str], names: set[str]) -> dict[str, int]:
    raw = env.get("ROUTER_WEIGHTS", "").strip()
    weights: dict[str, int] = {}
    for item in filter(None, (i.strip() for i in raw.split(","))):
        name, _, value = (part.strip() for part in item.partition("="))
        if name not in names or not value.isdigit() or int(value) > MAX_WEIGHT:
            raise SettingsError("ROUTER_WEIGHTS", raw, f"name=weight pairs of the cells in ROUTER_CELLS "
                                                       f"({', '.join(sorted(names))}), weights 0 to {MAX_WEIGHT}")
        weights[name] = int(value)
    if weights and len(weights) == len(names) and not any(weights.values()):
        raise SettingsError("ROUTER_WEIGHTS", raw, "at least one cell with a weight above 0")
    return weights


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("1", "0", "true", "false"):
        raise SettingsError(name, raw, "1 or 0 (true or false)")
    return raw in ("1", "true")


# The memory of a router task (cell_constructs/router_service.py RouterTaskSize) and what is kept from it for
# the agent (Python, its libraries, botocore), HAProxy's own tables and the page cache of its logs.
DEFAULT_TASK_MEMORY_MIB = 2048
AGENT_RESERVE_MIB = 512
# HAProxy 2.6's own model of a connection's memory when it derives maxconn from a memory limit
# (`-m`, src/haproxy.c v2.6.0, the `mem / ((STREAM_MAX_COST + 2 * global.tune.bufsize) + ...)` loop:
# "stream + 2 buffers per stream", of 97 % of the memory, MEM_USABLE_RATIO include/haproxy/defaults.h),
# with 64 KiB for the stream and a TLS session towards an HTTPS cell. `-m` itself is not used: 2.6.12
# dies of a segmentation fault at start when its limit is small for the buffers (measured, -m 100).
USABLE_MEMORY_RATIO = 0.97
STREAM_COST_BYTES = 64 * 1024


def maxconn_for(memory_mib: int, buffer_bytes: int) -> int:
    """Connections a task of `memory_mib` holds in flight with two buffers of `buffer_bytes` each (at least 1).

    The manual, 3.2 "tune.bufsize": "values larger than default size will increase memory usage,
    possibly causing the system to run out of memory. At least the global maxconn parameter should
    be decreased by the same factor as this one is increased." Measured with the default buffer: a
    stream in flight costs 1.12 MB of RSS (200 streams 245 MB, 400 streams 470 MB): one buffer in
    the steady state, the second while a request and its answer overlap."""
    usable = (memory_mib - AGENT_RESERVE_MIB) * 1024 * 1024 * USABLE_MEMORY_RATIO
    return max(1, int(usable // (2 * buffer_bytes + STREAM_COST_BYTES)))


# GetParameter every 2 s per router task. Parameter Store's default throughput, per account and region, is
# shared by GetParameter, GetParameters and PutParameter (API_GetParameter.html: "This applies to
# GetParameter, GetParameters, and PutParameter API calls for your AWS account and AWS Region"); the
# quotas page (https://docs.aws.amazon.com/general/latest/gr/ssm.html) gives 40 transactions/s for it
# (figure as quoted by secondary sources; the page was not retrieved). Two tasks use 1/s (2.5 %), and up
# to 8 tasks stay under a tenth of it, leaving the rest to the account's other users; an evacuation
# starts within 2 s at every task. docs/router.md "Evacuation".
SSM_POLL_SECONDS = 2.0


def _ssm(env: Mapping[str, str]) -> dict[str, object]:
    """ROUTER_SSM_PREFIX (evacuation from SSM, docs/contracts.md) with its region and poll period."""
    prefix = env.get("ROUTER_SSM_PREFIX", "").strip().rstrip("/")
    poll = _float(env, "ROUTER_SSM_POLL_SECONDS", SSM_POLL_SECONDS, 1, 60)
    task_id = env.get("ROUTER_TASK_ID", "").strip()
    if not prefix:
        return {"ssm_poll_seconds": poll, "task_id": task_id}
    if not re.fullmatch(r"(/[a-zA-Z0-9_.-]+)+", prefix):
        raise SettingsError("ROUTER_SSM_PREFIX", prefix, "an SSM parameter path such as "
                            "/inference-fleet/<Fleet>/router/<region> (letters, digits, _.- between slashes)")
    if env.get("ROUTER_EVACUATION_FILE", "").strip():
        raise SettingsError("ROUTER_SSM_PREFIX", prefix, "either ROUTER_SSM_PREFIX or ROUTER_EVACUATION_FILE, not both")
    region = (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "").strip()
    if not region:
        raise SettingsError("AWS_REGION", "", "the region of the router's SSM parameters (with ROUTER_SSM_PREFIX)")
    return {"ssm_prefix": prefix, "ssm_region": region, "ssm_poll_seconds": poll, "task_id": task_id}


@dataclass(frozen=True)
class RouterSettings:
    """Every setting of the router; docs/router.md lists them with their meaning."""

    cells: tuple[CellBackend, ...]
    host: str = "0.0.0.0"
    port: int = 8080
    # `/router/health` for the ALB's target group check, on a listener of its own: the data listener's
    # maxconn never holds it back (render). 0: any free port (the stack sets ROUTER_HEALTH_PORT 8081;
    # `/router/health` is answered on the data port too).
    health_port: int = 0
    admin_host: str = "127.0.0.1"
    admin_port: int = 9091
    retry: bool = True
    check_interval_ms: int = 1000
    fall: int = 2
    # How long a cell that went down must pass its checks before it takes requests again (rendered as
    # `rise`, rise_checks): at least its load balancer's time to drop a failing unit (the units' target
    # group: a check every 10 s, out after 2 failed, so up to 30 s; inference_fleet.config
    # UNIT_DETECTION_SECONDS, which the stack sets). The router's checks reach one unit of the cell, the
    # one its ALB picks; with a shorter wait a cell with one failing unit of two comes back while the ALB
    # still sends that unit half the checks, and is taken out again (docs/router.md "Rejoining").
    rejoin_seconds: float = 30.0
    error_limit: int = 3
    connect_timeout_ms: int = 1000
    timeout_seconds: float = 905.0
    buffer_bytes: int = 1_130_496
    # The data frontend's maxconn: connections beyond it wait in the listen queue (ROUTER_MAXCONN; 0 here:
    # `default_maxconn`, what the default task holds).
    maxconn: int = 0
    workers: int = 1
    evacuation_file: str = ""
    poll_seconds: float = 1.0
    # A cell that answered 429 is drained this long, doubled while it stays full (unit_proxy.router).
    full_hold_seconds: float = 10.0
    ssm_prefix: str = ""
    ssm_region: str = ""
    ssm_poll_seconds: float = SSM_POLL_SECONDS
    task_id: str = ""
    runtime_dir: str = ""
    ca_file: str = SYSTEM_CA_FILE
    # EMF (unit_proxy.router_metrics): off unless ROUTER_METRICS_NAMESPACE is set.
    metrics_namespace: str = ""
    router_name: str = ""
    emf_interval_seconds: float = 10.0
    ejection_window_seconds: float = 300.0  # RecentCellEjections' window: the ejections alarm's evaluation_minutes

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RouterSettings:
        env = os.environ if env is None else env
        return cls(
            cells=_cells(env),
            host=env.get("ROUTER_HOST", cls.host).strip() or cls.host,
            port=_int(env, "ROUTER_PORT", cls.port, 0, 65535),
            health_port=_health_port(env, cls.health_port),
            admin_host=env.get("ROUTER_ADMIN_HOST", cls.admin_host).strip() or cls.admin_host,
            admin_port=_int(env, "ROUTER_ADMIN_PORT", cls.admin_port, 0, 65535),
            retry=_bool(env, "ROUTER_RETRY", cls.retry),
            check_interval_ms=_int(env, "ROUTER_CHECK_INTERVAL_MS", cls.check_interval_ms, 100, 2000),
            fall=_int(env, "ROUTER_FALL", cls.fall, 1, 10),
            rejoin_seconds=_float(env, "ROUTER_REJOIN_SECONDS", cls.rejoin_seconds, 0.1, 600),
            error_limit=_int(env, "ROUTER_ERROR_LIMIT", cls.error_limit, 1, 100),
            connect_timeout_ms=_int(env, "ROUTER_CONNECT_TIMEOUT_MS", cls.connect_timeout_ms, 100, 10_000),
            timeout_seconds=_float(env, "ROUTER_TIMEOUT_SECONDS", cls.timeout_seconds, 1, 4000),
            **_buffers(env),
            workers=_int(env, "ROUTER_WORKERS", cls.workers, 1, 64),
            evacuation_file=env.get("ROUTER_EVACUATION_FILE", "").strip(),
            poll_seconds=_float(env, "ROUTER_POLL_SECONDS", cls.poll_seconds, 0.05, 60),
            full_hold_seconds=_float(env, "ROUTER_FULL_HOLD_SECONDS", cls.full_hold_seconds, 0.05, 600),
            **_ssm(env),
            runtime_dir=env.get("RUNTIME_DIR", "").strip(),
            ca_file=env.get("ROUTER_CA_FILE", cls.ca_file).strip() or cls.ca_file,
            **_metrics(env),
        )


def fd_maxconn() -> int:
    """The most connections this process's file descriptors allow: two each (client and cell side) and
    a few hundred for listeners, checks and pipes. HAProxy raises its soft limit up to the hard one to
    fit maxconn and refuses to start otherwise ("Cannot raise FD limit"); the hard limit on Fargate is
    the task definition's `nofile` ulimit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1_000_000 if hard == resource.RLIM_INFINITY else max(1, (hard - 256) // 2)


def _health_port(env: Mapping[str, str], default: int) -> int:
    port = _int(env, "ROUTER_HEALTH_PORT", default, 0, 65535)
    data = env.get("ROUTER_PORT", "").strip() or str(RouterSettings.port)
    if port and str(port) == data:
        raise SettingsError("ROUTER_HEALTH_PORT", str(port),
                            f"a port other than ROUTER_PORT ({data}); 0: any free port")
    return port


def default_maxconn(buffer_bytes: int) -> int:
    """What the default task's memory holds, within the file descriptor limit."""
    return min(maxconn_for(DEFAULT_TASK_MEMORY_MIB, buffer_bytes), fd_maxconn())


def _buffers(env: Mapping[str, str]) -> dict[str, int]:
    """ROUTER_BUFFER_BYTES (tune.bufsize) and ROUTER_MAXCONN (default: `default_maxconn`)."""
    buffer_bytes = _int(env, "ROUTER_BUFFER_BYTES", RouterSettings.buffer_bytes, MIN_BUFFER_BYTES, MAX_BUFFER_BYTES)
    maxconn = _int(env, "ROUTER_MAXCONN", default_maxconn(buffer_bytes), 1, fd_maxconn())
    return {"buffer_bytes": buffer_bytes, "maxconn": maxconn}


def _metrics(env: Mapping[str, str]) -> dict[str, object]:
    """ROUTER_METRICS_NAMESPACE and ROUTER_NAME (the EMF dimension `Router`): both or neither."""
    namespace, name = env.get("ROUTER_METRICS_NAMESPACE", "").strip(), env.get("ROUTER_NAME", "").strip()
    if bool(namespace) != bool(name):
        unset = "ROUTER_NAME" if namespace else "ROUTER_METRICS_NAMESPACE"
        raise SettingsError(unset, "", "set ROUTER_METRICS_NAMESPACE and ROUTER_NAME together (EMF needs both) or "
                                       "neither")
    interval = _float(env, "ROUTER_EMF_INTERVAL_SECONDS", RouterSettings.emf_interval_seconds, 0.05, 300)
    window = _float(env, "ROUTER_EJECTION_WINDOW_SECONDS", RouterSettings.ejection_window_seconds, 1, 3600)
    return {"metrics_namespace": namespace, "router_name": name, "emf_interval_seconds": interval,
            "ejection_window_seconds": window}


@dataclass(frozen=True, slots=True)
class RouterPaths:
    """The runtime directory's files and the listening socket HAProxy inherits (as unit_proxy's Paths)."""

    runtime_dir: str
    listen_fd: int
    health_fd: int = -1  # the health listener's socket (ROUTER_HEALTH_PORT); -1: none (a rendering for `haproxy -c`)

    @property
    def config(self) -> str:
        return str(Path(self.runtime_dir) / "router.cfg")

    @property
    def admin_socket(self) -> str:
        return str(Path(self.runtime_dir) / "admin.sock")

    @property
    def master_socket(self) -> str:
        return str(Path(self.runtime_dir) / "master.sock")

    @property
    def ready_map(self) -> str:
        """Empty until the agent adds `ready` (through the runtime API) after its first SSM read."""
        return str(Path(self.runtime_dir) / "ready.map")


def _ms(value: float) -> str:
    return f"{int(value)}ms"


def _server(cell: CellBackend, settings: RouterSettings) -> str:
    line = f"    server {cell.name} {cell.address} weight {cell.weight} check"
    if cell.https:
        # 5.2 "ssl", "verify required", "ca-file", "sni", "check-sni": TLS to the cell's ALB (an ACM
        # certificate for its DNS name), the name sent for the data and the checks alike.
        line += f" ssl verify required ca-file {settings.ca_file} sni str({cell.host}) check-sni {cell.host}"
    if not _is_ip(cell.host):
        # An ALB's addresses change over time: re-resolved from the VPC resolver (5.3.2 "resolvers",
        # 5.2 "resolvers", "init-addr"; "none": the router starts while a name does not resolve yet).
        line += " resolvers vpc init-addr last,libc,none resolve-prefer ipv4"
    return line


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _resolvers(settings: RouterSettings) -> list[str]:
    if all(_is_ip(cell.host) for cell in settings.cells):
        return []
    # 5.3.2 "parse-resolv-conf": the VPC's resolver (the task's /etc/resolv.conf). A server's name is
    # resolved again every `timeout resolve` (1 s by default; ALB DNS records have a 60 s TTL); "hold valid"
    # applies only to do-resolve actions, not to servers (5.3.2), and is kept as it was. "hold <status>": a
    # server is taken DOWN (`MAINT (resolution)`) once no valid answer came within that status's period, 30 s
    # by default: a resolver silent for about 30 s took every DNS-named cell out and the router answered 503 to
    # all, though the cells still served at the addresses it had (a defect hunt, thirty-second session,
    # test_router_dns.py). An hour: the last address is kept and the health checks decide, as they do for an
    # address that went stale (a deleted cell's name, NXDOMAIN, fails its checks too).
    holds = [f"    hold {status} {DNS_HOLD_FAILED}" for status in ("nx", "refused", "timeout", "other")]
    return ["resolvers vpc", "    parse-resolv-conf", "    hold valid 10s", *holds, "    accepted_payload_size 8192",
            ""]


HEALTH_RULE = "    http-request return status 200 content-type text/plain string ok if { path /router/health }"


def _not_ready_rule(settings: RouterSettings, paths: RouterPaths) -> list[str]:
    """With SSM evacuation, 503 to everything until the agent's first SSM read succeeded (it then adds
    `ready` to the map through the runtime API, management guide 9.3 "add map")."""
    if not settings.ssm_prefix:
        return []
    return [f'    http-request return status 503 content-type text/plain string "evacuation not read yet" '
            f'if !{{ str(ready),map({paths.ready_map}) -m found }}']


def _health_frontend(settings: RouterSettings, paths: RouterPaths) -> list[str]:
    """`/router/health` on its own listener (ROUTER_HEALTH_PORT), for the ALB's check: answered while the
    data listener is at its maxconn, which would otherwise hold the check in its listen queue until the
    ALB's 5 s timeout and have ECS replace a task that is only full. Gated on the first SSM read as the
    data listener is."""
    if paths.health_fd < 0:
        return []
    return [
        "frontend health",
        f"    bind fd@{paths.health_fd}",
        f"    maxconn {CONTROL_CONNECTIONS // 2}",
        *_not_ready_rule(settings, paths),
        HEALTH_RULE,
        '    http-request return status 404 content-type text/plain string "only /router/health here"',
        "",
    ]


def fast_inter_ms(settings: RouterSettings) -> int:
    """`fastinter`: the checks' interval while a cell is going up or down (5.2 "fastinter")."""
    return max(settings.check_interval_ms // 2, 100)


def rise_checks(settings: RouterSettings) -> int:
    """`rise` for ROUTER_REJOIN_SECONDS: passing checks in a row that span that time. A cell going up is
    checked every `fastinter` (srv_getinter, src/server.c:97-108 of HAProxy v2.6.0) and one failed check
    takes it back to the start (src/check.c:482-505: below `rise`, health is set to 0), so its last
    `rise` checks passed over (rise - 1) x fastinter. At least 2, the manual's default."""
    return max(2, 1 + math.ceil(settings.rejoin_seconds * 1000 / fast_inter_ms(settings)))


def render(settings: RouterSettings, paths: RouterPaths) -> str:
    """The whole router.cfg for these settings (a pure function; `haproxy -c` runs on it in the tests)."""
    inter = settings.check_interval_ms
    maxconn = settings.maxconn or default_maxconn(settings.buffer_bytes)
    retry = [
        # 4.2 "retries": one more attempt. 4.2 "option redispatch 1": that attempt goes back to the
        # load balancing, which avoids the cell just tried when another is up (leastconn's
        # fwlc_get_next_server(p, srvtoavoid), src/lb_fwlc.c).
        "    retries 1",
        "    option redispatch 1",
        # 4.2 "retry-on": a refused or reset connection, a connection closed with no answer, a 503
        # (a cell with no serving unit: its proxies' `unit_unavailable`, or the ALB's own 503) or a
        # 502 (the cell's engine connection failed before its answer started: measured when a unit's
        # engine is killed under load, its proxy answers 502 until its next health round). The
        # manual: anything beyond conn-failure needs the whole request in one buffer; "Requests not
        # fitting in a single buffer will never be retried" (tune.bufsize below). Once response bytes
        # went to the client, HAProxy cannot retry (a retry replays the request on a new connection
        # and is decided on the response's status line, before it is forwarded).
        "    retry-on conn-failure empty-response 502 503",
        # 4.2 "option http-buffer-request": wait for the body before connecting, so the request is
        # whole in the buffer when a retry needs it (up to tune.bufsize).
        "    option http-buffer-request",
    ] if settings.retry else ["    retries 0"]
    lines = [
        "global",
        f"    nbthread {settings.workers}",
        f"    stats socket {paths.admin_socket} mode 600 level admin",
        # 3.2 "tune.bufsize": the largest request a retry can replay (headers and body together).
        f"    tune.bufsize {settings.buffer_bytes}",
        # 3.2 "maxconn": "Proxies will stop accepting connections when this limit is reached", every
        # listener of the process: so the data frontend has the task's limit (maxconn_for) and the
        # process room beyond it for the health listener and the runtime API.
        f"    maxconn {maxconn + CONTROL_CONNECTIONS}",
        f"    hard-stop-after {HARD_STOP_SECONDS}s",
        "",
        *_resolvers(settings),
        "defaults",
        "    mode http",
        "    option http-no-delay",
        "    option abortonclose",
        f"    timeout connect {_ms(settings.connect_timeout_ms)}",
        f"    timeout client {_ms(settings.timeout_seconds * 1000)}",
        f"    timeout server {_ms(settings.timeout_seconds * 1000)}",
        "    timeout http-request 30s",
        "    timeout http-keep-alive 905s",
        f"    timeout check {_ms(inter)}",
        "",
        "frontend router",
        f"    bind fd@{paths.listen_fd}",
        # 4.2 "maxconn" (frontend): "Excess connections will be queued by the system in the socket's listen
        # queue and will be served once a connection closes": the task's memory stays bounded.
        f"    maxconn {maxconn}",
        # The router's own health, not forwarded (the ALB checks the health listener's, `_health_frontend`).
        # Not ready before the first SSM read: a task that cannot read which cells are evacuated takes no
        # traffic. Every path, not only the health: when every target is unhealthy the ALB fails open and
        # sends to them all (https://docs.aws.amazon.com/elasticloadbalancing/latest/application/target-group-health-checks.html),
        # and a task that never read SSM would then route with no cell evacuated (docs/router.md "Evacuation").
        *_not_ready_rule(settings, paths),
        HEALTH_RULE,
        f"    default_backend {BACKEND}",
        "",
        *_health_frontend(settings, paths),
        f"backend {BACKEND}",
        # 4.2 "balance leastconn": the cell with the fewest open streams relative to its weight.
        "    balance leastconn",
        *retry,
        # 4.2 "option srvtcpka", "srvtcpka-idle", "srvtcpka-intvl": TCP keep-alive probes on the connections
        # to the cells after 60 s of silence, then every 30 s. The path runs through a PrivateLink interface
        # endpoint, reported to close TCP connections idle for 350 s (aws/aws-sdk-js-v3#3624, third-party;
        # no AWS statement found: docs/router.md "Verified only on paper"), and a non-streamed answer or a
        # long prefill can be silent longer than that. Probes are not data: the ALB's HTTP idle timeout
        # still applies beyond them.
        "    option srvtcpka",
        "    srvtcpka-idle 60s",
        "    srvtcpka-intvl 30s",
        # 4.2 "option httpchk", "http-check send/expect": a cell is up while its load balancer's
        # GET /health answers 200: an ALB routes only to healthy targets while it has one (a serving
        # unit's proxy answers 200) and fails open to all when none is (each proxy answers 503).
        "    option httpchk",
        "    http-check send meth GET uri /health ver HTTP/1.1 hdr Host cell-router",
        "    http-check expect status 200",
        # 5.2 "inter", "fastinter", "downinter", "fall", "rise": checked every ROUTER_CHECK_INTERVAL_MS, out
        # after `fall` failed checks, back after passing for ROUTER_REJOIN_SECONDS (rise_checks);
        # 5.2 "observe layer7" + "error-limit" + "on-error mark-down": that many 5xx answers (but 501
        # and 505) or connection errors in a row take the cell out at once, before the next check.
        f"    default-server inter {inter} fastinter {fast_inter_ms(settings)} downinter {inter} fall {settings.fall} "
        f"rise {rise_checks(settings)} observe layer7 error-limit {settings.error_limit} on-error mark-down",
        # Which cell answered (issue 26), replacing any such header from upstream; `http-after-response`, so
        # HAProxy's own answers about a cell (its 504 when the cell is silent, its 502) name it too (4.2: these
        # rules apply to all responses; an `http-response` rule missed them: a defect hunt, thirty-second
        # session). None when no cell was chosen (the 503 with every cell out).
        f"    http-after-response set-header {SERVED_BY_HEADER} %[srv_name] if {{ srv_name -m found }}",
        # The 429s each cell answers (its units at their in-flight limit), per server id, for the agent
        # (unit_proxy.router, `_steer_from_full`): 4.2 "stick-table", "http-response track-sc0",
        # "sc-inc-gpc0"; 7.3.3 "srv_id". A retried answer never gets here (HAProxy 2.6 retries before
        # the response rules); a 429 is never retried (2.6's retry-on has no 429).
        f"    stick-table type integer size {FULL_TABLE_SIZE} expire {FULL_TABLE_EXPIRE_SECONDS}s store gpc0",
        "    http-response track-sc0 srv_id if { status 429 }",
        "    http-response sc-inc-gpc0(0) if { status 429 }",
        *(_server(cell, settings) for cell in settings.cells),
    ]
    return "\n".join(lines) + "\n"
