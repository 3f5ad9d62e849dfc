"""The layout table of docs/ARCHITECTURE.md is what `python docs/layout.py` generates from the docstrings."""

from __future__ import annotations

import pytest

from docs import layout


def test_the_layout_table_is_current():
    text = layout.ARCHITECTURE.read_text(encoding="utf-8")
    assert layout.with_table(text) == text, "docs/ARCHITECTURE.md's layout table is stale: run `python docs/layout.py`"
    assert layout.main(["--check"]) == 0


def test_every_module_has_a_row_and_a_stale_row_is_caught():
    table = layout.table()
    for package in layout.PACKAGES:
        for path in (layout.ROOT / package).rglob("*.py"):
            folders = path.relative_to(layout.ROOT / package).parents
            if not all((layout.ROOT / package / folder / "__init__.py").is_file() for folder in folders):
                continue  # data folders (an lm-eval task's loader) are not packages
            name = path.relative_to(layout.ROOT).as_posix()
            expected = name[: -len("__init__.py")] if path.name == "__init__.py" else name
            assert f"| `{expected}` |" in table
    text = layout.ARCHITECTURE.read_text(encoding="utf-8")
    stale = text.replace("| `trainer/loop.py` | ", "| `trainer/loop.py` | (old) ", 1)
    assert stale != text and layout.with_table(stale) == text


def test_first_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "ROOT", tmp_path)
    module = tmp_path / "m.py"
    module.write_text('"""`tool A... --x`: reads a | b. More here.\n\nDetails."""\n')
    assert layout.first_sentence(module) == "`tool A... --x`: reads a \\| b"
    module.write_text("x = 1\n")
    with pytest.raises(ValueError, match="no module docstring"):
        layout.first_sentence(module)
