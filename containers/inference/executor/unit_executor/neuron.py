"""The unit worker on Neuron with NxD Inference (vllm-neuron 0.5.x, the pinned image's plugin).

vllm-neuron's worker starts torch.distributed with a world of one: one process drives
every NeuronCore of its node through NxD Inference, and its platform forces the
single-process executor (docs/neuron-multi-node.md cites the lines). A unit keeps the
one-process-per-node model and widens vLLM's world to one rank per node, so that vLLM's
multi-node executor can broadcast each step to every node's worker:

- vLLM's world: `--tensor-parallel-size <nodes> --nnodes <nodes>`, one worker per node
  (local world size 1), gloo over the nodes: a control plane for the step broadcast;
- the model's own parallelism (tp/cp/attention dp over every NeuronCore of the unit)
  runs inside NxD Inference's compiled graph, with its collectives over EFA;
- each node loads its rank slice from its own view of the compiled layout (the launcher
  writes `start_rank_id`/`local_ranks_size` into it: `unit_launcher.artifacts`).

vllm-neuron 0.5.x patches ParallelConfig.world_size_across_dp to the data parallel size
(its platform.py, in `pre_register_and_update`), which would make vLLM's multi-node world
one rank wide; it applies the patch only when the current platform's class is named
"NeuronPlatform", which the unit platform's is not. Other name checks of the plugin are
skipped the same way: see docs/neuron-multi-node.md, "Not verified".

VERIFIED ONLY ON PAPER: no Trainium was available; nothing here has run on Neuron.
"""

from __future__ import annotations

from typing import Any

from unit_executor.worker import UnitWorker

NEURON_WORKER = "vllm_neuron.worker.neuron_worker.NeuronWorker"


class UnitNeuronWorker(UnitWorker):  # type: ignore[misc, valid-type]
    """vllm-neuron's worker, in a vLLM world of one rank per node."""

    def init_distributed_environment(self, *args: Any, **kwargs: Any) -> None:
        # The plugin's own method with vLLM's world instead of a world of one (whn09/vllm-neuron@3afb0a92
        # vllm_neuron/worker/neuron_worker.py:175-199), its world-size patch left out (see above).
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.distributed.kv_transfer import ensure_kv_transfer_initialized

        parallel = self.parallel_config
        init_distributed_environment(
            world_size=parallel.world_size,
            rank=self.rank,
            distributed_init_method=self.distributed_init_method,
            local_rank=self.local_rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        # A no-op without a kv_transfer_config (never rendered by the launcher); kept so that one given
        # through engine.extra_args is set up as the plugin would.
        ensure_kv_transfer_initialized(self.vllm_config)

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        # The model loads here (vllm-neuron neuron_worker.py `load_model`): its compile fallback
        # is turned off first when the launcher asks for compiled artifacts only (no_compile), and
        # the runner's on-device sampling parameters put in the batch's order (sampling_order).
        from unit_executor import no_compile, sampling_order

        no_compile.install_from_env()
        if not sampling_order.install():
            raise sampling_order.PluginMismatch(
                f"{sampling_order.RUNNER} cannot be imported in a vllm-neuron worker: refusing to serve with "
                "on-device sampling parameters in arrival order")
        return super().load_model(*args, **kwargs)
