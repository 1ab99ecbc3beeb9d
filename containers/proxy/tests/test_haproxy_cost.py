"""HAProxy's own cost per request under the unit's configuration (issue 25's bench targets).

The 1.1 MB request buffer (`REQUEST_BUFFER_BYTES`, so that `wait-for-body` holds a whole
1 MiB body) is twice HAProxy 2.6's per-thread object cache: without its global pool
(`-dMglobal`, `haproxy_config.HAPROXY_OPTIONS`) every freed buffer flushed that cache to
malloc/free, and HAProxy's worker took 2.7 minor page faults and about 10 us of CPU per small
request (docs/proxy.md "Measured"). Page faults are counted by the kernel per process, so the
guard holds on a loaded machine where CPU time would not.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from unit_proxy.agent import start
from unit_proxy.haproxy_config import HAPROXY_OPTIONS, Paths, render
from unit_proxy.settings import Settings

from .conftest import LOOPBACK, FakeEngine, burst, children, minor_faults

REQUESTS = 400
CONNECTIONS = 8
# Measured with the global pool: 0.00-0.01 faults a request; without: 2.4-2.8.
MAX_FAULTS_PER_REQUEST = 0.5


async def test_small_requests_do_not_page_fault_haproxy_with_the_default_buffer(engine: FakeEngine):
    settings = Settings(
        host=LOOPBACK, port=0, admin_host=LOOPBACK, admin_port=0, upstream_url=engine.url,
        launcher_status_url="", engine_metrics_url=engine.url + "/metrics", workers=1,
    )
    assert settings.request_buffer_bytes > 1024 * 1024  # the default this guards
    running = await start(settings)
    try:
        workers = children(running.process.pid)
        assert len(workers) == 1, workers  # -W: the master and one worker
        url = f"http://{LOOPBACK}:{running.port}"
        assert set(await burst(url, 100, CONNECTIONS)) == {200}  # warm-up: pools and heap at their size
        before = minor_faults(workers[0])
        assert set(await burst(url, REQUESTS, CONNECTIONS)) == {200}
        per_request = (minor_faults(workers[0]) - before) / REQUESTS
    finally:
        await running.close()
    print(f"HAProxy worker: {per_request:.2f} minor page faults per request")
    assert per_request < MAX_FAULTS_PER_REQUEST, (
        f"{per_request:.2f} page faults per request: is HAProxy's global pool on (HAPROXY_OPTIONS)?"
    )


def test_the_hot_path_knobs_are_in_the_rendered_config(tmp_path: Path):
    """What the per-request cost relies on (each measured with callgrind, docs/proxy.md): the
    global pool on the command line, no pattern cache, one regex pass per direction for the
    hop-by-hop headers instead of one pass per name."""
    assert "-dMglobal" in HAPROXY_OPTIONS
    text = render(replace(Settings(), launcher_status_url=""), Paths(str(tmp_path), 3))
    assert "    tune.pattern.cache-size 0\n" in text
    assert text.count("http-request del-header") == 1 and "http-request del-header '^(connection|" in text
    assert text.count("http-response del-header") == 2  # engine backend, and Server on /health
    assert "|http2-settings)$' -m reg" in text and "x-unit-proxy-error" not in text
