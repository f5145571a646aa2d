"""``pyserve.testing``: pytest fixtures and a conformance suite for backend authors.

Installed with pyserve as the pytest plugin ``pyserve`` (entry-point group ``pytest11``), so
every test session in an environment with pyserve has the fixtures below; nothing needs to go
into a ``conftest.py``. Importing this package is cheap: the server, numpy and ``tritonclient``
are imported only when a fixture or a conformance test runs.

Fixtures
--------

``pyserve_server_factory``
    ``start(repository, *more, backends=None, server_plugins=(), use_entry_points=True,
    **options) -> ServerThread``: starts a real server on loopback with HTTP and gRPC on
    free ports (``http_port=0``, ``grpc_port=0``, and ``metrics_port=0`` should metrics be
    turned on; any other ``ServerOptions`` field may be passed). ``backends`` maps backend
    names to plugin objects (a module, a ``Backend`` instance or subclass) registered as if
    installed; installed backends are found through their entry points as usual. Every
    server started is stopped at teardown, last first. The returned ``ServerThread`` has
    ``url`` and ``grpc_url`` in the form the ``tritonclient`` clients take.

``pyserve_repository``
    The model repository ``pyserve_server`` serves. Override it in your test module or
    ``conftest.py``; the default fails with a message saying so.

``pyserve_backends``
    ``{name: plugin}`` registered by ``pyserve_server``; default ``None`` (installed
    backends only). Override it to test a backend that is not installed.

``pyserve_server``
    A server on ``pyserve_repository`` with ``pyserve_backends`` (one per test).

``pyserve_client`` / ``pyserve_grpc_client``
    ``tritonclient.http`` / ``tritonclient.grpc`` clients of ``pyserve_server``, closed at
    teardown.

Helpers
-------

``serve(repository, ..., **options)``
    The context manager behind ``pyserve_server_factory``, for servers of another scope
    (e.g. one per module).

``write_model(repo, name, config=None, files=None, versions=(1,))``
    Writes ``repo/name`` with a ``config.pbtxt`` (dedented; none when ``config`` is ``None``),
    version folders and extra files (``bytes`` or ``str`` by relative path).

``BatchRecorder``
    A server plugin recording how many requests each execute of a model received and on which
    thread it ran. A plugin object lives in the test's process, so while one wraps execute,
    ``--replicate-models auto`` replicates nothing and it sees every execute.
    ``until_on_the_loop(model, connect, call)`` calls until a compute-only model executes on the
    loop, opening clients until one's connection reaches the recording process.

``require_owner_connections(thread)``
    Skips the calling test when every connection of ``thread`` goes to a frontend process
    (``PYSERVE_TEST_LAYOUT=frontends``): for checks of what the owner itself executes.

``wrong_echo_answers(client_module, url, model, size, names=("IN", "OUT"), threads=4, each=25)``
    Sends distinct FP32 values from several clients at once to a model that answers its input
    as its output, and returns a line for each answer that carried other values than its
    request's (a backend that reuses an output buffer while answers are still being sent).

``OWN_GRPC_CONNECTION``
    ``channel_args`` that give a tritonclient gRPC client a connection of its own (grpc's channels
    to one address share one otherwise), for tests that care which process serves a connection.

Conformance suite
-----------------

Subclass ``BackendConformance`` in a test module under a ``Test*`` name and set its class
attributes; pytest then runs every check against a real server::

    from pyserve.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "mybackend"                 # the name config.pbtxt uses
        plugin = None                         # None: the installed entry point; or the plugin object
        repository = "model_repository"       # relative paths are resolved from the test file
        model = "mybackend_model"
        datatypes = ("FP32",)                 # every datatype the model's inputs/outputs declare
        decoupled = False

        def expected_outputs(self, inputs):   # optional: what the model must answer
            return {"OUTPUT0": inputs["INPUT0"] * 2}

The checks (each a test method; a check that does not apply is skipped with the reason):

* ``test_model_is_ready_and_declared``: the model is READY, its config names ``backend``,
  its decoupled flag equals ``decoupled`` and its declared datatypes equal ``datatypes``.
* ``test_round_trip[<datatype>-<protocol>]``: for every datatype the model declares, over
  HTTP and gRPC, a request with inputs generated from the model metadata (random values,
  full integer ranges, binary BYTES) is answered with every requested output, each with the
  declared datatype and rank, and with ``expected_responses`` when that is not ``None``.
* ``test_batched_equals_unbatched``: for a model with ``max_batch_size > 0`` and dynamic
  batching, ``concurrency`` different requests sent at once give the same answers as the
  same requests sent one by one.
* ``test_error_isolation``: one bad request (``bad_inputs``; by default a request missing a
  required input) sent together with good ones fails alone; the good ones are answered as
  one by one.
* ``test_decoupled_response_order`` (decoupled models only): several requests streamed at
  once each get their responses in the same order as alone, then exactly one final flag.
* ``test_dlpack_inputs``: every input the backend sees whose datatype DLPack can carry with
  numpy (BOOL, integers, FP16/32/64) can be exported with ``numpy.from_dlpack`` without a
  copy and with equal values (the inputs are captured by a server plugin wrapping
  ``pyserve_execute``).
* ``test_clean_shutdown``: a server started, used and stopped leaves no new Python thread
  and no new open file descriptor (``/proc/self/fd``) behind, so instance/model/backend
  finalizers released what they acquired.
* ``test_reload``: after a server on the repository stopped, a new one on the same
  repository loads the model again and gives the same answers.

Override ``conformance_repository`` to build the repository at test time (it receives a
temporary directory), ``generate_inputs`` to choose the inputs, ``expected_responses`` /
``expected_outputs`` to check values, and ``bad_inputs`` for a request the *backend* (not the
server's validation) must reject.

The checks share one server per class (class-scoped fixtures ``pyserve_conformance_server``,
``pyserve_conformance_model``, ``pyserve_conformance_repository``,
``pyserve_conformance_probe``); ``test_clean_shutdown`` and ``test_reload`` start their own.
Requests go over gRPC (``ModelStreamInfer`` for decoupled models) unless a check says HTTP.

The package: ``helpers`` (``serve``, ``write_model``, ``BatchRecorder``), ``inputs``
(``generate_inputs`` and the comparison of outputs), ``dlpack`` (``DLPackProbe``), ``client``
(the ``tritonclient`` calls the checks make) and ``conformance`` (``BackendConformance``); the
fixtures and the pytest hook are defined here, in the module pytest loads as the plugin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pyserve.testing.client import TIMEOUT_S as TIMEOUT_S  # re-exported: how long a check waits
from pyserve.testing.client import _Model
from pyserve.testing.conformance import BackendConformance
from pyserve.testing.dlpack import DLPackProbe
from pyserve.testing.helpers import (
    OWN_GRPC_CONNECTION,
    BatchRecorder,
    ServerFactory,
    python_environment,
    require_owner_connections,
    serve,
    shared_python_environment,
    write_model,
    wrong_echo_answers,
)
from pyserve.testing.inputs import generate_inputs

if TYPE_CHECKING:
    from pyserve.server.core import ServerThread

__all__ = [
    "OWN_GRPC_CONNECTION",
    "BackendConformance",
    "BatchRecorder",
    "DLPackProbe",
    "ServerFactory",
    "generate_inputs",
    "python_environment",
    "require_owner_connections",
    "shared_python_environment",
    "serve",
    "write_model",
    "wrong_echo_answers",
]


# -- server fixtures ------------------------------------------------------------------------------


@pytest.fixture
def pyserve_server_factory() -> Iterator[ServerFactory]:
    """``start(repository, ..., backends=None, server_plugins=(), **options) -> ServerThread``.

    Every server started is stopped at teardown, in reverse start order.
    """
    with contextlib.ExitStack() as stack:

        def start(*repositories: Path | str, **kwargs: Any) -> ServerThread:
            return stack.enter_context(serve(*repositories, **kwargs))

        yield start


@pytest.fixture
def pyserve_repository() -> Path:
    """The repository ``pyserve_server`` serves; override this fixture."""
    raise pytest.UsageError(
        "pyserve_server needs a model repository: define a 'pyserve_repository' fixture "
        "returning its path (in the test module or a conftest.py)"
    )


@pytest.fixture
def pyserve_backends() -> Mapping[str, object] | None:
    """Backends ``pyserve_server`` registers besides the installed ones; override to set."""
    return None


@pytest.fixture
def pyserve_server(
    pyserve_server_factory: ServerFactory,
    pyserve_repository: Path,
    pyserve_backends: Mapping[str, object] | None,
) -> ServerThread:
    """A running server on ``pyserve_repository``; stopped after the test."""
    return pyserve_server_factory(pyserve_repository, backends=pyserve_backends)


@pytest.fixture
def pyserve_client(pyserve_server: ServerThread) -> Iterator[Any]:
    """A ``tritonclient.http.InferenceServerClient`` of ``pyserve_server``."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(pyserve_server.url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def pyserve_grpc_client(pyserve_server: ServerThread) -> Iterator[Any]:
    """A ``tritonclient.grpc.InferenceServerClient`` of ``pyserve_server``."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(pyserve_server.grpc_url)
    try:
        yield client
    finally:
        client.close()


# -- the conformance fixtures (class-scoped; requested by BackendConformance's checks) ----------------


def _conformance_class(request: pytest.FixtureRequest) -> type[BackendConformance]:
    cls = request.cls
    if cls is None or not issubclass(cls, BackendConformance):
        raise pytest.UsageError(f"{request.fixturename} is for BackendConformance subclasses only")
    if not cls.backend or not cls.model:
        raise pytest.UsageError(f"{cls.__name__}: set the 'backend' and 'model' class attributes")
    return cls


@pytest.fixture(scope="class")
def pyserve_conformance_probe() -> DLPackProbe:
    """The DLPack probe plugged into ``pyserve_conformance_server``."""
    return DLPackProbe()


@pytest.fixture(scope="class")
def pyserve_conformance_repository(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The repository of the conformance class (``conformance_repository()``)."""
    cls = _conformance_class(request)
    return cls().conformance_repository(tmp_path_factory.mktemp(cls.__name__))


@pytest.fixture(scope="class")
def pyserve_conformance_server(
    request: pytest.FixtureRequest,
    pyserve_conformance_repository: Path,
    pyserve_conformance_probe: DLPackProbe,
) -> Iterator[ServerThread]:
    """One server shared by the class's checks, with the DLPack probe."""
    cls = _conformance_class(request)
    with serve(
        pyserve_conformance_repository, **cls._server_kwargs(), server_plugins=[pyserve_conformance_probe]
    ) as server:
        yield server


@pytest.fixture(scope="class")
def pyserve_conformance_model(
    request: pytest.FixtureRequest, pyserve_conformance_server: ServerThread
) -> _Model:
    """Metadata and config of the model under test, read from the running server."""
    import tritonclient.http as httpclient

    cls = _conformance_class(request)
    client = httpclient.InferenceServerClient(pyserve_conformance_server.url)
    try:
        if not client.is_model_ready(cls.model):
            pytest.fail(f"model '{cls.model}' is not ready: {client.get_model_repository_index()}")
        return _Model(client.get_model_metadata(cls.model), client.get_model_config(cls.model))
    finally:
        client.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the round trip of a ``BackendConformance`` class over its ``datatypes``."""
    cls = metafunc.cls
    if (
        cls is not None
        and issubclass(cls, BackendConformance)
        and "pyserve_datatype" in metafunc.fixturenames
    ):
        metafunc.parametrize("pyserve_datatype", list(cls.datatypes) or ["*"])
