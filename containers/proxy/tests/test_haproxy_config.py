"""The rendered HAProxy configuration: accepted by the HAProxy 2.6 that ships in the image
(`haproxy -c`), for each front end and with the gate on and off, and the map it starts with."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from unit_proxy.haproxy_config import ENGINE_HEALTH_LUA, GateMap, Paths, initial_map, map_file, render
from unit_proxy.settings import Settings

HAPROXY = shutil.which("haproxy")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (make tools)")


def _check(settings: Settings, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        paths = Paths(str(tmp_path), sock.fileno())
        Path(paths.config).write_text(render(settings, paths))
        Path(paths.gate_map).write_text(map_file(initial_map(bool(settings.launcher_status_url))))
        Path(paths.lua).write_text(ENGINE_HEALTH_LUA)
        assert HAPROXY is not None
        return subprocess.run(
            [HAPROXY, "-c", "-f", paths.config], pass_fds=[sock.fileno()], capture_output=True, text=True, timeout=30
        )


@needs_haproxy
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"frontend": "triton"},
        {"launcher_status_url": ""},
        {"workers": 1, "request_buffer_bytes": 98304, "max_body_bytes": 16384, "max_inflight": 1},
    ],
    ids=["openai", "triton", "no-gate", "small"],
)
def test_haproxy_accepts_the_config(tmp_path: Path, overrides: dict[str, object]) -> None:
    result = _check(replace(Settings(), **overrides), tmp_path)  # type: ignore[arg-type]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Configuration file is valid" in result.stdout
    assert "WARNING" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_settings_reach_the_config() -> None:
    s = replace(
        Settings(), workers=3, request_buffer_bytes=131072, max_body_bytes=4096, max_inflight=7, retry_after_seconds=4
    )
    text = render(s, Paths("/run/up", 5))
    assert "nbthread 3" in text and "tune.bufsize 131072" in text and "bind fd@5" in text
    assert "srv_conn(engine/vllm) ge 7" in text and "maxconn 7" in text
    assert "Retry-After '4'" in text
    assert "stats socket /run/up/admin.sock mode 600 level admin" in text


def test_routes_are_checked_on_the_decoded_path() -> None:
    text = render(Settings(), Paths("/r", 3))
    # The path is decoded once (set-var) and every route ACL reads the variable.
    assert "http-request set-var(txn.path) path,url_dec" in text
    assert "acl routes_0 var(txn.path) -m beg /v1/" in text
    assert re.search(r"acl routes_\d var\(txn.path\) -m str /tokenize /detokenize", text)
    assert "acl route_denied var(txn.path) -m beg /v1/load_lora_adapter /v1/unload_lora_adapter" in text
    assert "path,url_dec" not in text.replace("set-var(txn.path) path,url_dec", "")
    triton = render(replace(Settings(), frontend="triton"), Paths("/r", 3))
    assert "acl route_denied var(txn.path) -m beg /v2/repository " in triton
    # Issue 28: default deny on Triton too: exact paths and anchored model routes, no /v2/ prefix.
    assert "-m beg /v2/ " not in triton and "-m beg /v2/\n" not in triton
    assert "acl routes_0 var(txn.path) -m str /v2 /v2/health/live /v2/health/ready" in triton
    assert r"'^/v2/models/[^/]+(/versions/[0-9]+)?/generate_stream\z'" in triton
    assert "acl route_denied var(txn.path) -m str /v2/models/stats" in triton
    assert "/v1/" not in re.sub(r"(?m)^.*load_lora.*$", "", triton.split("frontend data")[1].split("backend")[0])


def test_no_gate_without_a_launcher() -> None:
    text = render(replace(Settings(), launcher_status_url=""), Paths("/r", 3))
    assert "gate_open" not in text
    assert initial_map(False)[GateMap.UNIT] == "open" and initial_map(False)[GateMap.DOWN] == "no"
    closed = initial_map(True)
    assert closed[GateMap.UNIT] != "open" and closed[GateMap.DOWN] == "yes"
    assert "unit_unavailable" in closed["err502"]


def test_cut_streams_have_a_ceiling_on_the_whole_backend() -> None:
    # Admission counts the engine server's slots; a stream the slow-reader watchdog cut leaves the
    # server but keeps its buffers in the backend until its client reads or `timeout client` (905 s).
    # Without a backend ceiling, clients that never read pile up cut streams without bound.
    text = render(replace(Settings(), max_inflight=17), Paths("/r", 3))
    assert "acl unit_full srv_conn(engine/vllm) ge 17" in text
    assert "acl unit_full be_conn(engine) ge 34" in text


def test_a_triton_model_error_counts_as_an_engine_error_while_the_unit_goes_down() -> None:
    """Triton's generate answers a model's error with HTTP 400 whatever its code (Triton 2.51.0, measured:
    a decoupled model's TritonError UNAVAILABLE came back 400), so with the Triton front end an engine
    answer from 400 on is the half unit's while the unit goes down (e2e-triton step T4); vLLM's OpenAI
    server answers a dead engine with 500, and its 4xx stay the model's."""
    triton = render(replace(Settings(), frontend="triton"), Paths("/r", 3))
    openai = render(Settings(), Paths("/r", 3))
    assert "acl engine_5xx status ge 400" in triton and "acl engine_5xx status ge 500" not in triton
    assert "acl engine_5xx status ge 500" in openai
