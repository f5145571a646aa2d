"""The gRPC frontend: Triton's ``inference.GRPCInferenceService``.

A call's path: :mod:`~pyserve.grpc.listener` (the server, pyserve's own HTTP/2 on asyncio) →
:mod:`~pyserve.grpc.connection` (frames, streams, flow control; :mod:`~pyserve.grpc.http2`
framing, :mod:`~pyserve.grpc.call` the servicer context) → :mod:`~pyserve.grpc.servicer`
(the RPCs) → :mod:`~pyserve.grpc.codec` (messages ⇄ requests) → the data plane.
``--grpc-server grpcio`` serves the same servicer on ``grpc.aio`` instead (:mod:`~pyserve.grpc.server`).
"""
