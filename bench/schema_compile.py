"""The schema-compile row: how long a JSON Schema takes to become a grammar, over the official
JSON-Schema-Test-Suite's groups (drafts 2020-12, 7 and 4; ``make test`` unpacks the suite from
``jsonschema``'s sdist into the venv).

Each round compiles every group's schema three ways and reports the median and the 99th
percentile of the per-schema times, in ms:

- ``Grammar.from_json_schema`` (lcgen's converter and llama.cpp's parse of the GBNF it writes,
  which the constructor runs);
- ``with masks``: that, then the grammar compiled for full-vocabulary masks on the bench's model
  (:func:`lcgen.constrain.llg.compile_matcher`: the translation to Lark and llguidance's
  compile), what a new schema costs before its first mask (``GrammarState`` keeps it);
- ``llguidance``: llguidance 1.9.1 compiling the schema by itself on the same vocabulary.

Refused schemas (a ``GrammarError`` naming the keyword; an error state in llguidance) count
too, since refusing takes time as well.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llguidance import LLMatcher, grammar_from

import lcgen
from bench.harness import Bench, Check, Row, RowFactory, SkipRow
from bench.runners import Sample, Workload
from lcgen.constrain import llg
from lcgen.vocab import Vocab

SUITE = Path(__file__).resolve().parent.parent / ".venv/schema-suite/jsonschema-4.26.0/json/tests"
DRAFTS = {
    "draft2020-12": "https://json-schema.org/draft/2020-12/schema",
    "draft7": "http://json-schema.org/draft-07/schema#",
    "draft4": "http://json-schema.org/draft-04/schema#",
}


def suite_groups() -> list[tuple[str, dict[str, Any]]]:
    """Every group of the suite, named by draft, file and description, its schema with its
    draft's ``$schema`` where it names none."""
    groups = []
    for draft, uri in DRAFTS.items():
        for path in sorted((SUITE / draft).glob("*.json")):
            for group in json.loads(path.read_text(encoding="utf-8")):
                schema = group["schema"]
                if isinstance(schema, dict) and "$schema" not in schema:
                    group = {**group, "schema": {**schema, "$schema": uri}}
                groups.append((f"{draft}/{path.name}: {group['description']}", group))
    return groups


def remotes() -> dict[str, Any]:
    """The documents the suite's references name, by URI (as its own harness serves them)."""
    folder = SUITE.parent / "remotes"
    return {
        f"http://localhost:1234/{path.relative_to(folder).as_posix()}": json.loads(
            path.read_text(encoding="utf-8")
        )
        for path in sorted(folder.rglob("*.json"))
    }


def _lcgen(schema: Any, vocab: Vocab | None, documents: dict[str, Any]) -> None:
    with contextlib.suppress(lcgen.GrammarError):
        grammar = lcgen.Grammar.from_json_schema(schema, documents=documents)
        if vocab is not None:
            llg.compile_matcher(grammar.gbnf, grammar.root, vocab)


def _llguidance(schema: Any, vocab: Vocab) -> None:
    LLMatcher(llg.tokenizer(vocab), grammar_from("json_schema", json.dumps(schema)), log_level=0)


def _round(schemas: list[Any], vocab: Vocab, documents: dict[str, Any]) -> dict[str, Sample]:
    compilers: dict[str, Callable[[Any], None]] = {
        "": lambda schema: _lcgen(schema, None, documents),
        "with masks ": lambda schema: _lcgen(schema, vocab, documents),
        "llguidance ": lambda schema: _llguidance(schema, vocab),
    }
    llg.tokenizer(vocab)  # built once per vocabulary, before timing
    out = {"schemas": Sample(1.0, len(schemas))}
    for name, compile_ in compilers.items():
        times = []
        for schema in schemas:
            start = time.perf_counter()
            compile_(schema)
            times.append(time.perf_counter() - start)
        out[f"{name}p50"] = Sample(statistics.median(times), 1)
        out[f"{name}p99"] = Sample(statistics.quantiles(times, n=100)[98], 1)
    return out


def compile_row(work: Workload) -> Row:
    del work
    if not SUITE.is_dir():
        raise SkipRow(f"the JSON-Schema-Test-Suite is not at {SUITE}: run `make test` once")
    schemas = [group["schema"] for _, group in suite_groups()]
    documents = remotes()

    def round_(bench: Bench, r: int) -> dict[str, Sample]:
        del r
        return _round(schemas, bench.lcgen.model.vocab, documents)

    names = ("p50", "p99", "with masks p50", "with masks p99", "llguidance p50", "llguidance p99")
    return Row(
        "schema-compile",
        f"ms per schema over the {len(schemas)} groups of the JSON-Schema-Test-Suite (drafts "
        "2020-12, 7, 4): Grammar.from_json_schema (lcgen's converter and llama.cpp's parse of "
        "its GBNF; the suite's other documents given as documents=); 'with masks': that and "
        "the grammar's compile for full-vocabulary masks on the bench's model (the translation "
        "to Lark and llguidance's compile, once per schema); 'llguidance': llguidance 1.9.1 "
        "compiling the schema by itself on the same vocabulary; refused schemas included; "
        "median and 99th percentile of one round",
        {**dict.fromkeys(names, "ms"), "schemas": "count"},
        round_,
        (Check("p50"), Check("p99"), Check("with masks p50", "llguidance p50")),
    )


FACTORIES: dict[str, RowFactory] = {"schema-compile": compile_row}
