"""Routing the requests of one sequence to one replica (Serve request router).

A sequence-batched model keeps each sequence's state in the replica that started it, so every
request of a sequence must reach that replica. The ingress marks those requests with the
multiplexed model id ``<model>/<correlation id>``; this router maps the id to a replica by
rendezvous hashing over the running replicas' ids, so the choice is the same on every
router (ingress replicas, proxies) without shared state, and only the sequences of a replica
that goes away move. Requests without an id are routed by Serve's default power-of-two choice.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter


def _score(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


class SequenceAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's default router, except that a request with a multiplexed model id always
    goes to the replica its id hashes to (it waits for that replica when it is busy)."""

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            return await super().choose_replicas(candidate_replicas, pending_request)
        replicas = list(self._replicas.values()) or list(candidate_replicas)
        if not replicas:
            return []
        chosen = max(replicas, key=lambda r: _score(key, r.replica_id.unique_id))
        return [[chosen]]

