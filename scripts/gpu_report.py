"""Turn the JUnit XML of ``tests/gpu/test_gpu.py`` into the markdown block docs/gpu.md keeps.

Usage: ``python scripts/gpu_report.py JUNIT_XML`` (``scripts/gpu_check.sh`` runs it). Prints a
heading with today's date and the commit, the machine (``nvidia-smi``) and package versions,
then one row per check: pass / FAIL / skip, and the figures or the reason.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECKS = {
    "test_repository_serves_on_cpu": "the checks' models serve on CPU (plumbing)",
    "test_onnxruntime_kind_gpu_matches_cpu": "KIND_GPU onnxruntime on GPU 0 = CPU run",
    "test_pytorch_kind_gpu_matches_cpu": "KIND_GPU PyTorch on cuda:0 = CPU run",
    "test_python_model_returns_device_tensor_without_copy": "model.py returns a cupy tensor by DLPack, same pointer",
    "test_python_model_receives_gpu_input": "model.py gets a CUDA shm input on the GPU (FORCE_CPU_ONLY_INPUT_TENSORS no)",
    "test_ensemble_python_steps_share_device_tensor": "ensemble: Python → Python, same device pointer",
    "test_ensemble_pytorch_to_python_stays_on_device": "ensemble: PyTorch GPU → Python, input on the GPU",
    "test_cuda_shared_memory": "CUDA shared memory (tritonclient cuda_shared_memory), input and output",
    "test_gpu_metrics": "nv_gpu_utilization / memory_total / memory_used / power_usage, label gpu_uuid",
    "test_model_metrics_carry_gpu_uuid": "per-model metrics of a GPU model carry gpu_uuid (as Triton)",
    "test_default_layout_serves_gpu_models": "default process layout serves KIND_GPU models",
    "test_gpu_instance_uses_cuda_provider": "onnxruntime plugin test: KIND_GPU instance (in-process server)",
    "test_gpu_instance_runs_on_cuda": "pytorch plugin test: KIND_GPU instance (in-process server)",
    "test_gpu_instance_forward_runs_with_its_device_current": "pytorch plugin test: GPU 1 instance's forward on cuda:1 (two GPUs)",
    "test_throughput_against_triton": "throughput against Triton 2.51 on the same GPU (same-run ratio)",
}
"""Test function → what the row says it checks."""

PACKAGES = ("pyserve", "torch", "cupy-cuda13x", "cupy-cuda12x", "onnxruntime", "onnxruntime-gpu", "tritonclient",
            "cuda-bindings", "nvidia-ml-py", "numpy")


def _cell(text: str, limit: int = 300) -> str:
    """One table cell: a single line, pipes escaped, cut at ``limit`` characters."""
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _machine() -> str:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        gpus = "; ".join(line.strip() for line in result.stdout.splitlines() if line.strip())
    except (OSError, subprocess.TimeoutExpired):
        gpus = ""
    return gpus or "no NVIDIA GPU (nvidia-smi missing or lists none)"


def _versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def _commit() -> str:
    try:
        result = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return "unknown"
    return result.stdout.strip() or "unknown"


def rows(junit: Path) -> list[tuple[str, str, str]]:
    """``(check, result, details)`` for every test case of the report, in run order."""
    found = []
    for case in ElementTree.parse(junit).iter("testcase"):
        name = case.get("name", "")
        function, _, param = name.partition("[")
        label = CHECKS.get(function, function) + (f" [{param}" if param else "")
        figures = [f"{p.get('name')}: {p.get('value')}" for p in case.iter("property")]
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            result, details = "FAIL", (failure.get("message") or failure.text or "").strip().splitlines()[0:1]
        elif skipped is not None:
            result, details = "skip", [(skipped.get("message") or "").removeprefix("Skipped: ")]
        else:
            result, details = "pass", []
        found.append((label, result, _cell("; ".join([*details, *figures]))))
    return found


def render(junit: Path, today: datetime.date | None = None) -> str:
    """The markdown block for ``junit``."""
    today = today or datetime.date.today()
    table = rows(junit)
    counts = {r: sum(1 for _, result, _ in table if result == r) for r in ("pass", "FAIL", "skip")}
    lines = [
        f"### GPU check, {today.isoformat()} (commit {_commit()})",
        "",
        f"Machine: {_cell(_machine())}. Python {sys.version.split()[0]}; {_versions()}.",
        f"Result: {counts['pass']} pass, {counts['FAIL']} fail, {counts['skip']} skipped.",
        "",
        "| Check | Result | Details |",
        "| --- | --- | --- |",
        *(f"| {_cell(label)} | {result} | {details} |" for label, result, details in table),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: gpu_report.py JUNIT_XML", file=sys.stderr)
        return 2
    junit = Path(argv[0])
    if not junit.is_file():
        print(f"gpu_report.py: {junit} does not exist (did pytest run?)", file=sys.stderr)
        return 2
    sys.stdout.write(render(junit))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
