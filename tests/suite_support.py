"""Helpers shared by the test modules (imported as ``suite_support``; fixtures live in conftest).

A module of its own, with a name no other test folder uses, so that ``from suite_support import``
resolves to this file whatever order pytest collects the plugin test folders in.
"""

from __future__ import annotations

import asyncio
import importlib.util
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

from pyserve.testing import OWN_GRPC_CONNECTION as OWN_GRPC_CONNECTION  # re-exported for the tests
from pyserve.testing import ServerFactory, write_model

__all__ = [
    "DATATYPES",
    "EXAMPLE_REPOSITORY",
    "REPO_ROOT",
    "SQUARE_CONFIG",
    "QueuedStream",
    "RunningServer",
    "StartServer",
    "grpc_handler_server",
    "identity_config",
    "sample",
    "write_model",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_REPOSITORY = REPO_ROOT / "examples" / "model_repository"

StartServer = ServerFactory

STARTED = re.compile(r"Started HTTPService at (\S+):(\d+)")
"""The log line ``pyserve run`` writes once it serves, with the HTTP address and port."""

DATATYPES: dict[str, tuple[str, Any]] = {
    # KServe datatype → (config data_type, numpy dtype)
    "BOOL": ("TYPE_BOOL", np.bool_),
    "UINT8": ("TYPE_UINT8", np.uint8),
    "UINT16": ("TYPE_UINT16", np.uint16),
    "UINT32": ("TYPE_UINT32", np.uint32),
    "UINT64": ("TYPE_UINT64", np.uint64),
    "INT8": ("TYPE_INT8", np.int8),
    "INT16": ("TYPE_INT16", np.int16),
    "INT32": ("TYPE_INT32", np.int32),
    "INT64": ("TYPE_INT64", np.int64),
    "FP16": ("TYPE_FP16", np.float16),
    "BF16": ("TYPE_BF16", ml_dtypes.bfloat16),
    "FP32": ("TYPE_FP32", np.float32),
    "FP64": ("TYPE_FP64", np.float64),
    "BYTES": ("TYPE_STRING", np.object_),
}

SQUARE_CONFIG = """
    backend: "square"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
"""The decoupled ``square`` backend's model (``pyserve-backend-square``)."""


def sample(datatype: str, shape: tuple[int, ...] = (2, 3), blank: bytes = b"") -> np.ndarray:
    """Distinct, exactly representable values of ``datatype`` including each type's extremes
    (BYTES: UTF-8 text alternating with ``blank``)."""
    n = int(np.prod(shape))
    np_dtype = DATATYPES[datatype][1]
    if datatype == "BOOL":
        values: Any = [i % 3 == 0 for i in range(n)]
    elif datatype == "BYTES":
        values = [f"é{i}-\u2603".encode() if i % 2 else blank for i in range(n)]
    elif datatype.startswith(("UINT", "INT")):
        info = np.iinfo(np_dtype)
        values = [info.min, info.max] + [i * 3 + 1 for i in range(n - 2)]
    else:
        values = [-1.5, 0.25] + [i * 0.5 for i in range(n - 2)]
    return np.array(values, dtype=np_dtype).reshape(shape)


def pair_config(backend: str, extra: str = "") -> str:
    """A model of ``backend`` taking ``IN`` and giving ``OUT``, both FP32 ``[ 2 ]``, batching up to
    4, plus ``extra`` config text."""
    return f"""
    backend: "{backend}"
    max_batch_size: 4
    input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }} ]
    output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
    {extra}
    """


def identity_config(name: str, datatype: str, max_batch_size: int = 4, dims: str = "[ -1 ]") -> str:
    """An ``identity`` model ``IN`` → ``OUT`` of one datatype."""
    config_type = DATATYPES[datatype][0]
    return f"""
        name: "{name}"
        backend: "identity"
        max_batch_size: {max_batch_size}
        input [ {{ name: "IN" data_type: {config_type} dims: {dims} }} ]
        output [ {{ name: "OUT" data_type: {config_type} dims: {dims} }} ]
    """


# -- a Python-backend model summing the inputs of each sequence (frontend processes, Ray Serve) ------

ACCUMULATE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            key = request.correlation_id()
            if pb_utils.get_input_tensor_by_name(request, "START").as_numpy()[0]:
                self.sums[key] = 0
            self.sums[key] = self.sums.get(key, 0) + value
            out = pb_utils.Tensor("OUTPUT0", np.array([self.sums[key]], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""


def accumulate_config(extra: str = "") -> str:
    """``accumulate``: INT32 ``INPUT0`` [1] added to its sequence's sum, returned as ``OUTPUT0``."""
    return f"""
name: "accumulate"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 60000000
  control_input [ {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }} ]
}}
{extra}
"""


FP32_ECHO_CONFIG = """
    backend: "identity"
    max_batch_size: 0
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
"""The identity backend on FP32 ``INPUT0`` [-1] → ``OUTPUT0``, no batching (gRPC protocol tests)."""


ECHO_MODEL_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""
"""A Triton ``model.py`` echoing ``INPUT0`` as ``OUTPUT0`` (frontend processes, busy polling)."""


def _fp32_echo(name: str, backend: str, extra: str) -> str:
    return f"""
name: "{name}"
backend: "{backend}"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{extra}
"""


def python_echo_config(name: str, extra: str = "") -> str:
    """A Python-backend model running ``ECHO_MODEL_PY``: FP32 ``INPUT0`` [-1], batching up to 8."""
    return _fp32_echo(name, "python", extra)


def echo_config(extra: str = "") -> str:
    """``echo``: the identity backend on FP32 ``INPUT0`` [-1] → ``OUTPUT0``, batching up to 8."""
    return _fp32_echo("echo", "identity", "dynamic_batching { }\n" + extra)


@contextmanager
def grpc_handler_server(handler: Any) -> Iterator[int]:
    """pyserve's own ``GrpcServer`` serving one generic handler (no model server around it) on a
    loopback port, on a thread of its own; yields the port and stops the server on exit."""
    from pyserve.frontends.grpc.listener import GrpcServer
    from pyserve.frontends.grpc.server import GrpcOptions

    ready, stop = threading.Event(), threading.Event()
    port: list[int] = []

    def serve_forever() -> None:
        async def main() -> None:
            server = GrpcServer(GrpcOptions())
            server.add_generic_rpc_handlers([handler])
            port.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)
            await server.stop(None)

        asyncio.run(main())

    thread = threading.Thread(target=serve_forever, daemon=True)
    thread.start()
    assert ready.wait(60)
    try:
        yield port[0]
    finally:
        stop.set()
        thread.join(60)


class QueuedStream:
    """A ``tritonclient.grpc`` stream whose callback results land in a queue, for tests to take
    one at a time (each ``(result, error)``; ``timeout`` seconds at most)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> None:
        import tritonclient.grpc as grpcclient

        self.timeout = timeout
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)), headers=headers)

    def next(self, timeout: float | None = None) -> tuple[Any, Any]:
        """The next ``(result, error)`` pair."""
        return self.results.get(timeout=self.timeout if timeout is None else timeout)

    def error(self) -> Any:
        """The next message, which must be an error (the ``InferenceServerException``)."""
        result, error = self.next()
        assert result is None and error is not None, result
        return error

    def assert_quiet(self, seconds: float = 0.3) -> None:
        """Nothing arrives for ``seconds``."""
        try:
            item = self.results.get(timeout=seconds)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected stream message: {item}")

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()


def wait_for(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition",
             detail: Callable[[], str] | None = None) -> None:
    """Poll ``condition`` every 10 ms until it holds; AssertionError naming ``what`` after ``timeout`` s
    (followed by ``detail()``, e.g. a server's log, read when it fails)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f":\n{detail()}" if detail else ""))
        time.sleep(0.01)


class RunningServer:
    """A ``pyserve run`` subprocess whose stderr is collected on a thread (``command`` is how
    ``pyserve`` is started: this interpreter's by default, or another environment's script).

    ``process`` is the process ``pyserve run`` started as: on Linux the keeper
    (``pyserve.handoff.keeper``), whose child serves; ``server_pid`` is the serving process that
    logged ``Started HTTPService`` last (log lines carry the writer's pid).
    """

    def __init__(self, args: Sequence[str], *, command: Sequence[str] = (sys.executable, "-m", "pyserve"),
                 cwd: Path = REPO_ROOT, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [*command, "run", "--http-port", "0", "--grpc-port", "0",
             "--metrics-port", "0", "--http-address", "127.0.0.1", *args],
            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self.server_pid: int | None = None
        self.starts = 0  # how many times a server process logged Started HTTPService
        self._started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            match = STARTED.search(line)
            if match:
                self.port = int(match.group(2))
                writer = line.split(None, 3)
                self.server_pid = int(writer[2]) if len(writer) > 2 and writer[2].isdigit() else None
                self.starts += 1
                self._started.set()
        self._started.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_started(self, timeout: float = 30) -> str:
        assert self._started.wait(timeout), "server did not start:\n" + self.stderr
        assert self.port is not None, "server exited before listening:\n" + self.stderr
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        self._reader.join(60)
        return code

    def close(self) -> None:
        """Kill the process if it still runs, and close its pipe."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._reader.join(60)
        if self.process.stderr is not None:
            self.process.stderr.close()


# -- language-model-shaped Python models (the OpenAI routes and KServe streaming) -------------------

WORDS_MODEL_PY = '''
import asyncio
import json
import os
import re

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.marks = json.loads(args["model_config"])["parameters"]["marks"]["string_value"]

    async def execute(self, requests):
        for request in requests:
            await self.run(request)
        return None

    def piece(self, text):
        return pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))])

    async def run(self, request):
        sender = request.get_response_sender()
        text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
        word, _, rest = text.partition(" ")
        if word == "refuse":
            error = pb_utils.TritonError("refused: " + rest, pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        elif word == "forever":
            while not sender.is_cancelled():
                sender.send(self.piece("x"))
                await asyncio.sleep(0.01)
            open(os.path.join(self.marks, rest), "w").close()
            sender.send(flags=FINAL)
        elif word == "fail":
            sender.send(self.piece("one "))
            sender.send(self.piece("two "))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("failed after two words")), flags=FINAL)
        else:
            for piece in re.findall(r"\\S+\\s*", text):
                sender.send(self.piece(piece))
                await asyncio.sleep(0)
            sender.send(flags=FINAL)
'''
"""A decoupled Python model streaming its ``text_input`` back one word per response; ``refuse X``
fails at once (INVALID_ARG), ``fail`` fails after two words, ``forever TAG`` streams until
cancelled and then creates the file ``TAG`` in the folder of config parameter ``marks``."""


def words_config(marks: Path, extra: str = "") -> str:
    """``words``: ``WORDS_MODEL_PY``, decoupled, recording cancellations in ``marks``."""
    return f"""
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
parameters {{ key: "marks" value {{ string_value: "{marks}" }} }}
{extra}
"""


def wait_for_file(path: Path, timeout: float = 30.0) -> bool:
    """True once ``path`` exists (``wait_for``: AssertionError after ``timeout`` seconds)."""
    wait_for(path.exists, timeout, f"the file '{path.name}'")
    return True


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` (a page generator) as module ``name``, once per session."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
