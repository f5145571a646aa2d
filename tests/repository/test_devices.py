"""Which GPUs pyserve counts and reports: ``CUDA_VISIBLE_DEVICES`` as CUDA reads it, and the
NVML gauges' readings and failures with a stand-in for ``pynvml`` (NVML cannot run here;
``tests/gpu/test_gpu.py`` checks the gauges against ``nvidia-smi`` on a GPU machine)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from pyserve.metrics.system import NvmlReader, SystemMonitor
from pyserve.repository.devices import gpu_count, visible_entries, visible_indices

UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-abcd3333-0000"]


@pytest.mark.parametrize(("value", "entries"), [
    (None, None),
    ("", []),
    ("0,1", ["0", "1"]),
    (" 1 , 0 ", ["1", "0"]),
    ("0,-1,1", ["0"]),  # CUDA stops at the first invalid entry
    ("-1", []),
    ("GPU-bbbb,0", ["GPU-bbbb", "0"]),
    ("MIG-1234", ["MIG-1234"]),
    ("nonsense,0", []),
])
def test_visible_entries(value: str | None, entries: list[str] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_entries(value) == entries


def test_gpu_count_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,1")
    assert gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_count() == 0


@pytest.mark.parametrize(("value", "indices"), [
    (None, [0, 1, 2]),
    ("", []),
    ("2,0", [2, 0]),
    ("1,7,0", [1]),  # index 7 names no GPU: the list ends there
    ("GPU-bbbb", [1]),
    ("GPU-a,2", []),  # "GPU-a" is ambiguous (two UUIDs start with it)
    ("GPU-abcd,GPU-abcd3333-0000", [2]),
])
def test_visible_indices(value: str | None, indices: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_indices(UUIDS, value) == indices


class NVMLError(Exception):
    """pynvml's error base class (not a RuntimeError)."""


def _pynvml(fail: str = "") -> Any:
    """A stand-in ``pynvml`` with the three GPUs of ``UUIDS``; ``fail`` names a call that raises
    NVMLError; GPU 1 supports no power readings."""

    def call(name: str, function: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            if name == fail:
                raise NVMLError(f"{name}: Unknown Error")
            return function(*args)
        return wrapped

    def power(handle: int) -> int:
        if handle == 1:
            raise NVMLError("Not Supported")
        return 250_000 + handle

    module = types.SimpleNamespace(shutdowns=0)

    def shutdown() -> None:
        module.shutdowns += 1

    module.__dict__.update(
        nvmlInit=call("nvmlInit", lambda: None),
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=call("nvmlDeviceGetCount", lambda: len(UUIDS)),
        nvmlDeviceGetHandleByIndex=call("nvmlDeviceGetHandleByIndex", lambda i: i),
        nvmlDeviceGetUUID=call("nvmlDeviceGetUUID", lambda h: UUIDS[h].encode()),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * 2**30, used=(h + 1) * 2**20),
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetPowerManagementLimit=lambda h: 700_000,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: 1_000_000,
    )
    return module


def test_nvml_readings_of_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    reader = NvmlReader()
    samples = reader.sample()
    assert [s.uuid for s in samples] == [UUIDS[2], UUIDS[1]]
    assert samples[0].utilization == pytest.approx(0.42)
    assert samples[0].memory_used == 3 * 2**20 and samples[0].memory_total == 80 * 2**30
    assert samples[0].power_watts == pytest.approx(250.002) and samples[0].power_limit_watts == 700.0
    assert samples[0].energy_joules == 0.0
    assert samples[1].power_watts is None  # not supported: left out, the rest still read
    reader.close()


@pytest.mark.parametrize("fail", ["nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID"])
def test_an_nvml_failure_turns_gpu_metrics_off(fail: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An NVML error while finding the GPUs leaves the server without GPU gauges, not without metrics."""
    nvml = _pynvml(fail)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = SystemMonitor(cpu=True, gpu=True)
    assert not monitor.has_gpu
    monitor.sample()
    assert not [f for f in monitor.collect() if f.name.startswith("nv_gpu")]
    assert nvml.shutdowns == (0 if fail == "nvmlInit" else 1)


def test_no_visible_gpu_turns_gpu_metrics_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    with pytest.raises(RuntimeError, match="leaves none of the 3 GPU"):
        NvmlReader()
    assert not SystemMonitor(cpu=False, gpu=True).has_gpu
