"""The ``/v1`` routes and decoupled models' ``/infer`` streams with ``--frontend-processes 1``: a
frontend relays them to the model owner, streams included, and a client leaving mid-stream
still cancels the model. Fresh connections alternate between the owner and the frontend (the
balancer takes ties in turn), so each check over several connections passes through both."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from suite_support import (
    EXAMPLE_REPOSITORY,
    SQUARE_CONFIG,
    WORDS_MODEL_PY,
    wait_for_file,
    words_config,
    write_model,
)

from pyserve.server.core import ServerThread
from pyserve.testing import serve

CONNECTIONS = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai-frontends")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerThread]:
    repo = root / "models"
    shutil.copytree(EXAMPLE_REPOSITORY / "tiny_lm", repo / "tiny_lm")
    (root / "marks").mkdir()
    write_model(repo, "words", words_config(root / "marks"), {"1/model.py": WORDS_MODEL_PY})
    write_model(repo, "square", SQUARE_CONFIG)
    with serve(repo, frontend_processes=1) as thread:
        yield thread


def fresh_client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_every_route_answers_through_either_process(server: ServerThread) -> None:
    texts, streamed = [], []
    for _ in range(CONNECTIONS):
        with fresh_client(server) as client:
            assert [m.id for m in client.models.list()] == ["tiny_lm", "words"]
            texts.append(client.completions.create(model="tiny_lm", prompt="The river ", max_tokens=10,
                                                   temperature=0).choices[0].text)
            chunks = client.chat.completions.create(model="tiny_lm", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True})
            streamed.append([c.usage.completion_tokens for c in chunks if c.usage is not None])
            with pytest.raises(openai.BadRequestError, match="at least 1"):
                client.completions.create(model="tiny_lm", prompt="x", max_tokens=0)

    assert len(set(texts)) == 1 and len(texts[0]) == 10
    assert all(usage == [5] for usage in streamed)


def test_a_client_leaving_cancels_the_model_through_either_process(server: ServerThread, root: Path) -> None:
    for i in range(CONNECTIONS):
        with fresh_client(server) as client:
            stream = client.completions.create(model="words", prompt=f"forever fe-{i}", stream=True)
            for _, chunk in zip(range(3), stream):
                assert chunk.choices[0].text == "x"
            stream.close()
        assert wait_for_file(root / "marks" / f"fe-{i}")


def test_decoupled_infer_streams_through_either_process(server: ServerThread, root: Path) -> None:
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [2]}]}
    for i in range(CONNECTIONS):
        with httpx.Client(base_url=f"http://{server.url}", timeout=30) as http:
            answer = http.post("/v2/models/square/infer", json=body)
            assert answer.status_code == 200
            assert [json.loads(line)["parameters"]["triton_final_response"] for line in answer.text.splitlines()] \
                == [False, False, True]
            words = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [f"forever ks-{i}"]}]}
            with http.stream("POST", "/v2/models/words/infer", json=words) as stream:
                assert json.loads(next(stream.iter_lines()))["outputs"][0]["data"] == ["x"]
        assert wait_for_file(root / "marks" / f"ks-{i}")
