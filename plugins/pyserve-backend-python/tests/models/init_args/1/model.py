"""Returns the initialize() args as JSON, and echoes IN (BYTES) upper-cased."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            echo = np.array([item.upper() for item in text.reshape(-1)], dtype=np.object_)
            args = np.array([json.dumps(self.args).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ARGS", args),
                pb_utils.Tensor("ECHO", echo.reshape(text.shape)),
            ]))
        return responses
