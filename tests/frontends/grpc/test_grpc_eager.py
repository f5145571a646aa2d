"""Calls that start at once: ``pyserve.frontends.grpc.eager`` and the gRPC server's lone-connection rule.

The first half drives ``start_eagerly`` on a plain event loop: a coroutine that never waits
finishes inside the call, one that waits goes on as a task exactly as if the task had started
it (results, errors, cancellation, context variables). The second half serves a custom method
from a real ``GrpcServer`` and asks it, through grpcio, where it ran: in the connection's read
(no current task) while one client calls, an idle second connection included; in a task while
two connections call; and that waiting, deadlines and resets still work for a call that started
at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from suite_support import grpc_handler_server

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.eager import start_eagerly
from pyserve.runtime.scheduling import client_activity

# -- start_eagerly on its own --------------------------------------------------------------------


def test_a_coroutine_that_never_waits_finishes_inside_the_call() -> None:
    async def main() -> None:
        steps: list[Any] = []

        async def call() -> None:
            steps.append(asyncio.current_task())

        assert start_eagerly(asyncio.get_running_loop(), call()) is None
        assert steps == [asyncio.current_task()]  # it ran in this task, before this one waited

    asyncio.run(main())


def test_a_coroutine_that_waits_goes_on_as_a_task_with_the_awaited_results() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[int] = loop.create_future()
        second: asyncio.Future[int] = loop.create_future()
        seen: list[Any] = []

        async def call() -> str:
            seen.append(asyncio.current_task())
            seen.append(await first)
            await asyncio.sleep(0)  # a bare yield, as the task sees it
            try:
                await second
            except KeyError as exc:
                seen.append(f"caught {exc}")
            seen.append(asyncio.current_task())
            return "done"

        caller = asyncio.current_task()
        task = start_eagerly(loop, call())
        assert task is not None and seen == [caller]  # the first step ran in the caller
        first.set_result(7)
        await asyncio.sleep(0.01)
        assert seen == [caller, 7] and not task.done()
        second.set_exception(KeyError("k"))
        assert await task == "done"
        assert seen == [caller, 7, "caught 'k'", task]
        assert "call" in repr(task)

    asyncio.run(main())


def test_errors_of_the_first_step_are_raised_and_later_ones_end_the_task() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def fails_at_once() -> None:
            raise ValueError("first step")

        with pytest.raises(ValueError, match="first step"):
            start_eagerly(loop, fails_at_once())

        gate: asyncio.Future[None] = loop.create_future()

        async def fails_later() -> None:
            await gate
            raise ValueError("after waiting")

        task = start_eagerly(loop, fails_later())
        assert task is not None
        gate.set_result(None)
        with pytest.raises(ValueError, match="after waiting"):
            await task

    asyncio.run(main())


@pytest.mark.parametrize("when", ["before the task's first step", "while it waits"])
def test_cancelling_the_task_cancels_the_wait_inside_the_coroutine(when: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        seen: list[str] = []

        async def call() -> str:
            try:
                await gate
            except asyncio.CancelledError:
                seen.append("cancelled at the wait")
                raise
            finally:
                seen.append("cleaned up")
            return "not reached"

        task = start_eagerly(loop, call())
        assert task is not None
        if when == "while it waits":
            await asyncio.sleep(0.01)  # the task has taken over the wait
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled at the wait", "cleaned up"]
        assert task.cancelled()

    asyncio.run(main())


def test_context_variables_live_in_the_call_not_in_the_caller() -> None:
    variable: contextvars.ContextVar[str] = contextvars.ContextVar("variable", default="outside")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        seen: list[str] = []

        async def call() -> None:
            variable.set("inside")
            await gate
            seen.append(variable.get())

        task = start_eagerly(loop, call())
        assert variable.get() == "outside"  # the first step ran in a copy of this context
        gate.set_result(None)
        assert task is not None
        await task
        assert seen == ["inside"] and variable.get() == "outside"

    asyncio.run(main())


# -- the gRPC server: which calls start at once ----------------------------------------------------


class _Probe:
    """A unary method that reports how it ran: ``b"task"`` or ``b"read"`` (no current task).

    A request ``b"wait"`` waits 50 ms first; ``b"forever"`` waits until cancelled, which is
    then recorded in ``cancelled``; ``b"raise"`` raises at once, ``b"raise later"`` after a wait.
    """

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    async def behaviour(self, request: bytes, context: Any) -> bytes:
        where = b"read" if asyncio.current_task() is None else b"task"
        if request == b"raise":
            raise ValueError("boom")
        if request == b"wait":
            await asyncio.sleep(0.05)
        elif request == b"raise later":
            await asyncio.sleep(0.01)
            raise ValueError("boom later")
        elif request == b"forever":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return where


@contextmanager
def _probe_server() -> Iterator[tuple[int, _Probe]]:
    probe = _Probe()
    handler = grpc.method_handlers_generic_handler(
        "t.S", {"M": grpc.unary_unary_rpc_method_handler(probe.behaviour)})
    with grpc_handler_server(handler) as port:
        yield port, probe


def test_a_call_runs_in_the_read_while_one_client_calls_and_in_a_task_while_two_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with _probe_server() as (port, _):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/M")
            assert [call(b"", timeout=10) for _ in range(3)] == [b"read"] * 3
            assert call(b"wait", timeout=10) == b"read"  # started at once, went on as a task
            with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:  # a health checker's
                idle.sendall(h2.PREFACE + h2.settings({}))
                assert idle.recv(9)[3] == h2.SETTINGS  # the server has taken the connection
                time.sleep(2 * client_activity.WINDOW_NS / 1e9)  # past client_activity's window
                assert [call(b"", timeout=10) for _ in range(3)] == [b"read"] * 3  # idle: not counted
            # two clients calling: a window long enough that the test's pace cannot end it
            monkeypatch.setattr(client_activity, "WINDOW_NS", 60 * 10**9)
            # a pool of its own: grpcio would otherwise share the first channel's connection
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as second:
                other = second.unary_unary("/t.S/M")
                assert other(b"", timeout=10) == b"task"
                assert call(b"", timeout=10) == b"task"
                assert call(b"wait", timeout=10) == b"task"
                assert other(b"", timeout=10) == b"task"
            monkeypatch.undo()
            deadline = time.monotonic() + 60
            while call(b"", timeout=60) != b"read":  # one client again once the window has passed
                assert time.monotonic() < deadline, "the other client was never forgotten"
                time.sleep(0.01)


def test_a_call_started_at_once_still_ends_at_its_deadline_and_is_cancelled() -> None:
    with _probe_server() as (port, probe):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/M")
            with pytest.raises(grpc.RpcError) as error:
                call(b"forever", timeout=0.3)
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert probe.cancelled.wait(5)
            assert call(b"", timeout=10) == b"read"  # and the server serves on


def test_a_call_started_at_once_is_cancelled_by_the_client_going_away() -> None:
    with _probe_server() as (port, probe):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            future = channel.unary_unary("/t.S/M").future(b"forever", timeout=30)
            time.sleep(0.2)
            assert future.cancel()  # RST_STREAM(CANCEL) from grpcio
            assert probe.cancelled.wait(5)
            assert channel.unary_unary("/t.S/M")(b"", timeout=10) == b"read"


def test_a_method_that_raises_answers_unknown_and_the_connection_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """The servicer's exception, raised inside the read or after the call became a task: the
    call ends with UNKNOWN naming it, it is logged, and the same connection serves on."""
    with _probe_server() as (port, _):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/M")
            for request, message in ((b"raise", "boom"), (b"raise later", "boom later")):
                with pytest.raises(grpc.RpcError) as error:
                    call(request, timeout=10)
                assert error.value.code() == grpc.StatusCode.UNKNOWN
                assert error.value.details() == f"Unexpected <class 'ValueError'>: {message}"
                assert call(b"", timeout=10) == b"read"
    failures = [r for r in caplog.records if r.levelname == "ERROR" and "failed" in r.getMessage()]
    assert len(failures) == 2, caplog.text
