"""Stateful: TOTAL is the running sum of IN over the sequence (implicit state), CALLS the
number of requests seen for the correlation id (a dict keyed by correlation_id())."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.calls[corrid] = 0
            self.calls[corrid] = self.calls.get(corrid, 0) + 1
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "INPUT_STATE").as_numpy()
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            total = (np.zeros_like(state) if start.reshape(-1)[0] else state) + value
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                calls = self.calls.pop(corrid)
            else:
                calls = self.calls[corrid]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("TOTAL", total.astype(np.int32)),
                pb_utils.Tensor("OUTPUT_STATE", total.astype(np.int32)),
                pb_utils.Tensor("CALLS", np.array([[calls]], dtype=np.int32)),
            ]))
        return responses
