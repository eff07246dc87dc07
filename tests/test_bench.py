"""The benchmark runs end to end and writes its results (no timing is asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lcgen.bench import ROWS, main

IMPLEMENTATIONS = {"limit", "llama-cpp-python", "lcgen"}


def test_quick_bench_writes_every_row(tmp_path: Path) -> None:
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    seen = {(r["row"], r["implementation"]) for r in results["rows"]}
    assert seen == {(row, impl) for row in ROWS for impl in IMPLEMENTATIONS}
    for r in results["rows"]:
        assert r["samples"] and all(math.isfinite(x) and x > 0 for x in r["samples"]), r
        assert r["median"] > 0 and all(s > 0 for s in r["seconds"]), r
    assert {(r["row"], r["baseline"]) for r in results["ratios"]} >= {
        ("prefill", "limit"),
        ("decode", "limit"),
        ("decode", "llama-cpp-python"),
    }
    assert all(r["ratio"] > 0 for r in results["ratios"])
    env = results["environment"]
    assert env["model_file"].endswith(".gguf") and env["n_threads"] >= 1
    assert results["settings"]["decode_tokens"] == 32
    markdown = (tmp_path / "RESULTS.md").read_text()
    assert "| decode | lcgen |" in markdown and "| prefill | limit |" in markdown
    assert not list(tmp_path.glob("*.tmp*"))


def test_unknown_row_is_reported_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--quick", "--rows", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown benchmark rows ['nope']" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--repeats", "-1"], ["--tokens", "5000"]])
def test_bad_numbers_are_rejected(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
