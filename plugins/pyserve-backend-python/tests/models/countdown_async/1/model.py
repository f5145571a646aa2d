"""Decoupled, async def execute: counts N down to 1, one response every 20 ms. Requests
overlap on the instance's event loop (the next execute starts while one awaits). A request with
the parameter ``meet: K`` starts counting only once K requests are counting or waiting at once
(it fails after 60 s otherwise), so that overlap shows in answers rather than in timing."""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

MEET_TIMEOUT_S = 60.0


class TritonPythonModel:
    def initialize(self, args):
        self.under_way = 0  # requests of this instance counting (or waiting to) now

    async def execute(self, requests):
        await asyncio.gather(*(self._count(request) for request in requests))
        return None

    async def _count(self, request):
        sender = request.get_response_sender()
        n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
        if n < 0:
            raise pb_utils.TritonModelException("N must not be negative")
        meet = int(json.loads(request.parameters() or "{}").get("meet", 0))
        self.under_way += 1
        try:
            waited = 0.0
            while self.under_way < meet:
                if waited > MEET_TIMEOUT_S:
                    raise pb_utils.TritonModelException(f"{self.under_way} request(s) under way at once, not {meet}")
                await asyncio.sleep(0.005)
                waited += 0.005
            for left in range(n, 0, -1):
                await asyncio.sleep(0.02)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("LEFT", np.array([left], dtype=np.int32))]))
        finally:
            self.under_way -= 1
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
