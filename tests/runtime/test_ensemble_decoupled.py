"""Ensembles with decoupled steps, served by a real server and called over the gRPC stream.

As Triton: each response of a decoupled step runs the steps downstream of it as its own wave,
every wave that completes the outputs is one ensemble response, and the final flag comes when
no step of any wave runs any more. An ensemble is decoupled exactly when one of its steps is.

``Burst`` is the decoupled step: for ``IN`` it sends ``IN + 10``, ``IN + 20``... from a thread
of its own; request parameters (which ensembles pass to their steps) change what it does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from suite_support import QueuedStream
from tritonclient.utils import InferenceServerException

from pyserve import (
    Backend,
    InferError,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from pyserve.server.core import ServerThread
from pyserve.testing import serve, write_model

TIMEOUT = 10.0


class Add(Backend):
    """``OUT = IN + 1``."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        return [InferResponse({"OUT": (r.inputs["IN"] + 1).astype(np.int32)}) for r in requests]


class Burst(Backend):
    """Decoupled: sends ``OUT = IN + 10 * (i + 1)`` for i < ``count`` (parameter, default 2),
    ``delay_ms`` apart, then the final flag alone, or with the last response when ``final_with_last``
    is true; ``fail_at`` = i sends an error instead of response i."""

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> None:
        for request in requests:
            threading.Thread(target=self._send, args=(request,), daemon=True).start()

    @staticmethod
    def _send(request: InferRequest) -> None:
        sender = request.response_sender()
        count = int(request.parameters.get("count", 2))
        delay = float(request.parameters.get("delay_ms", 0)) / 1000
        fail_at = int(request.parameters.get("fail_at", -1))
        with_last = bool(request.parameters.get("final_with_last", False))
        x = request.inputs["IN"]
        for i in range(count):
            if i:
                time.sleep(delay)
            last = with_last and i == count - 1
            if i == fail_at:
                sender.send(InferError.invalid(f"burst failed at {i}"), final=last)
            else:
                sender.send(InferResponse({"OUT": (x + 10 * (i + 1)).astype(np.int32)}), final=last)
        if not with_last:
            sender.send(final=True)


def tensor_config(name: str, kind: str, extra: str = "") -> str:
    io = "IN" if kind != "identity" else "INPUT0"
    out = "OUT" if kind != "identity" else "OUTPUT0"
    return f"""
        backend: "{kind}"
        max_batch_size: 8
        input [ {{ name: "{io}" data_type: TYPE_INT32 dims: [ -1 ] }} ]
        output [ {{ name: "{out}" data_type: TYPE_INT32 dims: [ -1 ] }} ]
        {extra}
        """


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    imap = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    omap = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {imap} {omap} }}'


def ensemble(steps: list[str], outputs: Sequence[str] = ("OUT",), extra: str = "") -> str:
    outs = ", ".join(f'{{ name: "{o}" data_type: TYPE_INT32 dims: [ -1 ] }}' for o in outputs)
    return f"""
        platform: "ensemble"
        max_batch_size: 8
        input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }} ]
        output [ {outs} ]
        ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
        {extra}
        """


DECOUPLED = "model_transaction_policy { decoupled: true }"
ADD1 = step("add1", {"IN": "IN"}, {"OUT": "MID"})
MODELS = {
    "add1": tensor_config("add1", "add"),
    "decstep": tensor_config("decstep", "burst", DECOUPLED),
    "slow": tensor_config("slow", "identity", 'parameters { key: "execute_delay_ms" value: { string_value: "300" } }'),
    "pair": """
        backend: "identity"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ -1 ] },
                { name: "INPUT1" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] },
                 { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ -1 ] } ]
        """,
    # the probe's ens_dec: declared decoupled
    "ens_dec": ensemble([ADD1, step("decstep", {"IN": "MID"}, {"OUT": "OUT"})], extra=DECOUPLED),
    # not declared: decoupled all the same, because a step is (Triton derives it)
    "ens_derived": ensemble([ADD1, step("decstep", {"IN": "MID"}, {"OUT": "OUT"})]),
    # a step after the decoupled one runs once per wave
    "ens_after": ensemble([ADD1, step("decstep", {"IN": "MID"}, {"OUT": "D"}), step("add1", {"IN": "D"}, {"OUT": "OUT"})]),
    # waves of waves
    "ens_twice": ensemble([step("decstep", {"IN": "IN"}, {"OUT": "D"}), step("decstep", {"IN": "D"}, {"OUT": "OUT"})]),
    # a slow step after the decoupled one, to have waves still running when another fails
    "ens_slow": ensemble([ADD1, step("decstep", {"IN": "MID"}, {"OUT": "D"}),
                          step("slow", {"INPUT0": "D"}, {"OUTPUT0": "OUT"})]),
    # declared decoupled without a decoupled step: not decoupled (Triton derives it)
    "ens_plain": ensemble([ADD1, step("add1", {"IN": "MID"}, {"OUT": "OUT"})], extra=DECOUPLED),
    # refused: a step fed by a decoupled step and by the ensemble's input
    "ens_mixed_step": ensemble([step("decstep", {"IN": "IN"}, {"OUT": "D"}),
                                step("pair", {"INPUT0": "D", "INPUT1": "IN"}, {"OUTPUT0": "OUT"})]),
    # refused: outputs from different decoupled origins
    "ens_mixed_outputs": ensemble([ADD1, step("decstep", {"IN": "IN"}, {"OUT": "B"})], outputs=("MID", "B")),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    repo: Path = tmp_path_factory.mktemp("ensemble_decoupled")
    for name, config in MODELS.items():
        write_model(repo, name, config)
    with serve(repo, backends={"add": Add(), "burst": Burst()}) as thread:
        yield thread


class Stream(QueuedStream):
    """``suite_support.QueuedStream`` with this module's requests (``IN`` as INT32) and reading."""

    def send(self, model: str, data: list[list[int]], empty_final: bool = True, **parameters: Any) -> None:
        array = np.array(data, dtype=np.int32)
        tensor = grpcclient.InferInput("IN", list(array.shape), "INT32")
        tensor.set_data_from_numpy(array)
        self.client.async_stream_infer(model, [tensor], enable_empty_final_response=empty_final,
                                       parameters=parameters or None)

    def response(self) -> tuple[list[Any] | None, bool]:
        """The next message, which must be a response: (``OUT`` as a list or None, final flag)."""
        result, error = self.next()
        assert error is None, error
        final = bool(result.get_response().parameters["triton_final_response"].bool_param)
        out = result.as_numpy("OUT")
        return (None if out is None else out.tolist()), final

    def until_final(self) -> list[Any]:
        """The ``OUT`` of each response up to the final flag, which must come on the last
        message only (on the last response, or alone: whichever the run's timing gives)."""
        outs = []
        while True:
            out, final = self.response()
            if out is not None:
                outs.append(out)
            if final:
                return outs

    def error_message(self) -> str:
        return str(self.error().message())


@pytest.fixture
def stream(server: ServerThread) -> Iterator[Stream]:
    s = Stream(server.grpc_url, timeout=TIMEOUT)
    yield s
    s.close(cancel_requests=True)


def stats(server: ServerThread, model: str) -> dict[str, Any]:
    reply = httpx.get(f"http://{server.url}/v2/models/{model}/stats")
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["model_stats"][0])


@pytest.mark.parametrize("model", ["ens_dec", "ens_derived"])
def test_every_response_of_a_decoupled_step_is_an_ensemble_response(
    server: ServerThread, stream: Stream, model: str
) -> None:
    before = stats(server, model)
    stream.send(model, [[1, 2]])
    assert stream.response() == ([[12, 13]], False)
    assert stream.response() == ([[22, 23]], False)
    assert stream.response() == (None, True)  # the final flag alone, once both waves are done
    stream.assert_quiet()

    stream.send(model, [[1, 2]], empty_final=False)
    assert stream.response() == ([[12, 13]], False)
    assert stream.response() == ([[22, 23]], False)
    stream.assert_quiet()

    stream.send(model, [[1, 2], [3, 4]])
    assert stream.response() == ([[12, 13], [14, 15]], False)
    assert stream.response() == ([[22, 23], [24, 25]], False)
    assert stream.response() == (None, True)

    after = stats(server, model)  # one execution per request, however many responses
    assert after["execution_count"] - before["execution_count"] == 3
    assert after["inference_count"] - before["inference_count"] == 4
    success = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert success == 3


def test_the_last_response_carries_the_final_flag_when_it_ends_the_run(stream: Stream) -> None:
    stream.send("ens_dec", [[1, 2]], final_with_last=True, count=3)
    assert stream.response() == ([[12, 13]], False)
    assert stream.response() == ([[22, 23]], False)
    assert stream.response() == ([[32, 33]], True)
    stream.assert_quiet()


def test_a_decoupled_step_that_sends_nothing_gives_the_final_flag_alone(stream: Stream) -> None:
    stream.send("ens_dec", [[1, 2]], count=0)
    assert stream.response() == (None, True)
    stream.assert_quiet()


def test_steps_after_a_decoupled_step_run_once_per_wave(stream: Stream) -> None:
    stream.send("ens_after", [[1, 2]])
    assert stream.until_final() == [[[13, 14]], [[23, 24]]]
    stream.assert_quiet()

    stream.send("ens_twice", [[1, 2]])  # 2 waves, each forking 2 more
    assert sorted(stream.until_final()) == [[[21, 22]], [[31, 32]], [[31, 32]], [[41, 42]]]
    stream.assert_quiet()


def test_an_error_in_one_wave_fails_the_request_and_drops_the_other_waves(
    server: ServerThread, stream: Stream
) -> None:
    before = stats(server, "ens_slow")
    # wave 0 is in the 300 ms slow step when response 1 of decstep, an error, comes
    stream.send("ens_slow", [[1, 2]], fail_at=1, delay_ms=20)
    message = stream.error_message()
    assert message.startswith("in ensemble 'ens_slow', ") and "burst failed at 1" in message, message
    stream.assert_quiet(0.6)  # neither wave 0's response nor a final flag follows
    after = stats(server, "ens_slow")
    # two failures, as Triton counts a failure in a composing model: the step's and the ensemble's
    assert after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 2
    assert after["execution_count"] == before["execution_count"]

    stream.send("ens_slow", [[1, 2]])  # the stream and the ensemble still work
    assert stream.until_final() == [[[12, 13]], [[22, 23]]]


def test_an_ensemble_is_decoupled_exactly_when_a_step_is(server: ServerThread) -> None:
    def decoupled(model: str) -> bool:
        config = httpx.get(f"http://{server.url}/v2/models/{model}/config").json()
        return bool(config.get("model_transaction_policy", {}).get("decoupled", False))

    assert decoupled("ens_dec") and decoupled("ens_derived")
    assert not decoupled("ens_plain")
    client = httpclient.InferenceServerClient(server.url)
    try:
        data = np.array([[1, 2]], dtype=np.int32)
        tensor = httpclient.InferInput("IN", [1, 2], "INT32")
        tensor.set_data_from_numpy(data)
        for model in ("ens_dec", "ens_derived"):  # unary calls are refused, as for any decoupled model
            with pytest.raises(InferenceServerException, match="decoupled"):
                client.infer(model, [tensor])
        np.testing.assert_array_equal(client.infer("ens_plain", [tensor]).as_numpy("OUT"), [[3, 4]])
    finally:
        client.close()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        gtensor = grpcclient.InferInput("IN", [1, 2], "INT32")
        gtensor.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException, match="decoupled"):
            grpc.infer("ens_derived", [gtensor])
    finally:
        grpc.close()


def test_waves_that_would_mix_are_refused_at_load(server: ServerThread) -> None:
    index = {e["name"]: e for e in httpx.post(f"http://{server.url}/v2/repository/index", json={}).json()}
    for name, fragments in {
        "ens_mixed_step": ["step 1 (model 'pair')", "different decoupled models", "step 0 (model 'decstep')",
                           "the ensemble's inputs"],
        "ens_mixed_outputs": ["outputs originate from different decoupled models", "step 1 (model 'decstep')"],
    }.items():
        entry = index[name]
        assert entry["state"] == "UNAVAILABLE", entry
        for fragment in fragments:
            assert fragment in entry.get("reason", ""), (fragment, entry)
