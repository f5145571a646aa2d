"""BLS, async: two async_exec calls to add_sub awaited together, in an async def execute."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[None]
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()[None]
            forward = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=[pb_utils.Tensor("INPUT0", in0), pb_utils.Tensor("INPUT1", in1)],
                requested_output_names=["OUTPUT0"])
            backward = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=[pb_utils.Tensor("INPUT0", in1), pb_utils.Tensor("INPUT1", in0)],
                requested_output_names=["OUTPUT1"])
            first, second = await asyncio.gather(forward.async_exec(), backward.async_exec())
            for response in (first, second):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()[0]),
                pb_utils.Tensor("OUTPUT1", pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy()[0]),
            ]))
        return responses
