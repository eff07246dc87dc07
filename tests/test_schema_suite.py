"""The official JSON-Schema-Test-Suite (drafts 2020-12, 7 and 4), walked through lcgen's schema
grammars: every valid instance (``json.dumps``) should be accepted, no invalid one ever.

The suite ships inside ``jsonschema``'s sdist; ``make test`` unpacks it into the venv. Measured
(SmolLM2's vocabulary), with the suite's other documents given by URI as its own harness
serves them: 781 groups, 2,780 instances; 37 groups refused with a
``GrammarError``; 0 invalid instances accepted; 30 valid instances rejected, each by a stated
narrowing: 11 by formats lcgen asserts where the suite treats ``format`` as an annotation (not
counted below), 16 by the fixed property order, 2 by ``1.0`` as an integer, 1 by a custom
metaschema's vocabulary (a key named by patterns takes the schemas of just the patterns it
matches, non-ASCII characters pass escaped as ``json.dumps`` writes them, and ``multipleOf``
is exact decimal arithmetic: none of those cases is rejected). The bounds below hold those
figures.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

import lcgen
from bench.schema_compile import SUITE, remotes, suite_groups
from lcgen.constrain import Grammar, GrammarState
from lcgen.errors import GrammarError

MAX_REFUSED = 37
MAX_REJECTED = 19  # not counting the 11 format cases
# Formats are asserted (a generated date is a date): the suite's cases that call an invalid
# date "only an annotation" are rejected by design.
ANNOTATION_ONLY = "only an annotation by default"


def _groups() -> list[tuple[str, dict[str, Any]]]:
    assert SUITE.is_dir(), f"{SUITE} is missing: run `make test` (it unpacks the suite)"
    return suite_groups()


@pytest.fixture(scope="module")
def walk(model: lcgen.Model) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    rejected, accepted_invalid = [], []
    documents = remotes()  # (the documents the suite refers to, by URI)
    for name, group in _groups():
        counts["groups"] += 1
        try:
            grammar = Grammar.from_json_schema(group["schema"], documents=documents)
        except GrammarError:
            counts["refused"] += 1
            continue
        with GrammarState(grammar, model) as state:
            for case in group["tests"]:
                text = json.dumps(case["data"])
                accepted = state.accepts_text(text)
                if case["valid"] and not accepted and ANNOTATION_ONLY not in case["description"]:
                    rejected.append((name, case["description"], text))
                if not case["valid"] and accepted:
                    accepted_invalid.append((name, case["description"], text))
    return {"counts": counts, "rejected": rejected, "accepted_invalid": accepted_invalid}


def test_no_invalid_instance_is_ever_accepted(walk: dict[str, Any]) -> None:
    assert walk["accepted_invalid"] == []


def test_refused_groups_stay_within_the_measured_bound(walk: dict[str, Any]) -> None:
    counts = walk["counts"]
    assert counts["groups"] == 781
    assert counts["refused"] <= MAX_REFUSED, counts


def test_rejected_valid_instances_stay_within_the_measured_bound(walk: dict[str, Any]) -> None:
    assert len(walk["rejected"]) <= MAX_REJECTED, walk["rejected"]
