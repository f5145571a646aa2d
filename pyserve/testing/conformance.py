"""``BackendConformance``: the conformance suite a backend's test module subclasses."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from pyserve.testing.client import (
    TIMEOUT_S,
    _check_datatype,
    _grpc_infer_concurrent,
    _http_infer,
    _Model,
    _Reply,
    _stream,
)
from pyserve.testing.dlpack import _DLPACK_KINDS, DLPackProbe
from pyserve.testing.helpers import serve
from pyserve.testing.inputs import _assert_equal, _normalize, generate_inputs

if TYPE_CHECKING:
    import numpy as np

    from pyserve.server.core import ServerThread


class BackendConformance:
    """Base class of a backend's conformance tests; see the ``pyserve.testing`` docstring.

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
        # every execute in the test's own process, where the DLPack probe looks (frontend
        # processes, where the layout has them, still take connections and hand requests over)
        return {"backends": {cls.backend: cls.plugin} if cls.plugin is not None else None,
                "replicate_models": "none"}

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
