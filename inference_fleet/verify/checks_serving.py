"""Checks 1-3: the cell serves through its entry point, its nodes agree, and the step bound holds.

Each check sends real requests through the cell's load balancer (the local proxy in e2e), in
the API of the cell's front end (serving_client: vLLM's OpenAI API, or Triton's KServe v2
generate), and reads what the launchers publish (their log events and metrics) through the
adapter; none needs shell access to a task.
"""

from __future__ import annotations

import dataclasses
import random
import secrets
import threading
import time

from inference_fleet.verify.adapter import LogEvent
from inference_fleet.verify.context import Context
from inference_fleet.verify.judged import Excused
from inference_fleet.verify.report import CheckResult, Measured, Status, not_run

PROMPT = "The inference unit forms when"
# A session ended for one of these causes means the nodes did not run in lockstep or agree.
DISAGREEMENT = ("divergence", "step_timeout")
# Check 3 passes when the measured step is at most this fraction of the bound (2x margin).
STEP_MARGIN = 0.5
# The leader's periodic line (docs/contracts.md): `longest_step_seconds` is the session's longest completed
# step so far, the figure its EMF `LongestStepSeconds` carries (unit_launcher/evidence.py steps_event, steps_line).
STEPS_EVENT = "unit_steps"
# Check 3 on a front end that takes text only (Triton's generate): the long prompt is ASCII text of
# max_seq_len - 1 - TEXT_PROMPT_RESERVE characters, letters and digits in turn (long_text: one pre-token,
# so one byte-level BPE token, a character under GPT-2's and Llama 3's split patterns). A tokenizer
# makes at most one token of an ASCII character (byte-level BPE has a token for every byte and merges
# only shorten; SentencePiece has a piece or a byte token for each) plus its special tokens (BOS,
# SentencePiece's word-start piece), which the reserve covers. Not checked for every tokenizer: one
# that adds more answers 400 naming the length, and the check fails saying so.
TEXT_PROMPT_RESERVE = 16
# Where the front end says a prompt's token count (Triton's unit model: `return_num_input_tokens`, as
# vllm_backend's), a probe of this many characters first gives the tokenizer's fixed overhead (BOS and the
# like), and the long text is then sized to max_seq_len - 1 tokens exactly; the long answer's own count
# confirms it, and only then can check 3 pass on a text-only front end.
PROBE_CHARS = 64
# Check 3's prompt starts with this many tokens (characters) drawn at random on each run: vLLM's prefix cache
# (the unit's model.json sets enable_prefix_caching) keys each block on its tokens and its parent block's hash
# (vLLM 0.32.0 vllm/v1/core/kv_cache_utils.py `hash_block_tokens`: "the contents of a block and the contents of
# the preceding block(s)"), so a prompt that began as the last run's would skip most of its prefill and show nothing.
SALT_LENGTH = 8


def check_serving(ctx: Context) -> CheckResult:
    """1. The served model, a completion and a streamed chat through the entry point; every unit healthy.
    OpenAI: /v1/models, /v1/completions, a streamed /v1/chat/completions. Triton: the model's KServe v2
    metadata, `generate`, and `generate_stream` of the chat's text (its end: a finish reason)."""
    problems: list[str] = []
    label = ctx.client.labels
    answer, ids = ctx.client.models()
    if answer.status != 200 or not ids:
        problems.append(f"{label['models']}: {answer.status} {answer.error or str(answer.body)[:120]}")
    ctx.model = ids[0] if ids else ctx.client.fallback_model
    completion, text = ctx.client.completion(ctx.model, PROMPT, max_tokens=8)
    if completion.status != 200 or not text:
        problems.append(f"{label['completion']}: {completion.status} "
                        f"{completion.error or str(completion.body)[:120]}")
    chat = ctx.client.stream_chat(ctx.model, "Hello, how are you today?", max_tokens=8)
    if not chat.ok or not chat.text:
        problems.append(f"{label['stream']}: {chat.status} {chat.error or 'no text'}")
    health = {u: ctx.adapter.unit_health(u) for u in ctx.expect.units}
    unhealthy, gone = _unhealthy(ctx, health)
    if unhealthy:
        problems.append(f"units not healthy behind the entry point: {unhealthy}")
    serving = len(health) - len(unhealthy) - len(gone.units)
    figures = {"api": ctx.client.api, "model": ctx.model, "completion_s": round(completion.seconds, 3),
               "chat_first_token_s": chat.first_token_seconds, "chat_s": round(chat.seconds, 3),
               "unit_health": health}
    detail = "; ".join(problems) or (f"{serving} of {len(health) - len(gone.units)} unit(s) healthy; model "
                                     f"{ctx.model}; {label['completion']} {completion.seconds:.2f} s, "
                                     f"{label['stream']} {chat.seconds:.2f} s")
    detail += gone.note
    return CheckResult("1-serving", "fail" if problems else "pass", Measured(serving, "units serving"), detail,
                       figures)


def _unhealthy(ctx: Context, health: dict[str, int | None] | None = None) -> tuple[dict[str, int | None], Excused]:
    """The judged units not healthy now (or in `health`, read already), less those an elastic cell's autoscaler
    deactivated since the kit's start (or deactivated and activated again) while the floor holds (judged.excuse):
    those are returned apart, named, not failed."""
    if health is None:
        health = {u: ctx.adapter.unit_health(u) for u in ctx.expect.units}
    unhealthy = {u: h for u, h in health.items() if h != 200}
    gone = ctx.excuse(unhealthy)
    return {u: h for u, h in unhealthy.items() if u not in gone}, gone


def _burst(ctx: Context, count: int, max_tokens: int) -> list[int | None]:
    """`count` completions at once at temperature 0.8, each with its own seed (a Trainium unit ignores it,
    check_agreement): their statuses."""
    statuses: list[int | None] = [None] * count

    def one(i: int) -> None:
        answer, _ = ctx.client.completion(ctx.served_model(), f"{PROMPT} ({i})", max_tokens, 0.8, seed=1000 + i)
        statuses[i] = answer.status

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ctx.client.timeout + 5)
    return statuses


def check_agreement(ctx: Context, burst: int = 8, max_tokens: int = 24) -> CheckResult:
    """2. A burst at temperature > 0: every request served, and no session ended because a node
    disagreed (`divergence`: the leader compares its node's sampled-token chain with each
    follower's at every heartbeat) or fell behind (`step_timeout`). Then the same greedy request
    twice, one after the other: both served with text; whether they are identical is reported,
    not judged.

    Why greedy and not judged: a Trainium unit ignores the per-request `seed` (vllm-neuron gives
    each request `generator=None`, vllm-project/vllm-neuron@a5ef7c8 vllm_neuron/worker/
    neuronx_distributed_model_runner.py:438, whn09/vllm-neuron@3afb0a92 :976, and samples on the
    device with OnDeviceSamplingConfig(dynamic=True, deterministic=False), neuronx_distributed_model_loader.py
    a5ef7c8:731 / 3afb0a92:1071, from top_k, top_p and temperature only, get_nxd_sampling_params
    3afb0a92 model_runner:1715-1751), so two seeded requests at temperature > 0 differ on a healthy unit.
    Temperature 0 is top_k 1 there (the same function): an argmax that draws no random number. Even
    greedy is not promised bit-identical online: vLLM guarantees reproducibility only with batch
    invariance (https://docs.vllm.ai/en/latest/usage/reproducibility/), which has no Neuron support,
    and another client's requests sharing a batch can change the numerics. The nodes' agreement
    is what the unit measures itself (no `divergence`), so that is what this check judges."""
    since = time.time()
    model = ctx.served_model()
    count = max(burst, 2 * len(ctx.expect.units))
    statuses = _burst(ctx, count, max_tokens)
    greedy = [ctx.client.completion(model, PROMPT, max_tokens, temperature=0.0) for _ in range(2)]
    time.sleep(ctx.settle_seconds)
    disagreed = _disagreements(ctx, since)
    problems = []
    served = sum(1 for s in statuses if s == 200)
    if served != count:
        problems.append(f"burst: {served} of {count} answered 200 ({sorted({str(s) for s in statuses})})")
    (first, text1), (second, text2) = greedy
    if first.status != 200 or second.status != 200 or not text1 or not text2:
        problems.append(f"the greedy request twice: {first.status} {text1!r} / {second.status} {text2!r}")
    problems += disagreed
    unhealthy, gone = _unhealthy(ctx)
    if unhealthy:
        problems.append(f"after the burst, units not healthy: {unhealthy}")
    same = text1 == text2
    pair = (f"the greedy request gave {text1!r} twice" if same else
            f"the greedy request gave {text1!r} then {text2!r} (not judged: greedy output is not promised "
            "bit-identical online, e.g. when other requests share its batch)")
    detail = "; ".join(problems) or (f"{count} requests at temperature 0.8 served, no session ended by "
                                     f"divergence or step_timeout; {pair}")
    detail += gone.note
    return CheckResult("2-agreement", "fail" if problems else "pass", Measured(served, "requests agreed"), detail,
                       {"burst": count, "disagreements": disagreed, "since": since,
                        "greedy_text": text1, "greedy_pair_identical": same})


def _disagreements(ctx: Context, since: float, until: float | None = None) -> list[str]:
    """What the units published since `since` (up to `until`) that says their nodes disagreed: a session ended by
    `divergence` or `step_timeout`, or a leader's confirmed `lockstep: false` (a worker's step count or chain
    differs from its executor's, unit_launcher/steps.py; the unit may serve on with it, docs/contracts.md)."""
    def within(event: LogEvent) -> bool:
        return until is None or event.timestamp <= until

    ended = [e.doc for e in ctx.adapter.events("unit_session_end", since) if within(e)
             and e.doc.get("cause") in DISAGREEMENT]
    apart = [e.doc for e in ctx.adapter.events(STEPS_EVENT, since) if within(e) and e.doc.get("lockstep") is False]
    return ([f"session {d.get('session_id')} of {d.get('unit_id')} ended as {d.get('cause')}: {d.get('reason')}"
             for d in ended] +
            [f"session {d.get('session_id')} of {d.get('unit_id')} out of lockstep at {d.get('at')} "
             f"(members {d.get('members')}, {d.get('steps')} steps)" for d in apart])


def confirm_agreement(ctx: Context, result: CheckResult, until: float | None, health: bool) -> CheckResult:
    """Check 2 again at the kit's end, from the burst on: a leader ends a diverged session only after stopping its
    engine and telling its followers (seconds), and logs reach CloudWatch later still, so a disagreement at the
    burst's last heartbeat can outlast check 2's wait. Up to `until` (the destructive checks' start: they end
    sessions on purpose); with `health`, every judged unit must still be healthy (a read-only run stops nothing), but
    one an elastic cell's autoscaler deactivated (or deactivated and activated again) since the start with the floor
    held, named (judged.excuse)."""
    since = result.figures.get("since")
    if not isinstance(since, int | float):
        return result
    named = set(result.figures.get("disagreements") or [])
    late = [d for d in _disagreements(ctx, since, until) if d not in named]
    gone = Excused()
    if health:
        unhealthy, gone = _unhealthy(ctx)
        late += [f"at the kit's end, units not healthy: {unhealthy}"] if unhealthy else []
    note = "".join(f"; {n}" for n in gone.notes if n not in result.detail)  # not named by check 2
    if not late:
        return dataclasses.replace(result, detail=result.detail + note) if note else result
    detail = "; ".join(late) if result.status == "pass" else result.detail + "; " + "; ".join(late)
    return CheckResult(result.check_id, "fail", result.measured, f"found at the kit's end: {detail}{note}",
                       {**result.figures, "found_at_end": late}, seconds=result.seconds)


def long_prompt(tokens: int, salt: int = 0) -> list[int]:
    """A prompt of exactly `tokens` token ids (small ids: in every vocabulary, past the special tokens); its
    first SALT_LENGTH ids are drawn from `salt`."""
    draw = random.Random(salt)
    return [10 + (draw.randrange(50) if i < SALT_LENGTH else i % 50) for i in range(tokens)]


def long_text(chars: int, salt: int = 0) -> str:
    r"""ASCII text of `chars` characters: a letter and a digit in turn ("a0b1c2..."). Each character is
    its own pre-token under GPT-2's split pattern (letters and digits are separate runs) and Llama 3's
    (a run of letters, here one, and at most three digits, here one), and BPE merges only within a
    pre-token, so a byte-level BPE tokenizer makes one token a character, never more
    (TEXT_PROMPT_RESERVE); tests/test_verify_triton.py runs both patterns. A punctuation mark would not
    do: Llama 3's `[^\r\n\p{L}\p{N}]?\p{L}+` joins a mark to the letter after it (";b" is one pre-token)."""
    letters, digits = "abcdefghijklmnopqrstuvwxyz", "0123456789"
    draw = random.Random(salt)  # the first SALT_LENGTH characters; the letter-digit turn is kept

    def char(i: int) -> str:
        kind = letters if i % 2 == 0 else digits
        return draw.choice(kind) if i < SALT_LENGTH else kind[(i // 2) % len(kind)]

    return "".join(char(i) for i in range(chars))


def _text_prompt(ctx: Context, model: str, salt: int) -> tuple[str, str, bool]:
    """Check 3's text on a text-only front end, how it was sized, and whether the unit counts a prompt's tokens:
    to max_seq_len - 1 tokens where a probe's answer gives the tokenizer's overhead (one token a character,
    long_text, plus a fixed few), else the longest text that surely fits."""
    longest_prompt = ctx.expect.max_seq_len - 1
    # Its own salt: the probe shares no prefix with the long text (the prefix cache).
    probe = ctx.client.stream_completion(model, long_text(PROBE_CHARS, salt + 1), max_tokens=1, count_prompt=True)
    if not probe.ok or probe.prompt_tokens is None:
        why = "the front end does not say a prompt's token count" if probe.ok else f"the probe failed: {probe.error}"
        return long_text(longest_prompt - TEXT_PROMPT_RESERVE, salt), why, False
    overhead = probe.prompt_tokens - PROBE_CHARS
    if not 0 <= overhead <= TEXT_PROMPT_RESERVE:
        return (long_text(longest_prompt - TEXT_PROMPT_RESERVE, salt),
                f"a {PROBE_CHARS}-character probe made {probe.prompt_tokens} tokens, not one a character "
                f"and at most {TEXT_PROMPT_RESERVE} more", True)
    return (long_text(longest_prompt - overhead, salt),
            f"sized by a {PROBE_CHARS}-character probe that made {probe.prompt_tokens} tokens", True)


def _steps_after(ctx: Context, unit: str, done: float) -> float | None:
    """The unit's session's longest completed step from its first `unit_steps` line written after `done`."""
    for event in ctx.adapter.events(STEPS_EVENT, done, unit):
        at, longest = event.doc.get("at"), event.doc.get("longest_step_seconds")
        if isinstance(at, int | float) and at >= done and event.doc.get("completed") \
                and isinstance(longest, int | float):
            return float(longest)
    return None


def _ended_after(ctx: Context, done: float) -> dict[str, float]:
    """Per unit, the longest completed step of its session that ended after `done`, from its `unit_session_end`
    (steps.broadcast: the figure its `unit_steps` lines carry, unit_launcher/evidence.py `longest_step_seconds`); one
    read for every unit. A session that ends before its next line (drained by a scale-in, or its engine gone) writes
    none after the prompt; until the residuals of the thirty-ninth session its figure was left out and the time to
    first token taken in its place, so a longest step above the margin in it passed unseen."""
    found: dict[str, float] = {}
    for event in ctx.adapter.events("unit_session_end", done):
        ended = event.doc.get("ended_at")
        broadcast = (event.doc.get("steps") or {}).get("broadcast") or {}
        longest = broadcast.get("longest_step_seconds")
        if isinstance(ended, int | float) and ended >= done and broadcast.get("completed") \
                and isinstance(longest, int | float):
            found.setdefault(str(event.doc.get("unit_id")), float(longest))
    return found


def _longest_after(ctx: Context, done: float) -> dict[str, float]:
    """Per unit, the session's longest completed step from its first `unit_steps` line written after `done`, or
    from the end of its session after `done` (so the prompt's prefill is in it, if that unit served it). The line
    comes every steps_report_seconds and the kit reads it from the log: wait up to that plus settle_seconds."""
    deadline = time.monotonic() + ctx.steps_report_seconds + ctx.settle_seconds
    found: dict[str, float] = {}
    while True:
        for unit in [u for u in ctx.expect.units if u not in found]:
            longest = _steps_after(ctx, unit, done)
            if longest is not None:
                found[unit] = longest
        if len(found) < len(ctx.expect.units):
            ended = _ended_after(ctx, done)
            found.update({u: ended[u] for u in ctx.expect.units if u not in found and u in ended})
        if len(found) == len(ctx.expect.units) or time.monotonic() >= deadline:
            return found
        time.sleep(ctx.adapter.poll_seconds)


def check_step_bound(ctx: Context) -> CheckResult:
    """3. One prompt of max_seq_len - 1 tokens and one token out (prompt + completion = max_seq_len):
    its prefill is the longest step a healthy unit runs. The measure is each unit's longest completed
    step of its session, from the first `unit_steps` line its leader writes after the prompt was
    answered (every 60 s while serving; the value its EMF `LongestStepSeconds` publishes), or from its
    session's end after it. When a unit writes none in time, the time to the prompt's first token, which
    bounds its prefill step from above, is taken with the longest steps the others reported (a unit an
    elastic cell's autoscaler drained during the run is named so: judged.excuse). Pass: at most half of
    `serving.step_timeout_seconds`. The prompt's head is drawn anew each run (SALT_LENGTH).

    A front end that takes text only (Triton's generate: no token-id input) gets text (long_text). Where
    it says a prompt's token count (num_input_tokens), the text is sized by a probe (PROBE_CHARS) and
    counts as the longest prompt only if its answer says max_seq_len - 1 tokens. Otherwise it is the
    longest text that surely fits (TEXT_PROMPT_RESERVE), whose prefill may be shorter than the longest: a
    step above the margin still fails (it is a step the unit ran); one within it is not a pass but
    `not_run`, with the figure."""
    bound = ctx.expect.step_timeout_seconds
    model = ctx.served_model()
    if not model:
        return not_run("3-step-bound", "no model served (check 1 failed)", "s")
    longest_prompt = ctx.expect.max_seq_len - 1
    salt = secrets.randbelow(2**32) + 1
    exact = ctx.client.takes_token_ids
    prompt: str | list[int]
    if exact:
        prompt, sizing, counts = long_prompt(longest_prompt, salt), "", False
    else:
        prompt, sizing, counts = _text_prompt(ctx, model, salt)
    size = f"{len(prompt)}-token" if exact else f"{len(prompt)}-character"
    # The count is asked for only where the probe showed the unit gives it (an older unit image refuses it).
    streamed = ctx.client.stream_completion(model, prompt, max_tokens=1, timeout=max(ctx.client.timeout, 3 * bound),
                                            count_prompt=counts)
    if not streamed.ok or streamed.first_token_seconds is None:
        return CheckResult("3-step-bound", "fail", Measured(None, "s"),
                           f"a {size} prompt was not served: {streamed.status} {streamed.error}")
    counted = len(prompt) if exact else streamed.prompt_tokens
    described = f"{len(prompt)} tokens" if exact else f"{len(prompt)} characters" + (
        f", {counted} tokens" if counted is not None else "")
    published = _longest_after(ctx, time.time())
    missing = [u for u in ctx.expect.units if u not in published]
    # A unit drained during the run writes no line: named so, not as silent (judged.excuse). Its figure is unknown
    # all the same (the prompt may have been among its last answers), so the time to first token still bounds it.
    gone = ctx.excuse(missing)
    silent = [u for u in missing if u not in gone]
    if not missing:
        longest, source = max(published.values()), f"the session's longest step ({STEPS_EVENT} longest_step_seconds)"
    else:
        longest = max([streamed.first_token_seconds, *published.values()])
        source = "time to first token (an upper bound of the prefill step)" + (
            f" and the longest steps {published} reported" if published else "")
    ok = longest <= STEP_MARGIN * bound
    detail = (f"longest step {longest:.2f} s ({source}) against the bound {bound:g} s "
              f"(pass: at most {STEP_MARGIN:g} x the bound); prompt {described}")
    if silent:
        detail += (f"; no {STEPS_EVENT} line of {', '.join(silent)} written within "
                   f"{ctx.steps_report_seconds + ctx.settle_seconds:g} s after the prompt (the leader writes one "
                   f"every {ctx.steps_report_seconds:g} s while serving)")
    detail += gone.note
    status: Status = "pass" if ok else "fail"
    if ok and counted != longest_prompt:
        status = "not_run"
        made = (f"made {counted} tokens" if counted is not None
                else f"made an unknown number of tokens (at most {len(prompt) + TEXT_PROMPT_RESERVE})")
        detail = (f"inconclusive, not a pass: {ctx.client.labels['stream']} takes text, not token ids, and the "
                  f"prompt {made} ({sizing}), so its prefill may be shorter than a {longest_prompt}-token one; "
                  "measured: " + detail)
    return CheckResult("3-step-bound", status, Measured(longest, "s"), detail,
                       {"bound_s": bound, "prompt_tokens": counted,
                        "prompt_characters": None if exact else len(prompt), "sizing": sizing or None,
                        "first_token_s": streamed.first_token_seconds, "source": source,
                        "longest_step_s_by_unit": published})
