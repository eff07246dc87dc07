"""The mask-gemma row: what a full-vocabulary mask costs on Gemma 3's 262k vocabulary, step by
step along a JSON text: lcgen's ``GrammarState.allowed()`` (llguidance's mask of lcgen's grammar
translated to Lark, made to read as llama.cpp's), the same state's mask by llama.cpp's grammar
(what lcgen used before, and still uses for grammars that do not translate), and llguidance with
the schema compiled by itself, on the same vocabulary.

A mask is what a constraint costs when the sampled token is refused (lcgen samples first and
checks that one token; only then is the whole vocabulary masked), for every step of a
constrained beam, and for a constrained token's alternatives in log-probabilities. Each round
walks the tokens of one valid instance of the bench's COMPANY schema, computing the mask at
each step (after the previous token), and reports the median and 99th percentile over the open
steps (more than 1,000 tokens allowed: inside strings and numbers) in ms. What is built once
per model and grammar (llguidance's tokenizer of the vocabulary, about a second; the compiled
grammar) is built before timing.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import numpy as np
from llguidance import LLMatcher, grammar_from
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

import lcgen
from bench.constrained import COMPANY, GEMMA_MODEL
from bench.harness import Bench, Check, Lazy, Row, RowFactory, SkipRow, at_most
from bench.runners import Sample, Workload
from lcgen.constrain import llg
from lcgen.registry import resolve

# The constraints issue's targets for a full mask on Gemma 3 inside a JSON string.
MAX_P50_MS = 0.2
MAX_P99_MS = 2.0
LLAMA = "lcgen, llama.cpp's grammar"
OPEN = 1000  # steps with more tokens allowed than this are "open"
INSTANCE = {
    "company": "Acme Tools",
    "founded": 1987,
    "employees": 250,
    "address": {
        "street": "12 Harbour Street",
        "city": "Bristol",
        "postal_code": "BS1 5TR",
        "country": "United Kingdom",
    },
}

Walk = Callable[[list[int]], list[tuple[float, int]]]  # tokens -> (seconds, allowed) per step


def _lcgen_walks(model: lcgen.Model) -> dict[str, Walk]:
    grammar = lcgen.Grammar.from_json_schema(COMPANY)
    grammar.check(model)  # builds the vocabulary's tokenizer and the compiled grammar

    def walk_of(mask: Callable[[lcgen.GrammarState], np.ndarray]) -> Walk:
        def walk(tokens: list[int]) -> list[tuple[float, int]]:
            steps = []
            with grammar.state(model) as state:
                for token in tokens:
                    start = time.perf_counter()
                    allowed = mask(state)
                    steps.append((time.perf_counter() - start, int(allowed.sum())))
                    state.accept(token)
            return steps

        return walk

    return {
        "lcgen": walk_of(lambda state: state.allowed()),
        LLAMA: walk_of(lambda state: state._allowed_by_llama()),
    }


def _llguidance_walk(model: lcgen.Model) -> Walk:
    tokenizer = llg.tokenizer(model.vocab)
    grammar = grammar_from("json_schema", json.dumps(COMPANY))

    def walk(tokens: list[int]) -> list[tuple[float, int]]:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        bitmask = allocate_token_bitmask(1, model.n_vocab)
        steps = []
        for token in tokens:
            start = time.perf_counter()
            fill_next_token_bitmask(matcher, bitmask, 0)
            seconds = time.perf_counter() - start
            bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: model.n_vocab]
            steps.append((seconds, int(bits.sum())))
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token} of a valid instance")
        return steps

    return walk


def _percentiles(steps: list[tuple[float, int]]) -> tuple[float, float]:
    times = [seconds for seconds, allowed in steps if allowed > OPEN]
    return statistics.median(times), statistics.quantiles(times, n=100)[98]


def _load(bench: Bench) -> tuple[lcgen.Model, dict[str, Walk]]:
    del bench
    model = lcgen.load(GEMMA_MODEL, n_ctx=256, cache=False)
    return model, {**_lcgen_walks(model), "llguidance": _llguidance_walk(model)}


def mask_row(work: Workload) -> Row:
    del work
    try:
        resolve(GEMMA_MODEL, download=False)
    except lcgen.LcgenError as exc:
        raise SkipRow(f"{GEMMA_MODEL} is not available ({exc})") from None
    loaded: Lazy[tuple[lcgen.Model, dict[str, Walk]]] = Lazy(_load, lambda held: held[0].close())
    text = json.dumps(INSTANCE, indent=2)

    def round_(bench: Bench, r: int) -> dict[str, Sample]:
        del r
        model, walks = loaded.get(bench)
        tokens = model.tokenize(text, add_bos=False)
        out: dict[str, Sample] = {}
        for name, walk in walks.items():
            p50, p99 = _percentiles(walk(tokens))
            out[f"{name} p50"] = Sample(p50, 1)
            out[f"{name} p99"] = Sample(p99, 1)
        return out

    names = ["lcgen", LLAMA, "llguidance"]
    units = {f"{name} {p}": "ms" for name in names for p in ("p50", "p99")}
    checks = [
        Check("lcgen p50", target=at_most(MAX_P50_MS)),
        Check("lcgen p99", target=at_most(MAX_P99_MS)),
        Check(f"{LLAMA} p50", "lcgen p50"),
        Check("lcgen p50", "llguidance p50"),
    ]
    return Row(
        "mask-gemma",
        f"ms for one full-vocabulary mask on {GEMMA_MODEL}'s 262k vocabulary, at each step of "
        "a valid COMPANY JSON text where more than 1,000 tokens are allowed (inside strings "
        "and numbers): lcgen's GrammarState.allowed() (llguidance's mask of lcgen's grammar "
        "translated to Lark), the same state's mask by llama.cpp's grammar, and llguidance "
        "1.9.1 with the JSON schema compiled by itself (same vocabulary); median and 99th "
        "percentile of a walk; tokenizer and compiled grammar built before timing",
        units,
        round_,
        tuple(checks),
        close=loaded.close,
    )


FACTORIES: dict[str, RowFactory] = {"mask-gemma": mask_row}
