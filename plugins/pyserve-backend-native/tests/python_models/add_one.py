import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative values are not allowed")))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (x + 1).astype(np.float32))]))
        return responses
