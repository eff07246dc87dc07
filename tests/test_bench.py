"""The benchmark runs end to end and writes its results (no timing is asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lcgen
from bench import NOT_QUICK, ROWS, constrained, default_out_dir, main, select_rows
from bench.harness import Bench, Check, Row, Series, at_least, at_most, evaluate, run_rounds
from bench.report import number
from bench.runners import Sample
from lcgen.registry import resolve

ROOT = Path(__file__).resolve().parent.parent
THREE_WAY = {"limit", "llama-cpp-python", "lcgen"}
# --quick: a 64-token checkpoint sequence, so rewinds of 1 and 32 tokens (512 does not fit).
CHECKPOINT_SERIES = {
    "rewind": {
        f"{what} k={k}" for what in ("rewind", "rewind+step", "re-prefill") for k in (1, 32)
    },
    "fork": {"fork", "state growth", "state before"},
    "save-load": {"to_bytes", "from_bytes", "save", "load"},
    "regenerate": {"generate 32", "rewind 32 + regenerate 32"},
    "stream": {"generate", "stream", "generate, no stops"},
    "kv-bf16": {
        f"{what} {kind}"
        for what in ("decode", "long decode", "long prefill")
        for kind in ("f16", "bf16")
    },
    "constrained": set(constrained.CONSTRAINED_SERIES),
    "schema-compile": {
        f"{name}{p}" for name in ("", "with masks ", "llguidance ") for p in ("p50", "p99")
    }
    | {"schemas"},
    "grammar-rollback": {
        "GrammarState.clone",
        "gen.state",
        "gen.restore",
        "replay, per token",
        "decode 1 token",
    },
    "anti-slop": {"plain", "anti-slop", "rewinds"},
    "continuous": {"together", "one after another"},
    "prefix-fewshot": {"lcgen", "llama-cpp-python", "cells held", "prompt tokens"},
    "prefix-chat": {"lcgen", "llama-cpp-python"},
    "prefix-interleaved": {"lcgen", "llama-cpp-python", "llama-cpp-python + RAM cache"},
    "prefix-ttft": {"cold", "cached", "same prompt"},
    "prefix-crowded": {"empty cache", "other prompts cached"},
    "speculate-copy": {
        "lcgen, ngram",
        "lcgen",
        "llama-cpp-python, prompt lookup",
        "llama-cpp-python",
    },
    "speculate-free": {"lcgen, ngram", "lcgen"},
    "speculate-json": {"lcgen, ngram", "lcgen"},
    "speculate-draft": {"lcgen, draft model", "lcgen", "accepted / drafted"},
}
QUICK_ROWS = [name for name in ROWS if name not in NOT_QUICK]


def run_quick(out: Path, model_path: Path, *extra: str) -> dict[str, Any]:
    assert main(["--quick", "--model", str(model_path), "--out", str(out), *extra]) == 0
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return results


def test_quick_bench_writes_every_row(tmp_path: Path, model_path: Path) -> None:
    results = run_quick(tmp_path, model_path)
    seen = {(r["row"], r["implementation"]) for r in results["rows"]}
    expected = {(row, impl) for row in ("prefill", "decode") for impl in THREE_WAY}
    expected |= {(row, name) for row, names in CHECKPOINT_SERIES.items() for name in names}
    assert seen == expected
    assert list(dict.fromkeys(r["row"] for r in results["rows"])) == QUICK_ROWS
    for r in results["rows"]:
        assert r["samples"] and all(math.isfinite(x) and x > 0 for x in r["samples"]), r
        assert r["median"] > 0 and all(s > 0 for s in r["seconds"]), r
    checks = {(c["row"], c["implementation"], c["baseline"]): c for c in results["checks"]}
    assert set(checks) >= {
        ("prefill", "lcgen", "limit"),
        ("decode", "lcgen", "limit"),
        ("decode", "lcgen", "llama-cpp-python"),
        ("rewind", "rewind k=32", None),
        ("rewind", "re-prefill k=32", "rewind k=32"),
        ("rewind", "rewind k=32", "rewind k=1"),
        ("fork", "fork", None),
        ("fork", "state growth", "state before"),
        ("save-load", "to_bytes", None),
        ("save-load", "from_bytes", None),
        ("regenerate", "rewind 32 + regenerate 32", "generate 32"),
        ("stream", "stream", "generate"),
        ("constrained", "lcgen", "lcgen, no grammar"),
        ("constrained", "lcgen", "llama-cpp-python"),
        ("constrained", "llama-cpp-python", "llama-cpp-python, no grammar"),
        ("grammar-rollback", "GrammarState.clone", "decode 1 token"),
        ("grammar-rollback", "gen.state", "decode 1 token"),
        ("grammar-rollback", "gen.restore", "decode 1 token"),
        ("anti-slop", "anti-slop", "plain"),
        ("kv-bf16", "decode bf16", "decode f16"),
        ("kv-bf16", "long decode bf16", "long decode f16"),
        ("kv-bf16", "long prefill bf16", "long prefill f16"),
        ("continuous", "together", "one after another"),
        ("prefix-fewshot", "lcgen", "llama-cpp-python"),
        ("prefix-fewshot", "cells held", "prompt tokens"),
        ("prefix-chat", "lcgen", "llama-cpp-python"),
        ("prefix-interleaved", "llama-cpp-python", "lcgen"),
        ("prefix-interleaved", "llama-cpp-python + RAM cache", "lcgen"),
        ("prefix-ttft", "cold", "cached"),
        ("prefix-ttft", "cold", "same prompt"),
        ("prefix-crowded", "other prompts cached", "empty cache"),
        ("speculate-copy", "lcgen, ngram", "lcgen"),
        ("speculate-copy", "lcgen, ngram", "llama-cpp-python, prompt lookup"),
        ("speculate-free", "lcgen, ngram", "lcgen"),
        ("speculate-json", "lcgen, ngram", "lcgen"),
        ("speculate-draft", "lcgen, draft model", "lcgen"),
    }
    assert all(c["value"] > 0 for c in results["checks"])
    assert all(c["result"] in {"PASS", "MISS"} for c in results["checks"] if c["target"])
    assert results["same_tokens"]["regenerate"]  # greedy: the regeneration repeats itself
    assert results["same_tokens"]["stream"]
    env, cfg = results["environment"], results["settings"]
    assert env["model_file"].endswith(".gguf") and env["n_threads"] >= 1
    assert (cfg["decode_tokens"], cfg["context_tokens"], cfg["rewind_ks"]) == (32, 64, [1, 32])
    assert cfg["json_schemas"] == 1 and cfg["skipped"] == {}
    assert "constrained" in results["same_tokens"]  # lcgen's and llama-cpp-python's JSON tokens
    markdown = (tmp_path / "RESULTS.md").read_text()
    assert "| decode | lcgen |" in markdown and "| prefill | limit |" in markdown
    assert "| rewind | rewind k=1 |" in markdown and "| save-load | from_bytes |" in markdown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RESULTS.md", "results.json"]


def test_rows_run_alone_and_in_the_order_given(tmp_path: Path, model_path: Path) -> None:
    # fork opens the long sequence, decode must run with it closed, regenerate reopens it.
    results = run_quick(tmp_path, model_path, "--rows", "fork,decode,regenerate")
    assert [r["row"] for r in results["rows"]] == ["fork"] * 3 + ["decode"] * 3 + ["regenerate"] * 2
    assert list(results["settings"]["rows"]) == ["fork", "decode", "regenerate"]


def test_unknown_row_is_reported_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--quick", "--rows", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown benchmark rows ['nope']" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def bench_command(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *argv]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("entry", [[str(ROOT / "bench" / "run.py")], ["-m", "bench"]])
def test_entry_points_show_the_options(entry: list[str]) -> None:
    out = bench_command(*entry, "--help", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python bench/run.py") and "--quick" in out.stdout


def test_script_runs_from_any_folder_and_returns_mains_status(tmp_path: Path) -> None:
    script = str(ROOT / "bench" / "run.py")
    out = bench_command(script, "--quick", "--rows", "nope", "--out", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "unknown benchmark rows ['nope']" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not any(tmp_path.iterdir())


def test_results_go_to_the_bench_folder_by_default() -> None:
    assert default_out_dir() == ROOT / "bench"


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokens", "0"],
        ["--repeats", "-1"],
        ["--tokens", "5000"],
        ["--context-tokens", "1"],
        ["--context-tokens", "2049"],  # save-load holds the sequence twice in 4,096 cells
        ["--schemas", "0"],
        ["--schemas", str(len(constrained.SCHEMAS) + 1)],
    ],
)
def test_bad_numbers_are_rejected(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def series(name: str, unit: str, *pairs: tuple[float, float]) -> Series:
    return Series("row", name, unit, tuple(Sample(s, c) for s, c in pairs))


@pytest.mark.parametrize(
    ("check", "value", "unit", "verdict"),
    [
        (Check("fast", target=at_most(1.0)), 0.5, "ms", "PASS"),  # median of 0.4, 0.5, 3 ms
        (Check("fast", target=at_most(0.1)), 0.5, "ms", "MISS"),
        # Ratios are medians of per-round ratios: 200/0.4, 300/0.5, 100/3 -> 500.
        (Check("slow", "fast", at_least(100.0)), 500.0, "x", "PASS"),
        (Check("fast", "slow", at_most(0.001)), 0.002, "x", "MISS"),
        (Check("slow", "fast"), 500.0, "x", ""),  # reported without a target
        (Check("rate", target=at_least(0.5)), 2.0, "GB/s", "PASS"),  # 2e9 bytes in 1 s
    ],
)
def test_checks_compare_medians_with_their_targets(
    check: Check, value: float, unit: str, verdict: str
) -> None:
    found = [
        series("fast", "ms", (4e-4, 1), (5e-4, 1), (3e-3, 1)),
        series("slow", "ms", (0.2, 1), (0.3, 1), (0.1, 1)),
        series("rate", "GB/s", (1.0, 2e9), (1.0, 2e9), (1.0, 2e9)),
    ]
    row = Row("row", "", {s.implementation: s.unit for s in found}, lambda b, r: {}, (check,))
    (result,) = evaluate([row], found)
    assert result.value == pytest.approx(value)
    assert (result.unit, result.verdict) == (unit, verdict)


@pytest.mark.parametrize(
    ("x", "text"),
    [(0, "0"), (47188189, "47,188,189"), (272.81, "272.8"), (1.0312, "1.031"), (0.04951, "0.0495")],
)
def test_numbers_keep_about_four_figures(x: float, text: str) -> None:
    assert number(x) == text


def test_quick_leaves_out_the_rows_that_load_another_model() -> None:
    assert select_rows(None) == list(ROWS)
    assert select_rows(None, quick=True) == QUICK_ROWS
    assert "constrained-gemma" in ROWS and "constrained-gemma" not in QUICK_ROWS
    assert select_rows("constrained-gemma", quick=True) == ["constrained-gemma"]


def test_every_schema_compiles_and_its_prompt_asks_for_it(model_path: Path) -> None:
    with lcgen.Model(model_path, n_seq_max=1) as model:
        for i, (name, schema, request) in enumerate(constrained.SCHEMAS):
            case = constrained.json_case(model, i)
            assert case.name == name and case.grammar.gbnf and case.prompt
            assert all(key in request for key in schema["required"])
        prefix = model.tokenize(constrained.ROLLBACK_PREFIX, add_bos=False)
        rollback = constrained.json_case(model, constrained.ROLLBACK_SCHEMA)
        with rollback.grammar.state(model) as state:
            state.accept_tokens(prefix)  # a valid prefix, not yet complete
            assert not state.is_complete


def test_gemma_row_is_skipped_with_a_message_when_its_model_is_missing(
    tmp_path: Path,
    model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(constrained, "GEMMA_MODEL", "no-such-model")
    results = run_quick(tmp_path, model_path, "--rows", "constrained-gemma,grammar-rollback")
    assert "skipping constrained-gemma: no-such-model is not available" in capsys.readouterr().err
    assert {r["row"] for r in results["rows"]} == {"grammar-rollback"}
    assert list(results["settings"]["skipped"]) == ["constrained-gemma"]
    assert "- skipped constrained-gemma: " in (tmp_path / "RESULTS.md").read_text()


def _needs_gemma() -> None:
    """Skip where Gemma 3 is not installed (``make test`` installs it)."""
    try:
        resolve(constrained.GEMMA_MODEL, download=False)
    except lcgen.LcgenError:
        pytest.skip(f"{constrained.GEMMA_MODEL} is not installed")


def test_gemma_row_runs_on_its_own_model(tmp_path: Path, model_path: Path) -> None:
    _needs_gemma()
    results = run_quick(tmp_path, model_path, "--rows", "constrained-gemma")
    assert {r["implementation"] for r in results["rows"]} == set(constrained.CONSTRAINED_SERIES)
    assert all(r["median"] > 0 and r["row"] == "constrained-gemma" for r in results["rows"])
    assert "gemma-3-270m" in results["settings"]["rows"]["constrained-gemma"]
    assert results["settings"]["skipped"] == {}


def test_mask_row_walks_a_valid_instance_on_gemma(tmp_path: Path, model_path: Path) -> None:
    _needs_gemma()
    results = run_quick(tmp_path, model_path, "--rows", "mask-gemma")
    figures = {r["implementation"]: r["median"] for r in results["rows"]}
    assert 0 < figures["lcgen p50"] <= figures["lcgen p99"]
    targets = {c["implementation"]: c["target"] for c in results["checks"] if not c["baseline"]}
    assert targets["lcgen p50"] == 0.2 and targets["lcgen p99"] == 2.0


def test_rows_that_load_a_model_close_it_after_their_rounds() -> None:
    closed: list[str] = []

    class Runner:
        def close_long_sequence(self) -> None:
            pass

    def round_(bench: Bench, r: int) -> dict[str, Sample]:
        assert not closed, "closed before the last round"
        return {"x": Sample(1.0, 1)}

    row = Row("row", "", {"x": "ms"}, round_, close=lambda: closed.append("row"))
    bench = Bench(None, None, None, Runner(), Path())  # type: ignore[arg-type]
    (series,) = run_rounds(bench, [row], 3)
    assert len(series.samples) == 3 and closed == ["row"]


def test_a_server_that_does_not_start_says_why_and_keeps_the_python_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A module found only through the PYTHONPATH the bench was given (as where packages are
    # installed with --target): it reports its path on stderr and exits.
    from bench import server

    (tmp_path / "probe_server.py").write_text(
        "import os, sys\nsys.stderr.write('path: ' + os.environ['PYTHONPATH'])\nsys.exit(3)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="did not start") as failed:
        server._Server.start(["probe_server"], 9, "model")
    assert f"path: {server.ROOT}{os.pathsep}{tmp_path}" in str(failed.value)
