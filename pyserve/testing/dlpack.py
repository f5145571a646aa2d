"""A server plugin checking that backends see inputs DLPack can export without a copy."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from pyserve_hookspecs import hookimpl

_DLPACK_KINDS = frozenset("biuf")
"""numpy dtype kinds that ``numpy.from_dlpack`` can export (bfloat16 and objects cannot)."""


class DLPackProbe:
    """A server plugin that exports the inputs the backend sees through DLPack.

    Wraps ``pyserve_execute`` of every model; for requests whose id starts with
    ``PREFIX`` it checks that each input numpy can carry through DLPack comes back from
    ``numpy.from_dlpack`` as a view of the same memory with the same dtype, shape and values.
    Thread-safe; the results accumulate in ``checked`` and ``failures``.
    """

    PREFIX = "pyserve-dlpack-"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.checked: list[str] = []
        """``"<request id>/<input>"`` for every input exported successfully."""
        self.failures: list[str] = []
        """One message per input that failed the check."""

    @hookimpl(wrapper=True)
    def pyserve_execute(self, instance: Any, requests: Sequence[Any]) -> Any:
        for request in requests:
            if isinstance(request.id, str) and request.id.startswith(self.PREFIX):
                for name, array in request.inputs.items():
                    self._check(f"{request.id}/{name}", array)
        return (yield)

    def _check(self, label: str, array: Any) -> None:
        import numpy as np

        if array.dtype.kind not in _DLPACK_KINDS:
            return
        try:
            view = np.from_dlpack(array)
            problem = None
            if view.dtype != array.dtype or view.shape != array.shape:
                problem = f"came back as {view.dtype}{view.shape}, sent {array.dtype}{array.shape}"
            elif array.size and not np.shares_memory(view, array):
                problem = "was copied (DLPack export must be zero-copy)"
            elif not np.array_equal(view, array, equal_nan=array.dtype.kind == "f"):
                problem = "changed its values"
        except Exception as exc:  # the check reports, the request goes on
            problem = f"cannot be exported: {type(exc).__name__}: {exc}"
        with self._lock:
            if problem is None:
                self.checked.append(label)
            else:
                self.failures.append(f"{label} {problem}")
