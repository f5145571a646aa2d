"""``scripts/gpu_check.sh`` and ``scripts/gpu_report.py`` on a machine without a GPU: the CPU-only
run (repository written, ``pyserve run`` started, every model answering, GPU checks skipped,
the markdown report), the commands an offline install would run, and bad arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from suite_support import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gpu_report  # noqa: E402  the script folder's module


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, check=False)


@pytest.mark.timeout(900)
def test_cpu_only_run_serves_the_checks_models(tmp_path: Path) -> None:
    """torch is left out (--skip torch) to keep this run short; tests/gpu/test_gpu.py's plumbing
    check covers the TorchScript models wherever the script runs without --skip."""
    out = tmp_path / "out"
    result = _run("--cpu-only", "--python", sys.executable, "--skip", "torch", "--out", str(out), timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / "gpu-report.md").read_text()
    assert report in result.stdout
    table = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith(("| Check", "| ---"))]
    results = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1] for line in table}
    assert results.pop("the checks' models serve on CPU (plumbing)") == "pass", report
    assert set(results.values()) == {"skip"}, report
    assert "scripts/gpu_check.sh --cpu-only" in report  # the reason the GPU checks give
    assert any(label.startswith("onnxruntime plugin test") for label in results), report
    assert "Started HTTPService" in (out / "pyserve-server.log").read_text()


def test_dry_run_prints_the_offline_install(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    result = _run("--dry-run", "--wheels", str(wheels), "--skip", "torch", "--venv", str(tmp_path / "venv"),
                  "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    installs = [line for line in lines if " install " in line]
    assert len(installs) == 2 and all(f"--no-index --find-links {wheels}" in line for line in installs), lines
    assert "venv --clear --without-pip" in result.stdout
    assert "-e " + str(REPO_ROOT / "plugins/pyserve-backend-onnxruntime") in installs[1]
    assert "pyserve-backend-pytorch" not in result.stdout  # --skip torch: neither plugin nor its GPU test
    assert any("-m pytest tests/gpu/test_gpu.py" in line for line in lines), lines
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--skip", "tensorflow"], "--skip: unknown framework 'tensorflow'"),
    (["--timeout", "soon"], "--timeout must be a number of seconds"),
    (["--wheels"], "--wheels needs a directory"),
    (["--wheels", "/nonexistent-wheels"], "'/nonexistent-wheels' is not a directory"),
])
def test_bad_arguments(args: list[str], message: str) -> None:
    result = _run(*args)
    assert result.returncode == 2 and message in result.stderr, (result.returncode, result.stderr)


def test_report_rows(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
      <testcase classname="tests.test_gpu" name="test_pytorch_kind_gpu_matches_cpu">
        <properties><property name="torch GPU-CPU max abs diff" value="0.0001"/></properties></testcase>
      <testcase classname="tests.test_gpu" name="test_cuda_shared_memory[grpc]">
        <failure message="AssertionError: a | b&#10;second line">trace</failure></testcase>
      <testcase classname="tests.test_gpu" name="test_gpu_metrics"><skipped message="no GPU"/></testcase>
    </testsuite></testsuites>""")
    assert gpu_report.rows(junit) == [
        ("KIND_GPU PyTorch on cuda:0 = CPU run", "pass", "torch GPU-CPU max abs diff: 0.0001"),
        ("CUDA shared memory (tritonclient cuda_shared_memory), input and output [grpc]", "FAIL",
         "AssertionError: a \\| b"),
        ("nv_gpu_utilization / memory_total / memory_used / power_usage, label gpu_uuid", "skip", "no GPU"),
    ]
    text = gpu_report.render(junit)
    assert "Result: 1 pass, 1 fail, 1 skipped." in text and text.startswith("### GPU check, ")
