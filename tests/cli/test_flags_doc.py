"""``docs/flags.md`` is generated from ``pyserve``'s argparse options and must be up to date."""

from __future__ import annotations

import argparse
from pathlib import Path

from suite_support import load_script

from pyserve.cli import triton_flags
from pyserve.cli.main import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = REPO_ROOT / "docs" / "flags.md"

gen = load_script("gen_flags_doc")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_committed_page_is_the_generated_one() -> None:
    assert PAGE.is_file(), "docs/flags.md is missing: run python scripts/gen_flags_doc.py"
    assert PAGE.read_text(encoding="utf-8") == gen.render(), (
        "docs/flags.md is stale: run python scripts/gen_flags_doc.py and commit the result"
    )


def test_every_flag_of_every_command_is_on_the_page() -> None:
    page = gen.render()
    for name, parser in _subcommands().items():
        assert f"## `pyserve {name}`" in page, name
        section = page.split(f"## `pyserve {name}`", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            flag = action.option_strings[-1] if action.help == argparse.SUPPRESS else action.option_strings[0]
            assert f"`{flag}`" in section, f"pyserve {name} {flag}"
    for flag in (*triton_flags.TUNING_FLAGS, *triton_flags.FEATURE_FLAGS):
        assert f"| `{flag}` |" in page, flag


def test_check_mode_reports_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "flags.md"
    stale.write_text(gen.render().replace("--http-port", "--http-prt", 1), encoding="utf-8")
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert gen.main(["--output", str(stale)]) == 0
    assert gen.main(["--check", "--output", str(stale)]) == 0


def test_readme_flag_table_is_the_generated_one() -> None:
    readme = gen.README.read_text(encoding="utf-8")
    assert gen.TABLE_START in readme and gen.TABLE_END in readme, "README.md lost its main-flags markers"
    assert readme == gen.render_readme(readme), (
        "README.md's table of main flags is stale: run python scripts/gen_flags_doc.py and commit the result"
    )
    table = readme.split(gen.TABLE_START, 1)[1].split(gen.TABLE_END, 1)[0]
    for flag in ("--model-repository", "--http-port", "--grpc-port", "--metrics-port"):
        assert f"`{flag}`" in table, flag


def test_check_mode_reports_a_stale_readme_table(tmp_path: Path) -> None:
    page, readme = tmp_path / "flags.md", tmp_path / "README.md"
    page.write_text(gen.render(), encoding="utf-8")
    readme.write_text(f"# x\n\n{gen.TABLE_START}\n| old |\n{gen.TABLE_END}\n\nafter\n", encoding="utf-8")
    assert gen.main(["--check", "--output", str(page), "--readme", str(readme)]) == 1
    assert gen.main(["--output", str(page), "--readme", str(readme)]) == 0
    assert gen.main(["--check", "--output", str(page), "--readme", str(readme)]) == 0
    text = readme.read_text(encoding="utf-8")
    assert "| old |" not in text and "`--http-port`" in text and text.endswith(f"{gen.TABLE_END}\n\nafter\n")
