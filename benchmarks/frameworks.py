"""Per-request server overhead of the framework backends (onnxruntime, pytorch, tensorflow).

overhead = (latency of a request through pyserve) − (latency of calling the framework directly)

The same small model (a 4 → 8 → 3 MLP, FP32) is served by each backend from one temporary
repository, by one ``pyserve run`` process; the client (tritonclient, this process) sends
requests one after another and the table shows medians:

* batch 1 over gRPC and over HTTP (binary tensor data): a model without dynamic batching;
* ``identity`` (the echo backend, no framework) is the baseline row: what the server and the
  client cost on their own;
* concurrency 16: 16 client threads, each sending batch-1 requests in a closed loop to a model
  with ``dynamic_batching``; the overhead column compares the median latency with one direct
  call on a batch of 16 (what the batcher can at best turn 16 requests into).

The latency through pyserve includes the client's own work. tritonclient (on the grpc C core)
spends several hundred microseconds per call on its side, so gRPC batch 1 is measured twice:
with tritonclient, and with ``_h2client.py``, a lean blocking gRPC client (HTTP/2 frames, HPACK,
a ``ModelInferRequest`` serialized and a ``ModelInferResponse`` parsed per call, status checked)
whose overhead column is the closer measure of what the server adds. It runs in a process of its
own (this one holds every framework and a grpc channel, whose threads would take CPU from a
client that spins while it waits), once per cell and twice per model:
blocking in ``recv`` (as most clients do) and polling its socket (``poll=True``: no wake-up of the
client on this virtual machine, whose cost is the client's, not the server's). The floor rows
measure both against a bare HTTP/2 echo. The target is < 300 µs at batch 1 over gRPC; the
verdict is printed for both lean clients. The script prints a markdown table and always exits 0.

The batch-1 cells that decide the verdict (the direct call and both lean clients, and the
floor) are measured in ``--rounds`` rounds (3), interleaved over the backends, so that a slow
spell of this shared machine falls on every backend alike; the table shows the median of the
rounds' medians, and each verdict line lists the overhead of every round.

The batch-1 models carry no scheduling setting: a framework model then executes on the server's
event loop while one client alone sends requests (``pyserve.runtime.scheduling.adaptive``), which the
lean clients are, and on its instance thread otherwise. ``--inline`` sets
``pyserve_inline_execute: "true"`` on them (every execute on the loop); ``--threads-only`` sets
``"false"`` (every execute on an instance thread, the hand-off the adaptive choice avoids).

``--threads N`` gives each framework N intra-op threads, the same in the served models (Triton's
parameters ``intra_op_thread_count``, ``INTRA_OP_THREAD_COUNT``, ``TF_NUM_INTRA_THREADS``) and in
the direct calls; without it both use the frameworks' defaults (a pool as wide as the machine).

Run: ``.venv/bin/python benchmarks/frameworks.py [--requests 1000] [--backends onnxruntime,pytorch]``
(needs ``make install-test``: the three framework plugins, torch, onnx, tensorflow-cpu). As in the
other scripts, ``PYSERVE_BENCH_PYSERVE_ARGS`` adds flags to ``pyserve run`` (e.g. ``--busy-poll-us 300``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from _h2client import LeanGrpcClient, median_us  # sibling benchmark modules
from batching import free_port, stop_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parent.parent
BUILD_MODELS = ROOT / "examples" / "mixed_repository" / "build_models.py"
TARGET_GRPC_US = 300.0
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 100 }\n"
BACKENDS = ("identity", "onnxruntime", "pytorch", "tensorflow")
"""``identity`` (echo, no framework) is the baseline: what the server and client cost alone."""
FILES = {"onnxruntime": "model.onnx", "pytorch": "model.pt", "tensorflow": "model.savedmodel"}
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "pytorch": "pytorch_libtorch", "tensorflow": "tensorflow_savedmodel"}
NAMES = {
    "identity": ("INPUT0", "OUTPUT0"),
    "onnxruntime": ("x", "y"),
    "pytorch": ("INPUT__0", "OUTPUT__0"),
    "tensorflow": ("x", "y"),
}
THREAD_PARAMETERS = {
    "onnxruntime": "intra_op_thread_count",
    "pytorch": "INTRA_OP_THREAD_COUNT",
    "tensorflow": "TF_NUM_INTRA_THREADS",
}
"""Triton's model parameter for each backend's intra-op thread count (``--threads``)."""


def _load_builders() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mixed_build_models", BUILD_MODELS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- models


def build_torch_mlp(path: Path, weights: dict[str, np.ndarray]) -> None:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(4, 8)
            self.second = torch.nn.Linear(8, 3)
            with torch.no_grad():
                self.first.weight.copy_(torch.from_numpy(weights["w1"].T.copy()))
                self.first.bias.copy_(torch.from_numpy(weights["b1"]))
                self.second.weight.copy_(torch.from_numpy(weights["w2"].T.copy()))
                self.second.bias.copy_(torch.from_numpy(weights["b2"]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.relu(self.first(x)))

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.trace(MLP().eval(), torch.zeros(2, 4)).save(str(path))


PLACEMENT = 'parameters {{ key: "pyserve_inline_execute" value {{ string_value: "{}" }} }}\n'


def write_repository(repo: Path, store: Path, backends: tuple[str, ...], placement: str = "",
                     threads: int | None = None) -> dict[str, Path]:
    """Two models per backend, ``<backend>`` and ``<backend>_batched``, linking to one model file
    in ``store``; returns backend → model file. ``placement``: the batch-1 models'
    ``pyserve_inline_execute`` ("true", "false"; "": not set); ``threads``: the frameworks'
    intra-op threads."""
    extra = PLACEMENT.format(placement) if placement else ""
    builders = _load_builders()
    files: dict[str, Path] = {}
    for backend in backends:
        if backend == "identity":
            for name, batching in (("identity", ""), ("identity_batched", BATCHING)):
                (repo / name / "1").mkdir(parents=True)
                (repo / name / "config.pbtxt").write_text(
                    'backend: "identity"\nmax_batch_size: 16\n'
                    'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
                    'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n' + (batching or extra)
                )
            continue
        source = store / backend / FILES[backend]
        if backend == "onnxruntime":
            builders.build_onnx(source)
        elif backend == "pytorch":
            build_torch_mlp(source, builders.mlp_weights())
        else:
            builders.build_savedmodel(source)
        files[backend] = source
        inp, out = NAMES[backend]
        pool = (f'parameters {{ key: "{THREAD_PARAMETERS[backend]}" value {{ string_value: "{threads}" }} }}\n'
                if threads else "")
        for name, batching in ((backend, ""), (f"{backend}_batched", BATCHING)):
            version = repo / name / "1"
            version.mkdir(parents=True)
            target = version / FILES[backend]
            target.symlink_to(source, target_is_directory=source.is_dir())
            (repo / name / "config.pbtxt").write_text(
                f'platform: "{PLATFORMS[backend]}"\nmax_batch_size: 16\n'
                f'input [ {{ name: "{inp}", data_type: TYPE_FP32, dims: [ 4 ] }} ]\n'
                f'output [ {{ name: "{out}", data_type: TYPE_FP32, dims: [ 3 ] }} ]\n'
                "instance_group [ { kind: KIND_CPU, count: 1 } ]\n" + (batching or extra) + pool
            )
    return files


def limit_threads(backends: tuple[str, ...], threads: int) -> None:
    """Give the direct calls' PyTorch and TensorFlow ``threads`` intra-op threads (process-wide,
    and for TensorFlow only before its runtime starts: call this before building the models)."""
    if "pytorch" in backends:
        import torch

        torch.set_num_threads(threads)
    if "tensorflow" in backends:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)


def direct_caller(backend: str, path: Path, threads: int | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """The framework called the way the backend calls it, on a host array (ONNX Runtime with
    ``threads`` intra-op threads; see ``limit_threads`` for the others)."""
    if backend == "identity":
        return lambda x: x
    if backend == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return lambda x: session.run(["y"], {"x": x})[0]
    if backend == "pytorch":
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(str(path)).eval()

        def call_torch(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return module(torch.from_dlpack(x)).numpy()

        return call_torch
    import tensorflow as tf

    function = tf.saved_model.load(str(path)).signatures["serving_default"]
    return lambda x: function(x=tf.convert_to_tensor(x))["y"].numpy()


# --------------------------------------------------------------------------- server and clients




@contextmanager
def pyserve(repo: Path, log_path: Path) -> Iterator[tuple[str, str]]:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [
        sys.executable, "-m", "pyserve", "run", "--model-repository", str(repo), "--host", "127.0.0.1",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
    ] + os.environ.get("PYSERVE_BENCH_PYSERVE_ARGS", "").split()  # e.g. --busy-poll-us 300, as the others
    log_file = log_path.open("w")
    # a file, not a pipe: a pipe nobody reads fills up and stalls the server's logging
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pyserve did not become ready:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    finally:
        stop_process(process)
        log_file.close()


def client_caller(protocol: str, url: str, model: str, inp: str, out: str) -> Callable[[np.ndarray], np.ndarray]:
    if protocol == "grpc":
        import tritonclient.grpc as client_module
    else:
        import tritonclient.http as client_module  # type: ignore[no-redef]
    client = client_module.InferenceServerClient(url)
    outputs = [client_module.InferRequestedOutput(out)]

    def call(x: np.ndarray) -> np.ndarray:
        tensor = client_module.InferInput(inp, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer(model, [tensor], outputs=outputs).as_numpy(out)

    return call


@contextmanager
def h2_floor_server() -> Iterator[str]:
    """``_echo.py h2-floor``: a bare HTTP/2 echo, the loopback + client floor of a gRPC call."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_echo.py"), "h2-floor", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the h2-floor echo server did not start") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(process)


def lean_median_us(url: str, model: str, inp: str, out: str, requests: int, poll: bool = False) -> float:
    """The lean client's median latency, measured in a process of its own (``_h2client.py``):
    this one holds every framework's runtime and a grpc channel, whose threads would compete
    with a client that spins while it waits."""
    command = [sys.executable, str(Path(__file__).resolve().parent / "_h2client.py"), "--address", url,
               "--model", model, "--input", inp, "--output", out, "--requests", str(requests)]
    done = subprocess.run(command + (["--poll"] if poll else []), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the lean client failed: {done.stderr.strip()[-2000:]}")
    return float(json.loads(done.stdout)["median_us"])


def concurrent_median_us(make_call: Callable[[], Callable[[np.ndarray], Any]], x: np.ndarray, requests: int,
                         concurrency: int) -> tuple[float, float]:
    """(median latency µs, throughput req/s) of ``concurrency`` closed-loop clients."""
    calls = [make_call() for _ in range(concurrency)]
    for call in calls:
        call(x)
    samples: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(concurrency + 1)

    def worker(call: Callable[[np.ndarray], Any]) -> None:
        mine = []
        barrier.wait()
        for _ in range(requests):
            start = time.perf_counter_ns()
            call(x)
            mine.append(time.perf_counter_ns() - start)
        with lock:
            samples.extend(mine)

    threads = [threading.Thread(target=worker, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    barrier.wait()
    begin = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - begin
    return statistics.median(samples) / 1000.0, len(samples) / elapsed


# --------------------------------------------------------------------------- main


def progress(message: str) -> None:
    print(f"[frameworks] {message}", file=sys.stderr, flush=True)


@dataclass
class Row:
    """One backend's medians (µs); the batch-1 direct and lean-client cells have one per round."""

    backend: str
    grpc_1: float
    http_1: float
    direct_16: float
    c16_latency: float
    c16_throughput: float
    direct_rounds: list[float] = field(default_factory=list)
    lean_rounds: list[float] = field(default_factory=list)
    poll_rounds: list[float] = field(default_factory=list)

    @property
    def direct_1(self) -> float:
        return statistics.median(self.direct_rounds)

    @property
    def lean_1(self) -> float:
        return statistics.median(self.lean_rounds)

    @property
    def poll_1(self) -> float:
        return statistics.median(self.poll_rounds)

    def overheads(self, rounds: list[float]) -> str:
        """The overhead of each round (that round's client median − that round's direct median)."""
        return " / ".join(f"{c - d:.0f}" for c, d in zip(rounds, self.direct_rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="timed requests per batch-1 cell")
    parser.add_argument("--concurrent-requests", type=int, default=150, help="requests per client at concurrency 16")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--inline", action="store_true",
                           help="every execute of the batch-1 models on the event loop (pyserve_inline_execute: true)")
    placement.add_argument("--threads-only", action="store_true",
                           help="every execute of the batch-1 models on an instance thread (pyserve_inline_execute: false)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the batch-1 direct and lean-client cells, interleaved over the backends; "
                             "the table shows the median of the rounds' medians")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of each framework, served and direct (default: the frameworks')")
    args = parser.parse_args()
    backends = tuple(b for b in args.backends.split(",") if b)
    x1 = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    x16 = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="pyserve-frameworks-") as tmp:
        repo = Path(tmp) / "repository"
        if args.threads:
            limit_threads(backends, args.threads)
        progress("building the models")
        files = write_repository(repo, Path(tmp) / "files", backends, threads=args.threads,
                                 placement="true" if args.inline else "false" if args.threads_only else "")
        directs = {b: direct_caller(b, files.get(b, Path()), args.threads) for b in backends}
        progress("measuring the floor: the lean client against a bare HTTP/2 echo")
        floor_rounds: list[float] = []
        floor_poll_rounds: list[float] = []
        with h2_floor_server() as floor_url:
            for _ in range(args.rounds):
                floor_rounds.append(lean_median_us(floor_url, "floor", *NAMES["identity"], args.requests))
                floor_poll_rounds.append(
                    lean_median_us(floor_url, "floor", *NAMES["identity"], args.requests, poll=True))
        floor_us, floor_poll_us = statistics.median(floor_rounds), statistics.median(floor_poll_rounds)
        progress("starting pyserve")
        with pyserve(repo, Path(tmp) / "pyserve.log") as (http_url, grpc_url):
            for backend in backends:
                inp, out = NAMES[backend]
                direct = directs[backend]
                grpc_call = client_caller("grpc", grpc_url, backend, inp, out)
                np.testing.assert_allclose(grpc_call(x1), direct(x1), rtol=1e-4, atol=1e-5)
                for poll in (False, True):  # the lean client's answers, before it is timed elsewhere
                    lean = LeanGrpcClient(grpc_url, backend, inp, out, poll=poll)
                    try:
                        np.testing.assert_allclose(lean.infer(x1), direct(x1), rtol=1e-4, atol=1e-5)
                    finally:
                        lean.close()
                progress(f"{backend}: concurrency {args.concurrency}")
                c16 = concurrent_median_us(
                    lambda backend=backend, inp=inp, out=out: client_caller(
                        "grpc", grpc_url, f"{backend}_batched", inp, out),
                    x1, args.concurrent_requests, args.concurrency,
                )
                progress(f"{backend}: batch 1 (tritonclient gRPC, HTTP) and direct batch 16")
                rows.append(Row(
                    backend,
                    grpc_1=median_us(grpc_call, x1, args.requests),
                    http_1=median_us(client_caller("http", http_url, backend, inp, out), x1, args.requests),
                    direct_16=median_us(direct, x16, args.requests),
                    c16_latency=c16[0],
                    c16_throughput=c16[1],
                ))
            for number in range(1, args.rounds + 1):  # interleaved: a slow spell of the machine hits every backend
                progress(f"round {number} of {args.rounds}: batch 1 direct and with the lean clients")
                for row in rows:
                    inp, out = NAMES[row.backend]
                    row.direct_rounds.append(median_us(directs[row.backend], x1, args.requests))
                    row.lean_rounds.append(lean_median_us(grpc_url, row.backend, inp, out, args.requests))
                    row.poll_rounds.append(lean_median_us(grpc_url, row.backend, inp, out, args.requests, poll=True))
    pools = f"{args.threads} intra-op thread(s) per framework" if args.threads else "the frameworks' default thread pools"
    print(f"\nmedian latencies in µs; {os.cpu_count()} CPU(s); {pools}; client and server on this machine\n")
    print("| backend | direct b1 | gRPC b1 lean client | gRPC overhead (lean) | gRPC b1 polling lean client "
          "| gRPC overhead (polling) | gRPC b1 tritonclient "
          "| gRPC overhead (tritonclient) | HTTP b1 | HTTP overhead "
          "| direct b16 | c16 gRPC latency | c16 overhead vs direct b16 | c16 req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.backend} | {r.direct_1:.0f} | {r.lean_1:.0f} | {r.lean_1 - r.direct_1:.0f} "
            f"| {r.poll_1:.0f} | {r.poll_1 - r.direct_1:.0f} "
            f"| {r.grpc_1:.0f} | {r.grpc_1 - r.direct_1:.0f} | {r.http_1:.0f} "
            f"| {r.http_1 - r.direct_1:.0f} | {r.direct_16:.0f} | {r.c16_latency:.0f} "
            f"| {r.c16_latency - r.direct_16:.0f} | {r.c16_throughput:.0f} |"
        )
    print(f"\nfloor: the lean client against a bare HTTP/2 echo (`_echo.py h2-floor`, no server library): "
          f"{floor_us:.0f} µs median blocking, {floor_poll_us:.0f} µs polling (median of {args.rounds} rounds); "
          "the loopback round trip, "
          "the echo's wake-up and the client's own work\n")
    for r in rows:
        if r.backend == "identity":
            continue
        for label, latency, floor in (("lean", r.lean_1, floor_us), ("polling lean", r.poll_1, floor_poll_us)):
            overhead = latency - r.direct_1
            verdict = "meets" if overhead < TARGET_GRPC_US else "misses"
            rounds = r.lean_rounds if label == "lean" else r.poll_rounds
            print(f"{r.backend}: gRPC batch-1 overhead {overhead:.0f} µs with the {label} client {verdict} the "
                  f"< {TARGET_GRPC_US:.0f} µs target (above that client's floor: {overhead - floor:.0f} µs; "
                  f"rounds: {r.overheads(rounds)} µs)")
        print(f"{r.backend}: with tritonclient {r.grpc_1 - r.direct_1:.0f} µs")


if __name__ == "__main__":
    main()
