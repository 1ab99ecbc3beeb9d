"""The unit executor: a vLLM plugin that runs one model across the nodes of a unit.

The leader's engine core schedules and batches; every step it schedules is broadcast to
the workers of every node (vLLM's own multi-node `MultiprocExecutor` message queue: shared
memory on the node, ZeroMQ to the others); each worker runs its rank slice of the model;
only the output rank answers. This package adds what a production unit needs on top:

- `platform`: a vLLM platform plugin wrapping the node's real platform (CPU in the
  end-to-end test, Neuron on Trainium) that selects the executor and worker below;
- `executor`: the leader's executor, which bounds every step (lockstep has a deadline)
  and records each step it broadcasts;
- `worker`: the worker wrapper that records each step it executes;
- `steps`: the step records (standard library only), which the launcher reads for
  step-level liveness and the lockstep check.

Design and sources: docs/neuron-multi-node.md.
"""
