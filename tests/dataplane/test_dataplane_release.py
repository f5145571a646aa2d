"""``DataPlane.submit`` returns the request, held by the server until ``request.release()``.

Checked on a real server's event loop: a submitted request counts in flight until it is
released (once: a second release is a no-op), also when its model answered inline during
``submit``; ``with dataplane.submit(...)`` releases on leaving the block; a refused request
raises the refusal and holds nothing, so releasing it changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from suite_support import pair_config

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.api.errors import ErrorCode, InferError
from pyserve.api.inference import FutureSender

INLINE = 'parameters { key: "pyserve_inline_execute" value { string_value: "true" } }'


class Doubler(Backend):
    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[InferResponse]:
        return [InferResponse({"OUT": request.inputs["IN"] * 2}) for request in requests]


def _request(model: str) -> InferRequest:
    return InferRequest(model, -1, {"IN": np.ones((1, 2), dtype=np.float32)}, ("OUT",))


def _on_loop(server: Any, check: Any) -> Any:
    """Run the coroutine function ``check(dataplane)`` on the server's loop; its result."""
    future = asyncio.run_coroutine_threadsafe(check(server.server.dataplane), server._loop)
    return future.result(60)


@pytest.fixture()
def server(start_server, make_repo):  # type: ignore[no-untyped-def]
    repo = make_repo({"inline": pair_config("doubler", INLINE), "plain": pair_config("doubler")})
    return start_server(repo, backends={"doubler": Doubler()})


def test_a_submitted_request_is_held_until_released_once(server) -> None:  # type: ignore[no-untyped-def]
    async def check(dataplane: Any) -> list[Any]:
        loop = asyncio.get_running_loop()
        seen = []
        for name in ("inline", "plain"):
            request = _request(name)
            future = loop.create_future()
            request.attach_sender(FutureSender(loop, future))
            held = dataplane.submit(dataplane.model(name), request)
            result = await future
            seen.append((held is request, dataplane.in_flight, float(result.outputs["OUT"][0, 0])))
            request.release()
            seen.append(dataplane.in_flight)
            request.release()
            seen.append(dataplane.in_flight)
        return seen

    assert _on_loop(server, check) == [(True, 1, 2.0), 0, 0, (True, 1, 2.0), 0, 0]


def test_the_with_form_releases_on_leaving_the_block(server) -> None:  # type: ignore[no-untyped-def]
    async def check(dataplane: Any) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        request = _request("plain")
        future = loop.create_future()
        request.attach_sender(FutureSender(loop, future))
        with dataplane.submit(dataplane.model("plain"), request):
            await future
            inside = dataplane.in_flight
        return inside, dataplane.in_flight

    assert _on_loop(server, check) == (1, 0)


def test_a_refused_request_raises_and_holds_nothing(server) -> None:  # type: ignore[no-untyped-def]
    async def check(dataplane: Any) -> tuple[ErrorCode, str, int]:
        loop = asyncio.get_running_loop()
        request = _request("plain")
        request.attach_sender(FutureSender(loop, loop.create_future()))
        dataplane.accepting = False
        try:
            with pytest.raises(InferError) as refused:
                dataplane.submit(dataplane.model("plain"), request)
        finally:
            dataplane.accepting = True
        request.release()
        return refused.value.code, refused.value.message, dataplane.in_flight

    code, message, in_flight = _on_loop(server, check)
    assert code == ErrorCode.UNAVAILABLE and "no new requests" in message and in_flight == 0
