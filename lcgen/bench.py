"""Benchmarks: lcgen against the raw llama.cpp loop (the limit) and against llama-cpp-python.

Everything runs in one process on the same model file, prompt and thread count, and the
implementations are interleaved: each round runs every implementation once (the order rotates
from round to round) and the reported figure is the median over the rounds.

- ``limit``: a minimal loop over llama.cpp's C API, with a context set up exactly like lcgen's
  (same n_ctx, n_batch = n_ubatch, n_seq_max, threads, ``kv_unified``, ``swa_full``,
  ``no_perf``; flash attention left on llama.cpp's ``auto`` as lcgen leaves it). Prefill is
  ``llama_batch_get_one`` in n_batch chunks; each step is ``llama_decode`` of one token, then
  numpy argmax over ``llama_get_logits_ith(ctx, -1)`` with the end-of-generation tokens masked.
- ``llama-cpp-python``: ``llama_cpp.Llama.create_completion`` with the same settings (flash
  attention on, the value ``auto`` resolves to on CPU; its cache reset before each run, so the
  prompt is always decoded).
- ``lcgen``: the public API, ``model.sequence(prompt)`` and ``seq.generate``.

Every run bans the end-of-generation tokens (``logit_bias`` of -inf), so all generate exactly
the requested number of tokens with greedy sampling; the prompt is the same token list for all.

What is timed (rows are registered with :func:`register`; later rows add a few lines there):

- ``prefill``: from the call to the first greedy token, i.e. the prompt decoded in n_batch
  chunks plus one sample (lcgen: ``model.sequence`` + ``seq.generate(max_tokens=1)``; the
  limit: the same chunks + one masked argmax; llama-cpp-python: ``create_completion`` of one
  token). tokens/s = prompt tokens / that time. (``llama_batch_get_one`` also computes the
  logits of the last token of every chunk, lcgen only of the final one: a bit more work for
  the limit when the prompt is longer than n_batch; the default prompt fits one chunk.)
- ``decode``: N greedy tokens after the prompt and the first token. lcgen times
  ``seq.generate(max_tokens=N)`` and the limit its N decode + argmax steps; llama-cpp-python's
  loop cannot be entered from outside, so its time is ``create_completion`` of 1 + N tokens
  minus ``create_completion`` of 1 token, both in the same round (its per-token cost with its
  detokenization, as lcgen's includes its own).

This module imports ``llama_cpp`` directly, which elsewhere only ``lcgen/_llama.py`` does: the
raw C loop and ``llama_cpp.Llama`` are the baselines being measured, and nothing on lcgen's
generation path imports this module.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import llama_cpp as C
import numpy as np

import lcgen
from lcgen.errors import LcgenError

PROSE = (
    "The river came down from the hills in early spring, brown with snowmelt and loud enough "
    "to hear from the square. Every year the town argued about the bridge. The old men said it "
    "had stood for a hundred years and would stand for a hundred more; the engineer from the "
    "capital, who had measured the piers twice and written a careful report, said it would not "
    "see another flood. Nobody read the report. The baker, who crossed the bridge each morning "
    "before dawn with a cart of bread for the farms on the far bank, said only that the planks "
    "had begun to sing under his wheels, a low note that had not been there the year before. "
    "His daughter kept a notebook of the river's height, marked against a white stone at the "
    "water's edge, and she noticed that the marks were climbing earlier each spring. When she "
    "showed the notebook to the mayor, he thanked her, praised her handwriting, and put it in "
    "a drawer with the engineer's report. That April the rain did not stop for nine days. "
)
PROMPT_TOKENS = 500
DECODE_TOKENS = 256
REPEATS = 5
QUICK = {"repeats": 1, "tokens": 32, "prompt_tokens": 64}
WARMUP_TOKENS = 8
NUMERIC_COLUMNS = frozenset({"median", "min", "max", "samples", "value", "target"})
DESCRIPTION = "Benchmark lcgen against the raw llama.cpp loop and llama-cpp-python."


@dataclass(frozen=True, slots=True)
class ContextConfig:
    """Context settings shared by all three implementations (lcgen's own defaults)."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 8
    n_threads: int = 1
    n_gpu_layers: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """What every implementation is asked to do: decode ``prompt``, then ``n_tokens`` more."""

    prompt: tuple[int, ...]
    n_tokens: int
    banned: tuple[int, ...]
    bias: Mapping[int, float]  # the ban as a logit_bias: every banned token at -inf


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed run: ``count`` units of work (tokens) in ``seconds``; ``tokens`` it produced."""

    seconds: float
    count: int
    tokens: tuple[int, ...] = ()

    @property
    def rate(self) -> float:
        return self.count / self.seconds


def _check_decode(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"llama_decode failed with code {rc}")


class RawLoop:
    """The limit: the least Python that drives llama.cpp to do the same work as lcgen."""

    name = "limit"

    def __init__(self, path: Path, cfg: ContextConfig) -> None:
        C.llama_backend_init()
        params = C.llama_model_default_params()
        params.n_gpu_layers = cfg.n_gpu_layers
        self._model = C.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._ctx = C.llama_init_from_model(self._model, _context_params(cfg))
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._mem = C.llama_get_memory(self._ctx)
        self.n_vocab = int(C.llama_vocab_n_tokens(C.llama_model_get_vocab(self._model)))
        self.n_batch = cfg.n_batch

    def _prefill(self, prompt: ctypes.Array[ctypes.c_int32], banned: np.ndarray) -> int:
        """Clear the memory, decode the prompt in n_batch chunks, return the greedy token."""
        C.llama_memory_clear(self._mem, True)
        for at in range(0, len(prompt), self.n_batch):
            size = min(self.n_batch, len(prompt) - at)
            address = ctypes.addressof(prompt) + at * ctypes.sizeof(C.llama_token)
            chunk = ctypes.cast(address, ctypes.POINTER(C.llama_token))
            _check_decode(C.llama_decode(self._ctx, C.llama_batch_get_one(chunk, size)))
        return self._next_token(banned)

    def _next_token(self, banned: np.ndarray) -> int:
        ptr = C.llama_get_logits_ith(self._ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        logits[banned] = -np.inf  # llama.cpp's buffer: overwritten by the next decode anyway
        return int(logits.argmax())

    def prefill(self, work: Workload) -> Sample:
        prompt = (C.llama_token * len(work.prompt))(*work.prompt)
        banned = np.array(work.banned, dtype=np.int64)
        start = time.perf_counter()
        token = self._prefill(prompt, banned)
        return Sample(time.perf_counter() - start, len(work.prompt), (token,))

    def decode(self, work: Workload) -> Sample:
        prompt = (C.llama_token * len(work.prompt))(*work.prompt)
        banned = np.array(work.banned, dtype=np.int64)
        tokens = [self._prefill(prompt, banned)]
        one = (C.llama_token * 1)(tokens[0])
        batch = C.llama_batch_get_one(one, 1)
        start = time.perf_counter()
        for _ in range(work.n_tokens):
            one[0] = tokens[-1]
            _check_decode(C.llama_decode(self._ctx, batch))
            tokens.append(self._next_token(banned))
        return Sample(time.perf_counter() - start, work.n_tokens, tuple(tokens))

    def close(self) -> None:
        if self._ctx:
            C.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            C.llama_model_free(self._model)
            self._model = None


def _context_params(cfg: ContextConfig) -> Any:
    """The context parameters lcgen's ``_llama.ContextHandle`` uses, field for field."""
    params = C.llama_context_default_params()
    params.n_ctx = cfg.n_ctx
    params.n_batch = cfg.n_batch
    params.n_ubatch = cfg.n_batch
    params.n_seq_max = cfg.n_seq_max
    params.n_threads = cfg.n_threads
    params.n_threads_batch = cfg.n_threads
    params.no_perf = True
    params.kv_unified = True
    params.swa_full = True
    return params


class LlamaCppPython:
    """llama-cpp-python's high-level ``Llama``, used the way its users call it."""

    name = "llama-cpp-python"

    def __init__(self, path: Path, cfg: ContextConfig) -> None:
        self.llm = C.Llama(
            model_path=str(path),
            n_ctx=cfg.n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_batch,
            n_threads=cfg.n_threads,
            n_threads_batch=cfg.n_threads,
            n_gpu_layers=cfg.n_gpu_layers,
            flash_attn=True,
            swa_full=True,
            no_perf=True,
            verbose=False,
        )

    def _complete(self, work: Workload, max_tokens: int) -> float:
        """Seconds for one ``create_completion`` from an empty cache; checks it did it all."""
        self.llm.reset()  # type: ignore[no-untyped-call]
        # n_tokens == 0 turns off Llama.generate's prefix reuse; no LlamaCache is attached.
        if self.llm.n_tokens != 0 or self.llm.cache is not None:
            raise RuntimeError("llama-cpp-python would reuse a cached prompt prefix")
        start = time.perf_counter()
        out = self.llm.create_completion(
            list(work.prompt), max_tokens=max_tokens, temperature=0.0, logit_bias=dict(work.bias)
        )
        seconds = time.perf_counter() - start
        usage = out["usage"]  # type: ignore[index]
        if (usage["prompt_tokens"], usage["completion_tokens"]) != (len(work.prompt), max_tokens):
            raise RuntimeError(f"llama-cpp-python did not do the requested work: {usage}")
        return seconds

    def _generated(self, work: Workload) -> tuple[int, ...]:
        n_prompt = len(work.prompt)  # the last sampled token is never evaluated, so not stored
        return tuple(int(t) for t in self.llm.input_ids[n_prompt : self.llm.n_tokens])

    def prefill(self, work: Workload) -> Sample:
        seconds = self._complete(work, 1)
        return Sample(seconds, len(work.prompt), self._generated(work))

    def decode(self, work: Workload) -> Sample:
        # The extra time of n_tokens more tokens: its decode loop cannot be timed from inside.
        first = self._complete(work, 1)
        total = self._complete(work, work.n_tokens + 1)
        return Sample(total - first, work.n_tokens, self._generated(work))

    def close(self) -> None:
        self.llm.close()


class Lcgen:
    """lcgen through its public API."""

    name = "lcgen"

    def __init__(self, model: lcgen.Model) -> None:
        self.model = model

    def prefill(self, work: Workload) -> Sample:
        n_before = self.model.context.n_decoded
        start = time.perf_counter()
        with self.model.sequence(work.prompt) as seq:
            seq.generate(max_tokens=1, temperature=0.0, logit_bias=work.bias)
            seconds = time.perf_counter() - start
            generated = seq.tokens[len(work.prompt) :]
        _check_count("prefill", self.model.context.n_decoded - n_before, len(work.prompt))
        return Sample(seconds, len(work.prompt), tuple(generated))

    def decode(self, work: Workload) -> Sample:
        with self.model.sequence(work.prompt) as seq:
            seq.generate(max_tokens=1, temperature=0.0, logit_bias=work.bias)
            n_before = self.model.context.n_decoded
            start = time.perf_counter()
            seq.generate(max_tokens=work.n_tokens, temperature=0.0, logit_bias=work.bias)
            seconds = time.perf_counter() - start
            generated = seq.tokens[len(work.prompt) :]
        _check_count("decode", self.model.context.n_decoded - n_before, work.n_tokens)
        _check_count("generated", len(generated), work.n_tokens + 1)
        return Sample(seconds, work.n_tokens, tuple(generated))

    def close(self) -> None:
        self.model.close()


def _check_count(what: str, got: int, expected: int) -> None:
    if got != expected:
        raise RuntimeError(f"lcgen {what}: {got} tokens, expected {expected}")


# rows --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Bench:
    """Everything a row's measure functions get: the workload and the implementations."""

    work: Workload
    limit: RawLoop
    llama_cpp_python: LlamaCppPython
    lcgen: Lcgen


Measure = Callable[[Bench], Sample]


@dataclass(frozen=True, slots=True)
class Compare:
    """``implementation``'s median as a multiple of ``baseline``'s; ``target`` is the minimum."""

    implementation: str
    baseline: str
    target: float | None = None


@dataclass(frozen=True, slots=True)
class Row:
    """One benchmark: a measure function per implementation, each returning one sample."""

    name: str
    unit: str
    how: str
    measures: Mapping[str, Measure]
    compare: tuple[Compare, ...] = ()


ROWS: dict[str, Row] = {}


def register(row: Row) -> Row:
    """Add a row to the benchmark (rows run in the order they are registered)."""
    if row.name in ROWS:
        raise ValueError(f"a benchmark row named {row.name!r} is already registered")
    ROWS[row.name] = row
    return row


register(
    Row(
        "prefill",
        "tokens/s",
        "prompt tokens / time to decode the prompt (n_batch chunks) and sample 1 greedy token",
        {
            "limit": lambda b: b.limit.prefill(b.work),
            "llama-cpp-python": lambda b: b.llama_cpp_python.prefill(b.work),
            "lcgen": lambda b: b.lcgen.prefill(b.work),
        },
        (Compare("lcgen", "limit", 0.97), Compare("lcgen", "llama-cpp-python")),
    )
)
register(
    Row(
        "decode",
        "tokens/s",
        "greedy tokens / time, after the prompt and the first token (llama-cpp-python: "
        "create_completion(1 + N tokens) minus create_completion(1 token))",
        {
            "limit": lambda b: b.limit.decode(b.work),
            "llama-cpp-python": lambda b: b.llama_cpp_python.decode(b.work),
            "lcgen": lambda b: b.lcgen.decode(b.work),
        },
        (Compare("lcgen", "limit", 0.97), Compare("lcgen", "llama-cpp-python", 1.0)),
    )
)


# running -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Series:
    """All samples of one implementation in one row."""

    row: str
    implementation: str
    unit: str
    samples: tuple[Sample, ...]

    @property
    def median(self) -> float:
        return statistics.median(s.rate for s in self.samples)


@dataclass(frozen=True, slots=True)
class Ratio:
    row: str
    compare: Compare
    value: float

    @property
    def verdict(self) -> str:
        target = self.compare.target
        if target is None:
            return ""
        return "PASS" if self.value >= target else "MISS"


@dataclass(frozen=True, slots=True)
class Report:
    environment: dict[str, Any]
    settings: dict[str, Any]
    series: list[Series]
    ratios: list[Ratio]
    same_tokens: dict[str, bool]


def run_rounds(bench: Bench, rows: Sequence[Row], repeats: int) -> list[Series]:
    """Run every row ``repeats`` times, interleaving implementations and rotating their order."""
    samples: dict[tuple[str, str], list[Sample]] = {
        (row.name, name): [] for row in rows for name in row.measures
    }
    for r in range(repeats):
        for row in rows:
            names = list(row.measures)
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                samples[row.name, name].append(row.measures[name](bench))
    return [
        Series(row.name, name, row.unit, tuple(samples[row.name, name]))
        for row in rows
        for name in row.measures
    ]


def warm_up(bench: Bench, rows: Sequence[Row]) -> None:
    """One short unmeasured run of everything: first decodes allocate and fault pages in."""
    short = replace(
        bench, work=replace(bench.work, n_tokens=min(WARMUP_TOKENS, bench.work.n_tokens))
    )
    run_rounds(short, rows, 1)


def ratios(rows: Sequence[Row], series: Sequence[Series]) -> list[Ratio]:
    medians = {(s.row, s.implementation): s.median for s in series}
    return [
        Ratio(
            row.name, cmp, medians[row.name, cmp.implementation] / medians[row.name, cmp.baseline]
        )
        for row in rows
        for cmp in row.compare
    ]


def same_tokens(series: Sequence[Series]) -> dict[str, bool]:
    """Per row, whether every implementation produced the same tokens (compared up to the
    shortest), a check that they all did the same work."""
    outputs: dict[str, list[tuple[int, ...]]] = {}
    for s in series:
        if s.samples and s.samples[0].tokens:
            outputs.setdefault(s.row, []).append(s.samples[0].tokens)
    result = {}
    for row, seqs in outputs.items():
        n = min(len(t) for t in seqs)
        result[row] = all(t[:n] == seqs[0][:n] for t in seqs)
    return result


# set-up ------------------------------------------------------------------------------------
def build_workload(model: lcgen.Model, n_prompt: int, n_tokens: int) -> Workload:
    """A prompt of exactly ``n_prompt`` tokens of prose, and the end-of-generation tokens."""
    text = PROSE
    tokens = model.tokenize(text)
    while len(tokens) < n_prompt:
        text += PROSE
        tokens = model.tokenize(text)
    banned = tuple(t for t in range(model.n_vocab) if model.is_eog(t))
    bias = {tok: float("-inf") for tok in banned}
    return Workload(tuple(tokens[:n_prompt]), n_tokens, banned, bias)


def open_bench(args: argparse.Namespace) -> Bench:
    """Load the model three times (lcgen, the raw loop, llama-cpp-python) with one config."""
    base = ContextConfig(n_gpu_layers=-1 if C.llama_supports_gpu_offload() else 0)
    model = lcgen.load(
        args.model,
        n_threads=args.threads,
        n_gpu_layers=base.n_gpu_layers,
        n_ctx=base.n_ctx,
        n_batch=base.n_batch,
        n_seq_max=base.n_seq_max,
    )
    cfg = replace(base, n_threads=model.n_threads)
    try:
        work = build_workload(model, args.prompt_tokens, args.tokens)
        return Bench(work, RawLoop(model.path, cfg), LlamaCppPython(model.path, cfg), Lcgen(model))
    except BaseException:
        model.close()
        raise


def close_bench(bench: Bench) -> None:
    bench.llama_cpp_python.close()
    bench.limit.close()
    bench.lcgen.close()


def environment(bench: Bench) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "n_threads": bench.lcgen.model.n_threads,
        "model_file": bench.lcgen.model.path.name,
        "model": bench.lcgen.model.description,
        "llama_cpp_python": C.__version__,
        "lcgen": lcgen.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "system_info": bytes(C.llama_print_system_info()).decode("utf-8", "replace").strip(),
    }


def settings(bench: Bench, rows: Sequence[Row], repeats: int) -> dict[str, Any]:
    ctx = bench.lcgen.model.context
    return {
        "repeats": repeats,
        "prompt_tokens": len(bench.work.prompt),
        "decode_tokens": bench.work.n_tokens,
        "banned_tokens": list(bench.work.banned),
        "n_ctx": ctx.n_ctx,
        "n_batch": ctx.n_batch,
        "n_seq_max": ctx.n_seq_max,
        "sampling": "greedy; end-of-generation tokens banned with logit_bias -inf",
        "order": "interleaved: each round runs every implementation once, order rotating",
        "statistic": "median over rounds of per-run tokens/s",
        "rows": {row.name: row.how for row in rows},
    }


# output ------------------------------------------------------------------------------------
def series_json(s: Series) -> dict[str, Any]:
    return {
        "row": s.row,
        "implementation": s.implementation,
        "unit": s.unit,
        "median": s.median,
        "samples": [x.rate for x in s.samples],
        "seconds": [x.seconds for x in s.samples],
        "count": [x.count for x in s.samples],
    }


def ratio_json(r: Ratio) -> dict[str, Any]:
    cmp = r.compare
    return {
        "row": r.row,
        "implementation": cmp.implementation,
        "baseline": cmp.baseline,
        "ratio": r.value,
        "target": cmp.target,
        "result": r.verdict or None,
    }


def report_json(report: Report) -> dict[str, Any]:
    return {
        "environment": report.environment,
        "settings": report.settings,
        "rows": [series_json(s) for s in report.series],
        "ratios": [ratio_json(r) for r in report.ratios],
        "same_tokens": report.same_tokens,
    }


def series_cells(report: Report) -> list[list[str]]:
    """The results table: a header, then one line per (row, implementation)."""
    cells = [["row", "implementation", "median", "min", "max", "unit", "samples"]]
    for s in report.series:
        rates = [x.rate for x in s.samples]
        numbers = [f"{v:.1f}" for v in (s.median, min(rates), max(rates))]
        cells.append([s.row, s.implementation, *numbers, s.unit, str(len(rates))])
    return cells


def ratio_cells(report: Report) -> list[list[str]]:
    """The ratios table: a header, then one line per comparison."""
    cells = [["ratio", "value", "target", "result"]]
    for r in report.ratios:
        target = "" if r.compare.target is None else f">= {r.compare.target:.2f}"
        name = f"{r.row} {r.compare.implementation}/{r.compare.baseline}"
        cells.append([name, f"{r.value:.3f}", target, r.verdict])
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
        f"threads ({env['cpu_count']} CPUs), llama-cpp-python {env['llama_cpp_python']}: "
        f"{cfg['prompt_tokens']}-token prompt, {cfg['decode_tokens']} greedy tokens, "
        f"rounds: {cfg['repeats']}, {cfg['order']}; {cfg['statistic']}. limit = a raw llama.cpp "
        "C loop with lcgen's context settings."
    ]
    lines += [f"- {row}: {how}" for row, how in cfg["rows"].items()]
    lines += [
        f"- note: the implementations produced different tokens in {row!r}"
        for row, same in report.same_tokens.items()
        if not same
    ]
    return lines


def results_markdown(report: Report) -> str:
    lines = ["# lcgen benchmark results", "", *render_markdown(series_cells(report)), ""]
    lines += [*render_markdown(ratio_cells(report)), "", *summary_lines(report)]
    return "\n".join(lines) + "\n"


def results_text(report: Report) -> str:
    lines = [*render_text(series_cells(report)), "", *render_text(ratio_cells(report)), ""]
    return "\n".join(lines + summary_lines(report))


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def default_out_dir() -> Path:
    """The ``bench/`` folder of the source checkout lcgen runs from, else the current one."""
    candidate = Path(lcgen.__file__).resolve().parent.parent / "bench"
    return candidate if candidate.is_dir() else Path.cwd()


# command line ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lcgen bench", description=DESCRIPTION)
    p.add_argument("--repeats", type=int, help=f"rounds per row (default {REPEATS})")
    p.add_argument("--tokens", type=int, help=f"greedy tokens to decode (default {DECODE_TOKENS})")
    p.add_argument(
        "--prompt-tokens", type=int, help=f"prompt length in tokens (default {PROMPT_TOKENS})"
    )
    p.add_argument("--model", default=lcgen.DEFAULT_MODEL, help="model name, .gguf path or hf: ref")
    p.add_argument("--threads", type=int, help="CPU threads (default: lcgen's default)")
    p.add_argument("--rows", help=f"comma-separated rows to run (default all: {','.join(ROWS)})")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run for tests: 1 round, 32 tokens, a 64-token prompt, no warm-up",
    )
    p.add_argument("--out", type=Path, help="folder for results.json and RESULTS.md")
    args = p.parse_args(argv)
    defaults = (
        QUICK
        if args.quick
        else {"repeats": REPEATS, "tokens": DECODE_TOKENS, "prompt_tokens": PROMPT_TOKENS}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("repeats", "tokens", "prompt_tokens"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    n_ctx = ContextConfig().n_ctx
    if args.prompt_tokens + args.tokens + 1 > n_ctx:
        p.error(f"--prompt-tokens + --tokens + 1 must fit the context of {n_ctx} tokens")
    return args


def select_rows(spec: str | None) -> list[Row]:
    if spec is None:
        return list(ROWS.values())
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown benchmark rows {unknown or spec!r}; known: {', '.join(ROWS)}")
    return [ROWS[n] for n in names]


def measure(args: argparse.Namespace, rows: Sequence[Row]) -> Report:
    bench = open_bench(args)
    try:
        if not args.quick:
            warm_up(bench, rows)
        series = run_rounds(bench, rows, args.repeats)
        return Report(
            environment(bench),
            settings(bench, rows, args.repeats),
            series,
            ratios(rows, series),
            same_tokens(series),
        )
    finally:
        close_bench(bench)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table, write ``results.json`` and ``RESULTS.md``.

    Returns:
        The exit status: 0 (a missed target is reported, not an error), 2 on a bad argument
        or a model that cannot be loaded.
    """
    args = parse_args(argv)
    out_dir = args.out or default_out_dir()
    try:
        rows = select_rows(args.rows)
        out_dir.mkdir(parents=True, exist_ok=True)
        report = measure(args, rows)
    except (ValueError, LcgenError) as exc:
        print(f"lcgen bench: {exc}", file=sys.stderr)
        return 2
    print(results_text(report))
    write_atomic(out_dir / "results.json", json.dumps(report_json(report), indent=2) + "\n")
    write_atomic(out_dir / "RESULTS.md", results_markdown(report))
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'RESULTS.md'}")
    return 0
