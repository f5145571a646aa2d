"""Decoupled, async def execute: counts N down to 1, one response every 20 ms. Requests
overlap on the instance's event loop (the next execute starts while one awaits)."""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.gather(*(self._count(request) for request in requests))
        return None

    async def _count(self, request):
        sender = request.get_response_sender()
        n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
        if n < 0:
            raise pb_utils.TritonModelException("N must not be negative")
        for left in range(n, 0, -1):
            await asyncio.sleep(0.02)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("LEFT", np.array([left], dtype=np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
