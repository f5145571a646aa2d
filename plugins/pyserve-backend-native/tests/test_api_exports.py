"""The shim exports every function of Triton's backend API that a backend may import.

``triton_api_r24.10.txt`` lists them (names taken from the r24.10 headers of
triton-inference-server/core). With ``TRITON_CORE_INCLUDE`` pointing at a folder holding
``triton/core/tritonbackend.h`` and ``tritonserver.h``, the list is also checked against the
headers' declarations.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from pyserve_backend_native import loader

API_LIST = Path(__file__).resolve().parent / "triton_api_r24.10.txt"

BACKEND_ENTRY_POINTS = {
    "TRITONBACKEND_Initialize", "TRITONBACKEND_Finalize", "TRITONBACKEND_GetBackendAttribute",
    "TRITONBACKEND_ModelInitialize", "TRITONBACKEND_ModelFinalize", "TRITONBACKEND_ModelInstanceInitialize",
    "TRITONBACKEND_ModelInstanceFinalize", "TRITONBACKEND_ModelInstanceExecute",
    "TRITONBACKEND_ModelBatchIncludeRequest", "TRITONBACKEND_ModelBatchInitialize",
    "TRITONBACKEND_ModelBatchFinalize", "TRITONBACKEND_ModelBatcherInitialize",
    "TRITONBACKEND_ModelBatcherFinalize",
}
"""What backends implement (tritonbackend.h declares them with TRITONBACKEND_ISPEC)."""


def api_functions() -> set[str]:
    lines = API_LIST.read_text(encoding="utf-8").splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def shim_exports() -> set[str]:
    return {s for s in loader.shim_symbols() if s.startswith(("TRITONSERVER_", "TRITONBACKEND_"))}


def test_the_shim_exports_exactly_the_api() -> None:
    api = api_functions()
    assert len(api) == 263
    exported = shim_exports()
    assert sorted(api - exported) == [], "functions of the API the shim does not export"
    assert sorted(exported - api) == [], "exports that are not functions of the API"
    assert not exported & BACKEND_ENTRY_POINTS  # the shim must never shadow a backend's own


def test_a_backend_importing_every_function_loads(tmp_path: Path) -> None:
    """A library that references each function links against the shim (the loader checks its
    imports, then the dynamic loader binds every one of them with RTLD_NOW)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the test library")
    names = sorted(api_functions())
    source = tmp_path / "imports_all.c"
    lines = [f"extern void {name}(void);" for name in names]
    lines.append("void* const pyserve_api_table[] = {" + ", ".join(f"(void*){n}" for n in names) + "};")
    lines.append("void* TRITONBACKEND_ModelInstanceExecute(void* i, void** r, unsigned n) { (void)i; (void)r; (void)n; "
                 "return pyserve_api_table[0]; }")
    source.write_text("\n".join(lines) + "\n")
    library = tmp_path / "libtriton_imports_all.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    info = loader.read_elf(library)
    assert set(names) <= info.undefined
    loaded = loader.load_library(library)
    assert "TRITONBACKEND_ModelInstanceExecute" in loaded.entry_points


def _declared(header: Path, spec: str) -> set[str]:
    text = re.sub(r"/\*.*?\*/", "", header.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    names = set()
    for match in re.finditer(rf"\b{spec}\b(.*?);", text, flags=re.S):
        name = re.search(r"\b((?:TRITONSERVER|TRITONBACKEND)_\w+)\s*\(", match.group(1))
        if name:
            names.add(name.group(1))
    return names


def test_the_list_matches_the_headers() -> None:
    include = os.environ.get("TRITON_CORE_INCLUDE")
    if not include:
        pytest.skip("set TRITON_CORE_INCLUDE to a folder holding triton/core/tritonbackend.h and tritonserver.h")
    core = Path(include) / "triton" / "core"
    server = _declared(core / "tritonserver.h", "TRITONSERVER_DECLSPEC")
    backend = _declared(core / "tritonbackend.h", "TRITONBACKEND_DECLSPEC")
    backend |= _declared(core / "tritonbackend.h", "TRITONSERVER_DECLSPEC")
    implemented_by_backends = _declared(core / "tritonbackend.h", "TRITONBACKEND_ISPEC")
    # the header marks one server function ISPEC; the server implements it all the same
    server_side = implemented_by_backends - BACKEND_ENTRY_POINTS
    assert server_side <= {"TRITONBACKEND_InferenceResponseOutputByName"}
    assert server | backend | server_side == api_functions()
