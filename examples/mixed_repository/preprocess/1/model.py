"""Standardize raw features: NORMALIZED = (RAW - MEAN) / SCALE, row by row."""

import numpy as np
import triton_python_backend_utils as pb_utils

MEAN = np.array([5.0, 3.0, 4.0, 1.0], dtype=np.float32)
SCALE = np.array([0.8, 0.4, 1.8, 0.8], dtype=np.float32)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            normalized = ((raw - MEAN) / SCALE).astype(np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("NORMALIZED", normalized)]))
        return responses
