"""The anti-slop row: banned phrases against plain generation, lcgen only.

Three chat prompts whose greedy continuations contain phrases the model overuses; each round
generates ``--tokens`` greedy tokens from each (end-of-generation banned, so every run has the
same length), once plainly and once with ten banned phrases. The figure is decoded tokens per
second: every token passed to ``llama_decode``, the tokens re-decoded after rewinds included,
so the ratio shows what backtracking costs beyond the tokens it decodes again. Each run checks
that the prompt was decoded once: decoded = prompt + generated - 1 + re-decoded, as counted by
the context (the prompt is prefilled whole, untimed; the first token is drawn from the logits
kept after it).
"""

from __future__ import annotations

import re
import time

from bench.harness import Bench, Check, Row, RowFactory, at_least
from bench.runners import Sample, Workload, check_count

# Phrases SmolLM2-135M writes unprompted in greedy answers to PROMPTS (measured).
BANNED = (
    "tapestry",
    "canvas",
    "shimmer",
    "bustling",
    "majestic",
    "iridescent",
    "vibrant",
    "a testament to",
    "ethereal",
    re.compile(r"(?i)\bdelve\b"),
)
PROMPTS = (
    "Tell me about the history of Rome.",
    "Describe the ocean at night.",
    "Write a short story about a dragon.",
)
MIN_RATIO = 0.95


def _run(bench: Bench, banned: bool) -> tuple[Sample, int]:
    """All prompts once; the decoded tokens over the time, and the rewinds done."""
    model = bench.lcgen.model
    seconds = 0.0
    decoded = rewinds = 0
    for prompt in PROMPTS:
        tokens = model.chat_tokens([{"role": "user", "content": prompt}])
        n_before = model.context.n_decoded
        with model.sequence(tokens) as seq:
            seq.prefill()  # untimed: the whole prompt, the same for both
            start = time.perf_counter()
            out = seq.generate(
                max_tokens=bench.work.n_tokens,
                temperature=0.0,
                logit_bias=bench.work.bias,
                banned=BANNED if banned else None,
                banned_ignore_case=True,
            )
            seconds += time.perf_counter() - start
        stats = out.stats
        check_count("decoded", model.context.n_decoded - n_before, len(tokens) + stats.decoded)
        check_count("prompt decoded once", stats.decoded, bench.work.n_tokens - 1 + stats.redecoded)
        if banned:
            _check_clean(out)
        decoded, rewinds = decoded + stats.decoded, rewinds + stats.rewinds
    return Sample(seconds, decoded), rewinds


def _check_clean(text: str) -> None:
    for phrase in BANNED:
        found = phrase.search(text) if isinstance(phrase, re.Pattern) else phrase in text.lower()
        if found:
            raise RuntimeError(f"banned phrase {phrase!r} in the output: {text!r}")


def _round(bench: Bench, r: int) -> dict[str, Sample]:
    """Plain and anti-slop runs, in an order that alternates from round to round."""
    samples: dict[str, Sample] = {}
    for banned in (False, True) if r % 2 == 0 else (True, False):
        sample, rewinds = _run(bench, banned)
        samples["anti-slop" if banned else "plain"] = sample
        if banned:
            samples["rewinds"] = Sample(1.0, rewinds)
    return samples


def antislop_row(work: Workload) -> Row:
    del work
    return Row(
        "anti-slop",
        f"decoded tokens / time for {len(PROMPTS)} chat prompts, N greedy tokens each: "
        f"plain, and with {len(BANNED)} banned phrases (the tokens a rewind drops are decoded "
        "again and counted; the prompt is decoded once); rewinds per round",
        {"plain": "tokens/s", "anti-slop": "tokens/s", "rewinds": "count"},
        _round,
        (Check("anti-slop", "plain", at_least(MIN_RATIO)), Check("rewinds")),
    )


FACTORIES: dict[str, RowFactory] = {"anti-slop": antislop_row}
