"""``pyserve bench`` against a real server on the bundled example repository (HTTP and gRPC),
plus the pieces that need no server: option parsing, input data, HTTP response framing,
the progress display and the plot.
"""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from suite_support import REPO_ROOT, StartServer, write_model

from pyserve.server.core import ServerThread
from pyserve.tools.bench import BenchError, BenchOptions, inputs
from pyserve.tools.bench.options import range_values
from pyserve.tools.bench.report import (
    LevelResult,
    Progress,
    check_plot,
    write_plot,
)
from pyserve.tools.bench.worker import Recorder, _HttpConnection

FAST = ["-p", "200", "-r", "3", "--workers", "1"]
"""Three 200 ms windows per level (all reported), one worker process."""


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyserve", "bench", *args],
        capture_output=True, text=True, timeout=90, cwd=REPO_ROOT,
    )


def check_levels(levels: Sequence[dict[str, Any]], expected: Sequence[float]) -> None:
    assert [level["level"] for level in levels] == list(expected)
    for level in levels:
        assert level["throughput"] > 0
        assert level["requests"] > 0
        assert level["errors"] == 0
        p = level["percentiles_us"]
        assert 0 < p["p50"] <= p["p90"] <= p["p95"] <= p["p99"]
        assert level["avg_us"] > 0


def test_http_concurrency_range_table_csv_json(example_server: ServerThread, tmp_path: Path) -> None:
    csv_file, json_file = tmp_path / "results.csv", tmp_path / "results.json"
    done = bench("-m", "identity_fp32", "-u", example_server.url, "--shape", "INPUT0:16",
                 "--concurrency-range", "1:2:1", *FAST, "-f", str(csv_file), "--json", str(json_file))
    assert done.returncode == 0, done.stderr
    table = done.stdout
    assert "Concurrency" in table and "Infer/s" in table and "p99 ms" in table
    assert "concurrency 1: window 3/3" in done.stderr  # periodic progress lines when not a TTY

    rows = list(csv.DictReader(csv_file.read_text().splitlines()))
    assert [r["Concurrency"] for r in rows] == ["1", "2"]
    for row in rows:
        assert float(row["Inferences/Second"]) > 0
        assert 0 < int(row["p50 latency"]) <= int(row["p90 latency"]) <= int(row["p95 latency"]) <= int(row["p99 latency"])

    document = json.loads(json_file.read_text())
    assert document["model"] == "identity_fp32" and document["protocol"] == "http"
    assert document["mode"] == "concurrency"
    check_levels(document["results"], [1, 2])
    for level in document["results"]:  # the split is shown when the server has the statistics extension
        assert level["server"] is not None or any("statistics extension" in n for n in document["notes"])


def test_grpc_simple(example_server: ServerThread, tmp_path: Path) -> None:
    json_file = tmp_path / "grpc.json"
    done = bench("-m", "simple", "-i", "grpc", "-u", example_server.grpc_url, "--concurrency-range", "1:2:1",
                 "--percentile", "95", *FAST, "--json", str(json_file))
    assert done.returncode == 0, done.stderr
    document = json.loads(json_file.read_text())
    assert document["protocol"] == "grpc" and document["percentile"] == 95
    check_levels(document["results"], [1, 2])


def test_input_data_file_json_encoding_and_request_rate(example_server: ServerThread, tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [
        {"INPUT0": list(range(16)), "INPUT1": {"content": [1] * 16, "shape": [16]}},
        {"INPUT0": [[v] for v in range(16)], "INPUT1": [2] * 16},
    ]}))
    json_file = tmp_path / "rate.json"
    done = bench("-m", "simple", "-u", example_server.url, "--input-data", str(data), "--http-binary", "false",
                 "--request-rate-range", "100", "--request-distribution", "poisson", *FAST, "--json", str(json_file))
    assert done.returncode == 0, done.stderr
    assert "Request rate" in done.stdout
    (level,) = json.loads(json_file.read_text())["results"]
    check_levels([level], [100.0])
    assert 40 < level["throughput"] < 200


def test_streaming_decoupled_model(start_server: StartServer, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "square", """
        backend: "square"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    """)
    server = start_server(repo)
    data = tmp_path / "n.json"
    data.write_text('{"data": [{"IN": [3]}, {"IN": [0]}]}')
    json_file = tmp_path / "stream.json"
    done = bench("-m", "square", "-i", "grpc", "-u", server.grpc_url, "--streaming", "--input-data", str(data),
                 *FAST, "--json", str(json_file))
    assert done.returncode == 0, done.stderr
    check_levels(json.loads(json_file.read_text())["results"], [1])

    unary = bench("-m", "square", "-i", "grpc", "-u", server.grpc_url, *FAST)
    assert unary.returncode == 1
    assert "decoupled: use -i grpc --streaming" in unary.stderr


def test_bad_model_and_unreachable_server(example_server: ServerThread) -> None:
    done = bench("-m", "no_such_model", "-u", example_server.url, *FAST)
    assert done.returncode == 1
    assert "error: model 'no_such_model' is not available on the server" in done.stderr
    assert "Traceback" not in done.stderr

    done = bench("-m", "no_such_model", "-i", "grpc", "-u", example_server.grpc_url, *FAST)
    assert done.returncode == 1
    assert "model 'no_such_model' is not available" in done.stderr

    done = bench("-m", "identity_fp32", "-u", example_server.url, *FAST)  # INPUT0 has a variable dimension
    assert done.returncode == 1
    assert "--shape INPUT0:" in done.stderr


def test_llm_endpoints_report_time_to_first_token_inter_token_latency_and_tokens(
    example_server: ServerThread, tmp_path: Path,
) -> None:
    json_file = tmp_path / "llm.json"
    done = bench("-m", "tiny_lm", "-u", example_server.url, "--endpoint-type", "chat", "--concurrency-range", "1:2:1",
                 "--request-count", "6", "--max-tokens", "12", "--json", str(json_file))
    assert done.returncode == 0, done.stderr
    assert "TTFT avg ms" in done.stdout and "ITL avg ms" in done.stdout and "Out tok/s" in done.stdout

    document = json.loads(json_file.read_text())
    assert document["endpoint_type"] == "chat" and document["max_tokens"] == 12
    assert [level["concurrency"] for level in document["levels"]] == [1, 2]
    for level in document["levels"]:
        assert level["requests"] == 6
        assert 0 < level["output_tokens_avg"] <= 12 and level["output_tokens_per_s"] > 0
        assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"] <= level["latency_ms"]["p99"]
        assert level["itl_ms"]["avg"] >= 0

    done = bench("-m", "tiny_lm", "-u", example_server.url, "--endpoint-type", "completions", "--request-count", "2",
                 "--max-tokens", "4", "-q")
    assert done.returncode == 0, done.stderr


def test_llm_endpoint_errors(example_server: ServerThread) -> None:
    done = bench("-m", "no_such_model", "-u", example_server.url, "--endpoint-type", "completions", "-q")
    assert done.returncode == 1 and "HTTP 404" in done.stderr and "model_not_found" in done.stderr
    done = bench("-m", "tiny_lm", "-i", "grpc", "-u", example_server.grpc_url, "--endpoint-type", "chat")
    assert done.returncode == 1 and "leave out -i grpc" in done.stderr
    done = bench("-m", "tiny_lm", "-u", example_server.url, *FAST)
    assert done.returncode == 1 and "--endpoint-type" in done.stderr
    assert "Traceback" not in done.stderr


def test_shared_memory_needs_server_support(example_server: ServerThread) -> None:
    done = bench("-m", "simple", "-u", example_server.url, "--shared-memory", "system", *FAST)
    if done.returncode == 0:  # the server supports the extension
        assert "Concurrency" in done.stdout
    else:
        assert done.returncode == 1
        assert "does not support system shared memory" in done.stderr
        assert "Traceback" not in done.stderr


# -- no server -------------------------------------------------------------------------------------------


def test_option_parsing() -> None:
    from pyserve.cli.main import build_parser
    from pyserve.tools.bench import options_from_args

    args = build_parser().parse_args(["bench", "-m", "m", "--concurrency-range", "2:8:3", "--shape", "A:3,4",
                                      "-i", "GRPC"])
    options = options_from_args(args)
    assert options.concurrency == [2, 5, 8]
    assert options.shapes == {"A": [3, 4]}
    assert options.url == "localhost:8001"
    assert options.host_port == ("localhost", 8001)
    assert range_values(0.5, 1.5, 0.5) == [0.5, 1.0, 1.5]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "-m", "m", "--concurrency-range", "4:2"])
    with pytest.raises(BenchError, match="--streaming needs -i grpc"):
        options_from_args(build_parser().parse_args(["bench", "-m", "m", "--streaming"]))


MODEL = inputs.ModelInfo(
    "m", "", [inputs.TensorSpec("X", "FP16", [-1, 2]), inputs.TensorSpec("S", "BYTES", [-1, 1]),
              inputs.TensorSpec("B", "BF16", [-1, 2])],
    [inputs.TensorSpec("Y", "FP32", [-1, 2])], max_batch_size=4,
)


def test_generated_inputs_all_datatypes() -> None:
    (sample,) = inputs.build_samples(MODEL, BenchOptions(model="m", batch_size=3, string_length=5))
    assert sample["X"].dtype.name == "float16" and sample["X"].shape == (3, 2)
    assert sample["B"].dtype.name == "bfloat16" and sample["B"].shape == (3, 2)
    assert sample["S"].shape == (3, 1) and len(sample["S"][0, 0]) == 5
    request = inputs.http_request(MODEL, sample, "h:1", binary=True)
    head, _, body = request.partition(b"\r\n\r\n")
    assert f"Content-Length: {len(body)}".encode() in head
    assert inputs.grpc_request(MODEL, sample)
    with pytest.raises(BenchError, match="BF16 inputs cannot be sent as JSON"):
        inputs.http_request(MODEL, sample, "h:1", binary=False)
    with pytest.raises(BenchError, match="max_batch_size 4"):
        inputs.build_samples(MODEL, BenchOptions(model="m", batch_size=5))


def test_input_data_file_errors(tmp_path: Path) -> None:
    data = tmp_path / "d.json"
    data.write_text(json.dumps({"data": [{"X": [1, 2, 3], "S": ["a"], "B": [1, 2]}]}))
    with pytest.raises(BenchError, match="has 3 value"):
        inputs.build_samples(MODEL, BenchOptions(model="m", input_data=str(data)))
    data.write_text(json.dumps({"data": [{"X": [1, 2], "S": ["a"]}]}))
    with pytest.raises(BenchError, match="no value for input 'B'"):
        inputs.build_samples(MODEL, BenchOptions(model="m", input_data=str(data)))
    data.write_text("{")
    with pytest.raises(BenchError, match="not valid JSON"):
        inputs.build_samples(MODEL, BenchOptions(model="m", input_data=str(data)))


class _Driver:
    def __init__(self) -> None:
        self.recorder = Recorder()
        self.results: list[str] = []

    def done(self, connection: object, latency: float, error: str) -> None:
        self.results.append(error)

    def lost(self, connection: object, exc: Exception | None) -> None:
        pass


@pytest.mark.parametrize("chunked", [False, True])
def test_http_response_framing(chunked: bool) -> None:
    def response(status: str, body: bytes) -> bytes:
        if chunked:
            framed = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:5], body[5:]) if part)
            return f"HTTP/1.1 {status}\r\ntransfer-encoding: chunked\r\n\r\n".encode() + framed + b"0\r\n\r\n"
        return f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body

    stream = response("200 OK", b'{"outputs": []}') + response("400 Bad Request", b'{"error":"bad input"}')
    stream += response("200 OK", b"x" * 20)
    driver = _Driver()
    connection = _HttpConnection(driver)  # type: ignore[arg-type]
    for i in range(0, len(stream), 7):  # arbitrary segment boundaries
        connection.data_received(stream[i : i + 7])
    assert driver.results == ["", 'HTTP/1.1 400 Bad Request: {"error":"bad input"}', ""]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_display() -> None:
    pipe = io.StringIO()
    progress = Progress(pipe)
    progress.update("ticking")
    progress.update("window 1 done", final=True)
    assert pipe.getvalue() == "window 1 done\n"
    tty = _Tty()
    progress = Progress(tty)
    progress.update("long status line")
    progress.update("short", final=True)
    assert tty.getvalue() == "\rlong status line" + "\r" + "short".ljust(16) + "\n"


def test_plot_checks_matplotlib_before_running(tmp_path: Path) -> None:
    """Without matplotlib, ``--plot`` fails at once, before the server is even reached (the URL
    below answers nothing: a check after connecting would report that instead)."""
    blocked = tmp_path / "no_matplotlib" / "matplotlib"
    blocked.mkdir(parents=True)  # a matplotlib that cannot be imported, first on the path
    (blocked / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "pyserve", "bench", "-m", "m", "-u", f"127.0.0.1:{port}", "--plot",
         str(tmp_path / "plot.png"), *FAST],
        capture_output=True, text=True, timeout=90, cwd=REPO_ROOT, env=env,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == "pyserve bench: error: --plot needs matplotlib: pip install matplotlib"
    assert not (tmp_path / "plot.png").exists()
    with pytest.raises(BenchError, match="folder .* does not exist"):
        check_plot(tmp_path / "nowhere" / "plot.png")


def test_plot(tmp_path: Path) -> None:
    result = LevelResult("concurrency", 1, 100.0, 100.0, 300, 0, 0, 900.0, {50: 800.0, 90: 1000.0, 95: 1100.0, 99: 1500.0},
                         True, 3)
    target = tmp_path / "plot.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(BenchError, match="--plot needs matplotlib"):
            write_plot(target, [result], BenchOptions(model="m"))
    else:
        write_plot(target, [result], BenchOptions(model="m"))
        assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
