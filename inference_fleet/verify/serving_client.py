"""The requests the kit's checks send, whatever the cell's front end: one protocol, two clients.

`serving.frontend: openai` units serve vLLM's OpenAI API (`openai_http.OpenAIHttp`); `triton`
units serve Triton's KServe v2 generate routes only (`triton_http.TritonHttp`, docs/contracts.md
"Triton front end routes"). `serving_client` is the one place that picks, from the
expectations (the fleet file). What each check means on each front end: docs/verifying.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from inference_fleet.verify.adapter import Expectations
from inference_fleet.verify.http_base import Answer, Streamed
from inference_fleet.verify.openai_http import OpenAIHttp
from inference_fleet.verify.triton_http import TritonHttp


class ServingClient(Protocol):
    api: str  # "openai" or "triton"
    timeout: float
    takes_token_ids: bool  # whether a prompt may be a list of token ids (check 3's exact-length prompt)
    labels: dict[str, str]  # how the checks name the requests in their details: models, completion, stream
    # The model asked when models() lists none: Triton's is the fleet file's (the route needs one); OpenAI's
    # none (vLLM then answers that the model "" does not exist, which names the problem).
    fallback_model: str

    def models(self) -> tuple[Answer, list[str]]:
        """The served model names (OpenAI: /v1/models; Triton: the unit's model's metadata)."""

    def completion(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float = 0.0,
                   seed: int | None = None) -> tuple[Answer, str]:
        """One answer and its generated text (the prompt not repeated)."""

    def stream_chat(self, model: str, content: str, max_tokens: int, temperature: float = 0.0,
                    on_chunk: Callable[[Streamed], None] | None = None, extra: dict[str, Any] | None = None,
                    timeout: float | None = None) -> Streamed:
        """A streamed answer to `content`, read to its end marker; `extra`: more sampling parameters; `on_chunk` is
        called with the answer so far after each chunk of text (its `served_by` known from the first)."""

    def stream_completion(self, model: str, prompt: str | list[int], max_tokens: int,
                          timeout: float | None = None, count_prompt: bool = False) -> Streamed:
        """A streamed completion of `prompt` at temperature 0 (token ids only where takes_token_ids); with
        `count_prompt` the result's `prompt_tokens` is the prompt's token count where the server says it."""


def serving_client(expect: Expectations, endpoint: str, timeout: float, tls_name: str | None = None) -> ServingClient:
    """The client of the cell's front end (serving.frontend)."""
    if expect.frontend == "triton":
        return TritonHttp(endpoint, expect.triton_model, timeout, tls_name=tls_name)
    if expect.frontend == "openai":
        return OpenAIHttp(endpoint, timeout, tls_name=tls_name)
    raise ValueError(f"serving.frontend {expect.frontend!r}: the kit speaks openai or triton")
