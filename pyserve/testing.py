"""``pyserve.testing``: pytest fixtures and a conformance suite for backend authors.

Installed with pyserve as the pytest plugin ``pyserve`` (entry-point group ``pytest11``), so
every test session in an environment with pyserve has the fixtures below; nothing needs to go
into a ``conftest.py``. Importing this module is cheap: the server, numpy and ``tritonclient``
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
    A server plugin recording how many requests each execute of a model received.

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
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
from pyserve_hookspecs import hookimpl

if TYPE_CHECKING:
    import numpy as np

    from pyserve.server import ServerThread

__all__ = [
    "BackendConformance",
    "BatchRecorder",
    "DLPackProbe",
    "ServerFactory",
    "generate_inputs",
    "serve",
    "write_model",
]

ServerFactory = Callable[..., "ServerThread"]
"""The type of the ``pyserve_server_factory`` fixture."""

TIMEOUT_S = 30.0
"""How long a conformance check waits for one response."""

_DLPACK_KINDS = frozenset("biuf")
"""numpy dtype kinds that ``numpy.from_dlpack`` can export (bfloat16 and objects cannot)."""


# -- starting servers -------------------------------------------------------------------------


@contextlib.contextmanager
def serve(
    *repositories: Path | str,
    backends: Mapping[str, object] | None = None,
    server_plugins: Sequence[object] = (),
    use_entry_points: bool = True,
    **options: Any,
) -> Iterator[ServerThread]:
    """Run a server on loopback (HTTP and gRPC on free ports) for the ``with`` block.

    :param repositories: the model repositories.
    :param backends: backend name → plugin object, registered as if installed.
    :param server_plugins: server-wide plugins (e.g. ``pyserve_execute`` wrappers).
    :param use_entry_points: also find installed backends and plugins by entry point.
    :param options: any other ``pyserve.server.ServerOptions`` field.
    :raises pyserve.server.StartupError: the server could not start.
    """
    from pyserve.plugins import PluginHost
    from pyserve.server import Server, ServerOptions, ServerThread

    host = PluginHost(
        extra_backends=backends, server_plugins=server_plugins, use_entry_points=use_entry_points
    )
    options.setdefault("host", "127.0.0.1")
    options.setdefault("http_port", 0)
    options.setdefault("grpc_port", 0)
    options.setdefault("metrics_port", 0)
    settings = ServerOptions(model_repositories=[Path(r) for r in repositories], **options)
    thread = ServerThread(Server(settings, host))
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


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


# -- model folders and batch sizes ------------------------------------------------------------------


def write_model(
    repo: Path,
    name: str,
    config: str | None = None,
    files: Mapping[str, bytes | str] | None = None,
    versions: Sequence[int] = (1,),
) -> Path:
    """Create ``repo/name``: a dedented ``config.pbtxt`` (none if ``config`` is ``None``),
    the version folders and ``files`` (relative path → ``bytes`` or text); returns the folder."""
    model_dir = repo / name
    model_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(textwrap.dedent(config))
    for version in versions:
        (model_dir / str(version)).mkdir(exist_ok=True)
    for rel, data in (files or {}).items():
        path = model_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
    return model_dir


class BatchRecorder:
    """A server plugin that records how many requests each execute of a model received."""

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {}
        """Model name → the number of requests of each execute, in order."""

    @hookimpl(wrapper=True)
    def pyserve_execute(self, instance: Any, requests: Sequence[Any]) -> Any:
        self.sizes.setdefault(instance.model.name, []).append(len(requests))
        return (yield)


# -- inputs from metadata ------------------------------------------------------------------------


def generate_inputs(
    metadata: Mapping[str, Any],
    *,
    seed: int = 0,
    batch_size: int = 1,
    batched: bool = False,
    variable_dim: int = 3,
) -> dict[str, np.ndarray]:
    """Random inputs for every input of a model, from its KServe metadata (HTTP JSON form).

    The same arguments always give the same arrays. Integers span their whole range, floats
    are finite, BOOL is random, BYTES elements are 0–8 random bytes (NUL and 0xFF included),
    BF16 arrays use ``ml_dtypes.bfloat16``.

    :param metadata: ``client.get_model_metadata(model)`` of ``tritonclient.http``.
    :param seed: the random seed.
    :param batch_size: the leading dimension when ``batched``.
    :param batched: whether the model batches (``max_batch_size > 0``): the first dim of
        every input is then the batch dimension.
    :param variable_dim: the size used for every other ``-1`` dimension.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    for tensor in metadata["inputs"]:
        dims = [int(d) for d in tensor["shape"]]
        if batched and dims:
            dims[0] = batch_size
        shape = tuple(variable_dim if d < 0 else d for d in dims)
        inputs[tensor["name"]] = _random_array(rng, tensor["datatype"], shape)
    return inputs


def _random_array(rng: Any, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    import numpy as np
    from tritonclient.utils import triton_to_np_dtype

    if datatype == "BYTES":
        flat = [
            bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8))
            for _ in range(int(np.prod(shape)))
        ]
        values = np.empty(len(flat), dtype=object)
        values[:] = flat
        return values.reshape(shape)
    dtype = np.dtype(triton_to_np_dtype(datatype))
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 8).astype(np.float32).astype(dtype)


def _normalize(array: np.ndarray, datatype: str) -> np.ndarray:
    """Values comparable across clients (tritonclient may read BF16 back as float32)."""
    import numpy as np

    if datatype == "BF16":
        return np.asarray(array).astype(np.float32)
    return np.asarray(array)


def _assert_equal(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], what: str) -> None:
    import numpy as np

    assert set(actual) == set(expected), f"{what}: outputs {sorted(actual)} != expected {sorted(expected)}"
    for name, value in expected.items():
        got, want = np.asarray(actual[name]), np.asarray(value)
        if want.dtype == object or got.dtype == object:
            equal = got.shape == want.shape and list(got.reshape(-1)) == list(want.reshape(-1))
        else:
            equal = got.shape == want.shape and np.array_equal(
                got.astype(np.float64) if want.dtype.kind == "V" or got.dtype.kind == "V" else got,
                want.astype(np.float64) if want.dtype.kind == "V" or got.dtype.kind == "V" else want,
                equal_nan=got.dtype.kind == "f",
            )
        assert equal, f"{what}: output '{name}' differs:\n got {got!r}\nwant {want!r}"


# -- the DLPack probe ---------------------------------------------------------------------------


class DLPackProbe:
    """A server plugin that exports the inputs the backend sees through DLPack.

    Wraps ``pyserve_execute`` of every model; for requests whose id starts with
    ``PREFIX`` it checks that each input numpy can carry through DLPack comes back from
    ``numpy.from_dlpack`` as a view of the same memory with the same dtype, shape and values.
    Thread-safe; the results accumulate in ``checked`` and ``failures``.
    """

    PREFIX = "pyserve-dlpack-"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.checked: list[str] = []
        """``"<request id>/<input>"`` for every input exported successfully."""
        self.failures: list[str] = []
        """One message per input that failed the check."""

    @hookimpl(wrapper=True)
    def pyserve_execute(self, instance: Any, requests: Sequence[Any]) -> Any:
        for request in requests:
            if isinstance(request.id, str) and request.id.startswith(self.PREFIX):
                for name, array in request.inputs.items():
                    self._check(f"{request.id}/{name}", array)
        return (yield)

    def _check(self, label: str, array: Any) -> None:
        import numpy as np

        if array.dtype.kind not in _DLPACK_KINDS:
            return
        try:
            view = np.from_dlpack(array)
            problem = None
            if view.dtype != array.dtype or view.shape != array.shape:
                problem = f"came back as {view.dtype}{view.shape}, sent {array.dtype}{array.shape}"
            elif array.size and not np.shares_memory(view, array):
                problem = "was copied (DLPack export must be zero-copy)"
            elif not np.array_equal(view, array, equal_nan=array.dtype.kind == "f"):
                problem = "changed its values"
        except Exception as exc:  # the check reports, the request goes on
            problem = f"cannot be exported: {type(exc).__name__}: {exc}"
        with self._lock:
            if problem is None:
                self.checked.append(label)
            else:
                self.failures.append(f"{label} {problem}")


# -- the conformance suite ------------------------------------------------------------------------


class _Model:
    """What a conformance check needs to know about the model under test."""

    def __init__(self, metadata: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.metadata = metadata
        self.config = config
        self.max_batch_size = int(config.get("max_batch_size", 0))
        self.dynamic_batching = "dynamic_batching" in config
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.output_types = {t["name"]: t["datatype"] for t in metadata["outputs"]}
        self.output_ranks = {t["name"]: len(t["shape"]) for t in metadata["outputs"]}
        self.input_types = {t["name"]: t["datatype"] for t in metadata["inputs"]}

    @property
    def datatypes(self) -> set[str]:
        return set(self.input_types.values()) | set(self.output_types.values())


class _Reply:
    """One response of a request: outputs by name, or the error text."""

    def __init__(self, outputs: dict[str, np.ndarray] | None = None, error: str | None = None) -> None:
        self.outputs = outputs or {}
        self.error = error


class BackendConformance:
    """Base class of a backend's conformance tests; see the module docstring.

    Class attributes a subclass sets:

    :cvar backend: the backend name config.pbtxt uses (required).
    :cvar plugin: the plugin object registered under ``backend``; ``None`` uses the
        installed entry point (which also checks the packaging).
    :cvar repository: the model repository; a relative path is resolved from the directory
        of the test module. Alternatively override ``conformance_repository``.
    :cvar model: the model to test (required).
    :cvar datatypes: every KServe datatype the model's inputs and outputs declare
        (``"FP32"``, ``"BYTES"``, ...); the round trip is parametrized over them. Empty:
        one round trip over whatever the metadata declares, and no declaration check.
    :cvar decoupled: whether the model is decoupled (answers over the gRPC stream).
    :cvar concurrency: how many requests the batching and isolation checks send at once.
    :cvar shutdown_grace_s: how long ``test_clean_shutdown`` waits for threads and file
        descriptors to go after the server stopped.
    """

    backend: ClassVar[str] = ""
    plugin: ClassVar[object | None] = None
    repository: ClassVar[Path | str | None] = None
    model: ClassVar[str] = ""
    datatypes: ClassVar[tuple[str, ...]] = ()
    decoupled: ClassVar[bool] = False
    concurrency: ClassVar[int] = 8
    shutdown_grace_s: ClassVar[float] = 10.0

    # -- what a subclass may override ---------------------------------------------------------
    def conformance_repository(self, tmp_path: Path) -> Path:
        """The repository to serve; ``tmp_path`` is a fresh directory for this class."""
        if self.repository is None:
            raise pytest.UsageError(
                f"{type(self).__name__}: set 'repository' or override conformance_repository()"
            )
        path = Path(self.repository)
        if not path.is_absolute():
            module = sys.modules[type(self).__module__]
            path = Path(module.__file__ or ".").resolve().parent / path
        return path

    def generate_inputs(self, metadata: Mapping[str, Any], seed: int, batched: bool) -> dict[str, np.ndarray]:
        """The inputs of request number ``seed`` (default: ``pyserve.testing.generate_inputs``)."""
        return generate_inputs(metadata, seed=seed, batched=batched)

    def expected_outputs(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray] | None:
        """The outputs a non-decoupled model must give for ``inputs``; ``None``: not checked."""
        return None

    def expected_responses(
        self, inputs: Mapping[str, np.ndarray]
    ) -> Sequence[Mapping[str, np.ndarray]] | None:
        """Every response for ``inputs``, in order (default: ``[expected_outputs(inputs)]``)."""
        outputs = self.expected_outputs(inputs)
        return None if outputs is None else [outputs]

    def bad_inputs(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """A request that must fail alone, made from good ``inputs``.

        Default: ``inputs`` without its first input (the server's validation refuses it).
        Override with inputs your *backend* rejects per request to test its own isolation.
        """
        return dict(list(inputs.items())[1:])

    @classmethod
    def _server_kwargs(cls) -> dict[str, Any]:
        return {"backends": {cls.backend: cls.plugin} if cls.plugin is not None else None}

    # -- talking to the model ---------------------------------------------------------------
    def _infer_all(
        self,
        server: ServerThread,
        model: _Model,
        requests: Sequence[Mapping[str, np.ndarray]],
        *,
        protocol: str = "grpc",
        ids: Sequence[str] | None = None,
        concurrent: bool = True,
    ) -> list[list[_Reply]]:
        """Every reply of every request (one list per request, in request order)."""
        ids = list(ids) if ids is not None else [f"req-{i}" for i in range(len(requests))]
        if model.decoupled:
            if concurrent:
                return _stream(server.grpc_url, self.model, model, requests, ids)
            return [_stream(server.grpc_url, self.model, model, [r], [i])[0] for r, i in zip(requests, ids)]
        if protocol == "http":
            return [[_http_infer(server.url, self.model, model, r, i)] for r, i in zip(requests, ids)]
        if concurrent:
            return [
                [reply] for reply in _grpc_infer_concurrent(server.grpc_url, self.model, model, requests, ids)
            ]
        return [
            [reply]
            for r, i in zip(requests, ids)
            for reply in _grpc_infer_concurrent(server.grpc_url, self.model, model, [r], [i])
        ]

    def _check_replies(
        self, model: _Model, inputs: Mapping[str, np.ndarray], replies: list[_Reply], what: str
    ) -> None:
        assert replies, f"{what}: no response"
        for reply in replies:
            assert reply.error is None, f"{what}: the request failed: {reply.error}"
            for name, array in reply.outputs.items():
                assert name in model.output_types, f"{what}: undeclared output '{name}'"
                assert array.ndim == model.output_ranks[name], (
                    f"{what}: output '{name}' has rank {array.ndim}, "
                    f"the metadata declares {model.output_ranks[name]}"
                )
        if not model.decoupled:
            assert len(replies) == 1, f"{what}: {len(replies)} responses to a non-decoupled request"
            missing = set(model.output_types) - set(replies[0].outputs)
            assert not missing, f"{what}: outputs {sorted(missing)} were not returned"
        expected = self.expected_responses(inputs)
        if expected is not None:
            assert len(replies) == len(expected), (
                f"{what}: {len(replies)} responses, expected {len(expected)}"
            )
            for index, (reply, want) in enumerate(zip(replies, expected)):
                got = {n: _normalize(a, model.output_types[n]) for n, a in reply.outputs.items()}
                _assert_equal(
                    got,
                    {n: _normalize(a, model.output_types[n]) for n, a in want.items()},
                    f"{what}, response {index}",
                )

    # -- the checks --------------------------------------------------------------------------
    def test_model_is_ready_and_declared(self, pyserve_conformance_model: _Model) -> None:
        config = pyserve_conformance_model.config
        assert config.get("backend") == self.backend, (
            f"model '{self.model}' names backend {config.get('backend')!r}, the suite tests '{self.backend}'"
        )
        assert pyserve_conformance_model.decoupled == self.decoupled, (
            f"model '{self.model}': decoupled is {pyserve_conformance_model.decoupled} in the config, "
            f"{self.decoupled} in the test class"
        )
        if self.datatypes:
            assert pyserve_conformance_model.datatypes == set(self.datatypes), (
                f"model '{self.model}' declares datatypes {sorted(pyserve_conformance_model.datatypes)}, "
                f"the test class lists {sorted(self.datatypes)}"
            )

    @pytest.mark.parametrize("protocol", ["http", "grpc"])
    def test_round_trip(
        self,
        pyserve_conformance_server: ServerThread,
        pyserve_conformance_model: _Model,
        pyserve_datatype: str,
        protocol: str,
    ) -> None:
        model = pyserve_conformance_model
        if pyserve_datatype != "*" and pyserve_datatype not in model.datatypes:
            pytest.fail(f"model '{self.model}' declares no {pyserve_datatype} tensor")
        if model.decoupled and protocol == "http":
            pytest.skip("a decoupled model answers over the gRPC stream only")
        inputs = self.generate_inputs(model.metadata, seed=1, batched=model.max_batch_size > 0)
        [replies] = self._infer_all(pyserve_conformance_server, model, [inputs], protocol=protocol)
        self._check_replies(model, inputs, replies, f"{protocol} round trip of {self.model}")
        for reply in replies:
            for name, array in reply.outputs.items():
                datatype = model.output_types[name]
                if pyserve_datatype in ("*", datatype):
                    _check_datatype(array, datatype, f"output '{name}'")

    def test_batched_equals_unbatched(
        self, pyserve_conformance_server: ServerThread, pyserve_conformance_model: _Model
    ) -> None:
        model = pyserve_conformance_model
        if model.max_batch_size <= 0 or not model.dynamic_batching:
            pytest.skip(
                "the model does not use the dynamic batcher (max_batch_size > 0 and dynamic_batching)"
            )
        requests = [
            self.generate_inputs(model.metadata, seed=100 + i, batched=True) for i in range(self.concurrency)
        ]
        alone = self._infer_all(pyserve_conformance_server, model, requests, concurrent=False)
        together = self._infer_all(pyserve_conformance_server, model, requests, concurrent=True)
        for index, (inputs, one, many) in enumerate(zip(requests, alone, together)):
            self._check_replies(model, inputs, one, f"request {index} alone")
            assert len(many) == len(one), f"request {index}: {len(many)} responses batched, {len(one)} alone"
            for a, b in zip(many, one):
                assert a.error is None, f"request {index} failed when batched: {a.error}"
                _assert_equal(a.outputs, b.outputs, f"request {index} batched vs alone")

    def test_error_isolation(
        self, pyserve_conformance_server: ServerThread, pyserve_conformance_model: _Model
    ) -> None:
        model = pyserve_conformance_model
        batched = model.max_batch_size > 0
        good = [
            self.generate_inputs(model.metadata, seed=200 + i, batched=batched)
            for i in range(self.concurrency)
        ]
        bad = self.bad_inputs(self.generate_inputs(model.metadata, seed=299, batched=batched))
        alone = self._infer_all(pyserve_conformance_server, model, good, concurrent=False)
        if model.decoupled:
            # stream errors carry no request id: the bad request gets a stream of its own,
            # sent while the good ones stream together
            outcome: list[Any] = []

            def send_bad() -> None:
                try:
                    outcome.append(
                        _stream(pyserve_conformance_server.grpc_url, self.model, model, [bad], ["bad"])[0]
                    )
                except BaseException as exc:  # re-raised on the test's thread
                    outcome.append(exc)

            sender = threading.Thread(target=send_bad, name="pyserve-conformance-bad-request")
            sender.start()
            together = self._infer_all(pyserve_conformance_server, model, good, concurrent=True)
            sender.join(TIMEOUT_S + 5)
            assert outcome, "the bad request got no answer"
            if isinstance(outcome[0], BaseException):
                raise outcome[0]
            bad_replies = outcome[0]
        else:
            middle = len(good) // 2
            mixed = [*good[:middle], bad, *good[middle:]]
            together = self._infer_all(pyserve_conformance_server, model, mixed, concurrent=True)
            bad_replies = together.pop(middle)
        assert any(r.error is not None for r in bad_replies), "the bad request did not fail"
        for index, (one, many) in enumerate(zip(alone, together)):
            assert len(many) == len(one), (
                f"good request {index}: {len(many)} responses next to a bad one, {len(one)} alone"
            )
            for a, b in zip(many, one):
                assert a.error is None, f"good request {index} failed next to a bad one: {a.error}"
                _assert_equal(a.outputs, b.outputs, f"good request {index} next to a bad one")

    def test_decoupled_response_order(
        self, pyserve_conformance_server: ServerThread, pyserve_conformance_model: _Model
    ) -> None:
        model = pyserve_conformance_model
        if not model.decoupled:
            pytest.skip("the model is not decoupled")
        batched = model.max_batch_size > 0
        requests = [
            self.generate_inputs(model.metadata, seed=300 + i, batched=batched)
            for i in range(self.concurrency)
        ]
        alone = self._infer_all(pyserve_conformance_server, model, requests, concurrent=False)
        together = self._infer_all(pyserve_conformance_server, model, requests, concurrent=True)
        for index, (inputs, one, many) in enumerate(zip(requests, alone, together)):
            self._check_replies(model, inputs, one, f"decoupled request {index}")
            assert [sorted(r.outputs) for r in many] == [sorted(r.outputs) for r in one], (
                f"decoupled request {index}: responses differ in number or outputs when streamed together"
            )
            for position, (a, b) in enumerate(zip(many, one)):
                _assert_equal(a.outputs, b.outputs, f"decoupled request {index}, response {position}")

    def test_dlpack_inputs(
        self,
        pyserve_conformance_server: ServerThread,
        pyserve_conformance_model: _Model,
        pyserve_conformance_probe: DLPackProbe,
    ) -> None:
        model = pyserve_conformance_model
        inputs = self.generate_inputs(model.metadata, seed=400, batched=model.max_batch_size > 0)
        exportable = [n for n, a in inputs.items() if a.dtype.kind in _DLPACK_KINDS]
        if not exportable:
            pytest.skip("no input has a datatype numpy can carry through DLPack")
        ids = [f"{DLPackProbe.PREFIX}{id(self)}"]
        [replies] = self._infer_all(pyserve_conformance_server, model, [inputs], ids=ids)
        assert all(r.error is None for r in replies), [r.error for r in replies]
        assert not pyserve_conformance_probe.failures, "\n".join(pyserve_conformance_probe.failures)
        seen = {
            label.split("/", 1)[1] for label in pyserve_conformance_probe.checked if label.startswith(ids[0])
        }
        assert seen >= set(exportable), f"the backend never saw inputs {sorted(set(exportable) - seen)}"

    def test_clean_shutdown(
        self,
        pyserve_conformance_repository: Path,
        pyserve_conformance_model: _Model,
        request: pytest.FixtureRequest,
    ) -> None:
        model = pyserve_conformance_model
        batched = model.max_batch_size > 0
        requests = [self.generate_inputs(model.metadata, seed=500 + i, batched=batched) for i in range(4)]
        kwargs = self._server_kwargs()

        def cycle() -> None:
            with serve(pyserve_conformance_repository, **kwargs) as server:
                for replies in self._infer_all(server, model, requests):
                    assert all(r.error is None for r in replies), [r.error for r in replies]

        cycle()  # the first run creates process-wide resources (gRPC's, numpy's) once
        threads_before = set(threading.enumerate())
        fds_before = _open_fds()
        cycle()
        deadline = time.monotonic() + self.shutdown_grace_s
        while True:
            leaked_threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
            fds_after = _open_fds()
            leaked_fds = fds_after - fds_before if fds_after is not None and fds_before is not None else set()
            if (not leaked_threads and not leaked_fds) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not leaked_threads, (
            f"threads left after the server stopped: {[t.name for t in leaked_threads]}"
        )
        assert not leaked_fds, (
            f"file descriptors left open after the server stopped: {_describe_fds(leaked_fds)}"
        )

    def test_reload(
        self,
        pyserve_conformance_repository: Path,
        pyserve_conformance_model: _Model,
        request: pytest.FixtureRequest,
    ) -> None:
        model = pyserve_conformance_model
        inputs = self.generate_inputs(model.metadata, seed=600, batched=model.max_batch_size > 0)
        kwargs = self._server_kwargs()
        answers = []
        for run in range(2):
            with serve(pyserve_conformance_repository, **kwargs) as server:
                [replies] = self._infer_all(server, model, [inputs])
                self._check_replies(model, inputs, replies, f"server {run + 1} on the same repository")
                answers.append(replies)
        for a, b in zip(*answers):
            _assert_equal(a.outputs, b.outputs, "answers before and after the reload")


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


# -- client helpers ---------------------------------------------------------------------------------


def _check_datatype(array: np.ndarray, datatype: str, what: str) -> None:
    import numpy as np
    from tritonclient.utils import triton_to_np_dtype

    if datatype == "BYTES":
        assert array.dtype == object, f"{what}: BYTES came back as {array.dtype}"
    elif datatype != "BF16":  # tritonclient may read BF16 as float32
        want = np.dtype(triton_to_np_dtype(datatype))
        assert array.dtype == want, f"{what}: {datatype} came back as {array.dtype}"


def _client_inputs(module: Any, model: _Model, inputs: Mapping[str, np.ndarray]) -> list[Any]:
    tensors = []
    for name, array in inputs.items():
        datatype = model.input_types.get(name, "BYTES" if array.dtype == object else "")
        tensor = module.InferInput(name, list(array.shape), datatype)
        if module.__name__.endswith("http"):
            tensor.set_data_from_numpy(array, binary_data=True)
        else:
            tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _outputs(result: Any, model: _Model) -> dict[str, np.ndarray]:
    outputs = {}
    for name in model.output_types:
        array = result.as_numpy(name)
        if array is not None:
            outputs[name] = array
    return outputs


def _http_infer(
    url: str, model_name: str, model: _Model, inputs: Mapping[str, np.ndarray], request_id: str
) -> _Reply:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url, network_timeout=TIMEOUT_S)
    try:
        outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in model.output_types]
        result = client.infer(
            model_name, _client_inputs(httpclient, model, inputs), outputs=outputs, request_id=request_id
        )
        return _Reply(_outputs(result, model))
    except InferenceServerException as exc:
        return _Reply(error=str(exc))
    finally:
        client.close()


def _grpc_infer_concurrent(
    url: str, model_name: str, model: _Model, requests: Sequence[Mapping[str, np.ndarray]], ids: Sequence[str]
) -> list[_Reply]:
    """Send every request at once (``async_infer``), wait for all; replies in request order."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    try:
        for index, (inputs, request_id) in enumerate(zip(requests, ids)):
            client.async_infer(
                model_name,
                _client_inputs(grpcclient, model, inputs),
                callback=lambda result, error, i=index: results.put((i, result, error)),
                request_id=request_id,
                client_timeout=TIMEOUT_S,
            )
        replies: dict[int, _Reply] = {}
        for _ in requests:
            index, result, error = results.get(timeout=TIMEOUT_S + 5)
            replies[index] = (
                _Reply(error=str(error)) if error is not None else _Reply(_outputs(result, model))
            )
        return [replies[i] for i in range(len(requests))]
    finally:
        client.close()


def _stream(
    url: str, model_name: str, model: _Model, requests: Sequence[Mapping[str, np.ndarray]], ids: Sequence[str]
) -> list[list[_Reply]]:
    """Send every request on one ``ModelStreamInfer`` stream; every request's replies, in order.

    :raises AssertionError: a request got no final flag in time, or a response after it.
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    by_id: dict[str, list[_Reply]] = {i: [] for i in ids}
    finished: set[str] = set()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for inputs, request_id in zip(requests, ids):
            client.async_stream_infer(
                model_name,
                _client_inputs(grpcclient, model, inputs),
                request_id=request_id,
                enable_empty_final_response=True,
            )
        while len(finished) < len(ids):
            try:
                result, error = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(
                    f"requests {sorted(set(ids) - finished)} got no final response in {TIMEOUT_S} s"
                ) from None
            if error is not None:
                # A stream error carries no request id (tritonclient drops it), so it can only
                # be attributed on a stream of one request; there it ends the request.
                assert len(ids) == 1, f"a request failed on a stream of {len(ids)} requests: {error}"
                by_id[ids[0]].append(_Reply(error=str(error)))
                finished.add(ids[0])
                continue
            response = result.get_response()
            request_id = response.id
            assert request_id in by_id, f"response for unknown request id {request_id!r}"
            assert request_id not in finished, f"request {request_id!r} got a response after its final one"
            if response.outputs:
                by_id[request_id].append(_Reply(_outputs(result, model)))
            if response.parameters["triton_final_response"].bool_param:
                finished.add(request_id)
        return [by_id[i] for i in ids]
    finally:
        client.stop_stream()
        client.close()


def _open_fds() -> set[int] | None:
    """The process's open file descriptors, or ``None`` where ``/proc/self/fd`` is missing."""
    try:
        return {int(name) for name in os.listdir("/proc/self/fd")}
    except OSError:
        return None


def _describe_fds(fds: set[int]) -> list[str]:
    described = []
    for fd in sorted(fds):
        try:
            described.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            described.append(str(fd))
    return described
