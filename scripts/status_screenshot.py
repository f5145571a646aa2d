"""Write docs/status-page.md's picture of the status page: ``python scripts/status_screenshot.py [PNG]``.

Serves the bundled example repository plus one model that fails to load, sends a few seconds
of requests to two models, and takes a screenshot of ``/status`` in headless Chromium
(Playwright driving the system's ``chromium``, or ``PYSERVE_CHROMIUM``). Default output:
``docs/status-page.png``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from playwright.sync_api import sync_playwright

from pyserve.testing import serve, write_model

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
BROKEN_PY = """
class TritonPythonModel:
    def initialize(self, args):
        raise FileNotFoundError("weights.bin: no such file in the model directory")

    def execute(self, requests):
        return []
"""


def _load(url: str, model: str, inputs: list[tuple[str, list[int]]], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with httpclient.InferenceServerClient(url) as client:
        while time.monotonic() < deadline:
            tensors = []
            for name, shape in inputs:
                tensor = httpclient.InferInput(name, shape, "FP32")
                tensor.set_data_from_numpy(np.ones(shape, dtype=np.float32))
                tensors.append(tensor)
            client.infer(model, tensors)


def main(out: Path) -> None:
    chromium = os.environ.get("PYSERVE_CHROMIUM") or shutil.which("chromium") or "chromium"
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        shutil.copytree(ROOT / "examples" / "model_repository", repo)
        write_model(repo, "reranker", """
            backend: "python"
            max_batch_size: 0
            input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
            output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """, {"1/model.py": BROKEN_PY})
        with serve(repo) as server, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=FLAGS, headless=True)
            page = browser.new_page(viewport={"width": 1500, "height": 520})
            page.goto(f"http://{server.url}/status")
            loads = [
                threading.Thread(target=_load, args=(server.url, "identity_fp32", [("INPUT0", [1, 16])], 15.0)),
                threading.Thread(target=_load, args=(server.url, "add_sub", [("INPUT0", [1, 4]), ("INPUT1", [1, 4])],
                                                     15.0)),
            ]
            for load in loads:
                load.start()
            time.sleep(11.0)  # a few refreshes under load, the window full
            page.screenshot(path=str(out), full_page=True)
            browser.close()
            for load in loads:
                load.join()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "status-page.png")
