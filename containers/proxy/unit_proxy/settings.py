"""The proxy's settings, read once from the environment (names in docs/contracts.md).

Every value is checked at start: a bad one raises `SettingsError` naming the variable,
the value and what is allowed, and the proxy exits before it listens.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

# Routes the engine front ends serve; anything else is answered 404 by the proxy itself
# so that probes and scanners never reach the engine.
OPENAI_ROUTES: tuple[str, ...] = (
    "/v1/",
    "/tokenize",
    "/detokenize",
    "/version",
    "/invocations",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
)
# Triton's KServe v2 routes a serving client needs (unit_proxy.routes turns them into the
# allowlist; `{model}` is one path segment, each model route also under /versions/<n>).
TRITON_ROUTES: tuple[str, ...] = (
    "/v2",
    "/v2/health/live",
    "/v2/health/ready",
    "/v2/models/{model}",
    "/v2/models/{model}/ready",
    "/v2/models/{model}/generate",
    "/v2/models/{model}/generate_stream",
)
MAX_WORKERS = 64
# HAProxy's buffer bounds: its default (16 KiB) up to 16 MiB (memory: two buffers per stream).
MIN_BUFFER_BYTES = 16 * 1024
MAX_BUFFER_BYTES = 16 * 1024 * 1024
# Buffer bytes a request's body may not use: the header block (up to 64 KiB, the 431 limit of
# unit_proxy.haproxy_config), tune.maxrewrite (1024) and HTX block overhead. A body limit
# this far under the buffer means every admitted body is read whole before the engine is
# contacted (haproxy_config: a body that did not fit is 413, never streamed on).
BUFFER_RESERVE_BYTES = 64 * 1024 + 16 * 1024
# The launcher's endpoint for a failed canary, beside its /status (unit_launcher.rendezvous).
CANARY_FAILED_PATH = "/canary-failed"
# Where the proxy reports that it drained for a follower whose task is stopping (the launcher's
# unit_launcher.rendezvous DRAINED_PATH, answered on loopback only).
DRAINED_PATH = "/drained"
# A unit id (the cell stack's `u<n>`): plain text in a header value and a HAProxy config word.
UNIT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class SettingsError(ValueError):
    """An environment variable of the proxy has a value that is not allowed."""

    def __init__(self, name: str, value: str, allowed: str) -> None:
        super().__init__(f"{name}={value!r} is not allowed: {allowed}")
        self.name = name


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(name, raw, f"an integer from {low} to {high}") from None
    if not low <= value <= high:
        raise SettingsError(name, raw, f"an integer from {low} to {high}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(name, raw, f"a number of seconds from {low:g} to {high:g}") from None
    if not low <= value <= high:
        raise SettingsError(name, raw, f"a number of seconds from {low:g} to {high:g}")
    return value


def _url(env: Mapping[str, str], name: str, default: str, *, optional: bool = False) -> str:
    raw = env.get(name)
    raw = default if raw is None else raw.strip()
    if optional and raw == "":
        return ""
    parts = urlsplit(raw)
    hint = " (or empty to turn it off)" if optional else ""
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise SettingsError(name, raw, f"an http:// or https:// URL with a host and no user{hint}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or (":" in parts.netloc.rsplit("]", 1)[-1] and port is None):
        raise SettingsError(name, raw, f"an http:// or https:// URL whose port is from 1 to 65535{hint}")
    return raw


def _upstream(env: Mapping[str, str], default: str) -> str:
    """The engine's base URL: plain http, a host, a port, and nothing else. A path would
    be prefixed to every forwarded path (`.../v1` gives `/v1/v1/...`), so it is refused."""
    raw = _url(env, "UPSTREAM_URL", default)
    parts = urlsplit(raw)
    if parts.scheme != "http":
        raise SettingsError("UPSTREAM_URL", raw, "an http:// URL (the engine is on this host or its network)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise SettingsError(
            "UPSTREAM_URL", raw, "scheme, host and port only, e.g. http://127.0.0.1:8000 (no path such as /v1)"
        )
    return raw.rstrip("/")


def _host(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name, "").strip() or default
    try:
        ipaddress.ip_address(raw)
    except ValueError:
        raise SettingsError(name, raw, "an IPv4 or IPv6 address to listen on, e.g. 0.0.0.0 or 127.0.0.1") from None
    return raw


def _runtime_dir(env: Mapping[str, str]) -> str:
    raw = env.get("RUNTIME_DIR", "").strip()
    if raw and (not raw.startswith("/") or any(c.isspace() or c in "\"'#$\\" for c in raw) or len(raw) > 80):
        # Unix socket paths are at most 107 bytes; the config quotes nothing.
        raise SettingsError("RUNTIME_DIR", raw, "an absolute path of at most 80 characters without spaces or quotes")
    return raw


@dataclass(frozen=True)
class Settings:
    """Resolved settings of one proxy process."""

    host: str = "0.0.0.0"
    port: int = 8080
    upstream_url: str = "http://127.0.0.1:8000"
    launcher_status_url: str = "http://127.0.0.1:29400/status"
    engine_metrics_url: str = "http://127.0.0.1:8000/metrics"
    frontend: Literal["openai", "triton"] = "openai"
    max_inflight: int = 256
    drain_seconds: float = 120.0
    drain_timeout_seconds: float = 600.0
    metrics_namespace: str = ""
    cell: str = ""
    unit_id: str = ""
    health_interval_seconds: float = 2.0
    health_timeout_seconds: float = 2.0
    emf_interval_seconds: float = 5.0
    # 1 MiB: a 128k-token prompt is about 512 KB of JSON (4 bytes a token).
    max_body_bytes: int = 1024 * 1024
    body_read_timeout_seconds: float = 30.0
    upstream_connect_timeout_seconds: float = 5.0
    upstream_read_timeout_seconds: float = 600.0
    keepalive_timeout_seconds: float = 905.0
    retry_after_seconds: int = 1
    # A write that finds the client's socket full waits at most this long for the client
    # to read; then the stream is dropped and its in-flight slot freed.
    write_timeout_seconds: float = 30.0
    # Deep liveness: while no request is in flight, a one-token completion through the
    # engine every interval (every rank of the unit takes part); 0 turns it off.
    canary_interval_seconds: float = 60.0
    canary_timeout_seconds: float = 60.0
    # After a failed canary: the first retry this long after, doubling per failure in a
    # row up to canary_interval_seconds; retries run even while requests are in flight.
    canary_retry_seconds: float = 5.0
    # /ready, /load, /metrics (and /health with detail): a listener the ALB does not reach.
    admin_host: str = "127.0.0.1"
    admin_port: int = 8081
    # HAProxy's threads (`nbthread`): the data path's cores. The name is kept from the
    # Python data path's worker processes (docs/contracts.md).
    workers: int = 4
    # HAProxy's buffer (`tune.bufsize`): headers and the whole body are read into it before
    # the engine is contacted, so it is at least max_body_bytes + BUFFER_RESERVE_BYTES.
    request_buffer_bytes: int = 1024 * 1024 + BUFFER_RESERVE_BYTES
    # Where the agent keeps HAProxy's config, sockets and map; empty: /tmp/unit-proxy-<pid>.
    runtime_dir: str = ""

    def __post_init__(self) -> None:
        if self.max_body_bytes + BUFFER_RESERVE_BYTES > self.request_buffer_bytes:
            raise SettingsError(
                "MAX_BODY_BYTES",
                str(self.max_body_bytes),
                f"at most REQUEST_BUFFER_BYTES ({self.request_buffer_bytes}) less {BUFFER_RESERVE_BYTES} bytes for"
                f" headers, i.e. {self.request_buffer_bytes - BUFFER_RESERVE_BYTES}: the whole body must fit"
                " HAProxy's buffer, so that no body streams to the engine while it arrives; raise"
                f" REQUEST_BUFFER_BYTES to at least MAX_BODY_BYTES + {BUFFER_RESERVE_BYTES}",
            )

    @property
    def routes(self) -> tuple[str, ...]:
        return OPENAI_ROUTES if self.frontend == "openai" else TRITON_ROUTES

    @property
    def engine_health_url(self) -> str:
        path = "/health" if self.frontend == "openai" else "/v2/health/ready"
        return self.upstream_url + path

    @property
    def upstream_address(self) -> tuple[str, int]:
        parts = urlsplit(self.upstream_url)
        assert parts.hostname is not None
        return parts.hostname, parts.port or 80

    @property
    def launcher_canary_url(self) -> str:
        """Where a failed canary is reported: the launcher's own host and port, which answer
        it on loopback only; empty when the launcher check is off."""
        if not self.launcher_status_url:
            return ""
        parts = urlsplit(self.launcher_status_url)
        return f"{parts.scheme}://{parts.netloc}{CANARY_FAILED_PATH}"

    @property
    def launcher_drained_url(self) -> str:
        """Where the proxy reports that it drained for a stopping follower: the launcher's own
        host and port (loopback only); empty when the launcher check is off."""
        if not self.launcher_status_url:
            return ""
        parts = urlsplit(self.launcher_status_url)
        return f"{parts.scheme}://{parts.netloc}{DRAINED_PATH}"

    @property
    def emf_enabled(self) -> bool:
        return bool(self.metrics_namespace and self.cell and self.unit_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read and check every PROXY setting from `env` (default: os.environ)."""
        env = os.environ if env is None else env
        frontend = env.get("FRONTEND", "openai").strip() or "openai"
        if frontend not in ("openai", "triton"):
            raise SettingsError("FRONTEND", frontend, "'openai' or 'triton'")
        upstream = _upstream(env, cls.upstream_url)
        # Triton serves Prometheus metrics on its own port (8002), vLLM on its API port.
        default_metrics = upstream + "/metrics" if frontend == "openai" else "http://127.0.0.1:8002/metrics"
        namespace = env.get("METRICS_NAMESPACE", "").strip()
        cell = env.get("CELL", "").strip()
        unit_id = env.get("UNIT_ID", "").strip()
        for name, value in (("METRICS_NAMESPACE", namespace), ("CELL", cell)):
            if len(value) > 255 or any(ord(c) < 32 for c in value):
                raise SettingsError(name, value, "at most 255 printable characters")
        if unit_id and not UNIT_ID.fullmatch(unit_id):
            raise SettingsError("UNIT_ID", unit_id, "1 to 64 letters, digits, '.', '_' or '-', the first a letter or "
                                "digit (it is written into the X-Served-By-Unit header of streamed answers)")
        if (namespace or cell) and not all((namespace, cell, unit_id)):
            missing = [n for n, v in (("METRICS_NAMESPACE", namespace), ("CELL", cell), ("UNIT_ID", unit_id)) if not v]
            raise SettingsError(
                missing[0],
                "",
                "METRICS_NAMESPACE and CELL are set together and with UNIT_ID (EMF needs all three), or not at all",
            )
        workers = _int(env, "PROXY_WORKERS", cls.workers, 1, MAX_WORKERS)
        port = _int(env, "PROXY_PORT", cls.port, 1, 65535)
        admin_port = _int(env, "PROXY_ADMIN_PORT", cls.admin_port, 1, 65535)
        if admin_port == port:
            raise SettingsError("PROXY_ADMIN_PORT", str(admin_port), f"a port other than PROXY_PORT ({port})")
        health_interval = _float(env, "HEALTH_INTERVAL_SECONDS", cls.health_interval_seconds, 0.05, 60)
        return cls(
            host=_host(env, "PROXY_HOST", cls.host),
            port=port,
            admin_host=_host(env, "PROXY_ADMIN_HOST", cls.admin_host),
            admin_port=admin_port,
            upstream_url=upstream,
            launcher_status_url=_url(env, "LAUNCHER_STATUS_URL", cls.launcher_status_url, optional=True),
            engine_metrics_url=_url(env, "ENGINE_METRICS_URL", default_metrics, optional=True),
            frontend=frontend,  # type: ignore[arg-type]
            max_inflight=_int(env, "MAX_INFLIGHT", cls.max_inflight, 1, 1_000_000),
            drain_seconds=_float(env, "DRAIN_SECONDS", cls.drain_seconds, 0, 3600),
            drain_timeout_seconds=_float(env, "DRAIN_TIMEOUT_SECONDS", cls.drain_timeout_seconds, 0, 3600),
            metrics_namespace=namespace,
            cell=cell,
            unit_id=unit_id,
            health_interval_seconds=health_interval,
            health_timeout_seconds=_float(env, "HEALTH_TIMEOUT_SECONDS", min(2.0, health_interval * 4), 0.05, 60),
            emf_interval_seconds=_float(env, "EMF_INTERVAL_SECONDS", cls.emf_interval_seconds, 0.05, 300),
            max_body_bytes=_int(env, "MAX_BODY_BYTES", cls.max_body_bytes, 1024, 1024**3),
            body_read_timeout_seconds=_float(
                env, "BODY_READ_TIMEOUT_SECONDS", cls.body_read_timeout_seconds, 0.05, 3600
            ),
            upstream_connect_timeout_seconds=_float(
                env, "UPSTREAM_CONNECT_TIMEOUT_SECONDS", cls.upstream_connect_timeout_seconds, 0.05, 300
            ),
            upstream_read_timeout_seconds=_float(
                env, "UPSTREAM_READ_TIMEOUT_SECONDS", cls.upstream_read_timeout_seconds, 0.05, 86400
            ),
            keepalive_timeout_seconds=_float(
                env, "KEEPALIVE_TIMEOUT_SECONDS", cls.keepalive_timeout_seconds, 0.05, 86400
            ),
            retry_after_seconds=_int(env, "RETRY_AFTER_SECONDS", cls.retry_after_seconds, 0, 3600),
            canary_interval_seconds=_float(env, "CANARY_INTERVAL_SECONDS", cls.canary_interval_seconds, 0, 86400),
            canary_timeout_seconds=_float(env, "CANARY_TIMEOUT_SECONDS", cls.canary_timeout_seconds, 0.1, 3600),
            canary_retry_seconds=_float(env, "CANARY_RETRY_SECONDS", cls.canary_retry_seconds, 0.05, 3600),
            write_timeout_seconds=_float(env, "WRITE_TIMEOUT_SECONDS", cls.write_timeout_seconds, 0.05, 3600),
            workers=workers,
            request_buffer_bytes=_int(
                env, "REQUEST_BUFFER_BYTES", cls.request_buffer_bytes, MIN_BUFFER_BYTES, MAX_BUFFER_BYTES
            ),
            runtime_dir=_runtime_dir(env),
        )


# Every variable `Settings.from_env` reads, with its default and meaning: `--help` prints
# this table, and tests/test_cli.py checks it names exactly the variables from_env reads.
# docs/contracts.md ("Proxy container environment") has the long form.
_D = Settings()
ENVIRONMENT: tuple[tuple[str, str, str], ...] = (
    ("PROXY_HOST", _D.host, "listen address (an IP address); the ALB's target"),
    ("PROXY_PORT", str(_D.port), "listen port: the engine routes and GET /health"),
    ("PROXY_ADMIN_HOST", _D.admin_host, "admin listener address (/ready, /load, /metrics)"),
    ("PROXY_ADMIN_PORT", str(_D.admin_port), "admin listener port; not PROXY_PORT"),
    ("PROXY_WORKERS", str(_D.workers), f"HAProxy threads (nbthread) of the data path, 1-{MAX_WORKERS}"),
    ("UPSTREAM_URL", _D.upstream_url, "the engine's HTTP front end: http://host:port, no path"),
    ("LAUNCHER_STATUS_URL", _D.launcher_status_url, "the launcher's status endpoint; empty: no unit check"),
    ("ENGINE_METRICS_URL", "<UPSTREAM_URL>/metrics", "Prometheus page for load (triton: :8002/metrics); empty: off"),
    ("FRONTEND", _D.frontend, "openai or triton"),
    ("MAX_INFLIGHT", str(_D.max_inflight), "admission limit; 429 beyond"),
    ("DRAIN_SECONDS", f"{_D.drain_seconds:g}", "keep serving new requests this long after SIGTERM"),
    ("DRAIN_TIMEOUT_SECONDS", f"{_D.drain_timeout_seconds:g}", "longest wait for in-flight streams after that"),
    ("METRICS_NAMESPACE", "(unset)", "EMF namespace; with CELL and UNIT_ID, or neither it nor CELL"),
    ("CELL", "(unset)", "EMF dimension Cell"),
    ("UNIT_ID", "(unset)", "the unit: EMF dimension Unit, and the X-Served-By-Unit header of streamed answers"),
    ("HEALTH_INTERVAL_SECONDS", f"{_D.health_interval_seconds:g}", "period of the engine and launcher checks"),
    ("HEALTH_TIMEOUT_SECONDS", f"{_D.health_timeout_seconds:g}", "timeout of each check"),
    ("EMF_INTERVAL_SECONDS", f"{_D.emf_interval_seconds:g}", "period of the EMF lines"),
    ("MAX_BODY_BYTES", str(_D.max_body_bytes), "request body limit (413)"),
    ("BODY_READ_TIMEOUT_SECONDS", f"{_D.body_read_timeout_seconds:g}", "request body read limit (408)"),
    ("UPSTREAM_CONNECT_TIMEOUT_SECONDS", f"{_D.upstream_connect_timeout_seconds:g}", "engine connect timeout (502)"),
    ("UPSTREAM_READ_TIMEOUT_SECONDS", f"{_D.upstream_read_timeout_seconds:g}", "longest engine silence (504)"),
    ("KEEPALIVE_TIMEOUT_SECONDS", f"{_D.keepalive_timeout_seconds:g}", "idle client connection limit"),
    ("RETRY_AFTER_SECONDS", str(_D.retry_after_seconds), "Retry-After of a 429 and a 503"),
    ("WRITE_TIMEOUT_SECONDS", f"{_D.write_timeout_seconds:g}", "longest wait for a client that reads nothing"),
    ("CANARY_INTERVAL_SECONDS", f"{_D.canary_interval_seconds:g}", "one-token canary while idle; 0: off"),
    ("CANARY_TIMEOUT_SECONDS", f"{_D.canary_timeout_seconds:g}", "a slower canary fails"),
    ("REQUEST_BUFFER_BYTES", str(_D.request_buffer_bytes), "HAProxy tune.bufsize: bodies read whole up to it"),
    ("RUNTIME_DIR", "/tmp/unit-proxy-<pid>", "HAProxy's config, sockets and map (created, removed at exit)"),
    ("CANARY_RETRY_SECONDS", f"{_D.canary_retry_seconds:g}", "first retry after a failed canary (doubling)"),
)
del _D
