"""One ``/v1`` request in flight: a model request per choice, their text as it arrives.

``Run`` submits one ``InferRequest`` per prompt and choice (``n``) through ``DataPlane.submit``,
so scheduling, statistics, ``nv_inference_*`` metrics and tracing are those of any KServe
request. The responses of every choice arrive in one ``ResponseBacklog`` (a model sending faster
than the client reads waits there, as for any decoupled stream) and ``events`` turns them into
text pieces, in arrival order:

* text is decoded as UTF-8 incrementally (a character split across two responses is whole in
  the second; bytes that are not UTF-8 become U+FFFD);
* ``stop`` sequences are found by the server, whatever the model does: text that may be the start
  of one is held back until it is known not to be, a sequence found ends the choice (it is not
  part of the text) with ``finish_reason`` ``stop``;
* a choice ends with ``length`` once its tokens reach ``max_tokens``;
* a choice that ends before its model finished is cancelled (``request.cancel()``: the model
  sees ``is_cancelled()``), as is every unfinished choice when the client goes away (``close``).
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pyserve.api.errors import InferError
from pyserve.api.inference import InferRequest, InferResponse
from pyserve.dataplane.interface import InferencePlane
from pyserve.frontends.backlog import ResponseBacklog
from pyserve.frontends.http.openai.binding import Binding
from pyserve.frontends.http.openai.errors import OpenAIError, from_infer_error
from pyserve.frontends.http.openai.metrics import OpenAIMetrics
from pyserve.frontends.http.openai.schema import GenerationRequest
from pyserve.runtime.versions import ModelVersion


@dataclass
class Piece:
    """What ``Run.events`` yields: new text of one choice, or its end.

    :ivar finish_reason: ``stop`` / ``length`` when the choice ended with this piece, else None.
    :ivar error: set instead when the model failed this choice after the stream began.
    """

    index: int
    text: str = ""
    finish_reason: str | None = None
    error: OpenAIError | None = None


class _ChoiceSender:
    """Where one choice's responses go: the run's backlog, tagged with the choice's index."""

    __slots__ = ("backlog", "closed", "index")

    def __init__(self, backlog: ResponseBacklog, index: int) -> None:
        self.backlog = backlog
        self.index = index
        self.closed = False

    def send(self, response: InferResponse | InferError | None, final: bool) -> None:
        if self.closed or self.backlog.closed:  # the choice ended or the client went away: nobody reads it
            return
        self.backlog.put((self.index, response, final))

    def is_cancelled(self) -> bool:
        return self.closed or self.backlog.closed


class _StopFinder:
    """Holds back text that may begin a stop sequence; finds the sequences."""

    __slots__ = ("pending", "stops")

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text safe to send, a stop sequence was found)``."""
        if not self.stops:
            return text, False
        buffer = self.pending + text
        found = min((p for p in (buffer.find(s) for s in self.stops) if p >= 0), default=-1)
        if found >= 0:
            self.pending = ""
            return buffer[:found], True
        keep = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), keep, -1):
                if buffer.endswith(stop[:size]):
                    keep = size
                    break
        self.pending = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class _Choice:
    """The state of one choice while its responses arrive."""

    def __init__(self, index: int, prompt_index: int, request: InferRequest, sender: _ChoiceSender,
                 stops: list[str]) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.request = request
        self.sender = sender
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stops = _StopFinder(stops)
        self.completion_tokens = 0
        self.prompt_tokens: int | None = None  # as the model reported it
        self.done = False  # the choice ended (its last piece was yielded)
        self.model_finished = False  # the model sent its final response
        self.last_piece_ns = 0


class Run:
    """The model requests of one ``/v1`` request.

    Event loop only. ``start`` submits; ``events`` yields pieces until every choice ended;
    ``close`` must follow (``finally``): it cancels what is unfinished and releases the requests.

    :param prompt_tokens: the tokens of each prompt as the server counted them (the model's own
        count replaces it once reported).
    """

    def __init__(self, dataplane: InferencePlane, model: ModelVersion, binding: Binding, request: GenerationRequest,
                 prompt_tokens: list[int], metrics: OpenAIMetrics | None, trace_parent: str | None,
                 request_id: str) -> None:
        self.dataplane = dataplane
        self.model = model
        self.binding = binding
        self.request = request
        self.counted_prompt_tokens = prompt_tokens
        self.metrics = metrics
        self.trace_parent = trace_parent
        self.request_id = request_id
        self.backlog = ResponseBacklog(asyncio.get_running_loop())
        self.choices: list[_Choice] = []
        self.arrival_ns = time.monotonic_ns()
        self._open = 0
        self._recorded = False

    def start(self) -> None:
        """Build and submit every choice's request.

        :raises OpenAIError: a setting the model cannot take, or the server refused a request
            (what was already submitted is cancelled by ``close``).
        """
        request = self.request
        tracing = self.dataplane.tracing.active
        for prompt_index, prompt in enumerate(request.prompts):
            for choice in range(request.n):
                index = len(self.choices)
                infer = self.binding.build_request(self.model, prompt, request.sampling, stream=request.stream,
                                                   choice=choice, request_id=self.request_id)
                if tracing:
                    infer.trace_parent = self.trace_parent
                sender = _ChoiceSender(self.backlog, index)
                infer.attach_sender(sender)
                try:
                    self.dataplane.submit(self.model, infer)
                except InferError as error:
                    raise from_infer_error(error) from None
                self.choices.append(_Choice(index, prompt_index, infer, sender, request.sampling.stop))
                self._open += 1

    async def events(self) -> AsyncIterator[Piece]:
        """Pieces in arrival order, until every choice has ended.

        :raises OpenAIError: the model failed before any text of this request was yielded.
        """
        started = False
        while self._open:
            index, response, final = await self.backlog.get()
            choice = self.choices[index]
            if choice.done:
                continue
            if final:
                choice.model_finished = True
                choice.request.release()
            if isinstance(response, InferError):
                error = from_infer_error(response)
                if not started:
                    raise error
                self._end(choice)
                yield Piece(index, error=error)
                continue
            piece = self._piece(choice, response, final)
            if piece is not None:
                started = started or bool(piece.text) or piece.finish_reason is not None
                yield piece

    def _piece(self, choice: _Choice, response: InferResponse | None, final: bool) -> Piece | None:
        text = ""
        limit = self.request.sampling.max_tokens
        finish: str | None = None
        if response is not None:
            data, input_tokens, output_tokens = self.binding.read(response)
            if input_tokens is not None and choice.prompt_tokens is None:
                choice.prompt_tokens = input_tokens
            if data or output_tokens:
                choice.completion_tokens += output_tokens if output_tokens is not None else self._count(data)
            text, stopped = choice.stops.feed(choice.decoder.decode(data))
            if stopped:
                finish = "stop"
            elif limit is not None and choice.completion_tokens >= limit and self.model.decoupled:
                finish = "length"
        if finish is None and final:
            tail, stopped = choice.stops.feed(choice.decoder.decode(b"", final=True))
            text += tail if stopped else tail + choice.stops.flush()
            finish = "length" if not stopped and limit is not None and choice.completion_tokens >= limit else "stop"
        if text:
            self._observe(choice, text)
        if finish is not None:
            self._end(choice)
            return Piece(choice.index, text, finish)
        return Piece(choice.index, text) if text else None

    def _count(self, data: bytes) -> int:
        """Tokens of a response that did not report them: one per response of a decoupled model
        (one response per generated token, as streaming backends send), else counted."""
        if self.model.decoupled:
            return 1
        return self.binding.counter.count(data.decode("utf-8", "replace"))

    def _observe(self, choice: _Choice, text: str) -> None:
        now = time.monotonic_ns()
        if self.metrics is not None:
            if not choice.last_piece_ns:
                self.metrics.first_token(self.model.name, (now - self.arrival_ns) / 1e9)
            else:
                self.metrics.inter_token(self.model.name, (now - choice.last_piece_ns) / 1e9)
        choice.last_piece_ns = now

    def _end(self, choice: _Choice) -> None:
        """The choice is over: cancel its model request if that is still generating."""
        choice.done = True
        self._open -= 1
        if not choice.model_finished:
            choice.request.cancel()
            choice.sender.closed = True
            choice.model_finished = True
            choice.request.release()

    def close(self) -> None:
        """Cancel every unfinished choice, release every request and count the tokens in the
        metrics (idempotent)."""
        for choice in self.choices:
            if not choice.done:
                self._end(choice)
        self.backlog.close()  # releases a model waiting for room
        if self.metrics is not None and self.choices and not self._recorded:
            self._recorded = True
            usage = self.usage()
            self.metrics.tokens(self.model.name, usage["prompt_tokens"], usage["completion_tokens"])

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage``: each prompt counted once, every choice's completion tokens."""
        prompt_tokens = 0
        for prompt_index, counted in enumerate(self.counted_prompt_tokens):
            reported = [c.prompt_tokens for c in self.choices if c.prompt_index == prompt_index
                        and c.prompt_tokens is not None]
            prompt_tokens += reported[0] if reported else counted
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}
