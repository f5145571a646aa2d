"""Which NVIDIA GPUs this process may use, read without a CUDA library.

``CUDA_VISIBLE_DEVICES`` is read as the CUDA runtime reads it: a comma-separated list of
device indices or UUIDs (``GPU-...``, ``MIG-...``, a prefix is enough), ending at the first
entry that is neither (so ``"0,-1,1"`` is device 0 alone); set but empty means no GPU. Unset,
every NVIDIA device node ``/dev/nvidia<N>`` counts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

_ENTRY = re.compile(r"(?:\d+|(?:GPU|MIG)-[0-9A-Za-z-]*)")


def visible_entries(value: str | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (``value``, else the environment's) that CUDA
    honours, whitespace stripped; None when the variable is unset."""
    if value is None:
        value = os.environ.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return None
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if not _ENTRY.fullmatch(entry):
            break
        entries.append(entry)
    return entries


def gpu_count() -> int:
    """GPUs visible to this process: the ``CUDA_VISIBLE_DEVICES`` entries when it is set, else
    the NVIDIA device nodes in ``/dev`` (0 where there is no ``/dev``)."""
    entries = visible_entries()
    if entries is not None:
        return len(dict.fromkeys(entries))
    try:
        return len([n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)])
    except OSError:
        return 0


def visible_indices(uuids: Sequence[str], value: str | None = None) -> list[int]:
    """Positions in ``uuids`` (every GPU NVML lists, in NVML's order) of the GPUs
    ``CUDA_VISIBLE_DEVICES`` leaves visible, in the variable's order, each once.

    An index entry is taken as NVML's index (CUDA's order is the same under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), a UUID entry as the GPU whose UUID starts with it; an
    entry naming no GPU ends the list, as in CUDA. Unset: every GPU.
    """
    entries = visible_entries(value)
    if entries is None:
        return list(range(len(uuids)))
    found: list[int] = []
    for entry in entries:
        if entry.isdigit():
            index = int(entry)
            if index >= len(uuids):
                break
        else:
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            if len(matches) != 1:
                break
            index = matches[0]
        if index not in found:
            found.append(index)
    return found
