"""The agent's cost per request (issue 25): HAProxy carries the bytes, and the Python agent
beside it must not cost per request what the data path saved. Under a burst, the request
counts stay exact and the agent's own CPU per request, read from /proc, stays a small
fraction of what HAProxy's worker spends on the same requests in the same run.

The bound is a ratio, not microseconds (the developer guide's rule for speed targets): a
loaded or slower machine slows both processes alike. The agent counts every request from
HAProxy's log line (exact counts), reading the log ring at most every `READ_PAUSE_SECONDS`
(strace -c: 84 reads for this burst, 2,271 before) and parsing each distinct line once.
Measured on this shared 2-core machine (load average 9, HAProxy with one thread): the agent
5.0 us a request against HAProxy's worker 33.8 us, 0.15 of it, three runs alike. With the
follower reading each line as it comes and parsing every line (the two changes that made
the agent cheap undone in haproxy_log.py): 17.5-18.8 us against 35.0, 0.50-0.54 (seen
failing: "the agent spent 0.54 of HAProxy's CPU on the same requests"). 0.35 leaves room
for the 10 ms clock ticks (+-1.3 us a request over 8,000) and still fails that agent.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from pathlib import Path

from .conftest import FakeEngine, FakeLauncher, burst, children, cpu_seconds
from .test_adversarial import admin_text, wait_healthy
from .test_drain import proxy_process

BURST = 8000
CONCURRENCY = 32
MAX_AGENT_SHARE = 0.35  # agent CPU / HAProxy worker CPU over the same burst
BURSTS = 3  # the best of up to this many bursts is judged


def counted(metrics: str, name: str) -> float:
    line = next((x for x in metrics.splitlines() if x.startswith(name + " ")), None)
    return float(line.split()[1]) if line else 0.0


def haproxy_worker(agent: int) -> int:
    """HAProxy's worker: the child of the agent's `haproxy -W` master."""
    masters = [pid for pid in children(agent) if Path(f"/proc/{pid}/comm").read_text().strip() == "haproxy"]
    assert len(masters) == 1, masters
    workers = children(masters[0])
    assert len(workers) == 1, workers
    return workers[0]


async def test_a_burst_is_counted_exactly_at_a_small_agent_cost_per_request(engine: FakeEngine, launcher: FakeLauncher):
    # One HAProxy thread: with more threads than free cores, idle threads spin and the
    # baseline measures the machine, not the work (measured: 180-210 us a request with 4).
    env = {"HEALTH_INTERVAL_SECONDS": "5", "EMF_INTERVAL_SECONDS": "60", "PROXY_WORKERS": "1"}
    async with proxy_process(engine, launcher, **env) as (url, proc):
        await wait_healthy(url)
        worker = haproxy_worker(proc.pid)
        shares = []
        # The best of up to BURSTS: on a busy machine (load 5, two other test processes) a burst
        # lasts longer, and what the agent does per second (reads, health rounds, the idle rate's
        # +-10 ms ticks) weighs more per request: 0.46-0.53 seen once for the agent that makes
        # 0.15 on a quiet machine. The agent undone (module doc) stays above the bound in every burst.
        for _ in range(BURSTS):
            shares.append(await _burst_share(url, proc.pid, worker))
            if shares[-1] < MAX_AGENT_SHARE:
                break
        assert min(shares) < MAX_AGENT_SHARE, (
            f"the agent spent {', '.join(f'{x:.2f}' for x in shares)} of HAProxy's CPU on the same requests"
        )


async def _burst_share(url: str, agent: int, worker: int) -> float:
    """One burst of BURST requests, every one counted: the agent's CPU over HAProxy's worker's."""
    _, before = await admin_text(url, "/metrics")
    base = counted(before, 'unit_proxy_requests_total{code="200"}')
    base_latency = counted(before, "unit_proxy_request_latency_seconds_count")
    # The agent's idle rate (health rounds), to take out of the burst's CPU.
    idle_start, t0 = cpu_seconds(agent), time.monotonic()
    await asyncio.sleep(1.0)
    idle_rate = (cpu_seconds(agent) - idle_start) / (time.monotonic() - t0)

    start, haproxy_start, t0 = cpu_seconds(agent), cpu_seconds(worker), time.monotonic()
    tracer = None
    if os.environ.get("AGENT_STRACE"):
        with open(os.environ["AGENT_STRACE"], "w") as out:  # a diagnosis aid: syscalls of the agent
            tracer = await asyncio.create_subprocess_exec("strace", "-f", "-c", "-p", str(agent), stderr=out)
        await asyncio.sleep(0.5)
    statuses = await burst(url, BURST, CONCURRENCY)
    # The follower's last read (it reads every READ_PAUSE_SECONDS); the scrape after, which
    # also catches up with the ring, is not a per-request cost.
    await asyncio.sleep(0.3)
    if tracer is not None:
        tracer.send_signal(2)
        await tracer.wait()
    spent = cpu_seconds(agent) - start - idle_rate * (time.monotonic() - t0)
    haproxy_spent = cpu_seconds(worker) - haproxy_start
    status, after = await admin_text(url, "/metrics")
    assert statuses.count(200) == BURST, {s: statuses.count(s) for s in set(statuses)}
    assert status == 200
    assert counted(after, 'unit_proxy_requests_total{code="200"}') - base == BURST
    assert counted(after, "unit_proxy_request_latency_seconds_count") - base_latency >= BURST
    print(
        f"agent CPU: {spent / BURST * 1e6:.2f} us per request, HAProxy's worker "
        f"{haproxy_spent / BURST * 1e6:.2f} us: {spent / haproxy_spent:.2f} of it"
    )
    return spent / haproxy_spent


def test_the_skipping_reservoir_keeps_a_uniform_sample():
    """The per-interval sample (EMF percentiles) skips values geometrically (algorithm L): it
    must still keep every part of the interval alike. 100,000 values, 1,000 kept, 20 times:
    each tenth of the interval holds 100 kept values on average."""
    from unit_proxy.telemetry import SAMPLE_CAP, _Reservoir

    tenths = [0] * 10
    for _ in range(20):
        reservoir = _Reservoir()
        for i in range(100_000):
            reservoir.add(float(i))
        assert len(reservoir.values) == SAMPLE_CAP
        for value in reservoir.values:
            tenths[int(value) // 10_000] += 1
    assert all(1700 < count < 2300 for count in tenths), tenths  # 2,000 expected each, sd about 42


def test_identical_log_lines_are_counted_at_once_and_exactly():
    """`haproxy_log.feed` counts each distinct line once with its multiplicity: the figures must
    be those of counting the lines one by one (codes, refusals, upstream errors, 499s,
    histograms, the interval's sample sizes)."""
    from unit_proxy.haproxy_log import feed
    from unit_proxy.telemetry import TTFT_BUCKETS, Telemetry

    kinds = [
        b"200 3 0 1 245 ---- engine - - 3",
        b"200 812 805 0 1245 ---- engine - 12 812",  # a stream: its first byte 12 ms in
        b"200 812 805 0 1245 ---- engine - -3 812",  # the wall clock stepped back between its dates: 0
        b"404 0 0 -1 180 LR-- data - - -",
        b"429 0 0 -1 190 LR-- data rejected - -",
        b"429 0 0 -1 190 LR-- data - - -",  # the admission refusal as logged now (no outcome)
        b"429 5 0 4 90 ---- engine - - 5",  # the engine's own 429: proxied, not a refusal
        b"503 0 0 -1 190 LR-- data unit_unavailable - 0",
        b"503 9 0 8 190 ---- engine unit_unavailable - 9",
        b"200 40 30 2 100 CD-- engine - 20 40",
        b"502 5 0 -1 120 SH-- engine - - 5",
        b"504 5 0 -1 120 sH-- engine - - 5",
        b"200 300 805 0 1245 ---- engine - 12 812",  # a starved HAProxy: %Ta lost time, the wall clock not
        b"400 0 0 -1 190 PR-- data - - -",  # refused before the frontend's rules: no wall-clock span
        b"200 3 0 1 245 ---- engine - -",  # a line of the old format: not counted
        b"not a log line",
    ]
    lines = [kinds[(i * 5) % len(kinds)] if i % 5 else kinds[0] for i in range(3000)]
    assert all(kind in lines for kind in kinds)
    one_by_one, grouped = Telemetry(lambda: 0), Telemetry(lambda: 0)
    read = time.time() + 1.0  # the lines' read: the 812 ms streams started in the first interval
    for t in (one_by_one, grouped):
        t.emf_events("ns", "c", "u0", now=read - 0.4)
    for line in lines:
        feed(one_by_one, line + b"\n", now=read)
    feed(grouped, b"\n".join(lines) + b"\n", now=read)
    for t in (one_by_one, grouped):
        late = list(t._late_ttft.values())
        t.snapshot = (  # type: ignore[attr-defined]
            dict(t.codes), t.requests_total, t.rejected_total, t.unavailable_total,
            t.ttft.counts, round(t.ttft.total, 6), t.latency.counts, round(t.latency.total, 6),
            t._interval.requests, t._interval.ttft_ms.seen, t._interval.latency_ms.seen,
            len(t._interval.ttft_ms.values), t.upstream_errors.labels("reset")._value.get(),
            list(t._late_ttft), [r.seen for r in late], [len(r.values) for r in late],
        )
    assert grouped.snapshot == one_by_one.snapshot  # type: ignore[attr-defined]
    assert grouped.codes[200] == sum(map(lines.count, (*kinds[:3], kinds[12])))
    assert grouped.rejected_total == lines.count(kinds[4]) + lines.count(kinds[5]) > 0
    assert grouped.codes[429] == lines.count(kinds[6]) > 0
    # TTFT: the streamed answers only (the ninth field), the client gone after its first byte too.
    streams = lines.count(kinds[1]), lines.count(kinds[2]), lines.count(kinds[9]), lines.count(kinds[12])
    assert grouped.ttft.counts[bisect.bisect_left(TTFT_BUCKETS, 0.012)] >= streams[0] > 0
    assert sum(grouped.ttft.counts) == sum(streams)
    assert round(grouped.ttft.total, 6) == round(0.012 * (streams[0] + streams[3]) + 0.020 * streams[2], 6)
    # Dated at their start: the 812 ms streams in the first interval (written 0.4 s before the
    # read; the starved one by its wall-clock span, not its 300 ms %Ta), the 40 ms ones in the current interval.
    assert {k: r.seen for k, r in grouped._late_ttft.items()} == {
        int((read - 0.4) * 1000): streams[0] + streams[1] + streams[3]}
    assert grouped._interval.ttft_ms.seen == streams[2]


def test_adding_alike_values_at_once_keeps_a_uniform_sample():
    """`_Reservoir.add_many` (the grouped log lines) skips a run of values in one step: the
    sample must stay as uniform as adding them one by one (same check as above, values in runs
    of 1 to 50)."""
    from unit_proxy.telemetry import SAMPLE_CAP, _Reservoir

    tenths = [0] * 10
    for _ in range(20):
        reservoir, i = _Reservoir(), 0
        while i < 100_000:
            run = min(1 + i % 50, 100_000 - i)
            reservoir.add_many(float(i), run)
            i += run
        assert len(reservoir.values) == SAMPLE_CAP and reservoir.seen == 100_000
        for value in reservoir.values:
            tenths[int(value) // 10_000] += 1
    assert all(1700 < count < 2300 for count in tenths), tenths
