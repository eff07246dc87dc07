"""Benchmarks: lcgen against the raw llama.cpp loop (the limit) and llama-cpp-python, and
lcgen's checkpoint operations against their targets. Run from the repository root with
``make bench``, ``python bench/run.py`` or ``python -m bench``. This package is not part of the
lcgen wheel; it drives lcgen through its public API and imports ``llama_cpp`` for the baselines.

Everything runs in one process on the same model file, prompt and thread count, and the
implementations are interleaved: each round runs every implementation once (the order rotates
from round to round) and the reported figure is the median over the rounds.

- ``limit``: a minimal loop over llama.cpp's C API, with a context set up exactly like lcgen's
  (same n_ctx, n_batch = n_ubatch, n_seq_max, threads, ``kv_unified``, ``swa_full``,
  ``no_perf``; flash attention as lcgen leaves it: llama.cpp decides, on here). Prefill is
  ``llama_batch_get_one`` in n_batch chunks; each step is ``llama_decode`` of one token, then
  numpy argmax over ``llama_get_logits_ith(ctx, -1)`` with the end-of-generation tokens masked.
- ``llama-cpp-python``: ``llama_cpp.Llama.create_completion`` with the same settings (flash
  attention as lcgen's; its cache reset before each run, so the prompt is always decoded).
- ``lcgen``: the public API, ``model.sequence(prompt)`` and ``seq.generate``.

Every run bans the end-of-generation tokens (``logit_bias`` of -inf), so all generate exactly
the requested number of tokens with greedy sampling; the prompt is the same token list for all.

Rows (:data:`ROWS`: name -> factory building the row from the workload; they run in this order):

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
- ``rewind``, ``fork``, ``save-load``, ``regenerate``: lcgen alone, on one sequence of
  ``--context-tokens`` tokens (see :mod:`bench.checkpoints`).
- ``constrained``, ``constrained-gemma``: JSON-Schema-constrained generation, lcgen against
  itself without a grammar and against llama-cpp-python's ``create_completion(grammar=...)``
  with the same GBNF, on ``--schemas`` schemas; ``constrained-gemma`` loads Gemma 3 270M
  itself, is left out (with a message) when it is not installed, and is not in ``--quick``'s
  default rows. ``grammar-rollback``: the grammar's checkpoint costs against a decoded token
  (see :mod:`bench.constrained`). ``mask-gemma``: a full-vocabulary mask on Gemma 3, lcgen
  beside llguidance when installed (see :mod:`bench.masks`).
- ``speculate-copy``, ``speculate-free``, ``speculate-json``: speculative decoding with drafts
  looked up in the sequence's own tokens, against the same generation without and against
  llama-cpp-python's prompt lookup (see :mod:`bench.speculation`).

Modules: ``runners`` (the workload and the three implementations), ``harness`` (rows, targets,
rounds), ``rows``, ``checkpoints``, ``constrained``, ``antislop`` and ``continuous`` (the row
factories), ``report`` (JSON, tables and the files they are written to).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import llama_cpp as C

import lcgen
from bench import (
    antislop,
    cache,
    checkpoints,
    constrained,
    continuous,
    masks,
    rows,
    schema_compile,
    server,
    speculation,
    threads,
)
from bench.harness import (
    Bench,
    Row,
    RowFactory,
    SkipRow,
    evaluate,
    run_rounds,
    same_tokens,
)
from bench.report import (
    Report,
    environment,
    report_json,
    results_markdown,
    results_text,
)
from bench.report import settings as report_settings
from bench.runners import (
    ContextConfig,
    Lcgen,
    LlamaCppPython,
    RawLoop,
    Workload,
    build_workload,
)
from lcgen.runtime.statefile import write_atomic

__all__ = ["ROWS", "main"]

N_SCHEMAS = len(constrained.SCHEMAS)
DEFAULTS = {
    "repeats": 5,
    "tokens": 256,
    "prompt_tokens": 500,
    "context_tokens": 2048,
    "schemas": N_SCHEMAS,
}
QUICK = {"repeats": 1, "tokens": 32, "prompt_tokens": 64, "context_tokens": 64, "schemas": 1}
WARMUP = {"tokens": 8, "context_tokens": 64, "schemas": 1}
ROWS: dict[str, RowFactory] = {
    **rows.FACTORIES,
    **checkpoints.FACTORIES,
    **constrained.FACTORIES,
    **schema_compile.FACTORIES,
    **masks.FACTORIES,
    **antislop.FACTORIES,
    **continuous.FACTORIES,
    **cache.FACTORIES,
    **speculation.FACTORIES,
    **server.FACTORIES,
    **threads.FACTORIES,
}
PROG = "python bench/run.py"
# Load a second model or start servers: only when named under --quick.
NOT_QUICK = ("constrained-gemma", *masks.FACTORIES, *server.FACTORIES, *threads.FACTORIES)
DESCRIPTION = (
    "Benchmark lcgen against the raw llama.cpp loop and llama-cpp-python, its checkpoint "
    "operations (rewind, fork, save/load) and its grammar constraints against their targets."
)


# set-up ------------------------------------------------------------------------------------
def open_bench(args: argparse.Namespace, scratch: Path) -> Bench:
    """Load the model three times (lcgen, the raw loop, llama-cpp-python) with one config."""
    base = ContextConfig(n_gpu_layers=-1 if C.llama_supports_gpu_offload() else 0)
    model = lcgen.load(
        args.model,
        n_threads=args.threads,
        n_gpu_layers=base.n_gpu_layers,
        n_ctx=base.n_ctx,
        n_batch=base.n_batch,
        n_seq_max=base.n_seq_max,
        flash_attn=FLASH_ATTN[args.flash_attn],
        cache=False,  # these rows time cold work, as llama-cpp-python's reset cache does
    )
    cfg = replace(
        base,
        n_threads=model.n_threads,
        extra_cpu_buffers=model.extra_cpu_buffers,
        flash_attn=model.flash_attn,
    )
    try:
        work = build_workload(
            model, args.prompt_tokens, args.tokens, args.context_tokens, args.schemas
        )
        limit, llama_cpp_python = RawLoop(model.path, cfg), LlamaCppPython(model.path, cfg)
        return Bench(work, limit, llama_cpp_python, Lcgen(model), scratch)
    except BaseException:
        model.close()
        raise


def close_bench(bench: Bench) -> None:
    bench.llama_cpp_python.close()
    bench.limit.close()
    bench.lcgen.close()


def warm_up(bench: Bench, names: Sequence[str]) -> None:
    """One short unmeasured run of everything: first decodes allocate and fault pages in."""
    work = build_workload(
        bench.lcgen.model,
        len(bench.work.prompt),
        min(WARMUP["tokens"], bench.work.n_tokens),
        min(WARMUP["context_tokens"], bench.work.n_context),
        min(WARMUP["schemas"], bench.work.n_schemas),
    )
    short = replace(bench, work=work)
    run_rounds(short, [ROWS[name](work) for name in names], 1)


def default_out_dir() -> Path:
    """This package's folder, ``bench/`` of the checkout, beside ``run.py`` and the README."""
    return Path(__file__).resolve().parent


FLASH_ATTN = {"auto": None, "on": True, "off": False}


# command line ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    p.add_argument("--repeats", type=int, help=f"rounds per row (default {DEFAULTS['repeats']})")
    p.add_argument(
        "--tokens", type=int, help=f"greedy tokens to decode (default {DEFAULTS['tokens']})"
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help=f"prompt length in tokens (default {DEFAULTS['prompt_tokens']})",
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        help="tokens of the sequence the checkpoint rows work on "
        f"(default {DEFAULTS['context_tokens']})",
    )
    p.add_argument(
        "--schemas",
        type=int,
        help=f"JSON Schemas the constrained rows use, 1 to {N_SCHEMAS} (default {N_SCHEMAS})",
    )
    p.add_argument("--model", default=lcgen.DEFAULT_MODEL, help="model name, .gguf path or hf: ref")
    p.add_argument("--threads", type=int, help="CPU threads (default: lcgen's default)")
    p.add_argument(
        "--flash-attn",
        choices=sorted(FLASH_ATTN),
        default="auto",
        help="flash attention on every side (auto: as lcgen leaves it, llama.cpp decides); "
        "the server rows keep each server's own default",
    )
    p.add_argument("--rows", help=f"comma-separated rows to run (default all: {','.join(ROWS)})")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run for tests: 1 round, 32 tokens, a 64-token prompt, a 64-token "
        f"checkpoint sequence, 1 JSON Schema, no warm-up; {', '.join(NOT_QUICK)} only when "
        "named in --rows",
    )
    p.add_argument("--out", type=Path, help="folder for results.json and RESULTS.md")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject numbers the rows cannot run with (argparse exits with status 2)."""
    for key, least in (("repeats", 1), ("tokens", 1), ("prompt_tokens", 1), ("context_tokens", 2)):
        if getattr(args, key) < least:
            p.error(f"--{key.replace('_', '-')} must be >= {least}, got {getattr(args, key)}")
    if not 1 <= args.schemas <= N_SCHEMAS:
        p.error(f"--schemas must be from 1 to {N_SCHEMAS}, got {args.schemas}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    n_ctx = ContextConfig().n_ctx
    if args.prompt_tokens + args.tokens + 1 > n_ctx:
        p.error(f"--prompt-tokens + --tokens + 1 must fit the context of {n_ctx} tokens")
    if 2 * args.context_tokens > n_ctx:
        p.error(
            f"--context-tokens must be at most {n_ctx // 2}: save-load holds the sequence twice "
            f"in the context of {n_ctx} tokens"
        )


def select_rows(spec: str | None, quick: bool = False) -> list[str]:
    if spec is None:
        return [name for name in ROWS if not (quick and name in NOT_QUICK)]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown benchmark rows {unknown or spec!r}; known: {', '.join(ROWS)}")
    return names


def build_rows(names: Sequence[str], work: Workload) -> tuple[list[Row], dict[str, str]]:
    """The rows named, and why each row that cannot run here was left out."""
    built: list[Row] = []
    skipped: dict[str, str] = {}
    for name in names:
        try:
            built.append(ROWS[name](work))
        except SkipRow as exc:
            skipped[name] = str(exc)
    return built, skipped


def measure(args: argparse.Namespace, names: Sequence[str], scratch: Path) -> Report:
    bench = open_bench(args, scratch)
    try:
        built, skipped = build_rows(names, bench.work)
        for name, why in skipped.items():
            print(f"bench: skipping {name}: {why}", file=sys.stderr)
        if not args.quick:
            warm_up(bench, [row.name for row in built])
        series = run_rounds(bench, built, args.repeats)
        settings = report_settings(bench, built, args.repeats)
        settings["skipped"] = skipped
        return Report(
            environment(bench),
            settings,
            series,
            evaluate(built, series),
            same_tokens(series),
        )
    finally:
        close_bench(bench)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the tables, write ``results.json`` and ``RESULTS.md``.

    Args:
        argv: the command-line arguments (None: ``sys.argv[1:]``); see
            ``python bench/run.py --help``.

    Returns:
        The exit status: 0 (a missed target is reported, not an error), 2 on a bad argument
        or a model that cannot be loaded.
    """
    args = parse_args(argv)
    out_dir = args.out or default_out_dir()
    try:
        names = select_rows(args.rows, args.quick)
        out_dir.mkdir(parents=True, exist_ok=True)
        report = measure(args, names, out_dir)
    except (ValueError, lcgen.LcgenError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    print(results_text(report))
    write_atomic(
        out_dir / "results.json", (json.dumps(report_json(report), indent=2) + "\n").encode()
    )
    write_atomic(out_dir / "RESULTS.md", results_markdown(report).encode())
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'RESULTS.md'}")
    return 0
