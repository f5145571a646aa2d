"""A frontend's gRPC channel to the owner (``pyserve.handoff.frontend_grpc.OwnerChannel``) is
opened by the first relayed call only, and then reused; the relays themselves are exercised
end to end in ``test_frontend_processes`` (server readiness, streams)."""

from __future__ import annotations

import asyncio

import grpc

from pyserve.handoff.frontend_grpc import OwnerChannel


def test_the_channel_opens_on_first_use_only() -> None:
    async def scenario() -> None:
        unused = OwnerChannel("unix:/nonexistent/owner.sock", 1 << 20)
        await unused.close()  # never opened: nothing to close
        assert unused._channel is None
        used = OwnerChannel("unix:/nonexistent/owner.sock", 1 << 20)
        first = used.get()
        assert isinstance(first, grpc.aio.Channel) and used.get() is first
        await used.close()

    asyncio.run(scenario())
