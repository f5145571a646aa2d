"""The layer backends import (``pyserve.api``) stands alone, and the old import paths still work."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOKSPECS = ROOT / "hookspecs" / "src" / "pyserve_hookspecs"

# The layers above pyserve.api (pyproject.toml [tool.importlinter]); none may load with it.
ABOVE_API = (
    "pyserve.repository", "pyserve.host", "pyserve.metrics", "pyserve.tracing", "pyserve.logs",
    "pyserve.runtime", "pyserve.dataplane", "pyserve.frontends", "pyserve.handoff", "pyserve.server",
    "pyserve.tools", "pyserve.cli", "pyserve.testing",
)
TRANSPORTS = ("grpc", "starlette", "uvicorn", "httptools", "uvloop", "hpack", "opentelemetry")


def _modules_after(statement: str) -> list[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return list(json.loads(result.stdout.splitlines()[-1]))


@pytest.mark.parametrize("statement", ["import pyserve.api", "from pyserve import Backend", "pyserve.Backend"])
def test_importing_the_api_loads_nothing_of_the_server(statement: str) -> None:
    loaded = _modules_after(f"import pyserve; {statement}" if statement.startswith("pyserve.") else statement)
    server_side = [m for m in loaded if m.startswith(ABOVE_API)]
    transports = [m for m in loaded if m.split(".")[0] in TRANSPORTS]
    assert server_side == [], f"{statement} loaded {server_side}"
    assert transports == [], f"{statement} loaded {transports}"
    assert "pyserve.api.backend" in loaded


def test_import_pyserve_alone_loads_the_api_on_first_use() -> None:
    """``import pyserve`` (what ``import pyserve.<module>`` runs first) loads neither the API nor
    numpy: the keeper of ``pyserve run`` imports a few such modules and stays small."""
    loaded = _modules_after("import pyserve")
    assert "pyserve.api" not in loaded and "numpy" not in loaded, [m for m in loaded if m.startswith(("pyserve", "numpy"))]


def test_old_public_import_paths_still_work() -> None:
    import pyserve
    import pyserve.api as api
    import pyserve.metrics
    import pyserve.testing
    from pyserve.server import Server, ServerOptions
    from pyserve.server.core import Server as CoreServer

    for name in api.__all__:
        assert getattr(pyserve, name) is getattr(api, name), name
    for name in ("Backend", "BackendContext", "InstanceContext", "ModelContext", "InferRequest",
                 "InferResponse", "InferError", "ErrorCode", "gather_inputs", "split_outputs", "hookimpl"):
        assert name in pyserve.__all__
    assert pyserve.metrics.CustomMetrics is api.CustomMetrics
    assert Server is CoreServer and ServerOptions.__module__.startswith("pyserve.server.")
    assert callable(pyserve.testing.pyserve_server)  # the pytest plugin's fixtures
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pyserve.server.Nope  # noqa: B018


def _pyserve_imports(path: Path) -> list[str]:
    """Every module of pyserve a file imports, TYPE_CHECKING blocks included."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "pyserve":
            names.append(node.module or "")
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names if a.name.split(".")[0] == "pyserve")
    return names


def test_the_contract_type_checks_against_the_api_layer_only() -> None:
    """pyserve_hookspecs names the types hooks receive under TYPE_CHECKING; they come from pyserve.api,
    so type-checking the contract reads no module of the server."""
    imported = {str(p.name): _pyserve_imports(p) for p in HOOKSPECS.glob("*.py")}
    assert any(imported.values()), "the contract names pyserve's types"
    for name, modules in imported.items():
        assert all(m == "pyserve.api" or m.startswith("pyserve.api.") for m in modules), (name, modules)
