"""The ``/v1`` routes: ``GET /v1/models[/{id}]``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

A request is checked (``schema``), its model's binding found (``binding``), chat messages
rendered with the chat template, the prompt's tokens checked against the context length, and
one model request per prompt and choice submitted (``run``). Without ``stream`` the answer waits
for every choice; with it, Server-Sent Events in OpenAI's chunk format follow, ending with
``data: [DONE]``. The status waits for the first text, so a request the model refuses at once
gets its error with the right status; an error after that arrives as an event
``data: {"error": {...}}`` (which the ``openai`` client raises as ``APIError``), then
``[DONE]``. A client that disconnects cancels its model requests at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.api.errors import ErrorCode, InferError
from pyserve.dataplane.interface import ServingPlane
from pyserve.frontends.http.body import read_body
from pyserve.frontends.http.openai.binding import Binding, Bindings, describe
from pyserve.frontends.http.openai.errors import (
    OpenAIError,
    from_infer_error,
    invalid,
    model_not_found,
)
from pyserve.frontends.http.openai.metrics import OpenAIMetrics
from pyserve.frontends.http.openai.run import Piece, Run
from pyserve.frontends.http.openai.schema import (
    GenerationRequest,
    parse_body,
    parse_chat,
    parse_completion,
)
from pyserve.frontends.http.streaming import (
    DISCONNECTED,
    SSE_TYPE,
    EventStream,
    until_disconnected,
)
from pyserve.runtime.versions import ModelVersion

OWNER = "pyserve"
"""The ``owned_by`` of every listed model."""


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


def _event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class OpenAIRoutes:
    """The handlers, bound to one server's data plane.

    :param dataplane: the data plane every model request goes through.
    :param max_input_size: the request body cap (``--http-max-input-size``).
    :param metrics: where token timings and counts go (None: not counted).
    """

    def __init__(self, dataplane: ServingPlane, max_input_size: int, metrics: OpenAIMetrics | None) -> None:
        self.dataplane = dataplane
        self.max_input_size = max_input_size
        self.metrics = metrics
        self.bindings = Bindings()
        self._first_seen: weakref.WeakKeyDictionary[ModelVersion, int] = weakref.WeakKeyDictionary()

    def routes(self) -> list[Route]:
        """The Starlette routes."""
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.retrieve_model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

    # -- models ----------------------------------------------------------------------------------
    def _served(self) -> list[ModelVersion]:
        """The latest READY version of every model the routes can serve, by name."""
        served = []
        for name in sorted(self.dataplane.models.records):
            version = self.dataplane.models.records[name].latest_ready()
            if version is not None and not isinstance(describe(version), str):
                served.append(version)
        return served

    def _card(self, model: ModelVersion) -> dict[str, Any]:
        created = self._first_seen.setdefault(model, int(time.time()))
        return {"id": model.name, "object": "model", "created": created, "owned_by": OWNER}

    async def list_models(self, request: Request) -> Response:
        """``GET /v1/models``: every model the routes serve."""
        return _json({"object": "list", "data": [self._card(m) for m in self._served()]})

    async def retrieve_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: one of them, or 404."""
        name = request.path_params["model_id"]
        for model in self._served():
            if model.name == name:
                return _json(self._card(model))
        return model_not_found(name).response()

    def _model(self, name: str) -> ModelVersion:
        try:
            return self.dataplane.model(name)
        except InferError as exc:
            if exc.code is ErrorCode.NOT_FOUND:
                raise model_not_found(name) from None
            raise from_infer_error(exc, "model") from None

    # -- generation ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, chat=True)

    async def _prepare(self, request: Request, chat: bool) -> tuple[GenerationRequest, ModelVersion, Run]:
        """Check the body, find the model, render the prompt and submit the run.

        :raises OpenAIError: any problem, before or while submitting (nothing is left running).
        """
        try:
            body = await read_body(request, self.max_input_size)
        except InferError as exc:
            raise from_infer_error(exc) from None
        payload = parse_body(body)
        params = parse_chat(payload) if chat else parse_completion(payload)
        model = self._model(params.model)
        binding = await self.bindings.get(model)
        if params.stream and not model.decoupled:
            raise invalid(f"model '{model.name}' cannot stream: only decoupled models do "
                          "(model_transaction_policy { decoupled: true }); send 'stream': false", "stream")
        if chat:
            params.prompts = [binding.template.render(params.messages)]
        counts = await self._count(binding, params.prompts)
        for count in counts:
            binding.check_context(count, params.sampling.max_tokens, "messages" if chat else "prompt")
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        trace_parent = request.headers.get("traceparent") if self.dataplane.tracing.active else None
        run = Run(self.dataplane, model, binding, params, counts, self.metrics, trace_parent, request_id)
        try:
            run.start()
        except BaseException:
            run.close()
            raise
        return params, model, run

    @staticmethod
    async def _count(binding: Binding, prompts: list[str]) -> list[int]:
        if binding.counter.exact:  # a real tokenizer: off the event loop
            return await asyncio.to_thread(lambda: [binding.counter.count(p) for p in prompts])
        return [binding.counter.count(p) for p in prompts]

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            params, model, run = await self._prepare(request, chat)
        except OpenAIError as exc:
            return exc.response()
        if params.stream:
            return await self._stream(request, params, model, run, chat)
        try:
            result = await until_disconnected(request.receive, self._collect(run))
        except OpenAIError as exc:
            return exc.response()
        finally:
            run.close()
        if result is DISCONNECTED:
            return Response(b"", 400)  # nobody reads it
        texts, reasons = result
        if params.echo:
            texts = [params.prompts[c.prompt_index] + t for c, t in zip(run.choices, texts)]
        created = int(time.time())
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                        "finish_reason": reasons[i]} for i, t in enumerate(texts)]
            kind = "chat.completion"
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": reasons[i]}
                       for i, t in enumerate(texts)]
            kind = "text_completion"
        return _json({"id": run.request_id, "object": kind, "created": created, "model": model.name,
                      "choices": choices, "usage": run.usage()})

    @staticmethod
    async def _collect(run: Run) -> tuple[list[str], list[str | None]]:
        texts = [""] * len(run.choices)
        reasons: list[str | None] = [None] * len(run.choices)
        async for piece in run.events():
            if piece.error is not None:
                raise piece.error
            texts[piece.index] += piece.text
            if piece.finish_reason is not None:
                reasons[piece.index] = piece.finish_reason
        return texts, reasons

    async def _stream(self, request: Request, params: GenerationRequest, model: ModelVersion, run: Run,
                      chat: bool) -> Response:
        pieces = run.events()
        try:
            first = await until_disconnected(request.receive, anext(pieces))
        except OpenAIError as exc:
            run.close()
            return exc.response()
        except BaseException:
            run.close()
            raise
        if first is DISCONNECTED:
            run.close()
            return Response(b"", 400)
        chunks = _Chunks(run, params, model.name, chat)

        async def body() -> AsyncIterator[bytes]:
            for chunk in chunks.opening():
                yield chunk
            piece: Piece | None = first
            while piece is not None:
                if piece.error is not None:
                    yield _event(piece.error.payload())
                    break
                for chunk in chunks.piece(piece):
                    yield chunk
                piece = await anext(pieces, None)
            if params.include_usage:
                yield chunks.usage()
            yield _DONE

        return EventStream(body(), SSE_TYPE, on_close=run.close)


class _Chunks:
    """OpenAI's stream chunks for one run (``text_completion`` or ``chat.completion.chunk``)."""

    def __init__(self, run: Run, params: GenerationRequest, model: str, chat: bool) -> None:
        self.run = run
        self.params = params
        self.chat = chat
        self.head = {"id": run.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}

    def _chunk(self, index: int, text: str | None, finish: str | None, role: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.params.include_usage:
            chunk["usage"] = None
        return _event(chunk)

    def opening(self) -> list[bytes]:
        """Chat: each choice's role chunk; completions with ``echo``: each choice's prompt."""
        if self.chat:
            return [self._chunk(c.index, "", None, role=True) for c in self.run.choices]
        if self.params.echo:
            return [self._chunk(c.index, self.params.prompts[c.prompt_index], None) for c in self.run.choices]
        return []

    def piece(self, piece: Piece) -> list[bytes]:
        """The chunks of one piece: its text, then its finish reason (an empty delta)."""
        out = []
        if piece.text:
            out.append(self._chunk(piece.index, piece.text, None))
        if piece.finish_reason is not None:
            out.append(self._chunk(piece.index, None if self.chat else "", piece.finish_reason))
        return out

    def usage(self) -> bytes:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return _event({**self.head, "choices": [], "usage": self.run.usage()})


def openai_routes(dataplane: ServingPlane, max_input_size: int, metrics: OpenAIMetrics | None) -> list[Route]:
    """The ``/v1`` routes serving ``dataplane``'s models."""
    return OpenAIRoutes(dataplane, max_input_size, metrics).routes()
