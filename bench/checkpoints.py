"""The checkpoint rows, lcgen only: rewind, fork, save/load, rewind-then-regenerate.

All work on the lcgen runner's long sequence of ``--context-tokens`` tokens (2,048), whose last
token is pending as lcgen keeps it. Every round leaves that sequence as it found it: what a timed
step dropped is appended and decoded again, untimed.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lcgen
from bench.harness import Bench, Check, Row, RowFactory, at_least, at_most
from bench.runners import Lcgen, Sample, Workload, check_count

REWIND_MAX_MS = 1.0
REPREFILL_MIN_RATIO = 100.0
FLAT_MAX_RATIO = 2.0  # "flat in k": the largest k's rewind within 2x of the smallest k's
FORK_MAX_MS = 1.0
FORK_MAX_GROWTH = 0.01  # a fork adds seq ids only; a copy would add ~1x the parent's state
SAVE_LOAD_MIN_GBPS = 0.5
REGENERATE_MAX_RATIO = 1.05


def _greedy(seq: lcgen.Sequence, work: Workload, n: int) -> None:
    seq.generate(max_tokens=n, temperature=0.0, logit_bias=work.bias)


def _restore(seq: lcgen.Sequence, dropped: list[int], work: Workload) -> None:
    """Undo ``rewind(len(dropped))``, untimed: append the tokens again and decode them."""
    seq.append_tokens(dropped)
    _greedy(seq, work, 1)  # decodes the pending tokens and samples one more ...
    seq.rewind(1)  # ... which goes again: the last of ``dropped`` is pending, as before


def _check_in_place(seq: lcgen.Sequence, fallbacks: int) -> None:
    if seq.stats.fallbacks != fallbacks:
        raise RuntimeError(
            f"{seq.stats.fallbacks - fallbacks} rewinds fell back to decoding the sequence again "
            "(this model's KV memory cannot drop a partial range): the times would not be "
            "those of an in-place rewind"
        )


# rewind ------------------------------------------------------------------------------------
def _timed_rewind(seq: lcgen.Sequence, k: int, work: Workload) -> Sample:
    dropped = seq.tokens[-k:]
    start = time.perf_counter()
    seq.rewind(k)
    seconds = time.perf_counter() - start
    _restore(seq, dropped, work)
    return Sample(seconds, 1)


def _timed_rewind_step(lc: Lcgen, seq: lcgen.Sequence, k: int, work: Workload) -> Sample:
    """``rewind(k)`` and the next step, which decodes the new last token and samples one."""
    dropped = seq.tokens[-k:]
    n_before = lc.model.context.n_decoded
    start = time.perf_counter()
    seq.rewind(k)
    _greedy(seq, work, 1)
    seconds = time.perf_counter() - start
    check_count(f"rewind {k} + step", lc.model.context.n_decoded - n_before, 1)
    seq.rewind(1)
    _restore(seq, dropped, work)
    return Sample(seconds, 1)


def _timed_reprefill(lc: Lcgen, work: Workload, n_keep: int) -> Sample:
    """What a rewind saves: a fresh sequence of the kept prefix, up to its next greedy token."""
    n_before = lc.model.context.n_decoded
    start = time.perf_counter()
    with lc.model.sequence(work.long_prompt[:n_keep]) as seq:
        _greedy(seq, work, 1)
        seconds = time.perf_counter() - start
    check_count(f"re-prefill of {n_keep}", lc.model.context.n_decoded - n_before, n_keep)
    return Sample(seconds, 1)


def _rewind_round(bench: Bench, r: int) -> dict[str, Sample]:
    lc, work = bench.lcgen, bench.work
    lc.close_long_sequence()  # the baseline decodes alone, with no other sequence's cells
    reprefill = {k: _timed_reprefill(lc, work, work.n_context - k) for k in work.rewind_ks}
    seq = lc.long_sequence(work)
    fallbacks = seq.stats.fallbacks
    samples = {}
    ks = work.rewind_ks
    shift = r % len(ks)  # the first rewind after the prefill finds cold caches: rotate it
    for k in ks[shift:] + ks[:shift]:
        samples[f"rewind k={k}"] = _timed_rewind(seq, k, work)
        samples[f"rewind+step k={k}"] = _timed_rewind_step(lc, seq, k, work)
        samples[f"re-prefill k={k}"] = reprefill[k]
    _check_in_place(seq, fallbacks)
    return samples


def rewind_row(work: Workload) -> Row:
    units: dict[str, str] = {}
    checks: list[Check] = []
    for k in work.rewind_ks:
        units |= {f"rewind k={k}": "ms", f"rewind+step k={k}": "ms", f"re-prefill k={k}": "ms"}
        checks += [
            Check(f"rewind k={k}", target=at_most(REWIND_MAX_MS)),
            Check(f"re-prefill k={k}", f"rewind k={k}", at_least(REPREFILL_MIN_RATIO)),
            Check(f"re-prefill k={k}", f"rewind+step k={k}"),
        ]
    ks = work.rewind_ks
    if len(ks) > 1:
        checks.append(Check(f"rewind k={ks[-1]}", f"rewind k={ks[0]}", at_most(FLAT_MAX_RATIO)))
    how = (
        f"on a {work.n_context}-token sequence: 'rewind' = seq.rewind(k) alone "
        "(llama_memory_seq_rm; the dropped tokens are decoded again, untimed, before the next "
        "sample); 'rewind+step' = rewind(k) and the next generate(max_tokens=1), which decodes "
        "exactly 1 token (the new last one): what a rewind really costs; 're-prefill' = a fresh "
        "sequence of the kept n-k tokens decoded up to its next greedy token, alone in the cache. "
        f"'Flat in k' is read as: the largest k's rewind within {FLAT_MAX_RATIO:g}x of the "
        "smallest k's (a bound of this benchmark; the issue gives none)"
    )
    return Row("rewind", how, units, _rewind_round, tuple(checks), on_long_sequence=True)


# fork --------------------------------------------------------------------------------------
def _fork_round(bench: Bench, r: int) -> dict[str, Sample]:
    lc = bench.lcgen
    seq = lc.long_sequence(bench.work)
    before = lc.context_state_size()
    start = time.perf_counter()
    child = seq.fork()
    seconds = time.perf_counter() - start
    growth = lc.context_state_size() - before
    child.close()
    return {
        "fork": Sample(seconds, 1),
        "state growth": Sample(seconds, growth),
        "state before": Sample(seconds, before),
    }


def fork_row(work: Workload) -> Row:
    how = (
        f"'fork' = seq.fork() of the {work.n_context}-token sequence (closed untimed). llama.cpp "
        "cannot tell the KV bytes a fork copied, so measured instead: how much the whole "
        "context's serialized state (llama_state_get_size: each used cell once, with the ids of "
        "the sequences sharing it) grows across the fork, against its size before (the parent's "
        "KV data). lcgen's context is kv_unified: llama_memory_seq_cp adds the child's seq id to "
        "the parent's cells (4 B per cell per KV cache) and copies no K/V data, which would "
        "make the ratio about 1"
    )
    checks = (
        Check("fork", target=at_most(FORK_MAX_MS)),
        Check("state growth", "state before", at_most(FORK_MAX_GROWTH)),
    )
    units = {"fork": "ms", "state growth": "bytes", "state before": "bytes"}
    return Row("fork", how, units, _fork_round, checks, on_long_sequence=True)


# save / load -------------------------------------------------------------------------------
def _timed_load(seq: lcgen.Sequence, load: Callable[[], lcgen.Sequence]) -> float:
    start = time.perf_counter()
    copy = load()
    seconds = time.perf_counter() - start
    try:
        if copy.tokens != seq.tokens:
            raise RuntimeError("the loaded sequence's tokens differ from the saved ones")
    finally:
        copy.close()
    return seconds


def _save_load_round(bench: Bench, r: int) -> dict[str, Sample]:
    model = bench.lcgen.model
    seq = bench.lcgen.long_sequence(bench.work)
    start = time.perf_counter()
    data = seq.to_bytes()
    to_bytes = time.perf_counter() - start
    from_bytes = _timed_load(seq, lambda: lcgen.Sequence.from_bytes(model, data))
    with tempfile.TemporaryDirectory(prefix="lcgen-bench-", dir=bench.scratch) as tmp:
        path = Path(tmp) / "sequence.lcs"
        start = time.perf_counter()
        seq.save(path)
        save = time.perf_counter() - start
        size = path.stat().st_size
        load = _timed_load(seq, lambda: lcgen.Sequence.load(model, path))
    return {
        "to_bytes": Sample(to_bytes, len(data)),
        "from_bytes": Sample(from_bytes, len(data)),
        "save": Sample(save, size),
        "load": Sample(load, size),
    }


def save_load_row(work: Workload) -> Row:
    how = (
        f"bytes / time: seq.to_bytes() of the {work.n_context}-token sequence (KV state, tokens, "
        "RNG, checksum) and lcgen.Sequence.from_bytes() into a new slot; 'save' / 'load' = "
        "seq.save(path) (written atomically: temp file, fsync, rename) and Sequence.load(path), "
        "in a temporary folder of the output folder (the file is read back from the page cache)"
    )
    checks = (
        Check("to_bytes", target=at_least(SAVE_LOAD_MIN_GBPS)),
        Check("from_bytes", target=at_least(SAVE_LOAD_MIN_GBPS)),
    )
    units = dict.fromkeys(("to_bytes", "from_bytes", "save", "load"), "GB/s")
    return Row("save-load", how, units, _save_load_round, checks, on_long_sequence=True)


# rewind then regenerate --------------------------------------------------------------------
def _timed_generate(lc: Lcgen, seq: lcgen.Sequence, work: Workload, rewind: int) -> Sample:
    n_before = lc.model.context.n_decoded
    start = time.perf_counter()
    if rewind:
        seq.rewind(rewind)
    kept = seq.kept_logits() is not None  # the first token's logits: no decode for them
    _greedy(seq, work, work.n_regenerate)
    seconds = time.perf_counter() - start
    check_count("generate", lc.model.context.n_decoded - n_before, work.n_regenerate - kept)
    return Sample(seconds, 1, tuple(seq.tokens[-work.n_regenerate :]))


def _regenerate_round(bench: Bench, r: int) -> dict[str, Sample]:
    lc, work = bench.lcgen, bench.work
    seq = lc.long_sequence(work)
    m = work.n_regenerate
    if r % 2:  # every other round the regeneration goes first
        _greedy(seq, work, m)
        regenerate = _timed_generate(lc, seq, work, m)
        seq.rewind(m)
        generate = _timed_generate(lc, seq, work, 0)
    else:
        generate = _timed_generate(lc, seq, work, 0)
        regenerate = _timed_generate(lc, seq, work, m)
    seq.rewind(m)
    return {f"generate {m}": generate, f"rewind {m} + regenerate {m}": regenerate}


def regenerate_row(work: Workload) -> Row:
    m = work.n_regenerate
    how = (
        f"on the {work.n_context}-token sequence, greedy: 'generate {m}' = "
        f"seq.generate(max_tokens={m}); 'rewind {m} + regenerate {m}' = seq.rewind({m}) and "
        f"the same generate again, which makes the same tokens; each decodes {m} tokens, or "
        f"{m - 1} where it starts where the generate before began (after a rewind there), "
        "whose first logits the cache kept"
    )
    units = {f"generate {m}": "ms", f"rewind {m} + regenerate {m}": "ms"}
    check = Check(f"rewind {m} + regenerate {m}", f"generate {m}", at_most(REGENERATE_MAX_RATIO))
    return Row("regenerate", how, units, _regenerate_round, (check,), on_long_sequence=True)


FACTORIES: dict[str, RowFactory] = {
    "rewind": rewind_row,
    "fork": fork_row,
    "save-load": save_load_row,
    "regenerate": regenerate_row,
}
