"""The unit worker: the real platform's worker, recording every step it executes.

Every node's workers (leader and followers) run this class; the step record
(`worker-<rank>.rec` under UNIT_STEP_DIR, see `steps`) is what the launcher compares with
the leader's executor to show lockstep, and what shows a worker stuck in a step.
UNIT_BASE_WORKER_CLS (set by the unit platform) names the worker it wraps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from unit_executor.platform import resolve
from unit_executor.steps import StepRecorder, sampled_output_digest, scheduler_output_digest, worker_record_name

_Base: Any = resolve(os.environ.get("UNIT_BASE_WORKER_CLS", "vllm.v1.worker.cpu_worker.CPUWorker"))


class UnitWorker(_Base):  # type: ignore[misc, valid-type]
    """Records each `execute_model` (one step) and each `sample_tokens` call."""

    _unit_steps: StepRecorder | None = None

    def _unit_recorder(self) -> StepRecorder | None:
        if self._unit_steps is None and os.environ.get("UNIT_STEP_DIR"):
            name = worker_record_name(int(getattr(self, "rank", 0)))
            self._unit_steps = StepRecorder(Path(os.environ["UNIT_STEP_DIR"]) / name)
        return self._unit_steps

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = self._unit_recorder()
        if recorder is None:
            return super().execute_model(scheduler_output, *args, **kwargs)
        recorder.step(scheduler_output_digest(scheduler_output))
        try:
            output = super().execute_model(scheduler_output, *args, **kwargs)
        except BaseException:
            recorder.failed()  # not completed: the step bound names this node (StepRecorder.failed)
            raise
        recorder.done()
        # Runners that sample inside execute_model return the tokens here; vLLM's split path and
        # vllm-neuron 3afb0a92 (`neuronx_distributed_model_runner.py:697-778`) return None and
        # sample in sample_tokens. An output naming no request is not chained (sampled_output_digest).
        _record_output(recorder, output)
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        recorder = self._unit_recorder()
        if recorder is None:
            return super().sample_tokens(*args, **kwargs)
        recorder.begin()
        try:
            output = super().sample_tokens(*args, **kwargs)
        except BaseException:
            recorder.failed()
            raise
        recorder.done()
        _record_output(recorder, output)
        return output


def _record_output(recorder: StepRecorder, output: Any) -> None:
    """Chain the tokens this node sampled (every node's worker samples; only rank 0's output is
    returned to the scheduler, so the others' would otherwise go unseen)."""
    digest = sampled_output_digest(output)
    if digest is not None:
        recorder.sampled_output(digest)
