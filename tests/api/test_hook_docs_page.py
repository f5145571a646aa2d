"""``docs/hooks.md`` is generated from the hookspec docstrings and must be up to date."""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest
from suite_support import load_script

import pyserve_hookspecs
from pyserve_hookspecs import PROJECT_NAME, SPEC_MODULES, hookspec

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = REPO_ROOT / "docs" / "hooks.md"

gen = load_script("gen_hook_docs")

ALL_SPECS = sorted(
    name
    for module in SPEC_MODULES
    for name, func in inspect.getmembers(module, inspect.isfunction)
    if hasattr(func, f"{PROJECT_NAME}_spec")
)


def test_committed_page_is_the_generated_one() -> None:
    assert PAGE.is_file(), "docs/hooks.md is missing: run python scripts/gen_hook_docs.py"
    assert PAGE.read_text(encoding="utf-8") == gen.render(), (
        "docs/hooks.md is stale: run python scripts/gen_hook_docs.py and commit the result"
    )


@pytest.mark.parametrize("name", ALL_SPECS)
def test_every_hookspec_is_documented_on_the_page(name: str) -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert f"### `{name}`" in page, f"{name} has no section in docs/hooks.md"
    section = page.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
    for label in ("**When:**", "**Thread:**", "**Returns:**", "**Raises**"):
        assert label in section, f"{name}: the page section lacks {label}"


def test_an_undocumented_hookspec_fails_the_generator(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    module = types.ModuleType("undocumented_specs")

    @hookspec
    def pyserve_mystery(model: object) -> None:
        pass

    module.pyserve_mystery = pyserve_mystery  # type: ignore[attr-defined]
    monkeypatch.setattr(pyserve_hookspecs, "SPEC_MODULES", (*SPEC_MODULES, module))
    with pytest.raises(gen.UndocumentedHook, match="pyserve_mystery"):
        gen.render()
    assert gen.main(["--check", "--output", str(tmp_path / "hooks.md")]) == 1


def test_check_mode_detects_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "hooks.md"
    assert gen.main(["--check", "--output", str(page)]) == 1  # missing
    assert gen.main(["--output", str(page)]) == 0
    assert gen.main(["--check", "--output", str(page)]) == 0
    page.write_text(page.read_text(encoding="utf-8").replace("Thread:", "Thred:", 1), encoding="utf-8")
    assert gen.main(["--check", "--output", str(page)]) == 1
    assert "stale" in capsys.readouterr().err
