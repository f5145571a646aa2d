"""The process layout ``pyserve run`` chooses when its flags say ``auto`` (the default).

One Python process serves at most about one core. So, with no flags, the server counts the
CPUs it may use (``usable_cpus``: the scheduler affinity, bounded by a cgroup CPU quota in a
container) and runs one process per CPU, up to ``MAX_AUTO_PROCESSES``: this process (the
*owner*, which holds the models) and ``count - 1`` frontend processes that serve the same
ports, with connections balanced over all of them and stateless CPU models replicated in each
(``pyserve.handoff.replicas``). On one CPU it is the single process it always was.

The choices that only help in some settings decide themselves:

* busy polling (``pyserve.runtime.scheduling.busy_poll``) is on with a 300 µs window when there are at least two
  CPUs, and polls only after an answer to a lone client that sends its requests back to back;
* pinning each process to a CPU (``pyserve.handoff.affinity``) is on only when the CPU set is the
  server's alone (an exclusive cgroup cpuset), where no other work needs to move onto it.

Every flag still overrides its choice. ``describe`` is the one line the server logs at start.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

AUTO = "auto"
"""The value of a layout flag that lets the server choose."""

MAX_AUTO_PROCESSES = 32
"""The most processes ``auto`` starts (the owner included), however many CPUs there are."""

AUTO_BUSY_POLL_US = 300
"""The busy-poll window ``auto`` chooses on two or more CPUs, in microseconds."""

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup file systems are mounted (a test may point it elsewhere)."""

PROC_CGROUP = Path("/proc/self/cgroup")
"""This process's cgroup membership (a test may point it elsewhere)."""


@dataclass(frozen=True)
class CpuBudget:
    """How many CPUs the server may use, and where the number comes from.

    :ivar count: whole processes worth running (at least 1).
    :ivar affinity: CPUs in the scheduler affinity mask.
    :ivar quota: the cgroup CPU limit in CPUs (e.g. 1.5), or None without one.
    :ivar cpus: the CPU numbers of the affinity mask, in order.
    :ivar exclusive: the cgroup cpuset is exclusive to this server (no other work runs there).
    """

    count: int
    affinity: int
    quota: float | None = None
    cpus: tuple[int, ...] = ()
    exclusive: bool = False

    def explain(self) -> str:
        """Where ``count`` comes from, in words (e.g. ``2 CPUs usable (affinity 2, no cgroup quota)``)."""
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup CPU quota {self.quota:g}"
        noun = "CPU is" if self.count == 1 else "CPUs are"
        return f"{self.count} {noun} usable (affinity {self.affinity}, {quota})"


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, dict[str, str]]:
    """This process's cgroup v2 path and its v1 paths by controller, from ``/proc/self/cgroup``."""
    unified: str | None = None
    legacy: dict[str, str] = {}
    try:
        text = proc_cgroup.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None, legacy
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            unified = path
        for controller in controllers.split(","):
            if controller:
                legacy[controller] = path
    return unified, legacy


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _ancestors(root: Path, path: str) -> list[Path]:
    """``root/path`` and each folder above it up to ``root``, innermost first (limits of every
    ancestor apply)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(root: Path, path: str) -> float | None:
    limits: list[float] = []
    for folder in _ancestors(root, path):
        text = _read(folder / "cpu.max")
        if text is None:
            continue
        fields = text.split()
        if len(fields) == 2 and fields[0] != "max":
            try:
                quota, period = int(fields[0]), int(fields[1])
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits) if limits else None


def _v1_quota(root: Path, path: str) -> float | None:
    for mount in ("cpu,cpuacct", "cpu"):
        base = root / mount
        if not base.is_dir():
            continue
        limits: list[float] = []
        for folder in _ancestors(base, path):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            try:
                q, p = int(quota or "-1"), int(period or "0")
            except ValueError:
                continue
            if q > 0 and p > 0:
                limits.append(q / p)
        return min(limits) if limits else None
    return None


def _exclusive(root: Path, unified: str | None, legacy: dict[str, str]) -> bool:
    """Whether the cgroup's cpuset is exclusive: a v2 partition root (``root``/``isolated``)
    or a v1 ``cpuset.cpu_exclusive`` of 1."""
    if unified is not None:
        partition = _read(root.joinpath(*[p for p in unified.split("/") if p]) / "cpuset.cpus.partition")
        if partition is not None and unified.strip("/"):
            return partition.split()[0] in ("root", "isolated")
    if "cpuset" in legacy:
        base = root / "cpuset"
        flag = _read(base.joinpath(*[p for p in legacy["cpuset"].split("/") if p]) / "cpuset.cpu_exclusive")
        return flag == "1"
    return False


def usable_cpus(cgroup_root: Path | None = None, proc_cgroup: Path | None = None) -> CpuBudget:
    """The CPUs this process may use: its affinity mask, bounded by a cgroup CPU quota (v1 or
    v2, the smallest of the cgroup's and its ancestors'), rounded to whole processes (a quota
    of 1.5 CPUs counts as 2, of 1.2 as 1; never below 1).

    :param cgroup_root: where cgroups are mounted (default ``CGROUP_ROOT``).
    :param proc_cgroup: the membership file (default ``PROC_CGROUP``).
    """
    root = CGROUP_ROOT if cgroup_root is None else cgroup_root
    membership = PROC_CGROUP if proc_cgroup is None else proc_cgroup
    if hasattr(os, "sched_getaffinity"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    else:  # pragma: no cover - not Linux
        cpus = tuple(range(os.cpu_count() or 1))
    unified, legacy = _cgroup_paths(membership)
    quota = _v2_quota(root, unified) if unified is not None else None
    if quota is None and ("cpu" in legacy or "cpuacct" in legacy):
        quota = _v1_quota(root, legacy.get("cpu", legacy.get("cpuacct", "/")))
    count = len(cpus)
    if quota is not None:
        count = min(count, max(1, math.floor(quota + 0.5)))
    return CpuBudget(count=max(1, count), affinity=len(cpus), quota=quota, cpus=cpus,
                     exclusive=_exclusive(root, unified, legacy))


@dataclass
class Layout:
    """What ``pyserve run`` serves with: the resolved values of the layout flags.

    :ivar frontend_processes: frontend processes beside the owner.
    :ivar replicate_models: ``--replicate-models`` as resolved (``none`` without frontends).
    :ivar busy_poll_us: the busy-poll window (0: off).
    :ivar pin_processes: each process on a CPU of its own.
    :ivar reasons: why, one phrase per choice made automatically (for ``describe``).
    """

    frontend_processes: int
    replicate_models: str
    busy_poll_us: int
    pin_processes: bool
    budget: CpuBudget
    reasons: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The one line the server logs at start: how many processes and why."""
        processes = self.frontend_processes + 1
        if processes == 1:
            head = "Serving with 1 process"
        else:
            head = (f"Serving with {processes} processes (this one and {self.frontend_processes} "
                    f"frontend{'s' if self.frontend_processes > 1 else ''})")
        return f"{head}: " + "; ".join(self.reasons)


def _frontends(value: str | int, budget: CpuBudget, single_reason: str | None) -> tuple[int, str]:
    if value != AUTO:
        count = int(value)
        return count, "--frontend-processes {}".format(count)
    if single_reason is not None:
        return 0, single_reason
    processes = min(budget.count, MAX_AUTO_PROCESSES)
    if processes == 1:
        return 0, f"{budget.explain()}"
    capped = f", at most {MAX_AUTO_PROCESSES}" if budget.count > MAX_AUTO_PROCESSES else ""
    return processes - 1, f"one per CPU: {budget.explain()}{capped}"


def choose(
    frontend_processes: str | int = AUTO,
    replicate_models: str = AUTO,
    busy_poll_us: str | int = AUTO,
    pin_processes: str | bool = AUTO,
    *,
    single_reason: str | None = None,
    budget: CpuBudget | None = None,
) -> Layout:
    """Resolve the layout flags (each ``auto`` or a value the user gave).

    :param single_reason: why this server must stay one process whatever the CPUs (e.g.
        ``--http-server uvicorn``), or None.
    :param budget: the CPUs (default: ``usable_cpus()``).
    """
    budget = usable_cpus() if budget is None else budget
    frontends, why = _frontends(frontend_processes, budget, single_reason)
    reasons = [why]
    replicate = replicate_models
    if frontends and replicate == AUTO:
        reasons.append("stateless CPU models answered in every process")
    if not frontends:
        replicate = "none" if replicate == AUTO else replicate
    if busy_poll_us == AUTO:
        poll = AUTO_BUSY_POLL_US if budget.count >= 2 else 0
        reasons.append(f"busy polling {poll} µs after answers to a lone client sending back to back"
                       if poll else "no busy polling on one CPU")
    else:
        poll = int(busy_poll_us)
    if pin_processes == AUTO:
        pin = bool(frontends) and budget.exclusive
        if frontends:
            reasons.append("processes pinned to CPUs (the cpuset is exclusive)" if pin
                           else "processes not pinned (the CPU set is shared)")
    else:
        pin = bool(pin_processes)
    if frontends:
        reasons.append("--frontend-processes 0 serves from one process")
    return Layout(frontend_processes=frontends, replicate_models=replicate, busy_poll_us=poll,
                  pin_processes=pin, budget=budget, reasons=reasons)
