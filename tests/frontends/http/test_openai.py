"""The OpenAI-compatible ``/v1`` routes, driven with the official ``openai`` client (sync, async,
streaming, chat and completions, errors) against a real server: the bundled ``tiny_lm``, a
decoupled word-streaming Python model and non-decoupled Python models that echo what they
received."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from suite_support import EXAMPLE_REPOSITORY, WORDS_MODEL_PY, wait_for_file, words_config, write_model

from pyserve.server.core import ServerThread
from pyserve.testing import serve

ECHO_PY = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            received = {}
            for tensor in request.inputs():
                values = tensor.as_numpy().reshape(-1).tolist()
                received[tensor.name()] = [v.decode() if isinstance(v, bytes) else v for v in values]
            received["parameters"] = json.loads(request.parameters() or "{}")
            text = json.dumps(received, sort_keys=True).encode().hex()  # hex: no stop sequence can match it
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
            ]))
        return responses
"""
"""Answers a JSON object of every input it received and its request parameters, in hex."""

ECHO_PARAMS = """
backend: "python"
max_batch_size: 0
input [ { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
ECHO_SAMPLING = """
backend: "python"
max_batch_size: 4
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "max_tokens" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages, please') }}"
    "{% endif %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT]"
)
PLAIN = """
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def word_tokenizer() -> str:
    """A ``tokenizer.json``: one token per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer.to_str()


def make_repository(root: Path) -> Path:
    repo = root / "models"
    shutil.copytree(EXAMPLE_REPOSITORY / "tiny_lm", repo / "tiny_lm")
    (root / "marks").mkdir()
    write_model(repo, "words", words_config(root / "marks"), {"1/model.py": WORDS_MODEL_PY})
    write_model(repo, "echo_params", ECHO_PARAMS, {"1/model.py": ECHO_PY})
    write_model(repo, "echo_sampling", ECHO_SAMPLING, {"1/model.py": ECHO_PY})
    write_model(repo, "echo_template", ECHO_PARAMS, {"1/model.py": ECHO_PY, "chat_template.jinja": TEMPLATE,
                                                     "1/tokenizer.json": word_tokenizer()})
    write_model(repo, "plain", PLAIN)
    return repo


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerThread]:
    with serve(make_repository(root), allow_metrics=True) as thread:
        yield thread


@pytest.fixture
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def echoed(completion: Any) -> dict[str, Any]:
    """What an echo model received, from its completion's text."""
    choice = completion.choices[0]
    text = choice.message.content if hasattr(choice, "message") else choice.text
    return json.loads(bytes.fromhex(text))


# -- models ---------------------------------------------------------------------------------------


def test_models_lists_the_models_with_text_in_and_out(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]

    assert ids == ["echo_params", "echo_sampling", "echo_template", "tiny_lm", "words"]
    card = client.models.retrieve("tiny_lm")
    assert (card.id, card.object, card.owned_by) == ("tiny_lm", "model", "pyserve")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("plain")
    assert info.value.code == "model_not_found"


# -- the bundled model ------------------------------------------------------------------------------


def test_completion_of_the_bundled_model_is_reproducible_and_counted(client: openai.OpenAI) -> None:
    prompt = "The server "
    first = client.completions.create(model="tiny_lm", prompt=prompt, max_tokens=12, temperature=0)
    again = client.completions.create(model="tiny_lm", prompt=prompt, max_tokens=12, temperature=0)

    assert first.object == "text_completion" and first.id.startswith("cmpl-")
    assert first.choices[0].text == again.choices[0].text
    assert len(first.choices[0].text) == 12 and first.choices[0].finish_reason == "length"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (11, 12, 23)


def test_n_choices_with_a_seed_differ_and_repeat(client: openai.OpenAI) -> None:
    def texts() -> list[str]:
        result = client.completions.create(model="tiny_lm", prompt="A model ", max_tokens=16, n=3, seed=7,
                                           temperature=1.0)
        assert [c.index for c in result.choices] == [0, 1, 2]
        assert result.usage.completion_tokens == sum(len(c.text) for c in result.choices)
        assert result.usage.prompt_tokens == len("A model ")  # the prompt counted once
        return [c.text for c in result.choices]

    first = texts()
    assert first == texts()
    assert len(set(first)) > 1


def test_chat_stream_matches_the_unstreamed_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about the river."}]
    whole = client.chat.completions.create(model="tiny_lm", messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny_lm", messages=messages, max_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))

    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # the model's own chat template (tokenizer_config.json): "<user> ...\n<assistant> "
    assert whole.usage.prompt_tokens == len("<user> Tell me about the river.\n<assistant> ")


def test_async_clients_stream_concurrently(server: ServerThread) -> None:
    async def one(client: openai.AsyncOpenAI, seed: int) -> str:
        stream = await client.completions.create(model="tiny_lm", prompt="Every story ", max_tokens=24,
                                                 seed=seed, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def main() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=f"http://{server.url}/v1", api_key="x", max_retries=0,
                                      timeout=60) as client:
            together = await asyncio.gather(*(one(client, s) for s in (1, 2, 1, 2)))
            alone = [await one(client, 1), await one(client, 2)]
        return list(together), alone

    together, alone = asyncio.run(main())

    assert together == alone + alone


# -- how settings reach a model ----------------------------------------------------------------------


def test_settings_become_request_parameters(client: openai.OpenAI) -> None:
    result = client.completions.create(model="echo_params", prompt="hello", max_tokens=5, temperature=0.5,
                                       top_p=0.9, seed=3, stop=["@@", "##"], presence_penalty=0.25)
    received = echoed(result)

    assert received["prompt"] == ["hello"]
    assert received["parameters"] == {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                      "stop": '["@@","##"]', "presence_penalty": 0.25}
    assert result.usage.prompt_tokens == 5  # no tokenizer: UTF-8 bytes


def test_settings_become_inputs_and_sampling_parameters(client: openai.OpenAI) -> None:
    result = client.completions.create(model="echo_sampling", prompt="hi", temperature=0.0, stop="@@")
    received = echoed(result)

    assert received["text_input"] == ["hi"]
    assert received["max_tokens"] == [16]  # required by the model: OpenAI's default
    assert received["stop_words"] == ["@@"]
    assert json.loads(received["sampling_parameters"][0]) == {"temperature": 0.0}
    assert received["stream"] == [False] and received["exclude_input_in_output"] == [True]
    assert received["parameters"] == {}


def test_default_chat_template(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = client.chat.completions.create(model="echo_params", messages=messages)

    assert echoed(result)["prompt"] == ["system: Be brief.\nuser: Hi\nassistant:"]


def test_model_chat_template_and_its_refusal(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="echo_template", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])

    assert echoed(result)["prompt"] == ["[USER] Hi\n[ASSISTANT]"]
    # counted with the model's tokenizer.json (a word a token): the prompt, and the one hex word answered
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 1)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo_template", messages=[{"role": "system", "content": "S"}])
    assert "no system messages, please" in info.value.message


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    result = client.completions.create(model="words", prompt="alpha beta", echo=True)

    assert result.choices[0].text == "alpha betaalpha beta"


# -- stop sequences ----------------------------------------------------------------------------------


def test_a_stop_sequence_across_tokens_ends_the_text(client: openai.OpenAI) -> None:
    prompt = "alpha beta gamma delta"
    whole = client.completions.create(model="words", prompt=prompt, stop=["ta gam", "zzz"])
    streamed = list(client.completions.create(model="words", prompt=prompt, stop=["ta gam"], stream=True))

    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("alpha be", "stop")
    assert "".join(c.choices[0].text for c in streamed) == "alpha be"
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_max_tokens_ends_a_stream_of_a_model_that_ignores_it(client: openai.OpenAI) -> None:
    result = client.completions.create(model="words", prompt="a b c d e f", max_tokens=2)

    assert (result.choices[0].text, result.choices[0].finish_reason) == ("a b ", "length")
    assert result.usage.completion_tokens == 2


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"model": "tiny_lm", "prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"model": "tiny_lm", "prompt": "x", "max_tokens": "5"}, "max_tokens", "must be an integer"),
    ({"model": "tiny_lm", "prompt": "x", "temperature": 3}, "temperature", "between 0 and 2"),
    ({"model": "tiny_lm", "prompt": 5}, "prompt", "must be a string"),
    ({"model": "tiny_lm", "prompt": [[1, 2]]}, "prompt", "token ids"),
    ({"model": "tiny_lm", "prompt": "x", "n": 0}, "n", "from 1 to 128"),
    ({"model": "tiny_lm", "prompt": "x", "stop": [1]}, "stop", "list of strings"),
    ({"model": "tiny_lm", "prompt": "x", "logprobs": 2}, "logprobs", "not supported"),
    ({"model": "tiny_lm", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"model": "tiny_lm", "prompt": "x" * 300}, "prompt", "maximum context length is 256"),
    ({"model": "tiny_lm", "prompt": "x" * 200, "max_tokens": 100}, "prompt", "you requested 300 tokens"),
    ({"model": "echo_params", "prompt": "x", "stream": True}, "stream", "only decoupled models"),
    ({"model": "plain", "prompt": "x"}, "model", "no TYPE_STRING input"),
    ({"model": "echo_sampling", "prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16"),
])
def test_bad_completions_get_openai_errors(client: openai.OpenAI, body: dict[str, Any], param: str,
                                           text: str) -> None:
    model, prompt = body.pop("model"), body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=prompt, **body)

    error = info.value
    assert error.status_code == 400
    assert error.body["type"] == "invalid_request_error" and error.body["param"] == param
    assert text in error.message


def test_bad_chat_requests_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model="tiny_lm", messages=[])
    with pytest.raises(openai.BadRequestError, match="role must be one of"):
        client.chat.completions.create(model="tiny_lm", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        client.chat.completions.create(model="tiny_lm", messages=[{"role": "user", "content": "hi"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model="tiny_lm", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=-1)


def test_unknown_model_and_route_are_404(client: openai.OpenAI, server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body == {"message": "The model 'nope' does not exist", "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}
    answer = httpx.post(f"http://{server.url}/v1/embeddings", json={"model": "tiny_lm", "input": "x"})
    assert answer.status_code == 404 and answer.json()["error"]["message"] == "Not Found"
    answer = httpx.post(f"http://{server.url}/v1/completions", content=b"{not json")
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]


def test_model_errors_before_and_during_a_stream(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="refused: now"):
        client.completions.create(model="words", prompt="refuse now", stream=True)
    stream = client.completions.create(model="words", prompt="fail", stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="failed after two words"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == ["one ", "two "]
    with pytest.raises(openai.InternalServerError, match="failed after two words"):
        client.completions.create(model="words", prompt="fail")


def test_bad_requests_do_not_disturb_a_stream_in_flight(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="tiny_lm", prompt="The weather ", max_tokens=40, temperature=0,
                                       stream=True)
    texts = [next(iter(stream)).choices[0].text]
    for body in ({"max_tokens": 0}, {"temperature": -1}, {"prompt": "x" * 400}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{"model": "tiny_lm", "prompt": "y", **body})
    texts += [c.choices[0].text for c in stream]
    alone = client.completions.create(model="tiny_lm", prompt="The weather ", max_tokens=40, temperature=0)

    assert "".join(texts) == alone.choices[0].text


# -- cancellation ----------------------------------------------------------------------------------


def test_a_client_leaving_a_stream_cancels_the_model(client: openai.OpenAI, root: Path) -> None:
    stream = client.completions.create(model="words", prompt="forever openai-stream", stream=True)
    for _, chunk in zip(range(3), stream):
        assert chunk.choices[0].text == "x"
    stream.close()

    assert wait_for_file(root / "marks" / "openai-stream")


def test_a_client_leaving_an_unstreamed_request_cancels_the_model(server: ServerThread, root: Path) -> None:
    done = threading.Event()

    def ask() -> None:
        try:
            httpx.post(f"http://{server.url}/v1/completions", timeout=0.5,
                       json={"model": "words", "prompt": "forever openai-whole"})
        except httpx.TimeoutException:
            pass
        done.set()

    threading.Thread(target=ask, daemon=True).start()

    assert done.wait(30)
    assert wait_for_file(root / "marks" / "openai-whole")


# -- metrics, and the flag that turns the routes off --------------------------------------------------


def test_metrics_count_tokens_and_their_timings(client: openai.OpenAI, server: ServerThread) -> None:
    client.completions.create(model="tiny_lm", prompt="Good servers ", max_tokens=8, temperature=0)
    page = httpx.get(f"http://127.0.0.1:{server.server.metrics_port}/metrics").text
    samples = {}
    for line in page.splitlines():
        if line.startswith("pyserve_openai_") or line.startswith("nv_inference_request_success{"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)

    assert samples['pyserve_openai_time_to_first_token_seconds_count{model="tiny_lm"}'] >= 1
    assert samples['pyserve_openai_inter_token_latency_seconds_count{model="tiny_lm"}'] >= 7
    assert samples['pyserve_openai_completion_tokens{model="tiny_lm"}'] >= 8
    assert samples['pyserve_openai_prompt_tokens{model="tiny_lm"}'] >= len("Good servers ")
    assert samples['nv_inference_request_success{model="tiny_lm",version="1"}'] >= 1


def test_allow_openai_false_turns_the_routes_off(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(EXAMPLE_REPOSITORY / "tiny_lm", repo / "tiny_lm")
    with serve(repo, allow_openai=False) as thread:
        answer = httpx.get(f"http://{thread.url}/v1/models")

    assert answer.status_code == 404 and answer.json() == {"error": "Not Found"}


def test_model_requests_are_traced_under_the_clients_traceparent(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pyserve.tracing import parse_trace_config

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    config = parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"])
    repo = tmp_path / "models"
    write_model(repo, "words", words_config(tmp_path), {"1/model.py": WORDS_MODEL_PY})
    with serve(repo, trace_config=config) as thread:
        exporter = InMemorySpanExporter()
        thread.server.dataplane.tracing.use_span_exporter(exporter)
        with openai.OpenAI(base_url=f"http://{thread.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            client.completions.create(model="words", prompt="one two", n=2,
                                      extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        roots = [s for s in exporter.get_finished_spans() if s.name == "InferRequest"]

    assert len(roots) == 2
    assert all(format(s.context.trace_id, "032x") == trace_id for s in roots)
    assert all(s.attributes["triton.model_name"] == "words" for s in roots)


def test_restricted_apis_cover_the_routes(tmp_path: Path) -> None:
    from pyserve.frontends.restricted import Restriction

    repo = tmp_path / "models"
    shutil.copytree(EXAMPLE_REPOSITORY / "tiny_lm", repo / "tiny_lm")
    rules = {"inference": Restriction("infer-key", "yes"), "metadata": Restriction("meta-key", "yes")}
    with serve(repo, http_restricted_api=rules) as thread:
        with openai.OpenAI(base_url=f"http://{thread.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            with pytest.raises(openai.PermissionDeniedError):
                client.completions.create(model="tiny_lm", prompt="x", max_tokens=1)
            with pytest.raises(openai.PermissionDeniedError):
                client.models.list()
            allowed = client.completions.create(model="tiny_lm", prompt="x", max_tokens=1,
                                                extra_headers={"infer-key": "yes"})
            assert [m.id for m in client.models.list(extra_headers={"meta-key": "yes"})] == ["tiny_lm"]
    assert allowed.usage is not None and allowed.usage.completion_tokens <= 1


def test_uvicorn_serves_the_routes_and_a_leaving_client_cancels(tmp_path: Path) -> None:
    repo, marks = tmp_path / "models", tmp_path / "marks"
    marks.mkdir()
    write_model(repo, "words", words_config(marks), {"1/model.py": WORDS_MODEL_PY})
    with serve(repo, http_server="uvicorn") as thread:
        with openai.OpenAI(base_url=f"http://{thread.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            chunks = client.chat.completions.create(model="words", messages=[{"role": "user", "content": "hi"}],
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == "user: hi\nassistant:"
            stream = client.completions.create(model="words", prompt="forever uvicorn", stream=True)
            for _, chunk in zip(range(3), stream):
                assert chunk.choices[0].text == "x"
            stream.close()
            assert wait_for_file(marks / "uvicorn")
