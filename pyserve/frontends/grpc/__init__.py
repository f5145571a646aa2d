"""The gRPC frontend: Triton's ``inference.GRPCInferenceService``.

A call's path: :mod:`~pyserve.frontends.grpc.listener` (the server, pyserve's own HTTP/2 on asyncio) →
:mod:`~pyserve.frontends.grpc.connection` (frames, streams, flow control, in layers from
:mod:`~pyserve.frontends.grpc.frame_reader` down to :mod:`~pyserve.frontends.grpc.outgoing`;
:mod:`~pyserve.frontends.grpc.http2` framing, :mod:`~pyserve.frontends.grpc.call` the servicer context) → :mod:`~pyserve.frontends.grpc.servicer`
(the RPCs) → :mod:`~pyserve.frontends.grpc.codec` (messages ⇄ requests) → the data plane.
``--grpc-server grpcio`` serves the same servicer on ``grpc.aio`` instead (:mod:`~pyserve.frontends.grpc.server`).
"""
