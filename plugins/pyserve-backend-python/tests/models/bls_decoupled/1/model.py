"""BLS to a decoupled model: sums the OUT of every response of repeat_py.

With ASYNC=true the responses are read with async_exec(decoupled=True) and `async for`.
"""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN")
            use_async = pb_utils.get_input_tensor_by_name(request, "ASYNC")
            bls = pb_utils.InferenceRequest(
                model_name="repeat_py", inputs=[pb_utils.Tensor("IN", values.as_numpy())],
                requested_output_names=["OUT"])
            if use_async is not None and bool(use_async.as_numpy()[0]):
                total, count = asyncio.run(self._collect_async(bls))
            else:
                total, count = self._collect(bls.exec(decoupled=True))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([total], dtype=np.int32)),
                pb_utils.Tensor("COUNT", np.array([count], dtype=np.int32))]))
        return responses

    @staticmethod
    def _collect(iterator):
        total = count = 0
        for response in iterator:
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            out = pb_utils.get_output_tensor_by_name(response, "OUT")
            if out is not None:  # the final response may be empty
                total += int(out.as_numpy()[0])
                count += 1
        return total, count

    @staticmethod
    async def _collect_async(bls):
        total = count = 0
        async for response in await bls.async_exec(decoupled=True):
            out = pb_utils.get_output_tensor_by_name(response, "OUT")
            if out is not None:
                total += int(out.as_numpy()[0])
                count += 1
        return total, count
