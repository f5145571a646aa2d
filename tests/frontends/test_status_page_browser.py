"""The status page in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

Skipped when Chromium or the ``playwright`` package is missing (``make test`` installs both
where it can: Playwright from PyPI, Chromium with apt-get). ``PYSERVE_CHROMIUM`` names
another Chromium binary.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from suite_support import EXAMPLE_REPOSITORY, identity_config, write_model

from pyserve.frontends.restricted import Restriction
from pyserve.server.core import ServerThread
from pyserve.testing import serve

pytestmark = pytest.mark.timeout(240)

CHROMIUM = os.environ.get("PYSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") or ""
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
HOSTILE = "<img src=x onerror=window.__pwned=1>"
"""A model name that is HTML: the page must show it as text."""
WAIT_MS = 60_000

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if not CHROMIUM or not os.access(CHROMIUM, os.X_OK):
    pytest.skip("no Chromium binary (apt-get install chromium)", allow_module_level=True)

BROKEN_PY = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("deliberately broken: the weights file is missing")

    def execute(self, requests):
        return []
"""


def repository(root: Path) -> Path:
    """The bundled example repository, plus a model that fails to load and one whose name is HTML."""
    repo = root / "repo"
    shutil.copytree(EXAMPLE_REPOSITORY, repo)
    write_model(repo, "broken", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
    """, {"1/model.py": BROKEN_PY})
    write_model(repo, HOSTILE, identity_config(HOSTILE, "FP32"))
    return repo


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    with serve(repository(tmp_path_factory.mktemp("page"))) as thread:
        yield thread


def _row(page: Any, model: str) -> Any:
    return page.locator("#models tbody tr").filter(has=page.locator("td.name", has_text=model)).first


def _cell(page: Any, model: str, column: str) -> str:
    return str(page.eval_on_selector_all(
        "#models tbody tr", "(rows, [model, column]) => { const row = rows.find(r => r.dataset.model === model);"
        " return row ? row.querySelector('td.' + column).textContent : null; }", [model, column]))


def _load(server: ServerThread, model: str, stop: threading.Event, limit: int = 3000) -> None:
    """Bounded load on ``model`` (FP32 [1, 16] identity) until ``stop`` or ``limit`` requests."""
    with httpclient.InferenceServerClient(server.url) as client:
        for _ in range(limit):
            if stop.is_set():
                return
            tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.float32))
            client.infer(model, [tensor])


def test_the_page_shows_the_repository_a_failed_models_reason_and_numbers_that_move(
    browser: Any, server: ServerThread, tmp_path: Path,
) -> None:
    page = browser.new_page(viewport={"width": 1500, "height": 700})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"http://{server.url}/", wait_until="load")  # a browser's Accept header: the page
    page.wait_for_function("() => document.querySelectorAll('#models tbody tr').length >= 9", timeout=WAIT_MS)
    for model in sorted(p.name for p in EXAMPLE_REPOSITORY.iterdir() if (p / "config.pbtxt").is_file()):
        assert _cell(page, model, "state") == "READY", model
    assert _cell(page, "identity_fp32", "instances") == "2 × CPU (2 running)"
    assert "dynamic" in _cell(page, "identity_fp32", "batching")
    assert _cell(page, "broken", "state").startswith("UNAVAILABLE")
    reason = _row(page, "broken").locator("details.reason summary")
    assert "deliberately broken: the weights file is missing" in reason.text_content()
    # the name that is HTML is shown as text, and nothing of it ran
    assert _cell(page, HOSTILE, "name") == HOSTILE
    assert page.locator("#models img").count() == 0
    assert page.evaluate("window.__pwned") is None

    before = _cell(page, "identity_fp32", "totals")
    stop = threading.Event()
    workers = [threading.Thread(target=_load, args=(server, "identity_fp32", stop)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:  # the page refreshes itself: the rate and the latencies appear, the count grows
        page.wait_for_function(
            """() => { const row = [...document.querySelectorAll('#models tbody tr')]
                         .find(r => r.dataset.model === 'identity_fp32');
                       const rate = parseFloat(row.querySelector('td.rate').textContent);
                       return rate > 0 && row.querySelector('td.p99').textContent.includes('s'); }""",
            timeout=WAIT_MS)
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert _cell(page, "identity_fp32", "totals") != before
    assert _cell(page, "identity_fp32", "p50") != "—"
    page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
    assert (tmp_path / "status.png").stat().st_size > 10_000
    assert not errors


def test_a_hostile_filter_in_the_address_is_shown_as_text(browser: Any, server: ServerThread) -> None:
    page = browser.new_page()
    page.goto(f"http://{server.url}/status?model=%3Cscript%3Ewindow.__pwned%3D1%3C%2Fscript%3E")
    page.wait_for_function("() => document.getElementById('empty').textContent.includes('No model matches')",
                           timeout=WAIT_MS)
    assert page.locator("#filter").input_value() == "<script>window.__pwned=1</script>"
    assert "<script>window.__pwned=1</script>" in page.locator("#empty").text_content()
    assert page.locator("main script").count() == 0 and page.evaluate("window.__pwned") is None
    page.fill("#filter", "identity")  # the filter narrows the table as one types
    page.wait_for_function("() => document.querySelectorAll('#models tbody tr').length === 2", timeout=WAIT_MS)


def test_load_and_unload_buttons_only_where_the_repository_api_is_allowed(browser: Any, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "one", identity_config("one", "FP32"))
    write_model(repo, "two", identity_config("two", "FP32"))
    rules = {"model-repository": Restriction("admin-key", "secret")}
    with serve(repo, model_control_mode="explicit", load_models=["one"], http_restricted_api=rules) as server:
        plain = browser.new_page()
        plain.goto(f"http://{server.url}/status")
        plain.wait_for_function("() => !document.getElementById('restricted').hidden", timeout=WAIT_MS)
        assert "model-repository" in plain.locator("#restricted").text_content()
        assert plain.locator("button").count() == 0
        context = browser.new_context(extra_http_headers={"admin-key": "secret"})
        try:
            admin = context.new_page()
            admin.goto(f"http://{server.url}/status")
            admin.wait_for_function("() => document.querySelectorAll('#models tbody tr').length === 2", timeout=WAIT_MS)
            assert _cell(admin, "one", "state") == "READY" and _cell(admin, "two", "state") == "not loaded"
            _row(admin, "two").locator("button.load").click()
            admin.wait_for_function(
                "() => [...document.querySelectorAll('#models tbody tr')].some(r => r.dataset.model === 'two'"
                " && r.querySelector('td.state').textContent === 'READY')", timeout=WAIT_MS)
            _row(admin, "one").locator("button.unload").click()
            admin.wait_for_function(
                "() => [...document.querySelectorAll('#models tbody tr')].some(r => r.dataset.model === 'one'"
                " && r.querySelector('button.load'))", timeout=WAIT_MS)
            assert "unloaded" in admin.locator("#message").text_content()
        finally:
            context.close()
    with serve(repo) as unrestricted:  # not in explicit mode: no buttons either
        page = browser.new_page()
        page.goto(f"http://{unrestricted.url}/status")
        page.wait_for_function("() => document.querySelectorAll('#models tbody tr').length === 2", timeout=WAIT_MS)
        assert page.locator("button").count() == 0
