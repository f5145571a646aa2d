"""The parts of the OpenAI routes that need no server: stop sequences, request checks, chat
template files and how a model config maps onto the routes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pyserve.frontends.http.openai.binding import Binding, describe
from pyserve.frontends.http.openai.chat_template import (
    DEFAULT_TEMPLATE,
    ChatTemplate,
    TemplateError,
    load_chat_template,
)
from pyserve.frontends.http.openai.errors import OpenAIError
from pyserve.frontends.http.openai.run import _StopFinder
from pyserve.frontends.http.openai.schema import Sampling, parse_chat, parse_completion
from pyserve.frontends.http.openai.tokens import TokenCounter
from pyserve.repository.model_config import model_io, normalize, parse_config
from pyserve.runtime.versions import ModelState, ModelVersion


def feed(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    finder = _StopFinder(stops)
    out = ""
    for piece in pieces:
        text, stopped = finder.feed(piece)
        out += text
        if stopped:
            return out, True
    return out + finder.flush(), False


@pytest.mark.parametrize(("stops", "pieces", "expected"), [
    ([], ["a", "b"], ("ab", False)),
    (["END"], ["abcENDdef"], ("abc", True)),
    (["END"], ["ab", "cE", "N", "Dx"], ("abc", True)),
    (["END"], ["ab", "cE", "N", "x"], ("abcENx", False)),  # a held-back start released when it diverges
    (["xyz", "b"], ["axyzb"], ("a", True)),  # the earliest sequence wins
    (["aa"], ["a", "a"], ("", True)),
    (["ab"], ["a"], ("a", False)),  # what is held back at the end is text
])
def test_stop_sequences(stops: list[str], pieces: list[str], expected: tuple[str, bool]) -> None:
    assert feed(stops, pieces) == expected


def test_requests_are_normalized() -> None:
    chat = parse_chat({
        "model": "m", "max_tokens": 5, "max_completion_tokens": 7, "stream": True,
        "stream_options": {"include_usage": True}, "user": "ignored", "response_format": {"type": "text"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None}],
    })
    assert chat.sampling.max_tokens == 7 and chat.include_usage and chat.n == 1
    assert chat.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    completion = parse_completion({"model": "m", "prompt": ["a", "b"], "stop": "x", "seed": -1, "top_k": 4})
    assert completion.prompts == ["a", "b"] and completion.sampling.stop == ["x"]
    assert completion.sampling.given() == {"seed": -1, "stop": ["x"], "top_k": 4}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "m", "prompt": "x", "seed": 2**64}, "seed"),
    ({"model": "m", "prompt": "x", "top_p": True}, "top_p"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": ["x"] * 3, "n": 50}, "n"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
])
def test_bad_request_fields_are_named(body: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_completion(body)
    assert info.value.status == 400 and info.value.param == param


def test_bad_chat_content_and_formats() -> None:
    for messages, text in (([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
                           ([{"role": "user", "content": 5}], "string or a list"),
                           (["hi"], "must be an object")):
        with pytest.raises(OpenAIError, match=text):
            parse_chat({"model": "m", "messages": messages})
    with pytest.raises(OpenAIError, match="response_format"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_object"}})


# -- chat templates ------------------------------------------------------------------------------


def test_template_files_are_found_in_order(tmp_path: Path) -> None:
    model, version = tmp_path / "m", tmp_path / "m" / "1"
    version.mkdir(parents=True)
    messages = [{"role": "user", "content": "Hi"}]
    assert load_chat_template([version, model]).render(messages) == "user: Hi\nassistant:"

    (model / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "no"}, {"name": "default", "template": "{{ bos_token }}M"}],
    }))
    assert load_chat_template([version, model]).render(messages) == "<s>M"
    (model / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert load_chat_template([version, model]).render(messages) == "J</s>"  # the file beats the config
    (version / "chat_template.jinja").write_text("V")
    assert load_chat_template([version, model]).render(messages) == "V"  # the version folder first


def test_broken_template_files_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(TemplateError, match="tokenizer_config.json: cannot be read as JSON"):
        load_chat_template([tmp_path])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(TemplateError, match="'chat_template' must be a string"):
        load_chat_template([tmp_path])
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TemplateError, match="does not compile"):
        load_chat_template([tmp_path])


def test_templates_run_in_a_sandbox() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(OpenAIError, match="failed on the messages"):
        template.render([{"role": "user", "content": "x"}])
    assert ChatTemplate(DEFAULT_TEMPLATE).render([{"role": "system", "content": "S"}]) == "system: S\nassistant:"


# -- bindings ------------------------------------------------------------------------------------


def model(tmp_path: Path, config: str) -> ModelVersion:
    path = tmp_path / "config.pbtxt"
    path.write_text(textwrap.dedent(config))
    parsed = parse_config(path.read_text(), path)
    normalize(parsed, tmp_path)
    return ModelVersion(name="m", version=1, state=ModelState.READY, config=parsed, io=model_io(parsed, tmp_path))


TEXT = """
    backend: "python"
    max_batch_size: 2
    input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] },
            { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
            { name: "seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true },
            { name: "temperature" data_type: TYPE_FP16 dims: [ 1 ] optional: true },
            { name: "stop" data_type: TYPE_STRING dims: [ 2 ] optional: true } ]
    output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
    parameters [ { key: "pyserve_openai_text_input" value { string_value: "TEXT" } },
                 { key: "pyserve_openai_text_output" value { string_value: "OUT" } } ]
"""


def test_named_tensors_and_typed_inputs(tmp_path: Path) -> None:
    served = model(tmp_path, TEXT)
    shape = describe(served)
    assert not isinstance(shape, str)
    binding = Binding(shape, ChatTemplate(DEFAULT_TEMPLATE), TokenCounter())
    request = binding.build_request(served, "hi", Sampling(max_tokens=3, seed=-1, temperature=0.5, stop=["a", "b"]),
                                    stream=False, choice=0, request_id="r")
    assert request.inputs["TEXT"].tolist() == [[b"hi"]] and request.batch_size == 1
    assert request.inputs["max_tokens"].tolist() == [[3]] and request.inputs["seed"].tolist() == [[2**64 - 1]]
    assert request.inputs["temperature"].dtype == np.float16 and request.inputs["stop"].tolist() == [[b"a", b"b"]]
    second = binding.build_request(served, "hi", Sampling(seed=5), stream=False, choice=2, request_id="r")
    assert second.inputs["seed"].tolist() == [[7]]


@pytest.mark.parametrize(("sampling", "message"), [
    (Sampling(max_tokens=2**40), "out of the range"),
    (Sampling(stop=["only one"]), "cannot hold 1 value"),
])
def test_settings_that_do_not_fit_an_input(tmp_path: Path, sampling: Sampling, message: str) -> None:
    served = model(tmp_path, TEXT)
    shape = describe(served)
    assert not isinstance(shape, str)
    binding = Binding(shape, ChatTemplate(DEFAULT_TEMPLATE), TokenCounter())
    with pytest.raises(OpenAIError, match=message):
        binding.build_request(served, "hi", sampling, stream=False, choice=0, request_id="r")


@pytest.mark.parametrize(("extra_input", "parameters", "reason"), [
    ("", '{ key: "pyserve_openai" value { string_value: "false" } }', "pyserve_openai is false"),
    ('{ name: "other" data_type: TYPE_INT32 dims: [ 1 ] }', "", "required input 'other'"),
    ("", '{ key: "pyserve_openai_context_length" value { string_value: "-3" } }', "positive integer"),
    ('{ name: "sampling_parameters" data_type: TYPE_INT32 dims: [ 1 ] }', "", "is not TYPE_STRING"),
])
def test_models_the_routes_cannot_serve_say_why(tmp_path: Path, extra_input: str, parameters: str,
                                                 reason: str) -> None:
    config = f"""
        backend: "python"
        max_batch_size: 0
        input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} {"," if extra_input else ""} {extra_input} ]
        output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
        {"parameters [ " + parameters + " ]" if parameters else ""}
    """
    described = describe(model(tmp_path, config))
    assert isinstance(described, str) and reason in described
