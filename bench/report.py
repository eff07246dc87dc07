"""The results: the environment, the settings, a JSON document, text and markdown tables, and
the files they are written to."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as C
import numpy as np

import lcgen
from bench.harness import Bench, CheckResult, Row, Series

NUMERIC_COLUMNS = frozenset({"median", "min", "max", "samples", "value", "target"})


@dataclass(frozen=True, slots=True)
class Report:
    environment: dict[str, Any]
    settings: dict[str, Any]
    series: list[Series]
    checks: list[CheckResult]
    same_tokens: dict[str, bool]


def environment(bench: Bench) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "n_threads": bench.lcgen.model.n_threads,
        "model_file": bench.lcgen.model.path.name,
        "model": bench.lcgen.model.description,
        "flash_attn": {None: "auto", True: "on", False: "off"}[bench.lcgen.model.flash_attn],
        "llama_cpp_python": C.__version__,
        "lcgen": lcgen.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "system_info": bytes(C.llama_print_system_info()).decode("utf-8", "replace").strip(),
    }


def settings(bench: Bench, rows: Sequence[Row], repeats: int) -> dict[str, Any]:
    ctx, work = bench.lcgen.model.context, bench.work
    return {
        "repeats": repeats,
        "prompt_tokens": len(work.prompt),
        "decode_tokens": work.n_tokens,
        "context_tokens": work.n_context,
        "rewind_ks": list(work.rewind_ks),
        "regenerate_tokens": work.n_regenerate,
        "json_schemas": work.n_schemas,
        "banned_tokens": list(work.banned),
        "n_ctx": ctx.n_ctx,
        "n_batch": ctx.n_batch,
        "n_seq_max": ctx.n_seq_max,
        "sampling": "greedy; end-of-generation tokens banned with logit_bias -inf",
        "order": "interleaved: each round runs every implementation once, order rotating",
        "statistic": "median over rounds of each run's figure",
        "rows": {row.name: row.how for row in rows},
    }


# JSON --------------------------------------------------------------------------------------
def series_json(s: Series) -> dict[str, Any]:
    return {
        "row": s.row,
        "implementation": s.implementation,
        "unit": s.unit,
        "median": s.median,
        "samples": s.values,
        "seconds": [x.seconds for x in s.samples],
        "count": [x.count for x in s.samples],
    }


def check_json(c: CheckResult) -> dict[str, Any]:
    target = c.check.target
    return {
        "row": c.row,
        "implementation": c.check.series,
        "baseline": c.check.baseline,
        "value": c.value,
        "unit": c.unit,
        "target": None if target is None else target.bound,
        "bound": None if target is None else ("max" if target.is_max else "min"),
        "result": c.verdict or None,
    }


def report_json(report: Report) -> dict[str, Any]:
    return {
        "environment": report.environment,
        "settings": report.settings,
        "rows": [series_json(s) for s in report.series],
        "checks": [check_json(c) for c in report.checks],
        "same_tokens": report.same_tokens,
    }


# tables ------------------------------------------------------------------------------------
def number(x: float) -> str:
    """Four significant figures or so, whatever the magnitude (ms, GB/s, bytes, ratios)."""
    if x == 0 or abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3f}" if abs(x) >= 1 else f"{x:.3g}"


def series_cells(report: Report) -> list[list[str]]:
    """The results table: a header, then one line per (row, implementation)."""
    cells = [["row", "implementation", "median", "min", "max", "unit", "samples"]]
    for s in report.series:
        values = s.values
        numbers = [number(v) for v in (s.median, min(values), max(values))]
        cells.append([s.row, s.implementation, *numbers, s.unit, str(len(values))])
    return cells


def check_cells(report: Report) -> list[list[str]]:
    """The checks table: a header, then one line per check (a figure or a ratio)."""
    cells = [["check", "value", "unit", "target", "result"]]
    for c in report.checks:
        target = "" if c.check.target is None else str(c.check.target)
        cells.append([c.name, number(c.value), c.unit, target, c.verdict])
    return cells


def render_text(cells: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells
    ]


def render_markdown(cells: list[list[str]]) -> list[str]:
    rule = ["---:" if name in NUMERIC_COLUMNS else "---" for name in cells[0]]
    return ["| " + " | ".join(line) + " |" for line in [cells[0], rule, *cells[1:]]]


def summary_lines(report: Report) -> list[str]:
    env, cfg = report.environment, report.settings
    lines = [
        f"Measured {env['date']} in one process on {env['model_file']}, {env['n_threads']} "
        f"threads ({env['cpu_count']} CPUs), flash attention {env.get('flash_attn', 'auto')}, "
        f"llama-cpp-python {env['llama_cpp_python']}: "
        f"{cfg['prompt_tokens']}-token prompt, {cfg['decode_tokens']} greedy tokens, "
        f"checkpoint rows on a {cfg['context_tokens']}-token sequence; rounds: "
        f"{cfg['repeats']}, {cfg['order']}; {cfg['statistic']}. limit = a raw llama.cpp C "
        "loop with lcgen's context settings."
    ]
    lines += [f"- {row}: {how}" for row, how in cfg["rows"].items()]
    lines += [f"- skipped {row}: {why}" for row, why in cfg.get("skipped", {}).items()]
    lines += [
        f"- note: the implementations produced different tokens in {row!r}"
        for row, same in report.same_tokens.items()
        if not same
    ]
    return lines


def results_markdown(report: Report) -> str:
    lines = ["# lcgen benchmark results", "", *render_markdown(series_cells(report)), ""]
    lines += [*render_markdown(check_cells(report)), "", *summary_lines(report)]
    return "\n".join(lines) + "\n"


def results_text(report: Report) -> str:
    lines = [*render_text(series_cells(report)), "", *render_text(check_cells(report)), ""]
    return "\n".join(lines + summary_lines(report))
