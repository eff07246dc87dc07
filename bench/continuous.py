"""The continuous row: 8 seeded samples of one prompt decoded together against 8 runs one
after another, through the continuous API (``lcgen.continuous``)."""

from __future__ import annotations

import time

import lcgen
from bench.harness import Bench, Check, Row, RowFactory, at_least, interleaved
from bench.runners import Sample, Workload, check_count

N_SAMPLES = 8
MAX_TOKENS = 64  # per sample: 8 runs one after another of the full 256 would take ~20 s a round
SEED = 1234
TOGETHER_MIN_RATIO = 1.4


def _sampler(model: lcgen.Model, work: Workload, n_tokens: int) -> lcgen.Continuous:
    return lcgen.continuous(
        lcgen.generate.text(model, max_tokens=n_tokens, temperature=0.8, logit_bias=work.bias)
    )


def _prompt(model: lcgen.Model, work: Workload) -> tuple[str, int]:
    text = model.detokenize(work.prompt)
    return text, len(model.tokenize(text))


def _together(bench: Bench, n_tokens: int) -> Sample:
    model, work = bench.lcgen.model, bench.work
    sample = _sampler(model, work, n_tokens)
    prompt, n_prompt = _prompt(model, work)
    n_before = model.context.n_decoded
    start = time.perf_counter()
    with sample(prompt, num_samples=N_SAMPLES, seed=SEED) as state:
        seconds = time.perf_counter() - start
        tokens = state.tokens[0]
    # The prompt once, whole (each sample draws its first token from the logits kept after
    # it), then each sample's tokens but the last.
    decoded = model.context.n_decoded - n_before
    check_count("together", decoded, n_prompt + N_SAMPLES * (n_tokens - 1))
    for t in tokens:
        check_count("sample", len(t) - n_prompt, n_tokens)
    return Sample(seconds, N_SAMPLES * n_tokens, tuple(tokens[0][n_prompt:]))


def _one_after_another(bench: Bench, n_tokens: int) -> Sample:
    model, work = bench.lcgen.model, bench.work
    sample = _sampler(model, work, n_tokens)
    prompt, n_prompt = _prompt(model, work)
    n_before = model.context.n_decoded
    first: tuple[int, ...] = ()
    start = time.perf_counter()
    for j in range(N_SAMPLES):
        with sample(prompt, seed=SEED + j) as state:  # closed: the next run starts afresh
            first = first or tuple(state.tokens[0][0][n_prompt:])
    seconds = time.perf_counter() - start
    expected = N_SAMPLES * (n_prompt + n_tokens - 1)
    check_count("one after another", model.context.n_decoded - n_before, expected)
    return Sample(seconds, N_SAMPLES * n_tokens, first)


def continuous_row(work: Workload) -> Row:
    n = min(work.n_tokens, MAX_TOKENS)
    return Row(
        "continuous",
        f"{N_SAMPLES} samples (temperature 0.8, seeds {SEED}+j, end-of-generation banned) of "
        f"{n} tokens after the {len(work.prompt)}-token prompt, timed end to end through "
        f"lcgen.continuous: one call with num_samples={N_SAMPLES} (the prompt decoded once, "
        f"then one batch per step) against {N_SAMPLES} calls one after another (each decodes "
        "the prompt); tokens/s = generated tokens / time",
        {"together": "tokens/s", "one after another": "tokens/s"},
        interleaved(
            {
                "together": lambda b: _together(b, n),
                "one after another": lambda b: _one_after_another(b, n),
            }
        ),
        (Check("together", "one after another", at_least(TOGETHER_MIN_RATIO)),),
    )


FACTORIES: dict[str, RowFactory] = {"continuous": continuous_row}
