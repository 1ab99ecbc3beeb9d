"""The leader's unit executor: vLLM's multi-node step broadcast, bounded and recorded.

vLLM's `MultiprocExecutor` already does what a unit needs on the data path: the leader's
engine core calls `execute_model(scheduler_output)`, the executor enqueues it once on a
broadcast message queue that the local workers read from shared memory and the other
nodes' workers from ZeroMQ, every worker runs its rank slice, and only the output rank
answers (vllm/v1/executor/multiproc_executor.py). Followers run `vllm serve --headless`:
workers only, no API server, no scheduler. This subclass adds the unit's contract:

- every step is recorded (`executor.rec`: count, digest chain of what was broadcast,
  start of the step in flight), which the launcher compares with each node's worker
  records (lockstep) and watches against the step bound (a follower that does not finish
  a step fails the unit instead of hanging in a collective);
- the wait for a step's answer is bounded by VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, vLLM's
  own setting, which the launcher sets a little above its own step bound so the launcher
  declares the unit lost first and the engine's own timeout is only a backstop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from unit_executor.steps import EXECUTOR_RECORD, StepRecorder, scheduler_output_digest


class UnitExecutor(MultiprocExecutor):
    """MultiprocExecutor with step records for the unit's liveness and lockstep checks."""

    _unit_steps: StepRecorder | None = None

    def _init_executor(self) -> None:
        super()._init_executor()
        step_dir = os.environ.get("UNIT_STEP_DIR")
        if step_dir:
            self._unit_steps = StepRecorder(Path(step_dir) / EXECUTOR_RECORD)

    def _tracked(self, call: Callable[[], Any]) -> Any:
        recorder = self._unit_steps
        assert recorder is not None
        try:
            result = call()
        except BaseException:
            recorder.done()
            raise
        if isinstance(result, Future):
            result.add_done_callback(lambda _: recorder.done())
        else:
            recorder.done()
        return result

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if self._unit_steps is None:
            return super().execute_model(scheduler_output, non_block)
        self._unit_steps.step(scheduler_output_digest(scheduler_output))
        return self._tracked(lambda: super(UnitExecutor, self).execute_model(scheduler_output, non_block))

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        if self._unit_steps is None:
            return super().sample_tokens(grammar_output, non_block)
        self._unit_steps.begin()
        return self._tracked(lambda: super(UnitExecutor, self).sample_tokens(grammar_output, non_block))
