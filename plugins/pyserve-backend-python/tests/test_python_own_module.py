"""``import model``: a model.py reaches itself by its file's name, as under Triton's stub.

Triton's own test models run the test cases they define with ``unittest.main("model",
exit=False)`` from ``execute``; that needs the module ``model`` (the calling model's file) and a
``sys.argv`` without the server's flags. Relative imports of the files next to model.py keep
working, and two models whose files are both model.py each see their own.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from python_backend_helpers import start, write_python_model

from pyserve.server.core import ServerThread

CONFIG = """
    backend: "python"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

UNITTEST_MODEL = """
import threading
import unittest

import numpy as np
import triton_python_backend_utils as pb_utils

from . import helper
from .helper import VALUE


class HelperTest(unittest.TestCase):
    def test_relative_imports(self):
        self.assertEqual(VALUE, "next to model.py")
        self.assertIs(helper.VALUE, VALUE)

    def test_own_module(self):
        import model
        self.assertIs(model.HelperTest, HelperTest)
        seen = []  # a thread the model starts (no calling model): the only model.py loaded
        thread = threading.Thread(target=lambda: seen.append(__import__("model").HelperTest))
        thread.start()
        thread.join()
        self.assertEqual(seen, [HelperTest])


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for _ in requests:
            result = unittest.main("model", exit=False).result
            text = f"ran={result.testsRun} ok={result.wasSuccessful()}"
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([text.encode()], dtype=np.object_))]))
        return responses
"""

NAMED_MODEL = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

NAME = "{name}"


def answer(text):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text.encode()], dtype=np.object_))])


class TritonPythonModel:
    def execute(self, requests):
        import model
        seen = []
        if pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0] == 1:
            def look():
                try:
                    import model as from_thread
                    seen.append(from_thread.NAME)
                except AttributeError as exc:
                    seen.append(str(exc))
            thread = threading.Thread(target=look)
            thread.start()
            thread.join()
        return [answer(" ".join([model.NAME, *seen])) for _ in requests]
"""

STARTED = re.compile(r"Started HTTPService at \S+:(\d+)")


def _infer(url: str, model: str, value: int = 0) -> str:
    item = httpclient.InferInput("IN", [1], "INT32")
    item.set_data_from_numpy(np.array([value], dtype=np.int32))
    with httpclient.InferenceServerClient(url, network_timeout=120) as client:
        return client.infer(model, [item]).as_numpy("OUT")[0].decode()


@pytest.fixture
def cli_server(tmp_path: Path) -> Iterator[str]:
    """``pyserve run`` as a subprocess (its command line has flags unittest must not see)."""
    model_dir = write_python_model(tmp_path, "unittest_model", CONFIG, UNITTEST_MODEL)
    (model_dir / "1" / "helper.py").write_text('VALUE = "next to model.py"\n')
    process = subprocess.Popen(
        [sys.executable, "-m", "pyserve", "run", "--model-repository", str(tmp_path), "--http-address",
         "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    assert process.stderr is not None
    lines: list[str] = []
    port: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in process.stderr:  # type: ignore[union-attr]
            lines.append(line)
            match = STARTED.search(line)
            if match:
                port.append(match.group(1))
                started.set()
        started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120) and port, "server did not start:\n" + "".join(lines)
        yield f"127.0.0.1:{port[0]}"
    finally:
        process.terminate()
        process.wait(60)
        reader.join(60)
        process.stderr.close()


def test_unittest_main_model_runs_the_test_cases_of_model_py(cli_server: str) -> None:
    assert _infer(cli_server, "unittest_model") == "ran=2 ok=True"


def test_each_model_imports_its_own_file(tmp_path: Path) -> None:
    for name in ("first", "second"):
        write_python_model(tmp_path, name, CONFIG, NAMED_MODEL.replace("{name}", name))
    server: ServerThread = start(tmp_path)
    try:
        assert _infer(server.url, "first") == "first"
        assert _infer(server.url, "second") == "second"
        # a thread the model started has no calling model: with two model.py files loaded the
        # name is ambiguous, and the error says so
        assert re.search(r"runs outside a model's call and \d+ models of that file name are loaded",
                         _infer(server.url, "first", 1))
    finally:
        server.stop()


class _Model:
    """A stand-in for a ``ModelContext``: the alias keys its modules by such objects, weakly."""


def test_a_model_the_collector_forgets_while_this_thread_holds_the_alias_lock_does_not_hang() -> None:
    """A version that fails before it is created is forgotten by a ``weakref.finalize``, which the
    garbage collector runs on whatever thread allocates, also one inside ``register``, ``forget``
    or an ``import model`` look-up: that must neither deadlock nor lose the other models."""
    from types import ModuleType

    from pyserve_backend_python import alias

    kept, dropped = _Model(), [_Model()]
    kept_module, dropped_module = ModuleType("_probe_a.alias_probe"), ModuleType("_probe_b.alias_probe")
    alias.register(kept, kept_module)  # type: ignore[arg-type]
    alias.register(dropped[0], dropped_module)  # type: ignore[arg-type]
    finalizer = weakref.finalize(dropped[0], alias.forget, dropped_module)
    done = threading.Event()

    def drop_while_holding_the_lock() -> None:
        with alias._lock:
            dropped.clear()  # the last reference: the finalizer runs here, on this thread
            done.set()

    try:
        thread = threading.Thread(target=drop_while_holding_the_lock, daemon=True)
        thread.start()
        assert done.wait(60), "forget() from a finalizer hung on the alias lock"
        assert not finalizer.alive
        assert alias.OwnModule._target(sys.modules["alias_probe"]) is kept_module  # the only one left
    finally:
        if done.is_set():  # else the lock is held for good: forget would hang this test too
            alias.forget(kept_module)
        sys.modules.pop("alias_probe", None)
