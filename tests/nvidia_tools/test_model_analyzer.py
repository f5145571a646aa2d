"""NVIDIA model-analyzer 1.58 in remote mode against a real pyserve in explicit model control:
a brute search over gRPC (its default protocol, which needs ``triton_enable_empty_final_response``
accepted on unary calls) and a quick search over HTTP, on a small search space.

model-analyzer is large (optuna, matplotlib, numba...), so the test does not install it: it runs
when ``benchmarks/model_analyzer_remote.py`` has installed it once (into
``~/.cache/pyserve-bench/model-analyzer-venv``) and skips otherwise, as it does when perf_analyzer
cannot run here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyserve.server.core import ServerThread

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _pa_models  # noqa: E402
import _perf_analyzer  # noqa: E402
import model_analyzer_remote as remote  # noqa: E402


@pytest.fixture(scope="module")
def tools() -> tuple[Path, _perf_analyzer.PerfAnalyzer]:
    tool = remote.default_venv() / "bin" / "model-analyzer"
    if not tool.is_file():
        pytest.skip("model-analyzer is not installed: run benchmarks/model_analyzer_remote.py once to install it")
    try:
        return tool, _perf_analyzer.ensure()
    except (RuntimeError, OSError) as error:
        pytest.skip(f"perf_analyzer cannot run here: {error}")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _pa_models.write_repository(tmp_path_factory.mktemp("ma") / "models")


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerThread]:
    from pyserve.testing import serve

    with serve(repository, model_control_mode="explicit", allow_metrics=True) as thread:
        yield thread


@pytest.mark.timeout(600)
@pytest.mark.parametrize("search, protocol", [("brute", "grpc"), ("quick", "http")])
def test_remote_search_completes(
    tools: tuple[Path, _perf_analyzer.PerfAnalyzer], server: ServerThread, repository: Path, tmp_path: Path,
    search: str, protocol: str,
) -> None:
    tool, perf_analyzer = tools
    core = server.server
    assert core.http_port and core.grpc_port and core.metrics_port
    endpoint = remote.Endpoint("pyserve", core.http_port, core.grpc_port, core.metrics_port)
    ok, note = remote.run_one(tool, endpoint, search, protocol, tmp_path, repository,
                              remote.wrapper(perf_analyzer, tmp_path), timeout=540,
                              space=remote.Space(concurrency=1, instances=1, batch=2))
    assert ok, note
    variants, measurements = remote.measured_variants(tmp_path / f"pyserve-{search}-{protocol}" / "checkpoints")
    assert variants >= 2 and measurements >= variants  # the default config and at least one variant
