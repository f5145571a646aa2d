"""CPU, memory and GPU gauges: readings from ``/proc`` and NVML, shown as a collector."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric

from pyserve.metrics.prometheus import _family
from pyserve.repository.devices import visible_indices

log = logging.getLogger("pyserve.metrics")


def _read_cpu_times() -> tuple[int, int] | None:
    """``(idle, total)`` jiffies from /proc/stat, or None where there is no /proc."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    values = [int(x) for x in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user/nice
    return idle, total


def _read_memory() -> tuple[int, int] | None:
    """``(total, used)`` bytes from /proc/meminfo (used = total - available), or None."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable", b"MemFree"):
                    info[key.decode()] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    total = info.get("MemTotal")
    if total is None:
        return None
    available = info.get("MemAvailable", info.get("MemFree", 0))
    return total, total - available


@dataclass(frozen=True)
class GpuSample:
    """One GPU's readings (``None`` where NVML does not support a reading)."""

    uuid: str
    utilization: float | None
    memory_total: int | None
    memory_used: int | None
    power_watts: float | None
    power_limit_watts: float | None
    energy_joules: float | None


class NvmlReader:
    """GPU readings through NVML (``pynvml``, from the ``nvidia-ml-py`` package), for the GPUs
    this process may use: those ``CUDA_VISIBLE_DEVICES`` leaves visible (``pyserve.repository.devices``),
    as Triton reports only the GPUs CUDA shows it.

    :raises RuntimeError: ``pynvml`` is missing, NVML cannot start, or there is no visible GPU.
    """

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise RuntimeError("pynvml is not installed (pip install nvidia-ml-py)") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            raise RuntimeError(f"NVML is not available: {exc}") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise RuntimeError("NVML reports no GPU")
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            chosen = visible_indices(uuids)
            if not chosen:
                raise RuntimeError(f"CUDA_VISIBLE_DEVICES leaves none of the {count} GPU(s) NVML lists visible")
            self._handles = [handles[i] for i in chosen]
            self._uuids = [uuids[i] for i in chosen]
        except Exception as exc:  # NVMLError too: the caller turns GPU metrics off on RuntimeError
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            if isinstance(exc, RuntimeError):
                raise
            raise RuntimeError(f"NVML could not list the GPUs: {type(exc).__name__}: {exc}") from None
        self._energy_start = [self._call(pynvml.nvmlDeviceGetTotalEnergyConsumption, h) for h in self._handles]

    @staticmethod
    def _call(function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except Exception:  # NVMLError_NotSupported and friends: that reading is left out
            return None

    def sample(self) -> list[GpuSample]:
        """Read every GPU now."""
        nvml = self._nvml
        samples = []
        for handle, uuid, energy_start in zip(self._handles, self._uuids, self._energy_start):
            rates = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            power = self._call(nvml.nvmlDeviceGetPowerUsage, handle)
            limit = self._call(nvml.nvmlDeviceGetPowerManagementLimit, handle)
            energy = self._call(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            samples.append(GpuSample(
                uuid=uuid,
                utilization=None if rates is None else rates.gpu / 100.0,
                memory_total=None if memory is None else int(memory.total),
                memory_used=None if memory is None else int(memory.used),
                power_watts=None if power is None else power / 1000.0,
                power_limit_watts=None if limit is None else limit / 1000.0,
                energy_joules=(
                    None if energy is None or energy_start is None else (energy - energy_start) / 1000.0
                ),
            ))
        return samples

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SystemMonitor:
    """CPU, memory and (when available) GPU readings, refreshed by ``sample``; a collector.

    :param cpu: read CPU utilization and memory.
    :param gpu: read GPUs through NVML when ``pynvml`` and a GPU are present.
    """

    def __init__(self, cpu: bool = True, gpu: bool = True) -> None:
        self._cpu = cpu
        self._last_cpu: tuple[int, int] | None = None
        self.cpu_utilization: float | None = None
        self.memory: tuple[int, int] | None = None
        self.gpus: list[GpuSample] = []
        self._nvml: NvmlReader | None = None
        if gpu:
            try:
                self._nvml = NvmlReader()
            except RuntimeError as exc:
                log.info("GPU metrics are off: %s", exc)

    @property
    def has_gpu(self) -> bool:
        return self._nvml is not None

    def sample(self) -> None:
        """Take new readings (blocking: call off the event loop)."""
        if self._cpu:
            times = _read_cpu_times()
            if times is not None:
                if self._last_cpu is not None:
                    idle = times[0] - self._last_cpu[0]
                    total = times[1] - self._last_cpu[1]
                    if total > 0:
                        self.cpu_utilization = min(max(1.0 - idle / total, 0.0), 1.0)
                elif self.cpu_utilization is None:
                    self.cpu_utilization = 0.0
                self._last_cpu = times
            self.memory = _read_memory()
        if self._nvml is not None:
            self.gpus = self._nvml.sample()

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def collect(self) -> Iterator[Metric]:
        if self._cpu:
            if self.cpu_utilization is not None:
                family = _family("nv_cpu_utilization", "gauge")
                family.add_sample(family.name, {}, self.cpu_utilization)
                yield family
            if self.memory is not None:
                for name, value in (("nv_cpu_memory_total_bytes", self.memory[0]),
                                    ("nv_cpu_memory_used_bytes", self.memory[1])):
                    family = _family(name, "gauge")
                    family.add_sample(name, {}, value)
                    yield family
        gpus = self.gpus
        if not gpus:
            return
        readings: list[tuple[str, str, Callable[[GpuSample], float | None]]] = [
            ("nv_gpu_utilization", "gauge", lambda g: g.utilization),
            ("nv_gpu_memory_total_bytes", "gauge", lambda g: g.memory_total),
            ("nv_gpu_memory_used_bytes", "gauge", lambda g: g.memory_used),
            ("nv_gpu_power_usage", "gauge", lambda g: g.power_watts),
            ("nv_gpu_power_limit", "gauge", lambda g: g.power_limit_watts),
            ("nv_energy_consumption", "counter", lambda g: g.energy_joules),
        ]
        for name, kind, read in readings:
            family = _family(name, kind)
            for gpu in gpus:
                reading = read(gpu)
                if reading is not None:
                    family.add_sample(name, {"gpu_uuid": gpu.uuid}, reading)
            if family.samples:
                yield family
