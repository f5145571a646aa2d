"""NVIDIA's perf_analyzer (PyPI ``perf-analyzer`` 2.60) against a real pyserve, in its main modes.

perf_analyzer is fetched on first use into the user's cache (``benchmarks/_perf_analyzer.py``:
the wheel from PyPI, and Debian 13's C library from Debian's archive, since the binary needs
glibc 2.38). Where that cannot be had (no network to the registries, not x86-64 Linux, no
apt-get), the tests that need it skip, saying why. ``benchmarks/perf_analyzer_modes.py`` runs
every mode (and Triton 2.51 side by side with ``--triton``).
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
import perf_analyzer_modes as modes  # noqa: E402

CHECKED = (  # one of each kind: the ones Triton's users reach for first, and each fix of issue 30
    "http-sync", "http-shm-system", "http-batch-4", "http-request-rate", "http-sequence", "http-string",
    "grpc-sync", "grpc-async", "grpc-shm-system", "grpc-streaming", "grpc-streaming-decoupled",
    "grpc-ensemble",
)

GOOD = """
  Server:
    Inference count: 120
    Execution count: 120
    Successful request count: 120
    Avg request latency: 113 usec (overhead 38 usec + queue 55 usec + compute input 4 usec + compute infer 8 usec + compute output 8 usec)
  Client:
    Avg latency: 300 usec (standard deviation 20 usec)
"""


def test_judge_reads_perf_analyzer_breakdowns() -> None:
    """The check itself (no perf_analyzer needed): parts within the request pass, parts above
    it (what pyserve reported before issue 30) fail, and failures keep perf_analyzer's words."""
    ok = modes.judge(0, GOOD)
    assert ok.ok and "queue 55 + in 4 + infer 8 + out 8 + 38" in ok.note
    over = GOOD.replace("113 usec (overhead 38", "94 usec (overhead 0").replace("queue 55", "queue 90")
    assert not modes.judge(0, over).ok and "parts exceed" in modes.judge(0, over).note
    failed = modes.judge(99, "Thread [0] had error: parameter keys starting with 'triton_' are reserved\n")
    assert not failed.ok and "triton_" in failed.note
    assert not modes.judge(0, GOOD.replace("Successful request count: 120", "Successful request count: 0")).ok
    above_client = GOOD.replace("Avg latency: 300", "Avg latency: 100")
    assert "above client latency" in modes.judge(0, above_client).note


@pytest.fixture(scope="module")
def perf_analyzer() -> _perf_analyzer.PerfAnalyzer:
    try:
        return _perf_analyzer.ensure()
    except (RuntimeError, OSError) as error:
        pytest.skip(f"perf_analyzer cannot run here: {error}")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _pa_models.write_repository(tmp_path_factory.mktemp("pa") / "models")


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerThread]:
    from pyserve.testing import serve

    with serve(repository) as thread:
        yield thread


class _Ports:
    """What ``perf_analyzer_modes.arguments`` needs of a server."""

    def __init__(self, server: ServerThread) -> None:
        self.http_port = server.server.http_port
        self.grpc_port = server.server.grpc_port


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CHECKED)
def test_mode_completes_with_a_plausible_breakdown(
    perf_analyzer: _perf_analyzer.PerfAnalyzer, server: ServerThread, name: str
) -> None:
    (mode,) = [m for m in modes.MODES if m.name == name]
    result = perf_analyzer.run(modes.arguments(mode, _Ports(server), 30), timeout=150)  # type: ignore[arg-type]
    outcome = modes.judge(result.returncode, result.stdout, client_bound=mode.model != "decoupled")
    assert outcome.ok, f"{name}: {outcome.note}\n{result.stdout[-2000:]}"


def test_every_mode_has_a_model_of_the_repository() -> None:
    assert {m.model for m in modes.MODES} <= set(_pa_models.MODELS)
    assert len({m.name for m in modes.MODES}) == len(modes.MODES)
