"""The schema-compile row: how long a JSON Schema takes to become a grammar, over the official
JSON-Schema-Test-Suite's groups (drafts 2020-12, 7 and 4; ``make test`` unpacks the suite from
``jsonschema``'s sdist into the venv).

Each round compiles every group's schema with ``Grammar.from_json_schema`` (lcgen's converter
and llama.cpp's parse of the GBNF it writes, which the constructor runs) and reports the median
and the 99th percentile of the per-schema times, in ms; schemas lcgen refuses (a
``GrammarError`` naming the keyword) count too, since refusing takes time as well.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lcgen
from bench.harness import Bench, Check, Row, RowFactory, SkipRow
from bench.runners import Sample, Workload

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


def _round(schemas: list[Any]) -> dict[str, Sample]:
    times = []
    for schema in schemas:
        start = time.perf_counter()
        with contextlib.suppress(lcgen.GrammarError):
            lcgen.Grammar.from_json_schema(schema)
        times.append(time.perf_counter() - start)
    cut = statistics.quantiles(times, n=100)
    return {
        "p50": Sample(statistics.median(times), 1),
        "p99": Sample(cut[98], 1),
        "schemas": Sample(1.0, len(times)),
    }


def compile_row(work: Workload) -> Row:
    del work
    if not SUITE.is_dir():
        raise SkipRow(f"the JSON-Schema-Test-Suite is not at {SUITE}: run `make test` once")
    schemas = [group["schema"] for _, group in suite_groups()]

    def round_(bench: Bench, r: int) -> dict[str, Sample]:
        del bench, r
        return _round(schemas)

    return Row(
        "schema-compile",
        f"ms per schema for Grammar.from_json_schema over the {len(schemas)} groups of the "
        "JSON-Schema-Test-Suite (drafts 2020-12, 7, 4): lcgen's converter and llama.cpp's parse "
        "of its GBNF; refused schemas included; median and 99th percentile of one round",
        {"p50": "ms", "p99": "ms", "schemas": "count"},
        round_,
        (Check("p50"), Check("p99")),
    )


FACTORIES: dict[str, RowFactory] = {"schema-compile": compile_row}
