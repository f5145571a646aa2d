"""A model without config.pbtxt: auto_complete_config declares everything."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "A", "data_type": "TYPE_INT64", "dims": [2]},
                  {"name": "B", "data_type": "TYPE_INT64", "dims": [2], "optional": True}]
        outputs = [{"name": "SUM", "data_type": "TYPE_INT64", "dims": [2]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for item in inputs:
            if item["name"] not in input_names:
                auto_complete_model_config.add_input(item)
        for item in outputs:
            if item["name"] not in output_names:
                auto_complete_model_config.add_output(item)
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B")
            total = a + (b.as_numpy() if b is not None else np.zeros_like(a))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return responses
