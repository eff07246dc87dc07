"""Every Python snippet of the README runs, in order, as a reader would paste them."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


def test_the_readme_has_snippets() -> None:
    assert len(snippets()) >= 6


def test_every_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a snippet saves a file
    namespace: dict[str, Any] = {"__name__": "readme"}
    for i, code in enumerate(snippets(), 1):
        try:
            exec(compile(code, f"README.md snippet {i}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"README snippet {i} failed: {exc!r}\n{code}") from exc
    assert isinstance(namespace["cat"], namespace["Cat"])
    assert isinstance(namespace["obj"]["population"], int)
    assert isinstance(namespace["pet"], namespace["Pet"])
    assert os.path.exists(tmp_path / "story.lcs")
    namespace["model"].close()
