"""A stand-in for the unit's vLLM model in a real Triton, for the proxy's tests: the inputs and
parameter handling of vllm_backend (src/model.py, src/utils/request.py at
8de0c148bda1da25de1e05ffaaf67116dacc7264: `text_input`, optional BOOL `stream`, the request
parameters as sampling parameters), decoupled, answering `tok0 tok1 ...` (`max_tokens` of
them, `gap` seconds apart), stopping when Triton cancels the request (the client left), and
exporting `vllm:num_requests_running` as a Triton custom metric gauge, as the unit's model does."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # The family must outlive its metric (python_backend: deleting it first is an error).
        self.family = pb_utils.MetricFamily(
            name="vllm:num_requests_running",
            description="Number of requests in model execution batches.",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.running = self.family.Metric(labels={"model": "llm", "version": "1"})
        self.lock = threading.Lock()
        self.count = 0

    def _gauge(self, delta):
        with self.lock:
            self.count += delta
            self.running.set(self.count)

    def _run(self, request):
        sender = request.get_response_sender()
        params = json.loads(request.parameters() or "{}")
        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        stream = bool(stream.as_numpy()[0]) if stream is not None else False
        tokens, gap = int(params.get("max_tokens", 3)), float(params.get("gap", 0.02))
        self._gauge(1)
        try:
            text = []
            for i in range(tokens):
                if sender.is_cancelled():
                    print(f"CANCELLED at token {i}", flush=True)
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
                if stream:
                    out = pb_utils.Tensor("text_output", np.array([f"tok{i} ".encode()], dtype=object))
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                else:
                    text.append(f"tok{i} ")
                time.sleep(gap)
            if not stream:
                out = pb_utils.Tensor("text_output", np.array(["".join(text).encode()], dtype=object))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            self._gauge(-1)

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._run, args=(request,), daemon=True).start()
        return None
