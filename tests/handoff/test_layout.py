"""The process layout ``pyserve run`` chooses by itself (``pyserve.handoff.layout``).

The CPU count is read from real files: cgroup trees written under ``tmp_path`` in the layouts
the kernel uses (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``, cpuset partitions), and the real
scheduler affinity of a ``pyserve run`` started under ``taskset``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from suite_support import REPO_ROOT, write_model

from pyserve.handoff.layout import (
    AUTO_BUSY_POLL_US,
    MAX_AUTO_PROCESSES,
    CpuBudget,
    choose,
    usable_cpus,
)

AFFINITY = len(os.sched_getaffinity(0))


def _v2(root: Path, path: str, files: dict[str, str]) -> Path:
    """A cgroup v2 tree: ``/proc/self/cgroup`` saying ``0::path`` and the files of ``path``."""
    folder = root / "fs" / path.strip("/")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text + "\n")
    membership = root / "cgroup"
    membership.write_text(f"0::{path}\n")
    return membership


def test_without_cgroup_files_the_affinity_counts(tmp_path: Path) -> None:
    budget = usable_cpus(tmp_path / "none", tmp_path / "missing")
    assert budget == CpuBudget(count=AFFINITY, affinity=AFFINITY, quota=None, cpus=budget.cpus)
    assert budget.cpus == tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.parametrize(("cpu_max", "quota", "count"), [
    ("max 100000", None, AFFINITY),
    ("100000 100000", 1.0, 1),
    ("150000 100000", 1.5, min(2, AFFINITY)),
    ("120000 100000", 1.2, 1),
    ("50000 100000", 0.5, 1),
])
def test_a_v2_quota_bounds_the_count(tmp_path: Path, cpu_max: str, quota: float | None, count: int) -> None:
    membership = _v2(tmp_path, "/kubepods/pod1", {"cpu.max": cpu_max})
    budget = usable_cpus(tmp_path / "fs", membership)
    assert (budget.quota, budget.count) == (quota, count)


def test_the_smallest_quota_of_the_ancestors_applies(tmp_path: Path) -> None:
    membership = _v2(tmp_path, "/outer/inner", {"cpu.max": "max 100000"})
    (tmp_path / "fs" / "outer" / "cpu.max").write_text("100000 100000\n")
    assert usable_cpus(tmp_path / "fs", membership).quota == 1.0


def test_a_v1_cfs_quota_counts(tmp_path: Path) -> None:
    folder = tmp_path / "fs" / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("100000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    membership = tmp_path / "cgroup"
    membership.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    budget = usable_cpus(tmp_path / "fs", membership)
    assert (budget.quota, budget.count) == (1.0, 1)


@pytest.mark.parametrize(("partition", "exclusive"), [("root", True), ("isolated", True), ("member", False)])
def test_an_exclusive_cpuset_is_seen(tmp_path: Path, partition: str, exclusive: bool) -> None:
    membership = _v2(tmp_path, "/server", {"cpuset.cpus.partition": partition})
    assert usable_cpus(tmp_path / "fs", membership).exclusive is exclusive


def test_garbage_in_cgroup_files_is_ignored(tmp_path: Path) -> None:
    membership = _v2(tmp_path, "/x", {"cpu.max": "lots 0"})
    assert usable_cpus(tmp_path / "fs", membership).quota is None


def _budget(count: int, exclusive: bool = False) -> CpuBudget:
    return CpuBudget(count=count, affinity=count, cpus=tuple(range(count)), exclusive=exclusive)


def test_one_cpu_is_one_process_without_polling() -> None:
    layout = choose(budget=_budget(1))
    assert (layout.frontend_processes, layout.replicate_models, layout.busy_poll_us, layout.pin_processes) == (
        0, "none", 0, False)
    assert layout.describe().startswith("Serving with 1 process: 1 CPU is usable")


def test_several_cpus_are_one_process_each() -> None:
    layout = choose(budget=_budget(4))
    assert (layout.frontend_processes, layout.replicate_models, layout.busy_poll_us, layout.pin_processes) == (
        3, "auto", AUTO_BUSY_POLL_US, False)
    line = layout.describe()
    assert line.startswith("Serving with 4 processes (this one and 3 frontends): one per CPU: 4 CPUs are usable")
    assert "not pinned" in line and "--frontend-processes 0" in line


def test_an_exclusive_cpuset_pins_and_many_cpus_are_capped() -> None:
    assert choose(budget=_budget(2, exclusive=True)).pin_processes is True
    layout = choose(budget=_budget(MAX_AUTO_PROCESSES * 2))
    assert layout.frontend_processes == MAX_AUTO_PROCESSES - 1
    assert f"at most {MAX_AUTO_PROCESSES}" in layout.describe()


def test_every_flag_overrides_its_choice() -> None:
    layout = choose(0, "auto", 50, True, budget=_budget(4))
    assert (layout.frontend_processes, layout.replicate_models, layout.busy_poll_us, layout.pin_processes) == (
        0, "none", 50, True)
    assert choose(2, "none", "auto", "auto", budget=_budget(1)).frontend_processes == 2
    assert choose(budget=_budget(4), single_reason="one process: uvicorn").frontend_processes == 0


def _run_lines(*args: str, prefix: tuple[str, ...] = ()) -> str:
    """The log of a ``pyserve run`` that fails right after choosing its layout (its
    repository does not exist), so nothing is served."""
    result = subprocess.run(
        [*prefix, sys.executable, "-m", "pyserve", "run", "--model-repository", "missing", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    return result.stderr


def test_the_cli_serves_under_the_chosen_layout(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "m", 'backend: "identity" max_batch_size: 0 input [ { name: "IN" data_type: TYPE_FP32 '
                'dims: [ 1 ] } ] output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]')
    process = subprocess.Popen(
        [sys.executable, "-m", "pyserve", "run", "--model-repository", str(repo), "--http-port", "0",
         "--grpc-port", "0", "--metrics-port", "0", "--http-address", "127.0.0.1"],
        cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stderr is not None
        lines = []
        for line in process.stderr:
            lines.append(line)
            if "Started HTTPService" in line:
                break
        text = "".join(lines)
        processes = min(AFFINITY, MAX_AUTO_PROCESSES)
        noun = "1 process" if processes == 1 else f"{processes} processes"
        assert f"Serving with {noun}" in text, text
        if processes > 1:
            assert "Started 1 frontend process" in text or f"Started {processes - 1} frontend" in text, text
    finally:
        process.terminate()
        code = process.wait(60)
        if process.stderr is not None:
            process.stderr.close()
    assert code == 0


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_one_cpu_of_affinity_is_one_process(tmp_path: Path) -> None:
    stderr = _run_lines(prefix=("taskset", "-c", str(min(os.sched_getaffinity(0)))))
    assert "Serving with 1 process: 1 CPU is usable (affinity 1" in stderr, stderr


def test_frontend_processes_zero_is_one_process() -> None:
    assert "Serving with 1 process: --frontend-processes 0" in _run_lines("--frontend-processes", "0")


def test_uvicorn_keeps_one_process() -> None:
    stderr = _run_lines("--http-server", "uvicorn")
    assert "Serving with 1 process: --http-server uvicorn serves HTTP from this process only" in stderr, stderr


@pytest.mark.parametrize("value", ["many", "1.5"])
def test_bad_values_name_the_flag(value: str) -> None:
    stderr = _run_lines("--frontend-processes", value)
    assert "--frontend-processes" in stderr and value in stderr
