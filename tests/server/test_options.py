"""The option declarations (``pyserve.server.options``) and the flags generated from them."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pyserve.cli.main import build_parser, run_options
from pyserve.cli.option_flags import add_option_flags, option_values
from pyserve.frontends.grpc.server import GrpcOptions
from pyserve.frontends.http.body import DEFAULT_MAX_INPUT_SIZE
from pyserve.frontends.http.server import BODY_TIMEOUT, HEADER_TIMEOUT
from pyserve.server.options import GRPC_SETTINGS, RUN_GROUPS, ServerOptions, flags_of
from pyserve.server.options import http as http_options
from pyserve.server.options.declare import METADATA_KEY, flag, setting


def _run_parser() -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["run"]


def test_every_server_option_is_set_by_a_flag() -> None:
    for item in dataclasses.fields(ServerOptions):
        assert METADATA_KEY in item.metadata, f"ServerOptions.{item.name} declares no flag"
    grpc_fields = {item.name for item in dataclasses.fields(GrpcOptions)}
    assert set(GRPC_SETTINGS) == grpc_fields - {"port"}  # the port is --grpc-port


def test_grpc_flag_defaults_are_grpc_options_defaults() -> None:
    parsed = _run_parser().parse_args([])
    defaults = GrpcOptions()
    assert {name: declared.value(parsed) for name, declared in GRPC_SETTINGS.items()} == {
        name: getattr(defaults, name) for name in GRPC_SETTINGS
    }


def test_http_defaults_are_the_http_servers() -> None:
    assert http_options.MAX_INPUT_SIZE == DEFAULT_MAX_INPUT_SIZE
    assert http_options.HEADER_TIMEOUT_SECS == HEADER_TIMEOUT
    assert http_options.BODY_TIMEOUT_SECS == BODY_TIMEOUT


def test_every_declared_flag_is_a_run_flag_once() -> None:
    parser = _run_parser()
    declared = [name for item, _ in flags_of(RUN_GROUPS) for name in item.names]
    assert len(declared) == len(set(declared))
    for name in declared:
        assert name in parser._option_string_actions, name


def test_absent_flags_give_the_embedded_defaults_where_they_agree(tmp_path: Path) -> None:
    options = ServerOptions(**option_values(ServerOptions, _run_parser().parse_args(["--model-repository", str(tmp_path)])))
    embedded = ServerOptions(model_repositories=[tmp_path])
    differ = {f.name for f in dataclasses.fields(ServerOptions) if getattr(options, f.name) != getattr(embedded, f.name)}
    # pyserve run serves metrics, chooses the process layout itself (auto), and passes the parsed
    # (default) trace settings where an embedded server has None (which means the same)
    assert differ == {"allow_metrics", "frontend_processes", "replicate_models", "busy_poll_us", "pin_processes",
                      "trace_config"}


def test_run_options_read_every_group(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "run", "--model-store", str(tmp_path), "--http-address", "127.0.0.1", "--http-port", "0",
        "--grpc-port", "0", "--grpc-keepalive-time", "5", "--grpc-restricted-protocol", "health:k=v",
        "--metrics-config", "histogram_latencies=true", "--allow-metrics", "false",
        "--strict-model-config", "--backend-config", "identity,a=b", "--id", "me", "--frontend-processes", "0",
        "--max-tensor-elements", "7", "--grpc-server", "grpcio",
    ])
    options = run_options(args)
    assert options.model_repositories == [tmp_path] and options.host == "127.0.0.1"
    assert options.grpc.keepalive_time_ms == 5 and options.grpc.implementation == "grpcio"
    assert set(options.grpc.restrictions) == {"health"}
    assert options.metrics_config == {"histogram_latencies": "true"} and options.allow_metrics is False
    assert options.auto_complete is False and options.backend_config == {"identity": {"a": "b"}}
    assert options.server_id == "me" and options.frontend_processes == 0 and options.max_tensor_elements == 7


def test_a_conversion_error_names_the_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args(["run", "--model-repository", str(tmp_path), "--max-tensor-elements", "-1"])
    with pytest.raises(ValueError, match="--max-tensor-elements must be >= 0"):
        option_values(ServerOptions, args)
    args = build_parser().parse_args(["run", "--model-repository", str(tmp_path), "--exit-timeout-secs", "nan"])
    with pytest.raises(ValueError, match="--exit-timeout-secs must be a number of seconds >= 0"):
        option_values(ServerOptions, args)


def test_a_new_field_is_a_new_flag() -> None:
    @dataclasses.dataclass(kw_only=True)
    class Extra:
        answer: int = setting(flag("--answer", "--the-answer", type=int, help="the answer"), default=42)
        names: list[str] = setting(flag("--name", action="append"), default_factory=list, convert=sorted)

    parser = argparse.ArgumentParser()
    add_option_flags(parser, [Extra])
    assert option_values(Extra, parser.parse_args([])) == {"answer": 42, "names": []}
    parsed = parser.parse_args(["--the-answer", "7", "--name", "b", "--name", "a"])
    assert Extra(**option_values(Extra, parsed)) == Extra(answer=7, names=["a", "b"])


def test_help_builds_without_the_server_imports() -> None:
    heavy = ("grpc", "starlette", "uvicorn", "pyserve.server.core", "pyserve.frontends.grpc.server")
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from pyserve.cli.main import build_parser; build_parser(); "
                               f"print([m for m in {heavy!r} if m in sys.modules])"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"
