"""Starting servers on loopback, writing model folders, making Python environments, recording
batch sizes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pyserve_hookspecs import hookimpl

if TYPE_CHECKING:
    from pyserve.server.core import ServerThread


ServerFactory = Callable[..., "ServerThread"]
"""The type of the ``pyserve_server_factory`` fixture."""

LOOP_THREAD = "pyserve-server"
"""The name of a ``ServerThread``'s event loop thread."""

OWN_GRPC_CONNECTION = [
    ("grpc.use_local_subchannel_pool", 1),  # grpc's channels to one address share a connection otherwise
    ("grpc.max_send_message_length", 2**31 - 1),  # tritonclient's own limits, which channel_args replace
    ("grpc.max_receive_message_length", 2**31 - 1),
]
"""``channel_args`` of a tritonclient gRPC client whose connection is its own: a new connection
that the server's balancer places as any other."""

_MOST_CONNECTIONS = 16
"""How many clients ``BatchRecorder.until_on_the_loop`` opens at most to reach the owner."""

Client = TypeVar("Client")

LAYOUT_VARIABLE = "PYSERVE_TEST_LAYOUT"
"""Environment variable: ``default`` makes ``serve`` start servers in the process layout
``pyserve run`` chooses on this machine (frontend processes, replicas, busy polling), unless a
test sets ``frontend_processes`` itself; ``frontends`` does the same and also passes every
connection to a frontend process (``frontend_balance="frontends"``, unless a test sets a
balance), so each request takes the frontends' paths (replicas, hand-off, relays); unset or
anything else: one process, as embedded servers are by default. ``make test`` runs the suite
with ``default``, then the tests of the paths that frontends change with ``frontends``."""


def default_layout(options: dict[str, Any]) -> None:
    """Fill ``options`` (``ServerOptions`` keyword arguments) with the layout ``pyserve run``
    would choose, where the caller did not choose one (``frontend_processes`` unset)."""
    from pyserve.handoff.layout import choose

    if "frontend_processes" in options:
        return
    single = None
    if not (options.get("allow_http", True) or options.get("allow_grpc", True)):
        single = "neither HTTP nor gRPC is served"
    elif options.get("allow_http", True) and options.get("http_server", "pyserve") != "pyserve":
        single = "uvicorn"
    layout = choose(single_reason=single)
    options["frontend_processes"] = layout.frontend_processes
    options.setdefault("replicate_models", layout.replicate_models)
    options.setdefault("busy_poll_us", layout.busy_poll_us)
    options.setdefault("pin_processes", layout.pin_processes)


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
    :param options: any other ``pyserve.server.core.ServerOptions`` field. ``exit_on_error`` is
        False unless given: tests look at models that fail to load (UNAVAILABLE with their
        reason), where ``pyserve run``, as Triton, stops.
    :raises pyserve.server.core.StartupError: the server could not start.
    """
    from pyserve.host.plugins import PluginHost
    from pyserve.server.core import Server, ServerOptions, ServerThread

    host = PluginHost(
        extra_backends=backends, server_plugins=server_plugins, use_entry_points=use_entry_points
    )
    options.setdefault("host", "127.0.0.1")
    options.setdefault("http_port", 0)
    options.setdefault("grpc_port", 0)
    options.setdefault("metrics_port", 0)
    layout = os.environ.get(LAYOUT_VARIABLE)
    if layout in ("default", "frontends"):
        default_layout(options)
        if layout == "frontends" and options.get("frontend_processes", 0) > 0:
            options.setdefault("frontend_balance", "frontends")
    options.setdefault("exit_on_error", False)
    settings = ServerOptions(model_repositories=[Path(r) for r in repositories], **options)
    thread = ServerThread(Server(settings, host))
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


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


def require_owner_connections(thread: ServerThread) -> None:
    """Skip the calling test when ``thread``'s owner serves no client connection while a
    frontend runs (``frontend_balance="frontends"``, as ``PYSERVE_TEST_LAYOUT=frontends``
    sets): for checks of what the owner itself executes (``BatchRecorder``)."""
    import pytest

    balancer = thread.server.balancer
    if balancer is not None and not balancer.owner_serves:
        pytest.skip("every connection goes to a frontend process (frontend_balance='frontends'); "
                    "this test looks at what the owner executes")


class BatchRecorder:
    """A server plugin that records how many requests each execute of a model received, and
    on which thread it ran.

    Given to ``serve(..., server_plugins=[recorder])`` it lives in the test's process: while it
    is registered, ``--replicate-models auto`` replicates nothing (frontend processes hand every
    request to this process), so it sees every execute, and one batcher per model takes the
    requests of every connection. A model replicated all the same (named in
    ``--replicate-models``, or ``pyserve_replicate: "true"``) executes unseen in a frontend.
    Its lists are appended to on the instance threads and the event loop; read them from the
    test's thread between calls."""

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {}
        """Model name → the number of requests of each execute, in order."""
        self.threads: dict[str, list[str]] = {}
        """Model name → the name of the thread each execute ran on, in order."""

    @hookimpl(wrapper=True)
    def pyserve_execute(self, instance: Any, requests: Sequence[Any]) -> Any:
        name = instance.model.name
        self.sizes.setdefault(name, []).append(len(requests))
        self.threads.setdefault(name, []).append(threading.current_thread().name)
        return (yield)

    def until_on_the_loop(
        self, model: str, connect: Callable[[], Client], call: Callable[[Client], object], timeout: float = 60.0
    ) -> int:
        """Call ``call(client)`` (one request to ``model``, from one client) until an execute of
        ``model`` runs on a ``ServerThread``'s event loop thread, as a compute-only model's do
        once one client alone sends requests (``pyserve.runtime.scheduling.adaptive``).

        ``connect()`` opens a client with a connection of its own (for gRPC, ``channel_args=
        OWN_GRPC_CONNECTION``); it is closed at the end. This plugin sees only the executes of the
        process it was given to. When a call's execute does not show here, the balancer placed
        its connection on a frontend process whose replica answered it (a model replicated by
        name): another client is opened while the earlier stay open, and since the balancer
        gives a new connection to the process with the fewest, the owner first among equals, a
        later one lands here.

        :returns: the number of calls it took.
        :raises AssertionError: it did not happen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        clients = [connect()]
        calls = 0
        try:
            while True:
                seen = len(self.sizes.get(model, ()))
                call(clients[-1])
                calls += 1
                executes = self.sizes.get(model, [])
                if len(executes) > seen and self.threads[model][-1] == LOOP_THREAD:
                    return calls
                if time.monotonic() > deadline:
                    raise AssertionError(f"no execute of '{model}' ran on the event loop in {calls} calls"
                                         f" from {len(clients)} connections")
                if len(executes) == seen and len(clients) < _MOST_CONNECTIONS:
                    clients.append(connect())  # that call ran in another process
        finally:
            for client in clients:
                close = getattr(client, "close", None)
                if close is not None:
                    close()


def python_environment(root: Path, packages: Sequence[str] = (), timeout: float = 300.0) -> Path:
    """A virtual environment of this Python made at ``root`` (``python -m venv``), with
    ``packages`` installed by pip (none: made without pip, in a second or two); returns ``root``.
    What a Python model's ``EXECUTION_ENV_PATH`` names in tests.

    :raises RuntimeError: pip could not install the packages (the message ends with pip's output).
    """
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", *(() if packages else ("--without-pip",)), str(root)], check=True)
    if packages:
        done = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", *packages],
                              capture_output=True, text=True, check=False, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install {', '.join(packages)}: {done.stderr[-500:]}")
    return root


_SHARED_ENVIRONMENTS: dict[tuple[str, ...], Path | RuntimeError] = {}


def shared_python_environment(tmp_path_factory: Any, packages: Sequence[str]) -> Path:
    """``python_environment`` with ``packages``, made once per test session (in a directory of
    ``tmp_path_factory``) and shared by every test that asks for the same packages, which must
    only read it. Skips the asking test when pip cannot install the packages.
    """
    import pytest

    key = tuple(packages)
    made = _SHARED_ENVIRONMENTS.get(key)
    if made is None:
        try:
            made = python_environment(tmp_path_factory.mktemp("python-env") / "env", key)
        except RuntimeError as exc:
            made = exc
        _SHARED_ENVIRONMENTS[key] = made
    if isinstance(made, RuntimeError):
        pytest.skip(f"cannot make a test environment with {', '.join(key)}: {made}")
    return made


def wrong_echo_answers(
    client_module: Any,
    url: str,
    model: str,
    size: int,
    names: tuple[str, str] = ("IN", "OUT"),
    threads: int = 4,
    each: int = 25,
) -> list[str]:
    """Send ``each`` requests from each of ``threads`` clients at once (``client_module``:
    ``tritonclient.http`` or ``tritonclient.grpc``) to a model that answers its FP32 input
    ``names[0]`` (``size`` elements) as output ``names[1]``, every request with values of its
    own; returns a line for every answer that did not carry the values its request sent, and
    for every client whose request failed (it sends no more): an empty list when all were
    right. Waits up to 300 s for the clients."""
    import numpy as np

    input_name, output_name = names
    wrong: list[str] = []

    def run(number: int) -> None:
        client = client_module.InferenceServerClient(url)
        try:
            for index in range(each):
                value = float(number * 1000 + index)
                item = client_module.InferInput(input_name, [size], "FP32")
                item.set_data_from_numpy(np.full(size, value, dtype=np.float32))
                answer = client.infer(model, [item]).as_numpy(output_name)
                if answer is None or answer.shape != (size,) or not (answer == value).all():
                    shown = None if answer is None else answer[:3]
                    wrong.append(f"client {number} request {index}: sent {value}, got {shown}...")
        except Exception as exc:  # a failed request is a wrong answer too, not a thread's traceback
            wrong.append(f"client {number}: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    workers = [threading.Thread(target=run, args=(number,)) for number in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    if any(worker.is_alive() for worker in workers):
        wrong.append("a client did not finish within 300 s")
    return wrong
