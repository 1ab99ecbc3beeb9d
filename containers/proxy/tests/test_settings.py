"""Settings from the environment: defaults, and clear errors for bad values."""

from __future__ import annotations

import subprocess
import sys

import pytest
from unit_proxy.settings import Settings, SettingsError


def test_defaults_follow_the_contract():
    s = Settings.from_env({})
    assert s.port == 8080 and s.upstream_url == "http://127.0.0.1:8000"
    assert s.launcher_status_url == "http://127.0.0.1:29400/status"
    assert s.engine_health_url == "http://127.0.0.1:8000/health"
    assert s.engine_metrics_url == "http://127.0.0.1:8000/metrics"
    assert s.drain_timeout_seconds == 600 and s.frontend == "openai" and not s.emf_enabled
    assert s.workers == 4 and Settings.from_env({"PROXY_WORKERS": "1"}).workers == 1
    assert (s.admin_host, s.admin_port, s.write_timeout_seconds) == ("127.0.0.1", 8081, 30.0)
    assert (s.canary_interval_seconds, s.canary_timeout_seconds, s.canary_retry_seconds) == (60, 60, 5)


def test_triton_frontend_and_overrides():
    s = Settings.from_env(
        {
            "FRONTEND": "triton",
            "UPSTREAM_URL": "http://127.0.0.1:9000/",
            "MAX_INFLIGHT": "32",
            "DRAIN_SECONDS": "5",
            "METRICS_NAMESPACE": "Rufus/UnitProxy",
            "CELL": "dev",
            "UNIT_ID": "u3",
            "LAUNCHER_STATUS_URL": "",
        }
    )
    assert s.routes[:3] == ("/v2", "/v2/health/live", "/v2/health/ready") and s.engine_health_url == "http://127.0.0.1:9000/v2/health/ready"
    assert s.engine_metrics_url == "http://127.0.0.1:8002/metrics"
    assert s.max_inflight == 32 and s.drain_seconds == 5 and s.emf_enabled and s.launcher_status_url == ""


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PROXY_PORT": "http"}, "PROXY_PORT='http' is not allowed: an integer from 1 to 65535"),
        ({"MAX_INFLIGHT": "0"}, "MAX_INFLIGHT='0'"),
        ({"FRONTEND": "grpc"}, "'openai' or 'triton'"),
        ({"UPSTREAM_URL": "127.0.0.1:8000"}, "UPSTREAM_URL='127.0.0.1:8000' is not allowed: an http://"),
        ({"DRAIN_TIMEOUT_SECONDS": "-1"}, "DRAIN_TIMEOUT_SECONDS"),
        ({"CELL": "dev"}, "METRICS_NAMESPACE and CELL are set together and with UNIT_ID"),
        ({"CELL": "dev", "METRICS_NAMESPACE": "Rufus/UnitProxy"}, "UNIT_ID='' is not allowed: METRICS_NAMESPACE"),
        ({"UNIT_ID": "u 0"}, "UNIT_ID='u 0' is not allowed: 1 to 64 letters, digits"),
        ({"UNIT_ID": "u0'"}, "UNIT_ID=\"u0'\" is not allowed"),
        ({"PROXY_WORKERS": "0"}, "PROXY_WORKERS='0' is not allowed: an integer from 1 to 64"),
        ({"PROXY_WORKERS": "four"}, "PROXY_WORKERS='four'"),
        ({"PROXY_ADMIN_PORT": "8080"}, "a port other than PROXY_PORT (8080)"),
        ({"PROXY_ADMIN_HOST": "localhost"}, "an IPv4 or IPv6 address"),
        ({"WRITE_TIMEOUT_SECONDS": "0"}, "WRITE_TIMEOUT_SECONDS='0'"),
        ({"CANARY_RETRY_SECONDS": "0"}, "CANARY_RETRY_SECONDS='0' is not allowed: a number of seconds from 0.05"),
        ({"UPSTREAM_URL": "https://127.0.0.1:8000"}, "an http:// URL"),
        ({"UPSTREAM_URL": "http://127.0.0.1:8000/v1"}, "no path such as /v1"),
        ({"UPSTREAM_URL": "http://127.0.0.1:0"}, "port is from 1 to 65535"),
    ],
)
def test_bad_values_name_the_variable_and_what_is_allowed(env, fragment):
    with pytest.raises(SettingsError, match="is not allowed") as info:
        Settings.from_env(env)
    assert fragment in str(info.value)


def test_process_exits_2_with_the_message_on_bad_settings():
    proc = subprocess.run(
        [sys.executable, "-m", "unit_proxy"],
        env={"PROXY_PORT": "99999", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "PROXY_PORT='99999' is not allowed" in proc.stderr


def test_a_failed_canary_is_reported_beside_the_launchers_status():
    assert Settings.from_env({}).launcher_canary_url == "http://127.0.0.1:29400/canary-failed"
    custom = Settings.from_env({"LAUNCHER_STATUS_URL": "http://127.0.0.1:29500/status"})
    assert custom.launcher_canary_url == "http://127.0.0.1:29500/canary-failed"
    assert Settings.from_env({"LAUNCHER_STATUS_URL": ""}).launcher_canary_url == ""


def test_haproxy_buffer_and_runtime_dir():
    s = Settings.from_env({})
    assert s.request_buffer_bytes == 1024 * 1024 + 80 * 1024 and s.max_body_bytes == 1024 * 1024
    assert s.runtime_dir == ""
    small = Settings.from_env({"REQUEST_BUFFER_BYTES": "98304", "MAX_BODY_BYTES": "16384"})
    assert small.request_buffer_bytes == 98304
    with pytest.raises(SettingsError, match="REQUEST_BUFFER_BYTES"):
        Settings.from_env({"REQUEST_BUFFER_BYTES": "1000"})  # below HAProxy's default buffer


def test_the_body_limit_must_fit_the_buffer():
    """A body larger than HAProxy's buffer would stream to the engine while it arrives and
    hold an engine slot (test_data_path.py::test_d3_a_large_dribbled_body_holds_no_engine_slot):
    the settings refuse such a pair, naming both variables."""
    with pytest.raises(SettingsError, match=r"MAX_BODY_BYTES.*REQUEST_BUFFER_BYTES"):
        Settings.from_env({"MAX_BODY_BYTES": str(2 * 1024 * 1024)})
    with pytest.raises(SettingsError, match=r"MAX_BODY_BYTES.*REQUEST_BUFFER_BYTES"):
        Settings.from_env({"REQUEST_BUFFER_BYTES": str(512 * 1024)})
    fits = Settings.from_env(
        {"MAX_BODY_BYTES": str(2 * 1024 * 1024), "REQUEST_BUFFER_BYTES": str(2 * 1024 * 1024 + 81920)}
    )
    assert fits.max_body_bytes == 2 * 1024 * 1024
    assert Settings.from_env({"RUNTIME_DIR": "/run/unit-proxy"}).runtime_dir == "/run/unit-proxy"
    for bad in ("relative/dir", "/with space", "/q'uote", "/" + "x" * 90):
        with pytest.raises(SettingsError, match="RUNTIME_DIR"):
            Settings.from_env({"RUNTIME_DIR": bad})


def test_a_unit_id_alone_names_the_unit_without_emf():
    """UNIT_ID without METRICS_NAMESPACE and CELL: the streamed answers name the unit (X-Served-By-Unit), no EMF."""
    s = Settings.from_env({"UNIT_ID": "u3"})
    assert s.unit_id == "u3" and not s.emf_enabled
