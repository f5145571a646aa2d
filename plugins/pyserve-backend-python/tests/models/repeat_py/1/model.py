"""Decoupled: one response per element of IN, sent from a thread after execute returned."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("repeat_py must be decoupled")
        self.threads = []

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._repeat, args=(request,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return None

    def _repeat(self, request):
        sender = request.get_response_sender()
        values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        delay = pb_utils.get_input_tensor_by_name(request, "DELAY_MS")
        delay_s = float(delay.as_numpy()[0]) / 1000 if delay is not None else 0.0
        for index, value in enumerate(values):
            if sender.is_cancelled():
                break
            time.sleep(delay_s)
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
            ]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=5)
