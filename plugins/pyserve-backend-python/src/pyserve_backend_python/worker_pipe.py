"""The worker's end of the pipe to the server process, and the server requests it stands for.

``WorkerPipe`` sorts what the parent sends on a reader thread (the messages are those of
``pyserve_backend_python.worker``): answers to BLS and model-control calls go to the ``call``
waiting for that call id, cancellations into ``cancelled``, readiness questions to a thread of their own, and
everything else into ``inbox`` for the worker's main loop. Any thread may ``send``.

``WorkerRequest`` is what ``pb_utils.InferenceResponseSender`` needs of a server request, in
the worker: its ``PipeSender`` sends each response to the parent as it comes.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from pyserve import ErrorCode, InferError


class WorkerPipe:
    """The connection to the server process.

    :param conn: the worker's end of the pipe (``multiprocessing.connection.Connection``).
    :param on_ready: called with the token of a ``("ready", token)`` question, on a new thread.
    """

    def __init__(self, conn: Any, on_ready: Callable[[int], None]) -> None:
        self._conn = conn
        self._on_ready = on_ready
        self._send_lock = threading.Lock()  # the main loop, BLS calls and response senders all send
        self._calls_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._waiting: dict[int, queue.SimpleQueue[Any]] = {}  # call id -> where its answer goes
        self._gone = False  # the parent went away: calls answer None at once
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        """The main loop's messages; None once the parent went away."""
        self.cancelled: set[int] = set()
        """Keys of requests whose client went away."""

    def start_reader(self) -> None:
        """Start sorting what the parent sends (a daemon thread, until the pipe closes)."""
        threading.Thread(target=self._read, name="pyserve-python-worker-reader", daemon=True).start()

    def send(self, message: tuple[Any, ...]) -> None:
        """Send one message to the parent (any thread)."""
        with self._send_lock:
            self._conn.send(message)

    def call(self, message: tuple[Any, ...]) -> Any:
        """Send a BLS or model-control call, ``(kind, *fields)``, as ``(kind, call id, *fields)``
        and wait for its answer ``("bls_result", call id, payload)``; returns
        ``("bls_result", payload)``, or None when the parent went away. Calls from several
        threads are in flight at once (the parent runs each on a thread of its own)."""
        answer: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._calls_lock:
            if self._gone:
                return None
            call_id = next(self._call_ids)
            self._waiting[call_id] = answer
        try:
            self.send((message[0], call_id, *message[1:]))
        except (OSError, ValueError):
            with self._calls_lock:
                self._waiting.pop(call_id, None)
            return None
        return answer.get()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self.inbox.put(None)
                with self._calls_lock:
                    self._gone = True
                    waiting, self._waiting = self._waiting, {}
                for waiter in waiting.values():
                    waiter.put(None)
                return
            kind = message[0]
            if kind == "bls_result":
                with self._calls_lock:
                    answer = self._waiting.pop(message[1], None)
                if answer is not None:
                    answer.put((kind, message[2]))
            elif kind == "cancel":
                self.cancelled.add(message[1])
            elif kind == "ready":
                threading.Thread(target=self._on_ready, args=(message[1],), daemon=True,
                                 name="pyserve-python-worker-ready").start()
            else:
                self.inbox.put(message)


class PipeSender:
    """A decoupled request's responses, sent to the parent as they come (any thread)."""

    __slots__ = ("_pipe", "final_sent", "key")

    def __init__(self, key: int, pipe: WorkerPipe) -> None:
        self.key = key
        self.final_sent = False
        self._pipe = pipe

    def send(self, response: Any, final: bool) -> None:
        """Send a response (an ``InferResponse``, an ``InferError`` or None) to the parent.

        :raises InferError: the final response was sent already.
        """
        if self.final_sent:
            raise InferError("the final response was already sent", ErrorCode.INTERNAL)
        if isinstance(response, InferError):
            payload: Any = ("error", response.message, int(response.code))
        elif response is not None:
            payload = ("ok", [(n, np.asarray(a)) for n, a in response.outputs.items()], dict(response.parameters))
        else:
            payload = None
        if final:
            self.final_sent = True
            self._pipe.cancelled.discard(self.key)
        self._pipe.send(("send", self.key, payload, bool(final)))

    def is_cancelled(self) -> bool:
        return self.key in self._pipe.cancelled


class WorkerRequest:
    """What ``InferenceResponseSender`` needs of a server request, in the worker.

    :param key: the parent's key of the request.
    :param model_name: for the message of ``reschedule``.
    """

    __slots__ = ("_model_name", "_pipe", "_sender")

    def __init__(self, key: int, pipe: WorkerPipe, model_name: str) -> None:
        self._sender = PipeSender(key, pipe)
        self._pipe = pipe
        self._model_name = model_name

    def response_sender(self) -> PipeSender:
        return self._sender

    def is_cancelled(self) -> bool:
        return self._sender.key in self._pipe.cancelled

    @property
    def final_sent(self) -> bool:
        return self._sender.final_sent

    def reschedule(self) -> None:
        """:raises InferError: always (UNSUPPORTED in process mode)."""
        raise InferError(f"rescheduling requests (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) is not supported "
                         f"in execution_mode 'process' (model '{self._model_name}'); use execution_mode 'thread'",
                         ErrorCode.UNSUPPORTED)
