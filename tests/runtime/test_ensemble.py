"""Ensembles (``platform: "ensemble"``) served by a real server.

Steps chain a model of the ``identity`` backend and a model of ``Scale``, a small backend
defined here (``OUT = 2 * IN + 1``; a negative input makes it fail that request).
"""

from __future__ import annotations

import asyncio
import textwrap
import threading
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from pyserve import InferRequest, InferResponse, InstanceContext
from pyserve.api.backend import Backend
from pyserve.server.core import ServerThread

StartServer = Callable[..., ServerThread]
MakeRepo = Callable[..., Path]


class Scale(Backend):
    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        results: list[Any] = []
        for r in requests:
            x = r.inputs["IN"]
            if (x < 0).any():
                results.append(ValueError("negative values are not allowed"))
            else:
                results.append(InferResponse({"OUT": x * 2 + 1}))
        return results


class Meet(Backend):
    """Echoes ``INPUT0`` as ``OUTPUT0`` once ``parties`` executes are under way at once (each
    waits for the others; alone, one fails after ``timeout`` seconds)."""

    def __init__(self, parties: int, timeout: float = 60.0) -> None:
        self.barrier = threading.Barrier(parties, timeout=timeout)

    def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
        self.barrier.wait()
        return [InferResponse({"OUTPUT0": r.inputs["INPUT0"]}) for r in requests]


MEET = """
backend: "meet"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def identity(delay_ms: int = 0, datatype: str = "TYPE_FP32", pair: bool = False) -> str:
    inputs = f'{{ name: "INPUT0" data_type: {datatype} dims: [ 2 ] }}'
    outputs = f'{{ name: "OUTPUT0" data_type: {datatype} dims: [ 2 ] }}'
    if pair:
        inputs += f', {{ name: "INPUT1" data_type: {datatype} dims: [ 2 ] }}'
        outputs += f', {{ name: "OUTPUT1" data_type: {datatype} dims: [ 2 ] }}'
    return textwrap.dedent(
        f"""
        backend: "identity"
        max_batch_size: 0
        input [ {inputs} ]
        output [ {outputs} ]
        parameters {{ key: "execute_delay_ms" value: {{ string_value: "{delay_ms}" }} }}
        """
    )


SCALE = """
backend: "scale"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def ensemble(steps: str, inputs: str = "", outputs: str = "") -> str:
    inputs = inputs or '{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }'
    outputs = outputs or '{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }'
    return textwrap.dedent(
        f"""
        platform: "ensemble"
        max_batch_size: 0
        input [ {inputs} ]
        output [ {outputs} ]
        ensemble_scheduling {{ step [ {steps} ] }}
        """
    )


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    imap = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    omap = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {imap} {omap} }}'


CHAIN = ensemble(
    step("ident", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}) + ","
    + step("scale", {"IN": "mid"}, {"OUT": "OUT"})
)


def infer(client: httpclient.InferenceServerClient, model: str, data: np.ndarray, inp: str = "IN",
          out: str = "OUT") -> np.ndarray:
    tensor = httpclient.InferInput(inp, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor]).as_numpy(out)


def test_chain_matches_calling_the_steps_by_hand(start_server: StartServer, make_repo: MakeRepo) -> None:
    outer = ensemble(step("chain", {"IN": "IN"}, {"OUT": "x"}) + "," + step("scale", {"IN": "x"}, {"OUT": "OUT"}))
    repo = make_repo({"ident": identity(), "scale": SCALE, "chain": CHAIN, "outer": outer})
    server = start_server(repo, backends={"scale": Scale()})
    client = httpclient.InferenceServerClient(server.url)
    try:
        data = np.array([1.5, -0.0], dtype=np.float32)
        by_hand = infer(client, "scale", infer(client, "ident", data, "INPUT0", "OUTPUT0"))
        chained = infer(client, "chain", data)
        np.testing.assert_array_equal(chained, by_hand)
        np.testing.assert_array_equal(chained, data * 2 + 1)
        # an ensemble of an ensemble
        np.testing.assert_array_equal(infer(client, "outer", data), (data * 2 + 1) * 2 + 1)
        assert client.is_model_ready("outer")
    finally:
        client.close()


def test_ensemble_responses_carry_the_sequence_parameters(start_server: StartServer, make_repo: MakeRepo) -> None:
    """As Triton 2.51 answers (checked side by side): every ensemble response names the request's
    sequence id and START / END flags, also when it has none; a plain model's does not."""
    repo = make_repo({"ident": identity(), "scale": SCALE, "chain": CHAIN})
    server = start_server(repo, backends={"scale": Scale()})
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}
    with httpx.Client(base_url=f"http://{server.url}", timeout=30) as http:
        plain = http.post("/v2/models/chain/infer", json=body).json()
        assert plain["parameters"] == {"sequence_end": False, "sequence_id": 0, "sequence_start": False}
        assert plain["outputs"][0]["data"] == [3.0, 5.0]
        numbered = http.post("/v2/models/chain/infer", json={
            **body, "parameters": {"sequence_id": 42, "sequence_start": True}}).json()
        assert numbered["parameters"] == {"sequence_end": False, "sequence_id": 42, "sequence_start": True}
        named = http.post("/v2/models/chain/infer", json={
            **body, "parameters": {"sequence_id": "s-1", "sequence_end": True}}).json()
        assert named["parameters"] == {"sequence_end": True, "sequence_id": "s-1", "sequence_start": False}
        step_only = http.post("/v2/models/scale/infer", json=body).json()
        assert "parameters" not in step_only
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1, 2], dtype=np.float32))
        response = client.infer("chain", [tensor], sequence_id=7).get_response()
        assert response.parameters["sequence_id"].int64_param == 7
        assert response.parameters["sequence_start"].bool_param is False


def test_independent_steps_run_concurrently(start_server: StartServer, make_repo: MakeRepo) -> None:
    fan = ensemble(
        step("slow_a", {"INPUT0": "IN"}, {"OUTPUT0": "A"}) + "," + step("slow_b", {"INPUT0": "IN"}, {"OUTPUT0": "B"}),
        outputs='{ name: "A" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 2 ] }',
    )
    # each step's execute returns only once the other's is under way too: one after the other,
    # they would fail
    repo = make_repo({"slow_a": MEET, "slow_b": MEET, "fan": fan})
    server = start_server(repo, backends={"meet": Meet(2)})
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        data = np.array([3, 4], dtype=np.float32)
        tensor = httpclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("fan", [tensor])
        np.testing.assert_array_equal(result.as_numpy("A"), data)
        np.testing.assert_array_equal(result.as_numpy("B"), data)
    finally:
        client.close()


def test_failing_step_fails_only_that_request(start_server: StartServer, make_repo: MakeRepo) -> None:
    repo = make_repo({"ident": identity(50), "scale": SCALE, "chain": CHAIN})
    server = start_server(repo, backends={"scale": Scale()})
    values = [1.0, -1.0, 2.0, 3.0, -5.0, 4.0]

    async def one(client: aioclient.InferenceServerClient, value: float) -> Any:
        data = np.full(2, value, dtype=np.float32)
        tensor = httpclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(data)
        try:
            return (await client.infer("chain", [tensor])).as_numpy("OUT")
        except InferenceServerException as exc:
            return exc

    async def main() -> list[Any]:
        client = aioclient.InferenceServerClient(server.url)
        try:
            return list(await asyncio.gather(*(one(client, v) for v in values)))
        finally:
            await client.close()

    results = asyncio.run(main())
    for value, result in zip(values, results):
        if value < 0:
            assert isinstance(result, InferenceServerException), result
            message = str(result.message())
            assert message.startswith("in ensemble 'chain', ") and "negative values" in message, message  # Triton's form
        else:
            np.testing.assert_array_equal(result, np.full(2, value * 2 + 1, dtype=np.float32))
    client = httpclient.InferenceServerClient(server.url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        np.testing.assert_array_equal(infer(client, "chain", np.ones(2, np.float32)), np.full(2, 3, np.float32))
    finally:
        client.close()


BROKEN = {
    "unknown_model": (
        ensemble(step("nope", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})),
        ["step 0", "nope"],
    ),
    "unmapped_input": (
        ensemble(step("pair", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})),
        ["step 0", "'INPUT1' is not mapped"],
    ),
    "unknown_tensor": (
        ensemble(step("ident", {"INPUT0": "IN"}, {"OUTPUT0": "t"}) + "," + step("scale", {"IN": "ghost"}, {"OUT": "OUT"})),
        ["step 1", "'ghost'", "no input or step provides"],
    ),
    "written_twice": (
        ensemble(
            step("ident", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}) + "," + step("scale", {"IN": "IN"}, {"OUT": "OUT"})
        ),
        ["step 1", "'OUT'", "already written by step 0"],
    ),
    "cycle": (
        ensemble(
            step("pair", {"INPUT0": "IN", "INPUT1": "t1"}, {"OUTPUT0": "OUT", "OUTPUT1": "t0"}) + ","
            + step("ident", {"INPUT0": "t0"}, {"OUTPUT0": "t1"})
        ),
        ["cycle", "step 0", "step 1"],
    ),
    "dtype_mismatch": (
        ensemble(
            step("ident", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}),
            inputs='{ name: "IN" data_type: TYPE_INT32 dims: [ 2 ] }',
        ),
        ["step 0", "'INPUT0'", "FP32", "'IN'", "INT32"],
    ),
    "unused_input": (
        ensemble(
            step("ident", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}),
            inputs='{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "EXTRA" data_type: TYPE_FP32 dims: [ 2 ] }',
        ),
        ["ensemble input 'EXTRA' is not used"],
    ),
    "output_not_produced": (
        ensemble(
            step("ident", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}),
            outputs='{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "NOPE" data_type: TYPE_FP32 dims: [ 2 ] }',
        ),
        ["ensemble output 'NOPE' is not produced"],
    ),
    "unknown_step_output": (
        ensemble(step("ident", {"INPUT0": "IN"}, {"OUTPUT9": "OUT", "OUTPUT0": "x"})),
        ["step 0", "'OUTPUT9'"],
    ),
}


def test_invalid_ensembles_are_unavailable_with_reasons(start_server: StartServer, make_repo: MakeRepo) -> None:
    models = {"ident": identity(), "pair": identity(pair=True), "scale": SCALE, "good": CHAIN}
    models.update({name: text for name, (text, _) in BROKEN.items()})
    server = start_server(make_repo(models), backends={"scale": Scale()})
    index = httpx.post(f"http://{server.url}/v2/repository/index", json={}).json()
    entries = {e["name"]: e for e in index}
    assert entries["good"]["state"] == "READY"
    for name, (_, fragments) in BROKEN.items():
        entry = entries[name]
        assert entry["state"] == "UNAVAILABLE", entry
        for fragment in fragments:
            assert fragment in entry.get("reason", ""), (name, fragment, entry)
    client = httpclient.InferenceServerClient(server.url)
    try:
        np.testing.assert_array_equal(infer(client, "good", np.zeros(2, np.float32)), np.ones(2, np.float32))
    finally:
        client.close()


@pytest.mark.parametrize("requested", ["A", "B"])
def test_only_requested_output_is_returned(start_server: StartServer, make_repo: MakeRepo, requested: str) -> None:
    fan = ensemble(
        step("ident", {"INPUT0": "IN"}, {"OUTPUT0": "A"}) + "," + step("scale", {"IN": "IN"}, {"OUT": "B"}),
        outputs='{ name: "A" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 2 ] }',
    )
    server = start_server(make_repo({"ident": identity(), "scale": SCALE, "fan": fan}), backends={"scale": Scale()})
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensor = httpclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1, 2], np.float32))
        result = client.infer("fan", [tensor], outputs=[httpclient.InferRequestedOutput(requested)])
        other = "B" if requested == "A" else "A"
        assert result.as_numpy(other) is None
        expected = np.array([1, 2], np.float32) if requested == "A" else np.array([3, 5], np.float32)
        np.testing.assert_array_equal(result.as_numpy(requested), expected)
    finally:
        client.close()



BATCHING_CHAIN = {
    "bident": """
        backend: "identity"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
        """,
    "bscale": """
        backend: "scale"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
        """,
    "bchain": """
        platform: "ensemble"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
        ensemble_scheduling { step [
        """ + step("bident", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}) + ","
        + step("bscale", {"IN": "mid"}, {"OUT": "OUT"}) + "] }",
}


def model_stats(server: ServerThread, model: str) -> dict[str, Any]:
    reply = httpx.get(f"http://{server.url}/v2/models/{model}/stats")
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["model_stats"][0])


def test_ensemble_statistics_count_executions_batches_and_step_time(
    start_server: StartServer, make_repo: MakeRepo
) -> None:
    """As Triton: one execution per ensemble request, of its batch size; queue is the wait for
    the ensemble scheduler, compute the time its steps' requests computed."""
    server = start_server(make_repo(BATCHING_CHAIN), backends={"scale": Scale()}, allow_metrics=True)
    client = httpclient.InferenceServerClient(server.url)
    try:
        one = infer(client, "bchain", np.array([[1, 2]], np.float32))
        two = infer(client, "bchain", np.array([[1, 2], [3, 4]], np.float32))
        np.testing.assert_array_equal(one, [[3, 5]])
        np.testing.assert_array_equal(two, [[3, 5], [7, 9]])
    finally:
        client.close()
    stats = model_stats(server, "bchain")
    assert stats["inference_count"] == 3
    assert stats["execution_count"] == 2
    inference = stats["inference_stats"]
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[key]["count"] == 2, (key, inference)
    assert inference["fail"]["count"] == 0
    assert inference["queue"]["ns"] > 0
    assert inference["compute_infer"]["ns"] > 0
    batches = {b["batch_size"]: b for b in stats["batch_stats"]}
    assert sorted(batches) == [1, 2]
    for entry in batches.values():
        assert entry["compute_infer"]["count"] == 1
        assert entry["compute_infer"]["ns"] > 0
    # compute infer is the steps' compute infer, summed
    steps = [model_stats(server, name)["inference_stats"]["compute_infer"]["ns"] for name in ("bident", "bscale")]
    assert inference["compute_infer"]["ns"] == sum(steps)
    assert sum(b["compute_infer"]["ns"] for b in batches.values()) == sum(steps)
    # the nv_inference_* metrics read the same counters
    metrics = httpx.get(f"http://127.0.0.1:{server.server.metrics_port}/metrics").text
    samples = {(s.name.removesuffix("_total"), s.labels.get("model")): s.value
               for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert samples[("nv_inference_count", "bchain")] == 3
    assert samples[("nv_inference_exec_count", "bchain")] == 2
    assert samples[("nv_inference_request_success", "bchain")] == 2
    assert samples[("nv_inference_compute_infer_duration_us", "bchain")] > 0


def test_failed_ensemble_request_counts_no_execution(start_server: StartServer, make_repo: MakeRepo) -> None:
    """A request that fails in a composing model counts no execution; as Triton counts (and
    documents) it, it is two failures of the ensemble's, with reason OTHER: the composing
    model's failed request and the ensemble's own (checked side by side with Triton 2.51)."""
    server = start_server(make_repo(BATCHING_CHAIN), backends={"scale": Scale()}, allow_metrics=True)
    client = httpclient.InferenceServerClient(server.url)
    try:
        with pytest.raises(InferenceServerException, match="negative values"):
            infer(client, "bchain", np.array([[-1, 2]], np.float32))
        np.testing.assert_array_equal(infer(client, "bchain", np.array([[0, 0]], np.float32)), [[1, 1]])
    finally:
        client.close()
    stats = model_stats(server, "bchain")
    assert (stats["inference_count"], stats["execution_count"]) == (1, 1)
    assert stats["inference_stats"]["fail"]["count"] == 2
    assert stats["inference_stats"]["success"]["count"] == 1
    assert [b["batch_size"] for b in stats["batch_stats"]] == [1]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    assert 'nv_inference_request_failure{model="bchain",reason="OTHER",version="1"} 2\n' in text
    assert 'nv_inference_request_failure{model="bchain",reason="BACKEND",version="1"} 0\n' in text


# -- optional inputs (Triton's L0_optional_input cases) -------------------------------------------


OPTIONAL_PAIR = """
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] optional: true },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 2 ] optional: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""

OPTIONAL_IO = ('{ name: "A" data_type: TYPE_FP32 dims: [ 2 ] optional: true }, '
               '{ name: "B" data_type: TYPE_FP32 dims: [ 2 ] optional: true }',
               '{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }')


def _optional_infer(server: ServerThread, model: str, given: dict[str, np.ndarray], wanted: list[str]) -> dict:
    inputs = []
    for name, data in given.items():
        tensor = httpclient.InferInput(name, [2], "FP32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput(name) for name in wanted]
    with httpclient.InferenceServerClient(server.url) as client:
        result = client.infer(model, inputs, outputs=outputs)
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def test_optional_ensemble_inputs_may_be_left_out(start_server: StartServer, make_repo: MakeRepo) -> None:
    """As Triton: a left-out optional input, and a step output its step did not produce, are
    there but empty; the steps reading them run without them."""
    wrapper = ensemble(step("pair", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "X", "OUTPUT1": "Y"}), *OPTIONAL_IO)
    # the second step reads only one tensor of the first (its other input is optional and unmapped)
    pipeline = ensemble(
        step("pair", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "mid"}) + ","
        + step("pair", {"INPUT1": "mid"}, {"OUTPUT0": "X", "OUTPUT1": "Y"}), *OPTIONAL_IO)
    server = start_server(make_repo({"pair": OPTIONAL_PAIR, "wrapper": wrapper, "pipeline": pipeline}))
    ones, twos = np.ones(2, np.float32), np.full(2, 2, np.float32)
    got = _optional_infer(server, "wrapper", {"B": twos}, ["Y"])
    assert list(got) == ["Y"] and (got["Y"] == twos).all()
    got = _optional_infer(server, "wrapper", {"A": ones}, ["X"])
    assert (got["X"] == ones).all()
    # the identity backend answers zeros for an output whose optional input was left out (Triton's)
    got = _optional_infer(server, "pipeline", {"A": ones, "B": twos}, ["X", "Y"])
    assert (got["X"] == 0).all() and (got["Y"] == ones).all()


def test_an_unproduced_step_output_feeds_an_optional_input(start_server: StartServer, make_repo: MakeRepo) -> None:
    """Triton's 'optional_connecting_tensor': the first step produces only some of the tensors
    the second one reads; the second runs without the others."""
    only_given = """
backend: "only_given"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] optional: true },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 2 ] optional: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""

    class OnlyGiven(Backend):
        """Echoes only the inputs it was given (as Triton's test model does)."""

        def execute(self, instance: InstanceContext, requests: Sequence[InferRequest]) -> list[Any]:
            return [InferResponse({f"OUTPUT{n[-1]}": a for n, a in r.inputs.items()}) for r in requests]

    connecting = ensemble(
        step("echo", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "m0", "OUTPUT1": "m1"}) + ","
        + step("echo", {"INPUT0": "m0", "INPUT1": "m1"}, {"OUTPUT0": "X", "OUTPUT1": "Y"}), *OPTIONAL_IO)
    server = start_server(make_repo({"echo": only_given, "connecting": connecting}),
                          backends={"only_given": OnlyGiven()})
    ones = np.ones(2, np.float32)
    got = _optional_infer(server, "connecting", {"A": ones}, ["X"])
    assert list(got) == ["X"] and (got["X"] == ones).all()


def test_a_required_step_input_left_empty_fails_in_tritons_words(start_server: StartServer,
                                                                 make_repo: MakeRepo) -> None:
    needs_b = ensemble(step("ident", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "X", "OUTPUT1": "Y"}), *OPTIONAL_IO)
    server = start_server(make_repo({"ident": identity(pair=True), "needs_b": needs_b}))
    with pytest.raises(InferenceServerException) as caught:
        _optional_infer(server, "needs_b", {"A": np.ones(2, np.float32)}, ["X"])
    assert ("in ensemble 'needs_b', expected 2 inputs but got 1 inputs for model 'ident'. "
            "Got input(s) ['INPUT0'], but missing required input(s) ['INPUT1']") in caught.value.message()
