"""DLPack both ways: numpy reads the input through __dlpack__, outputs come back through
Tensor.from_dlpack (from a numpy array, and from a capsule made by to_dlpack)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "IN")
            assert tensor.is_cpu()
            assert tensor.triton_dtype() == 11  # TYPE_FP32
            array = np.from_dlpack(tensor)
            doubled = pb_utils.Tensor.from_dlpack("DOUBLED", array * 2)
            same = pb_utils.Tensor.from_dlpack("SAME", tensor.to_dlpack())
            responses.append(pb_utils.InferenceResponse([doubled, same]))
        return responses
