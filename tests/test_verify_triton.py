"""The acceptance kit on a Triton cell: its KServe v2 generate client and the checks through it.

Against FakeTriton (tests/verify_fakes.py): a real HTTP server on loopback answering in the shapes
of Triton's HTTP front (server@e1db8a603d863b1317ee859bdeea2be19959462e src/http_server.cc), whose
request parsing is the unit model's own (containers/inference/triton_backend/model.py
`parse_request`, `checked_parameters`), so a request the real backend would refuse is refused here.
"""

from __future__ import annotations

from typing import Any

import pytest
import regex  # installed with cfn-lint (requirements.txt); `re` has no \p{L}
import yaml

from inference_fleet.checks import parse_fleet
from inference_fleet.config import DEFAULT_CONFIG, FleetConfig
from inference_fleet.verify import checks_serving
from inference_fleet.verify.adapter import expectations as fleet_expectations
from inference_fleet.verify.context import Context
from inference_fleet.verify.openai_http import OpenAIHttp
from inference_fleet.verify.runner import run_kit
from inference_fleet.verify.serving_client import serving_client
from inference_fleet.verify.triton_http import TritonHttp
from tests.verify_fakes import MODEL, FakeAdapter, FakeTriton, TritonKnobs, expectations


def triton_context(server: FakeTriton, **expect: object) -> Context:
    return Context(FakeAdapter(server.url), expectations(frontend="triton", triton_model=MODEL, **expect),
                   TritonHttp(server.url, MODEL, 10), settle_seconds=0.0, recovery_timeout_seconds=5.0,
                   steps_report_seconds=0.3)


def triton_fleet(model: str | None = None) -> FleetConfig:
    """The default fleet with the Triton front end (its verify gate off: this file tests the kit, not the
    fleet checks, tests/test_config.py)."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data.setdefault("serving", {})["frontend"] = "triton"
    data["pipeline"]["verify_gate"] = False
    if model is not None:
        data["model"]["name"] = model
    return parse_fleet(data, "test")


def test_the_client_is_chosen_from_the_front_end_in_one_place() -> None:
    assert isinstance(serving_client(expectations(), "http://x", 5), OpenAIHttp)
    triton = serving_client(expectations(frontend="triton", triton_model="m"), "http://x", 5)
    assert isinstance(triton, TritonHttp) and triton.model == "m" and not triton.takes_token_ids
    with pytest.raises(ValueError, match="Triton model name is needed"):
        serving_client(expectations(frontend="triton"), "http://x", 5)


def test_a_triton_fleets_expectations_name_the_model_as_the_launcher_does() -> None:
    """The <m> of /v2/models/<m> is the launcher's model directory (unit_launcher.plan.triton_model_name)."""
    parsed = triton_fleet()
    expect = fleet_expectations(parsed, parsed.cells[0])
    assert expect.frontend == "triton"
    assert expect.triton_model == parsed.model.name.rsplit("/", 1)[-1] == "Llama-3.1-405B-Instruct"


def test_model_metadata_and_a_generate_answer_without_the_prompt() -> None:
    with FakeTriton() as server:
        client = TritonHttp(server.url, MODEL, 10)
        answer, ids = client.models()
        assert answer.status == 200 and ids == [MODEL]
        answer, text = client.completion(MODEL, "The unit forms when", max_tokens=4, temperature=0.8, seed=7)
        _, same = client.completion(MODEL, "The unit forms when", max_tokens=4, temperature=0.8, seed=7)
    assert answer.status == 200 and text and "The unit forms when" not in text and text == same
    assert answer.body["finish_reason"] == "length" and answer.body["model_name"] == MODEL
    sent = server.knobs.requests[0]
    assert sent["text_input"] == "The unit forms when" and sent["exclude_input_in_output"] is True
    assert sent["parameters"] == {"max_tokens": 4, "temperature": 0.8, "seed": 7}


def test_an_unknown_model_lists_none_and_a_refused_request_keeps_its_status() -> None:
    with FakeTriton(TritonKnobs(model="other")) as server:
        answer, ids = TritonHttp(server.url, MODEL, 10).models()
    assert answer.status == 400 and ids == [] and "unknown model" in answer.body["error"]
    with FakeTriton(TritonKnobs(status=503)) as server:
        client = TritonHttp(server.url, MODEL, 10)
        answer, text = client.completion(MODEL, "x", max_tokens=4)
        streamed = client.stream_chat(MODEL, "x", max_tokens=4)
    assert (answer.status, text) == (503, "") and streamed.status == 503 and not streamed.ok


def test_a_stream_is_read_to_its_finish_reason() -> None:
    with FakeTriton() as server:
        chunks: list[int] = []
        streamed = TritonHttp(server.url, MODEL, 10).stream_chat(
            MODEL, "Tell a long story.", max_tokens=5, on_chunk=lambda so_far: chunks.append(so_far.chunks),
            extra={"ignore_eos": True})
    assert streamed.ok, streamed.error
    assert streamed.finish_reason == "length" and streamed.chunks == 5 and chunks == [1, 2, 3, 4, 5]
    assert streamed.usage == {"completion_tokens": 5} and streamed.first_token_seconds is not None
    assert len(streamed.text.split()) == 5
    sent = server.knobs.requests[0]
    assert sent["parameters"]["stream"] is True and sent["parameters"]["ignore_eos"] is True


@pytest.mark.parametrize(("knobs", "words"), [
    (TritonKnobs(stream_error_after=2), "error in the stream: the vLLM engine is dead"),
    (TritonKnobs(no_finish=True), "ended without a finish reason"),
])
def test_a_stream_with_an_error_event_or_without_its_last_response_is_not_ok(knobs: TritonKnobs, words: str) -> None:
    """Triton answers 200 at the first response; a later error is an event, and a stream cut before the last
    response ends as cleanly as a whole one (no end marker): neither may pass as complete."""
    with FakeTriton(knobs) as server:
        streamed = TritonHttp(server.url, MODEL, 10).stream_chat(MODEL, "x", max_tokens=5)
    assert streamed.status == 200 and not streamed.ok and words in streamed.error


@pytest.mark.parametrize("finish", ["abort", "error"])
def test_an_aborted_stream_is_an_error_and_fails_check_1(finish: str) -> None:
    """vLLM ends a request it aborted with finish reason "abort" ("error" for one that failed, newer vLLM;
    vllm_backend passes str() of it on): the stream did end, but not served. Regression: it counted as done
    and check 1 passed."""
    with FakeTriton(TritonKnobs(finish_reason=finish)) as server:
        streamed = TritonHttp(server.url, MODEL, 10).stream_chat(MODEL, "x", max_tokens=5)
        result = checks_serving.check_serving(triton_context(server))
    assert streamed.status == 200 and streamed.finish_reason == finish and not streamed.ok
    assert f"aborted (finish reason {finish!r})" in streamed.error
    assert result.status == "fail" and "generate_stream: 200" in result.detail and "aborted" in result.detail


def test_token_ids_are_refused_by_the_client_not_sent() -> None:
    with FakeTriton() as server, pytest.raises(TypeError, match="takes text"):
        TritonHttp(server.url, MODEL, 10).stream_completion(MODEL, [10, 11, 12], max_tokens=1)
    assert server.knobs.requests == []


def test_a_sampling_parameter_the_backend_refuses_is_a_400_naming_it() -> None:
    """The fake parses as the unit's backend does: a request shape it refuses fails here too."""
    with FakeTriton() as server:
        streamed = TritonHttp(server.url, MODEL, 10).stream_chat(MODEL, "x", 4, extra={"best_of": 2})
    assert streamed.status == 400 and "best_of" in streamed.error


def test_serving_and_agreement_pass_on_a_triton_unit() -> None:
    with FakeTriton() as server:
        ctx = triton_context(server)
        serving = checks_serving.check_serving(ctx)
        agreement = checks_serving.check_agreement(ctx, burst=4)
    assert serving.status == "pass", serving.detail
    assert serving.figures["api"] == "triton" and "generate" in serving.detail and "generate_stream" in serving.detail
    assert agreement.status == "pass", agreement.detail
    assert agreement.figures["greedy_pair_identical"] is True


def test_serving_on_a_triton_unit_without_the_model_names_the_model_it_asked_for() -> None:
    """Regression: the failure was labelled with the literal route template "/v2/models/<m>"."""
    with FakeTriton(TritonKnobs(model="other")) as server:
        result = checks_serving.check_serving(triton_context(server))
    assert result.status == "fail"
    assert f"/v2/models/{MODEL}: 400" in result.detail and "<m>" not in result.detail


def test_a_failed_metadata_call_fails_check_1_and_still_asks_the_fleets_model() -> None:
    """The metadata call failing leaves no model name; the generate requests go to the fleet file's model, so the
    report names the one failure. Regression: they went to /v2/models//generate (404 "Not Found", two more
    problems that were not)."""
    with FakeTriton(TritonKnobs(metadata_status=404)) as server:
        ctx = triton_context(server)
        result = checks_serving.check_serving(ctx)
    assert result.status == "fail"
    assert result.detail.startswith(f"/v2/models/{MODEL}: 404")
    assert "generate: " not in result.detail and "generate_stream: " not in result.detail, result.detail
    assert ctx.served_model() == MODEL


def test_step_bound_on_triton_sizes_the_text_by_a_probe_and_passes_on_the_counted_longest_prompt() -> None:
    """The unit model says a prompt's token count (num_input_tokens, as vllm_backend's): a probe gives the
    tokenizer's overhead, the long text is sized to max_seq_len - 1 tokens, and its answer confirms the count.
    Regression: check 3 could never pass on a Triton cell (the count was not asked for)."""
    with FakeTriton(TritonKnobs(max_model_len=256, special_tokens=1)) as server:
        result = checks_serving.check_step_bound(triton_context(server, max_seq_len=256, step_timeout_seconds=4.0))
    assert result.status == "pass", result.detail
    assert result.figures["prompt_tokens"] == 255 and result.figures["prompt_characters"] == 254
    probe, prompt = (r["text_input"] for r in server.knobs.requests)
    assert len(probe) == checks_serving.PROBE_CHARS and len(prompt) == 254 and prompt.isascii()
    assert probe[:checks_serving.SALT_LENGTH] != prompt[:checks_serving.SALT_LENGTH]  # no shared cached prefix
    assert all(r["return_num_input_tokens"] is True for r in server.knobs.requests)


def test_a_unit_whose_backend_predates_the_token_count_is_still_served_and_verified() -> None:
    """Only check 3 asks for the prompt's token count: a cell on an older unit image (pinned `cells[].images`, or a
    newer kit) refuses the input it does not know (400), and every check's stream failed with it.
    Regression: every generate_stream asked for it."""
    with FakeTriton(TritonKnobs(reports_input_tokens=False)) as server:
        result = checks_serving.check_serving(triton_context(server))
    assert result.status == "pass", result.detail


@pytest.mark.parametrize(("knobs", "words"), [
    ({"reports_input_tokens": False}, "the probe failed: {\"error\": \"unknown sampling parameter"),
    ({"tokens_per_char": 0.5}, "made 33 tokens, not one a character"),
])
def test_step_bound_on_triton_is_not_a_pass_when_the_prompt_cannot_be_counted_and_fails_above_the_margin(
        knobs: dict, words: str) -> None:
    """Without a count (an older backend) or with a tokenizer that does not make one token a character, the text
    is the longest that surely fits, whose prefill may be shorter than the longest: within the margin not_run
    with the figure; above it a step the unit ran (fail)."""
    with FakeTriton(TritonKnobs(max_model_len=256, **knobs)) as server:
        result = checks_serving.check_step_bound(triton_context(server, max_seq_len=256, step_timeout_seconds=4.0))
    assert result.status == "not_run" and "inconclusive, not a pass" in result.detail and words in result.detail
    assert isinstance(result.measured.value, float)
    prompt = server.knobs.requests[-1]["text_input"]
    assert len(prompt) == 256 - 1 - checks_serving.TEXT_PROMPT_RESERVE and prompt.isascii()
    with FakeTriton(TritonKnobs(first_token_delay=0.8, **knobs)) as server:
        result = checks_serving.check_step_bound(triton_context(server, step_timeout_seconds=1.2))
    assert result.status == "fail" and result.measured.value >= 0.8


# The pre-tokenizers' split patterns, as their sources write them: GPT-2's
# (openai/gpt-2@27a08882c7706499a2c044840fa3d464ac4f5f0b src/encoder.py, Encoder.pat) and Llama 3's
# (meta-llama/llama3@e8f0267c321c34fd88f313938f5ab09a96f1c0da llama/tokenizer.py, Tokenizer.pat_str).
PRE_TOKENIZERS = {
    "gpt2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_the_long_text_is_one_pre_token_a_character(name: str) -> None:
    """Check 3's Triton prompt is close to one token a character only if each character is its own
    pre-token (BPE merges only within one). Regression: letters, digits and marks in turn made 2001
    pre-tokens of 3000 characters under Llama 3's pattern (a mark joins the letter after it: ";b")."""
    text = checks_serving.long_text(3000)
    assert len(text) == 3000 and text.isascii()
    pieces = regex.findall(PRE_TOKENIZERS[name], text)
    assert "".join(pieces) == text
    assert len(pieces) == len(text), pieces[:6]


def test_the_kit_speaks_kserve_generate_to_a_triton_fleets_cell() -> None:
    """Before: the kit sent /v1/* to every cell, and a Triton unit's proxy answers those 404 (docs/contracts.md
    'Triton front end routes'), so 1-serving failed on every Triton cell whatever its health."""
    parsed = triton_fleet("example/" + MODEL)
    with FakeTriton(TritonKnobs(max_model_len=parsed.model.max_seq_len)) as server:
        report = run_kit(FakeAdapter(server.url), fleet_expectations(parsed, parsed.cells[0]), settle_seconds=0.0,
                         steps_report_seconds=0.2, log=lambda line: None)
    status = {c.check_id: c.status for c in report.checks}
    assert status["1-serving"] == "pass", report.checks[0].detail
    assert status["2-agreement"] == "pass" and status["3-step-bound"] == "pass"
    assert all(r["text_input"] for r in server.knobs.requests)
