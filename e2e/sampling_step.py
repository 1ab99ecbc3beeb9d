"""Step 2b: the unit at temperature > 0, where each node samples on its own (issue 23 item 4 on CPU).

Every node's worker samples the next tokens and chains them into its step record (`sampled`,
`out_chain`, unit_executor.steps); the leader compares each follower's chain, as of its last
heartbeat, with its own node's at the highest sample count both have (unit_launcher.steps
`divergence`, run by the leader's watchdog every 0.5 s) and ends the session with cause
`divergence` when they differ (its session-end event and the unit's history). Here a burst of
requests at temperature 0.8, streamed and not, must complete with the chains equal and the
session unchanged, and a fixed `seed` must give the same tokens twice.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import CHAT, MODEL_NAME, PROMPT, Harness, OpenAIDriver, wait_until

TEMPERATURE = 0.8
BURST = 8  # half completions, half streamed chats; the unit runs max_num_seqs 4 at once
BURST_TOKENS = 24
SEED = 4321


def _completion(driver: OpenAIDriver, seed: int | None = None) -> dict[str, Any]:
    extra = {} if seed is None else {"seed": seed}
    out = driver.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=BURST_TOKENS,
                                           temperature=TEMPERATURE, logprobs=1, **extra)
    choice = out.choices[0]
    return {"text": choice.text, "tokens": list(choice.logprobs.tokens or []) if choice.logprobs else [],
            "finish": choice.finish_reason}


def _stream(driver: OpenAIDriver) -> dict[str, Any]:
    parts, finish = [], None
    stream = driver.client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=BURST_TOKENS,
                                                   temperature=TEMPERATURE, stream=True)
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"text": "".join(parts), "finish": finish}


def _workers(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """rank -> that node's worker record, as the leader holds it (its own read now, a follower's as of
    its last heartbeat)."""
    members = (status.get("steps") or {}).get("members") or {}
    return {rank: next((s for name, s in states.items() if name.startswith("worker-")), {})
            for rank, states in members.items()}


def _session_end_in(log_path: Path, session: str | None) -> dict[str, Any] | None:
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and "unit_session_end" in line and str(session) in line:
            try:
                return dict(json.loads(line))
            except ValueError:
                continue
    return None


def run_temperature(h: Harness, unit: Any, driver: OpenAIDriver) -> bool:
    """2b. A burst at temperature 0.8 completes; the nodes' sampled-token chains agree (no divergence);
    a fixed seed gives the same tokens twice."""
    r = h.report
    session = unit.whole_session()
    before = {rank: int(w.get("sampled", 0)) for rank, w in _workers(unit.status() or {}).items()}
    started = time.monotonic()
    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(_completion if i % 2 == 0 else _stream, driver) for i in range(BURST)]
        results, errors = [], []
        for future in futures:
            try:
                results.append(future.result(timeout=h.left(300)))
            except Exception as error:  # the check reports it
                errors.append(f"{type(error).__name__}: {error}")
    r.figure("temperature_burst_s", time.monotonic() - started)
    texts = [x["text"] for x in results]
    r.facts["temperature_burst"] = [{k: v for k, v in x.items() if k != "tokens"} for x in results]
    completions = [x["text"] for x in results if "tokens" in x]
    r.check(f"2b. a burst of {BURST} requests at temperature {TEMPERATURE} (streamed and not) completes, and "
            "sampling is in effect (the same prompt gives different texts)",
            not errors and len(results) == BURST and all(texts) and all(x["finish"] for x in results)
            and len(set(completions)) > 1,
            json.dumps({"errors": errors, "distinct completions": len(set(completions))}))
    seeded = [_completion(driver, SEED), _completion(driver, SEED)]
    other = _completion(driver, SEED + 1)
    r.facts["seeded"] = {"seed": SEED, "tokens": seeded[0]["tokens"], "again": seeded[1]["tokens"],
                         f"seed {SEED + 1}": other["tokens"]}
    r.check(f"2b. seed {SEED} at temperature {TEMPERATURE}: the same tokens twice",
            bool(seeded[0]["tokens"]) and seeded[0]["tokens"] == seeded[1]["tokens"],
            f"{seeded[0]['text']!r} / {seeded[1]['text']!r} (seed {SEED + 1}: {other['text']!r})")
    return check_chains(h, unit, session, before)


def check_chains(h: Harness, unit: Any, session: str | None, before: dict[str, int]) -> bool:
    """Once the leader holds a follower record covering every sample of the burst: equal chains, the
    launcher's own comparison finds no divergence, and the session goes on (no session end)."""
    from unit_launcher import steps

    r = h.report
    seen: dict[str, Any] = {}

    def caught_up() -> bool:
        status = unit.status() or {}
        workers = _workers(status)
        seen.update(status=status, workers=workers)
        counts = {int(w.get("sampled", -1)) for w in workers.values()}
        return (status.get("steps") or {}).get("lockstep") is True and len(workers) == 2 and len(counts) == 1
    try:
        wait_until("the follower's record (as the leader heard it) covers the burst", caught_up, h.left(60), 0.5)
    except TimeoutError as error:
        r.check("2b. the nodes' sampled-token chains agree", False, f"{error}: {json.dumps(seen.get('workers'))}")
        return False
    time.sleep(1.5)  # the leader's watchdog (every 0.5 s) has compared the records it now holds
    workers = seen["workers"]
    members = (seen["status"].get("steps") or {}).get("members") or {}
    differs = steps.divergence(members.get("0") or {}, members.get("1") or {})
    sampled = {rank: int(w["sampled"]) for rank, w in workers.items()}
    chains = {rank: str(w.get("out_chain")) for rank, w in workers.items()}
    r.figure("temperature_samples", f"{sampled} (before the burst {before})")
    r.figure("temperature_out_chain", chains.get("0", "")[:16])
    r.facts["temperature_steps"] = seen["status"].get("steps")
    r.check("2b. the nodes' sampled-token chains agree (same count, same out_chain; steps.divergence: none)",
            len(set(chains.values())) == 1 and differs is None and all(sampled[k] > before.get(k, 0) for k in sampled),
            json.dumps({"sampled": sampled, "chains": chains, "divergence": differs}))
    leader = unit.leader.current
    ended = _session_end_in(leader.log_path, session) if leader is not None else None
    again = unit.whole_session()
    r.check("2b. no divergence ended the session (same session serving, no session-end event)",
            again == session and session is not None and ended is None,
            f"session {session} -> {again}; end event {json.dumps(ended) if ended else 'none'}")
    return again == session
