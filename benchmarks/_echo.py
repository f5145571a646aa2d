"""Bare echo servers used by ``serving.py`` as ceilings (no model, no scheduler, no validation).

``python _echo.py http PORT``: Starlette on uvicorn (uvloop, httptools, orjson), answering
``POST /v2/models/{name}/infer`` with the KServe v2 response echoing the first input as
``OUTPUT0`` (JSON, or the binary tensor extension when the request uses it) and
``GET /v2/health/ready`` with 200.

``python _echo.py grpc PORT``: ``grpc.aio`` (default asyncio loop, one process) serving
``inference.GRPCInferenceService/ModelInfer`` (echo of ``raw_input_contents``) and
``ServerReady``, with pyserve's generated protobuf messages.

``python _echo.py h2-floor PORT``: no server library at all, one asyncio protocol answering
``ModelInfer`` over HTTP/2 (``frameworks.py`` measures the loopback + client floor with it).
"""

from __future__ import annotations

import asyncio
import sys


def serve_http(port: int) -> None:
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def infer(request: Request) -> Response:
        body = await request.body()
        name = request.path_params["name"]
        header_length = request.headers.get("inference-header-content-length")
        if header_length is None:
            tensor = orjson.loads(body)["inputs"][0]
            reply = {"model_name": name, "model_version": "1", "outputs": [
                {"name": "OUTPUT0", "datatype": tensor["datatype"], "shape": tensor["shape"],
                 "data": tensor["data"]}]}
            return Response(orjson.dumps(reply), media_type="application/json")
        length = int(header_length)
        tensor = orjson.loads(body[:length])["inputs"][0]
        raw = memoryview(body)[length:]
        header = orjson.dumps({"model_name": name, "model_version": "1", "outputs": [
            {"name": "OUTPUT0", "datatype": tensor["datatype"], "shape": tensor["shape"],
             "parameters": {"binary_data_size": len(raw)}}]})
        return Response(header + raw, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(header))})

    async def ready(request: Request) -> Response:
        return Response(b"", status_code=200)

    app = Starlette(routes=[
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
    ])
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False)


def serve_grpc(port: int) -> None:
    import grpc

    from pyserve.protocol import (
        ModelInferRequest,
        ModelInferResponse,
        ServerReadyRequest,
        ServerReadyResponse,
    )

    async def model_infer(request: ModelInferRequest, context: object) -> ModelInferResponse:
        response = ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for tensor in request.inputs:
            response.outputs.add(name="OUTPUT0", datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.extend(request.raw_input_contents)
        return response

    async def server_ready(request: ServerReadyRequest, context: object) -> ServerReadyResponse:
        return ServerReadyResponse(ready=True)

    handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(
            model_infer, request_deserializer=ModelInferRequest.FromString,
            response_serializer=ModelInferResponse.SerializeToString),
        "ServerReady": grpc.unary_unary_rpc_method_handler(
            server_ready, request_deserializer=ServerReadyRequest.FromString,
            response_serializer=ServerReadyResponse.SerializeToString),
    })

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1),
                                          ("grpc.max_send_message_length", -1)])
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def serve_h2_floor(port: int) -> None:
    """The transport floor: one asyncio protocol answering every ``ModelInfer`` on an HTTP/2
    connection with the echo, no gRPC server at all (settings acknowledged, pings answered,
    small single-frame messages only). What remains of a latency measured against it is the
    loopback round trip and the client."""
    import uvloop

    from pyserve.frontends.grpc import http2 as h2
    from pyserve.protocol import ModelInferRequest, ModelInferResponse

    headers = h2.STATUS_200 + h2.literal(b"content-type", b"application/grpc")
    trailers = h2.literal(b"grpc-status", b"0")

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.buffer = b""
            self.bodies: dict[int, bytes] = {}

        def data_received(self, data: bytes) -> None:
            buffer = self.buffer + data
            if buffer.startswith(h2.PREFACE):
                buffer = buffer[len(h2.PREFACE):]
                self.transport.write(h2.settings({}) + h2.window_update(0, 1 << 30))  # type: ignore[attr-defined]
            out = []
            frames, self.buffer = h2.split_frames(buffer)
            for kind, flags, stream, payload in frames:
                if kind == h2.DATA:
                    body = self.bodies.get(stream, b"") + payload
                    if not flags & h2.END_STREAM:
                        self.bodies[stream] = body
                        continue
                    self.bodies.pop(stream, None)
                    request = ModelInferRequest.FromString(body[5:])
                    response = ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
                    for tensor in request.inputs:
                        response.outputs.add(name="OUTPUT0", datatype=tensor.datatype, shape=tensor.shape)
                    response.raw_output_contents.extend(request.raw_input_contents)
                    message = response.SerializeToString()
                    out.append(h2.frame(h2.HEADERS, h2.END_HEADERS, stream, headers)
                               + h2.frame(h2.DATA, 0, stream, b"\x00" + len(message).to_bytes(4, "big") + message)
                               + h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, stream, trailers))
                elif kind == h2.SETTINGS and not flags & h2.ACK:
                    out.append(h2.frame(h2.SETTINGS, h2.ACK, 0))
                elif kind == h2.PING and not flags & h2.ACK:
                    out.append(h2.frame(h2.PING, h2.ACK, 0, payload))
            if out:
                self.transport.write(b"".join(out))  # type: ignore[attr-defined]

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


SERVERS = {"http": serve_http, "grpc": serve_grpc, "h2-floor": serve_h2_floor}

if __name__ == "__main__":
    kind, port_text = sys.argv[1], sys.argv[2]
    try:
        SERVERS[kind](int(port_text))
    except KeyboardInterrupt:
        pass
