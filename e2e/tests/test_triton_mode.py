"""The Triton e2e's own readers (e2e/triton_mode.py), on fixed text."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_mode import gauge_values


def test_gauge_values_sum_label_sets_and_skip_other_metrics():
    page = "\n".join([
        "# HELP vllm:num_requests_running Requests vLLM's scheduler is running",
        'vllm:num_requests_running{model="llm",version="1"} 1',
        'vllm:num_requests_waiting{model="llm",version="1"} 0',
        'nv_inference_pending_request_count{model="llm",version="1"} 3',
    ])
    assert gauge_values(page) == {"vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 0.0}
