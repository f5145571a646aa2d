"""``import model`` from model code: the calling model's own module, by its file's name.

Triton's stub keeps the version directory on ``sys.path``, so a model can import its own file
by its name (``model``; the stem of ``default_model_filename``): Triton's test models call
``unittest.main("model", exit=False)`` to run the test cases their model.py defines. pyserve
runs many models in one process, each model.py as a uniquely named module inside a package
whose path is the version directory (which keeps relative imports working), so a plain
``model`` entry in ``sys.modules`` cannot serve them all. Instead ``sys.modules["model"]`` is an
``OwnModule``: its attributes are those of the model.py of the Python model whose code runs
now (the backend's context variable, see ``context``); on a thread the model started itself,
which has no context, those of the only loaded model file of that name, if there is one.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import ModuleType
from typing import Any

from pyserve import ModelContext
from pyserve_backend_python import context

_lock = threading.RLock()
"""Guards ``_modules``. Reentrant: a model whose version failed is forgotten by a
``weakref.finalize`` (``pyserve_model_auto_complete``), which the garbage collector may run on
any allocation, also on a thread that holds this lock already."""
_modules: dict[int, tuple[weakref.ref[ModelContext], ModuleType]] = {}
"""``id(module)`` → (the model it was registered for, the module), until it is forgotten: a
plain dict, so that ``forget`` pops its entry without iterating, and readers iterate a
snapshot (``list`` of its values allocates nothing while it copies) that a collection running
a finalizer cannot change under them."""


class OwnModule(ModuleType):
    """``sys.modules[<file stem>]``: reads, writes and ``dir()`` go to the calling model's module.

    :raises AttributeError: (on attribute access) no Python model of that file name is calling
        and more than one (or none) is loaded; or the module lacks the attribute.
    """

    def _target(self) -> ModuleType:
        stem = ModuleType.__getattribute__(self, "__name__")
        model = context.current_model()
        with _lock:
            entries = list(_modules.values())
        if model is not None:
            for owner, module in entries:
                if owner() is model and _stem(module) == stem:
                    return module
        candidates = [m for owner, m in entries if _stem(m) == stem and owner() is not None]
        if len(candidates) == 1:
            return candidates[0]
        raise AttributeError(
            f"module '{stem}' is the calling Python model's own {stem}.py, but this code runs outside a "
            f"model's call and {len(candidates)} models of that file name are loaded"
        )

    def __getattr__(self, name: str) -> Any:  # only for names the alias itself lacks
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") and name.endswith("__"):
            ModuleType.__setattr__(self, name, value)
        else:
            setattr(self._target(), name, value)

    def __dir__(self) -> list[str]:
        return dir(self._target())


def _stem(module: ModuleType) -> str:
    return module.__name__.rpartition(".")[2]


def register(model: ModelContext, module: ModuleType) -> None:
    """Make ``import <stem>`` reach ``module`` for ``model``'s code (``stem``: the file's name).

    An installed module of that name that is no ``OwnModule`` is left alone (Triton's stub,
    which appends the version directory to ``sys.path``, would import it too)."""
    stem = _stem(module)
    with _lock:
        _modules[id(module)] = (weakref.ref(model), module)
        if stem not in sys.modules:
            sys.modules[stem] = OwnModule(stem, f"the calling Python model's own {stem}.py")


def forget(module: ModuleType) -> None:
    """The model module is unloaded: ``import <stem>`` no longer reaches it."""
    with _lock:
        _modules.pop(id(module), None)  # the entry holds its module: no other module has this id
