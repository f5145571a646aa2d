"""The status page over HTTP: its routes, its JSON, restrictions, frontend processes, load.

(What a browser makes of the page is ``test_status_page_browser.py``.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import ECHO_MODEL_PY, python_echo_config, write_model

from pyserve.frontends.restricted import Restriction
from pyserve.frontends.status.data import StatsHistory
from pyserve.metrics.latency import (
    LATENCY_BUCKETS,
    bucket_bounds_ns,
    latency_bucket,
    quantile_ns,
)
from pyserve.server.core import ServerThread
from pyserve.testing import serve

pytestmark = pytest.mark.timeout(180)

BROKEN_PY = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("deliberately broken: <b>no weights</b> & more")

    def execute(self, requests):
        return []
"""

ECHO_BATCHED = python_echo_config("echo", """
dynamic_batching { preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 500 }
instance_group [ { count: 2 kind: KIND_CPU } ]
""")


def _repository(root: Path) -> Path:
    repo = root / "repo"
    write_model(repo, "echo", ECHO_BATCHED, {"1/model.py": ECHO_MODEL_PY})
    write_model(repo, "broken", python_echo_config("broken"), {"1/model.py": BROKEN_PY})
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with serve(_repository(tmp_path_factory.mktemp("status"))) as thread:
        yield thread


@contextlib.contextmanager
def _client(server: ServerThread, **headers: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.url}", headers=headers, timeout=30) as client:
        yield client


def _infer(server: ServerThread, model: str, count: int) -> None:
    with httpclient.InferenceServerClient(server.url) as client:
        for i in range(count):
            tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), i, dtype=np.float32))
            client.infer(model, [tensor])


def _models(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in data["models"]}


def test_browsers_get_the_page_at_the_root_and_other_clients_what_they_got_before(server: ServerThread) -> None:
    with _client(server) as http:
        page = http.get("/", headers={"accept": "text/html,application/xhtml+xml;q=0.9,*/*;q=0.8"})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="status/status.js">' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-content-type-options"] == "nosniff"
        for answer in (http.get("/"), http.get("/", headers={"accept": "application/json"}),
                       http.post("/", headers={"accept": "text/html"})):
            assert answer.status_code == 404 and answer.json() == {"error": "Not Found"}
        assert http.get("/status").text == page.text
        script = http.get("/status/status.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert "textContent" in script.text and "innerHTML" not in script.text  # names are never HTML
        assert http.get("/status/status.css").headers["content-type"].startswith("text/css")
        assert http.get("/status/nothing").status_code == 404
        data = http.get("/status/json")
        assert data.headers["cache-control"] == "no-store"


def test_the_json_shows_every_model_its_state_reason_settings_and_numbers(server: ServerThread) -> None:
    with _client(server) as http:
        first = _models(http.get("/status/json").json())
        assert first["broken"]["state"] == "UNAVAILABLE"
        assert "deliberately broken: <b>no weights</b> & more" in first["broken"]["reason"]
        assert "stats" not in first["broken"]
        echo = first["echo"]
        assert echo["state"] == "READY" and echo["version"] == "1" and echo["backend"] == "python"
        assert echo["instance_groups"] == [{"name": "echo_0", "kind": "CPU", "count": 2, "gpus": []}]
        assert echo["instances"] == 2
        assert echo["batching"] == {"max_batch_size": 8, "scheduler": "dynamic", "preferred_batch_size": [2, 4],
                                    "max_queue_delay_us": 500, "decoupled": False}
        before = echo["stats"]["success"]
        time.sleep(1.0)  # two readings a second apart (the recent numbers compare them)
        _infer(server, "echo", 25)
        data = http.get("/status/json").json()
        stats = _models(data)["echo"]["stats"]
        assert stats["success"] == before + 25 and stats["failure"] == 0
        recent = stats["recent"]
        assert recent["window_s"] > 0 and recent["requests_per_s"] > 0
        assert 0 < recent["p50_ms"] <= recent["p90_ms"] <= recent["p99_ms"]
        assert recent["queue_ms"] is not None and recent["queue_ms"] >= 0
        assert data["server"]["name"] == "pyserve" and data["server"]["ready"] is False  # 'broken' failed
        assert data["control"] == {"mode": "none", "enabled": False} and data["restricted"] == {}
        with httpx.Client(base_url=f"http://{server.url}") as other:  # the statistics extension agrees
            triton = other.get("/v2/models/echo/stats").json()["model_stats"][0]
        assert triton["inference_stats"]["success"]["count"] == stats["success"]


def test_the_page_can_be_turned_off(tmp_path: Path) -> None:
    with serve(_repository(tmp_path), status_page=False) as off, _client(off) as http:
        for path in ("/status", "/status/json", "/status/status.js"):
            assert http.get(path).status_code == 404
        assert http.get("/", headers={"accept": "text/html"}).json() == {"error": "Not Found"}


def test_the_json_obeys_the_restrictions_of_the_apis_it_shows(tmp_path: Path) -> None:
    rules = {"statistics": Restriction("stats-key", "s"), "model-repository": Restriction("repo-key", "r"),
             "model-config": Restriction("config-key", "c")}
    with serve(_repository(tmp_path), http_restricted_api=rules, model_control_mode="explicit",
               load_models=["*"]) as restricted:
        with _client(restricted) as http:
            assert http.get("/status").status_code == 200  # the page itself holds no data
            data = http.get("/status/json").json()
            assert data["models"] is None and data["control"]["enabled"] is False
            assert data["restricted"]["model-repository"] == "This API is restricted, expecting header 'repo-key'"
            assert set(data["restricted"]) == {"statistics", "model-repository", "model-config"}
        with _client(restricted, **{"repo-key": "r"}) as http:
            data = http.get("/status/json").json()
            echo = _models(data)["echo"]
            assert echo["state"] == "READY" and "stats" not in echo and "batching" not in echo
            assert data["control"] == {"mode": "explicit", "enabled": True}  # the load/unload buttons
            assert set(data["restricted"]) == {"statistics", "model-config"}
        with _client(restricted, **{"repo-key": "r", "stats-key": "s", "config-key": "wrong"}) as http:
            echo = _models(http.get("/status/json").json())["echo"]
            assert "stats" in echo and "batching" not in echo
            # the buttons' own API stays behind its header
            assert http.post("/v2/repository/models/echo/unload", headers={"repo-key": ""}).status_code == 403


def test_with_frontend_processes_every_connection_sees_the_counts_of_every_process(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "echo", python_echo_config("echo"), {"1/model.py": ECHO_MODEL_PY})
    with serve(repo, frontend_processes=1, replicate_models="auto") as server:
        handoff = server.server._handoff
        assert handoff is not None
        deadline = time.monotonic() + 60
        while not any(handoff.replicas.values()):  # the frontend answers echo itself
            assert time.monotonic() < deadline, "the replica did not start"
            time.sleep(0.05)
        clients = [httpclient.InferenceServerClient(server.url) for _ in range(2)]  # one per process
        try:
            for client in clients:
                for i in range(10):
                    tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
                    tensor.set_data_from_numpy(np.full((1, 2), i, dtype=np.float32))
                    client.infer("echo", [tensor])
        finally:
            for client in clients:
                client.close()
        pages = [httpx.Client(base_url=f"http://{server.url}", timeout=30) for _ in range(2)]
        try:
            answers = [_models(page.get("/status/json").json())["echo"] for page in pages]
            assert all(page.get("/status").status_code == 200 for page in pages)
        finally:
            for page in pages:
                page.close()
        assert [a["stats"]["success"] for a in answers] == [20, 20]  # the replica's counts included
        assert handoff.absorbed > 0  # ... pulled from the frontend process


def test_concurrent_page_loads_under_inference_load_all_succeed(server: ServerThread) -> None:
    failures: list[str] = []

    def pages() -> None:
        with _client(server) as http:
            for _ in range(20):
                for path in ("/status", "/status/json", "/status/status.js"):
                    answer = http.get(path)
                    if answer.status_code != 200:
                        failures.append(f"{path}: {answer.status_code}")

    def load() -> None:
        try:
            _infer(server, "echo", 60)
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            failures.append(f"infer: {exc}")

    threads = [threading.Thread(target=pages) for _ in range(4)] + [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures
    with _client(server) as http:
        assert http.get("/v2/health/live").status_code == 200
        assert _models(http.get("/status/json").json())["echo"]["state"] == "READY"


def test_the_latency_histogram_and_its_quantiles() -> None:
    assert latency_bucket(0) == latency_bucket(1023) == 0
    assert latency_bucket(-5) == 0 and latency_bucket(1 << 60) == LATENCY_BUCKETS - 1
    previous = 0
    for duration in (1024, 1500, 2047, 2048, 10_000, 1_000_000, 123_456_789, (1 << 38) - 1):
        index = latency_bucket(duration)
        lower, upper = bucket_bounds_ns(index)
        assert lower <= duration < upper and upper <= lower * 1.25 + 1 and index >= previous
        previous = index
    counts = [0] * LATENCY_BUCKETS
    for duration_ms in range(1, 101):  # 1 .. 100 ms, one request each
        counts[latency_bucket(duration_ms * 1_000_000)] += 1
    p50, p99 = quantile_ns(counts, 0.5), quantile_ns(counts, 0.99)
    assert p50 is not None and p99 is not None
    assert 50e6 * 0.75 <= p50 <= 50e6 * 1.25 and 99e6 * 0.75 <= p99 <= 99e6 * 1.25
    assert quantile_ns([0] * LATENCY_BUCKETS, 0.5) is None


def test_the_history_compares_with_a_reading_about_a_window_old() -> None:
    history = StatsHistory(window_s=10.0)
    assert history.recent(100.0, {}) == (0.0, {})  # nothing to compare with yet
    seconds, _ = history.recent(100.2, {})
    assert seconds == 0.0  # too soon to say anything
    for now in range(101, 131):
        seconds, _ = history.recent(float(now), {})
    assert seconds == pytest.approx(10.0)  # the newest reading at least 10 s old
