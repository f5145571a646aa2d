"""Weights shared across processes: a 500 MB model served by the default command against one process.

For each kind of model (a Triton ``model.py`` holding its weights as a numpy array read from a
file in its folder, and an ONNX model whose initializer holds them), the script starts
``pyserve run`` twice on a repository with just that model: as the README starts it (one process
per CPU, the frontends forked after the models loaded) and with ``--frontend-processes 0`` (one
process). It sends requests over fresh connections so that every process answers some, then
reads the PSS of the whole process tree (shared pages counted once) and prints the ratio,
target <= 1.3x. Where Triton is found (or installed with ``--with-triton``), the Python model's startup until READY is
timed against Triton's (target: no slower).

Run: ``.venv/bin/python benchmarks/memory.py [--megabytes 500] [--with-triton]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _triton  # noqa: E402  sibling helper modules
from serving import Server, start_pyserve, start_triton, tree_memory  # noqa: E402

ELEMENTS = 16

PYTHON_MODEL = '''\
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        folder = os.path.dirname(os.path.abspath(__file__))
        self.weights = np.load(os.path.join(folder, "..", "weights.npy"))

    def execute(self, requests):
        responses = []
        for request in requests:
            index = pb_utils.get_input_tensor_by_name(request, "INDEX").as_numpy()
            picked = self.weights[index % self.weights.shape[0]]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", picked)]))
        return responses
'''


def _config(name: str, backend: str) -> str:
    return (f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: 0\n'
            f'input [ {{ name: "INDEX" data_type: TYPE_INT64 dims: [ {ELEMENTS} ] }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {ELEMENTS} ] }} ]\n'
            'instance_group [ { kind: KIND_CPU count: 1 } ]\n')


def write_python_model(root: Path, megabytes: int) -> Path:
    folder = root / "weights_py"
    (folder / "1").mkdir(parents=True)
    weights = np.random.default_rng(0).standard_normal(megabytes * 2**20 // 4, dtype=np.float32)
    np.save(folder / "weights.npy", weights)
    (folder / "1" / "model.py").write_text(PYTHON_MODEL)
    (folder / "config.pbtxt").write_text(_config("weights_py", "python"))
    return root


def write_onnx_model(root: Path, megabytes: int) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder = root / "weights_onnx"
    (folder / "1").mkdir(parents=True)
    weights = np.random.default_rng(0).standard_normal(megabytes * 2**20 // 4, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["W", "INDEX"], ["OUTPUT0"], axis=0)], "gather",
        [helper.make_tensor_value_info("INDEX", TensorProto.INT64, [ELEMENTS])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [ELEMENTS])],
        [numpy_helper.from_array(weights, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(folder / "1" / "model.onnx"))  # weights inside: read into memory at load
    (folder / "config.pbtxt").write_text(_config("weights_onnx", "onnxruntime"))
    return root


def _infer(port: int, model: str, count: int) -> None:
    """``count`` requests, each on a new connection, so that every process of the layout answers."""
    body = json.dumps({"inputs": [{"name": "INDEX", "datatype": "INT64", "shape": [ELEMENTS],
                                   "data": list(range(ELEMENTS))}]}).encode()
    for _ in range(count):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=body,
                                         headers={"Content-Type": "application/json", "Connection": "close"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200, reply.status


def measure(server: Server, model: str) -> dict[str, float]:
    assert server.http_port is not None
    _infer(server.http_port, model, 40)
    time.sleep(1.0)
    memory = tree_memory(server.process.pid)
    memory["startup_s"] = server.started_s
    return memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=500, help="size of the weights (500)")
    parser.add_argument("--rounds", type=int, default=2, help="starts per layout; medians shown (2)")
    parser.add_argument("--kinds", default="python,onnx", help="models to measure (python,onnx)")
    parser.add_argument("--with-triton", action="store_true",
                        help="install nvidia-pytriton into --triton-venv if no Triton is found")
    parser.add_argument("--no-triton", action="store_true", help="skip Triton's startup")
    parser.add_argument("--triton-venv", type=Path, default=_triton.default_venv(),
                        help="venv holding nvidia-pytriton")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pyserve-memory-") as scratch:
        work = Path(scratch)
        install, why = _triton.install_for(args, work)
        if why:
            print(why)
        for kind in args.kinds.split(","):
            root = work / f"repo-{kind}"
            model = f"weights_{'py' if kind == 'python' else kind}"
            (write_python_model if kind == "python" else write_onnx_model)(root, args.megabytes)
            layouts = {"default": [], "one process": ["--frontend-processes", "0"]}
            results: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
            if install is not None and kind == "python":
                results["triton"] = []
            for round_number in range(args.rounds):
                for name in results:
                    if name == "triton":
                        assert install is not None
                        server = start_triton(install, root, work, args.start_timeout, [model])
                    else:
                        server = start_pyserve(root, work, args.start_timeout, [model], name=f"pyserve-{kind}",
                                               extra_args=False, flags=layouts[name])
                    try:
                        results[name].append(measure(server, model))
                    finally:
                        server.stop()
                    m = results[name][-1]
                    print(f"round {round_number + 1}: {kind} {name}: PSS {m['pss']:.0f} MiB, RSS {m['rss']:.0f} MiB, "
                          f"{m['processes']:.0f} processes, READY in {m['startup_s']:.2f} s", flush=True)
            med = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                   for name, runs in results.items()}
            ratio = med["default"]["pss"] / med["one process"]["pss"]
            rows.append(f"| {kind} | {args.megabytes} MB | {med['one process']['pss']:.0f} | {med['default']['pss']:.0f} "
                        f"({med['default']['processes']:.0f} processes) | {ratio:.2f}x | "
                        f"{'met' if ratio <= 1.3 else '**MISSED**'} | {med['one process']['startup_s']:.2f} / "
                        f"{med['default']['startup_s']:.2f}"
                        + (f" / Triton {med['triton']['startup_s']:.2f}" if "triton" in med else "") + " |")
    print("\n| model | weights | PSS MiB, one process | PSS MiB, default | ratio | target <= 1.3x | "
          "READY s (one / default" + (" / Triton" if install is not None else "") + ") |")
    print("|---|---:|---:|---:|---:|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
