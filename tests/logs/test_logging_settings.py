"""The logging extension (``/v2/logging``, gRPC ``LogSettings``) and the log flags/formats."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pyserve import logs
from pyserve.api.errors import InferError
from pyserve.cli.main import build_parser, cmd_run
from pyserve.server.core import ServerThread


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Logging is process-wide: put settings and pyserve's handlers back after each test."""
    saved = logs.get_settings()
    root = logging.getLogger("pyserve")
    uvicorn_log = logging.getLogger("uvicorn.error")
    state = (list(root.handlers), root.level, root.propagate, list(uvicorn_log.handlers), uvicorn_log.level,
             uvicorn_log.propagate, logs._configured)
    yield
    for key, value in saved.items():
        setattr(logs.SETTINGS, key, value)
    for handler in root.handlers:
        if handler not in state[0]:
            handler.close()
    root.handlers[:], root.level, root.propagate = state[0], state[1], state[2]
    uvicorn_log.handlers[:], uvicorn_log.level, uvicorn_log.propagate = state[3], state[4], state[5]
    logs._configured = state[6]


@pytest.fixture(scope="module")
def http(example_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{example_server.url}", timeout=30) as client:
        yield client


def test_get_and_update_over_http(http: httpx.Client) -> None:
    settings = http.get("/v2/logging").json()
    assert set(settings) == {"log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format"}
    assert isinstance(settings["log_info"], bool) and isinstance(settings["log_verbose_level"], int)

    updated = http.post("/v2/logging", json={"log_info": False, "log_verbose_level": 2, "log_format": "ISO8601"})
    assert updated.status_code == 200, updated.text
    body = updated.json()
    assert body["log_info"] is False and body["log_verbose_level"] == 2 and body["log_format"] == "ISO8601"
    assert http.get("/v2/logging").json() == body
    assert "logging" in http.get("/v2").json()["extensions"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"log_verbose_level": -1}, "non-negative"),
        ({"log_verbose_level": "1"}, "integer"),
        ({"log_info": "yes"}, "boolean"),
        ({"log_format": "xml"}, "unknown 'log_format'"),
        ({"log_file": "/tmp/elsewhere.log"}, "can not be updated"),
    ],
)
def test_bad_updates_are_400(http: httpx.Client, body: dict[str, object], message: str) -> None:
    before = http.get("/v2/logging").json()
    response = http.post("/v2/logging", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert http.get("/v2/logging").json() == before


def test_unknown_keys_are_ignored_as_triton_does(http: httpx.Client) -> None:
    """Triton 2.51 answers 200 and ignores keys it does not know, the plural ``log_warnings``
    and ``log_errors`` of its own documentation among them."""
    before = http.get("/v2/logging").json()
    response = http.post("/v2/logging", json={"log_warnings": True, "nope": 1})
    assert response.status_code == 200
    assert response.json() == before


def test_not_json_is_400(http: httpx.Client) -> None:
    assert http.post("/v2/logging", content=b"[1, 2]").status_code == 400
    assert http.post("/v2/logging", content=b"{").status_code == 400


def test_grpc_log_settings(example_server: ServerThread) -> None:
    with grpcclient.InferenceServerClient(example_server.grpc_url) as client:
        settings = client.get_log_settings(as_json=True)["settings"]
        assert settings["log_error"]["bool_param"] is True
        updated = client.update_log_settings({"log_warning": False, "log_verbose_level": 1}, as_json=True)
        assert updated["settings"]["log_warning"]["bool_param"] is False
        assert updated["settings"]["log_verbose_level"]["uint32_param"] == 1
        assert updated["settings"]["log_format"]["string_param"] == "default"
        with pytest.raises(InferenceServerException) as info:
            client.update_log_settings({"log_format": "xml"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


def _capture(log_format: str = "default", **flags: bool) -> io.StringIO:
    logs.configure(0, log_format=log_format, **flags)
    stream = io.StringIO()
    handler = logging.getLogger("pyserve").handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    return stream


def test_levels_can_be_switched_off_and_on_at_once() -> None:
    stream = _capture()
    log = logging.getLogger("pyserve.test")
    log.info("info one")
    log.debug("hidden debug")
    logs.update_settings({"log_info": False, "log_error": False})
    log.info("info two")
    log.warning("warning shown")
    log.error("error hidden")
    logs.update_settings({"log_verbose_level": 1, "log_info": True})
    log.debug("debug shown")
    text = stream.getvalue()
    assert "info one" in text and "hidden debug" not in text and "info two" not in text
    assert "warning shown" in text and "error hidden" not in text and "debug shown" in text


def test_formats() -> None:
    stream = _capture()
    log = logging.getLogger("pyserve.test")
    log.info("plain")
    logs.update_settings({"log_format": "ISO8601"})
    log.warning("iso")
    logs.update_settings({"log_format": "json"})
    log.error("as json")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("I") and lines[0].endswith("] plain")
    iso = lines[1].split()
    assert iso[0].endswith("Z") and "T" in iso[0] and iso[1] == "W" and lines[1].endswith("] iso")
    record = json.loads(lines[2])
    assert record["level"] == "ERROR" and record["message"] == "as json" and record["file"] == "test_logging_settings.py"


def test_log_file(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    logs.configure(0, log_file=str(path))
    logging.getLogger("pyserve.test").warning("to the file")
    assert logs.get_settings()["log_file"] == str(path)
    for handler in logging.getLogger("pyserve").handlers:
        handler.flush()
    assert "to the file" in path.read_text()


def test_cli_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["run", "--log-verbose", "-1", "--model-repository", str(tmp_path)])
    assert cmd_run(args) == 2
    assert "--log-verbose must be >= 0" in capsys.readouterr().err
    args = build_parser().parse_args(["run", "--trace-config", "level=LOUD", "--model-repository", str(tmp_path)])
    assert cmd_run(args) == 2
    assert "unknown trace level" in capsys.readouterr().err
    parsed = build_parser().parse_args(
        ["run", "--log-info", "false", "--log-format", "ISO8601", "--log-file", str(tmp_path / "x.log")]
    )
    assert parsed.log_info is False and parsed.log_format == "ISO8601"


def test_update_listeners_get_every_changeable_setting_and_cannot_fail_an_update() -> None:
    """What the owner passes on to its frontend processes (``add_update_listener``)."""
    heard: list[dict[str, object]] = []

    def broken(settings: dict[str, object]) -> None:
        raise RuntimeError("a listener's bug")

    before = logs.changeable_settings()
    assert "log_file" not in before and "log_info" in before and "log_format" in before
    logs.add_update_listener(broken)
    logs.add_update_listener(heard.append)
    try:
        assert logs.update_settings({"log_verbose_level": 2})["log_verbose_level"] == 2
        assert heard == [{**before, "log_verbose_level": 2}]
        with pytest.raises(InferError):
            logs.update_settings({"log_info": "yes"})  # refused: nothing to pass on
        assert len(heard) == 1
    finally:
        logs.remove_update_listener(broken)
        logs.remove_update_listener(heard.append)
    logs.remove_update_listener(heard.append)  # not registered any more: nothing happens
    logs.update_settings({"log_verbose_level": 0})
    assert len(heard) == 1
