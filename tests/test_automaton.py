"""Automata of object keys: membership equals ``re.search``; the product splits keys by the
patterns they match (leaving out keys that Python's ``re`` and ECMA-262 judge apart); schema
grammars give each pattern-named key exactly its patterns' schemas.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from helpers import validator
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schemas import random_walk

import lcgen
from lcgen.constrain import Grammar, automaton
from lcgen.constrain.gbnf import RuleSet
from lcgen.errors import GrammarError

ATOMS = ["a", "b", "ab", "[ab]", "[^a]", "[a-c1]", ".", r"\d", r"\w", r"\s", r"\W", r"\n", "é"]
QUANTIFIERS = ["", "", "*", "+", "?", "{2}", "{1,2}", "{2,}", "*?"]
TEXTS = st.text(alphabet="ab1c _\né.", max_size=8)


@st.composite
def patterns(draw: st.DrawFn) -> str:
    """Small patterns of the supported subset: pieces, groups, alternation, anchors."""

    def piece() -> str:
        atom = draw(st.sampled_from(ATOMS))
        if len(atom) > 1 and not atom.startswith(("[", "\\")):
            atom = f"({atom})" if draw(st.booleans()) else f"(?:{atom})"
        return atom + draw(st.sampled_from(QUANTIFIERS))

    def branch() -> str:
        body = "".join(piece() for _ in range(draw(st.integers(0, 3))))
        start = draw(st.sampled_from(["", "", "^", r"\A"]))
        end = draw(st.sampled_from(["", "", "$", r"\Z"]))
        return start + body + end

    return "|".join(branch() for _ in range(draw(st.integers(1, 2))))


@settings(max_examples=300, deadline=None)
@given(pattern=patterns(), texts=st.lists(TEXTS, min_size=1, max_size=10))
def test_membership_is_re_search(pattern: str, texts: list[str]) -> None:
    dfa = automaton.product([automaton.search_nfa(pattern)], max_states=10_000)
    for text in texts:
        accepted = dfa.accepts[dfa.end(text)][0]
        assert accepted == (re.search(pattern, text) is not None), (pattern, text)


# ECMA-262's reading of the atoms above, spelled for Python's re (the differences the texts
# below meet: "$" before a final newline, a non-ASCII letter in \w).
ECMA_SPELLING = {
    r"\d": "[0-9]",
    r"\w": "[A-Za-z0-9_]",
    r"\W": "[^A-Za-z0-9_]",
    r"\s": "[\t\n\v\f\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]",
    ".": "[^\n\r\u2028\u2029]",
    "$": r"\Z",
}


def ecma_search(pattern: str, text: str) -> bool:
    spelled = re.sub(r"\\[dwWs]|[.$]", lambda m: ECMA_SPELLING[m[0]], pattern)
    return re.search(spelled, text) is not None


def test_the_ecma_reading_differs_where_the_partition_says() -> None:
    assert re.search("y$", "ay\n") and not ecma_search("y$", "ay\n")
    assert re.search(r"^\w$", "é") and not ecma_search(r"^\w$", "é")
    assert ecma_search(r"^\w.\Z", "a ") and not ecma_search(".", "\u2028")


@settings(max_examples=100, deadline=None)
@given(
    pats=st.lists(patterns(), min_size=1, max_size=3),
    names=st.lists(TEXTS, max_size=3),
    texts=st.lists(TEXTS, min_size=1, max_size=10),
)
def test_the_partition_is_by_the_patterns_matched(
    pats: list[str], names: list[str], texts: list[str]
) -> None:
    try:
        dfa, classes = automaton.partition(pats, names)
    except automaton.TooLarge:
        return
    where = {state: matched for matched, states in classes.items() for state in states}
    for text in [*texts, *names]:
        expected = frozenset(i for i, p in enumerate(pats) if re.search(p, text))
        apart = expected != {i for i, p in enumerate(pats) if ecma_search(p, text)}
        got = where.get(dfa.end(text))
        if text in names or apart:
            assert got is None, text
        else:  # (a few keys both readings agree on are left out too: fewer, never wrong)
            assert got in (None, expected), text


@pytest.mark.parametrize(
    ("pats", "names", "required", "key", "matched"),
    [
        (["a*", "aaa*"], ["foo"], [], "a", {0}),
        (["a*", "aaa*"], ["foo"], [], "xaay", {0, 1}),
        (["a*", "aaa*"], ["foo"], [], "", {0}),
        (["a*", "aaa*"], ["foo"], [], "foo", None),
        (["^x-", "y$"], ["x-y"], [], "x-a", {0}),
        (["^x-", "y$"], ["x-y"], [], "ay\n", None),  # ECMA-262's $ is the very end
        (["^x-", "y$"], ["x-y"], [], "x-ay\n", None),
        (["^x-", "y$"], ["x-y"], [], "x-y", None),
        (["^x-", "y$"], ["x-y"], [], "x-yy", {0, 1}),
        (["^x-", "y$"], ["x-y"], [], "b", set()),
        (["^x-", r"y\Z"], [], [], "ay\n", set()),
        (["[0-9]{2,}", "X_"], [], [], "answer 1", set()),
        (["[0-9]{2,}", "X_"], [], [], "a_x_3", set()),
        (["[0-9]{2,}", "X_"], [], [], "aX_12", {0, 1}),
        (["^a"], [], ["^[a-z]+$"], "ab", {0}),
        (["^a"], [], ["^[a-z]+$"], "Ab", None),
        (["^a"], [], ["^[a-z]+$"], "bc", set()),
        (["^a"], [], ["^[a-z]+$"], "ab\n", None),
        ([r"^\w+$", "b"], [], [], "éb", None),  # \w: Unicode in Python, ASCII in ECMA-262
        ([r"^\w+$", "b"], [], [], "ab", {0, 1}),
        ([r"^\W"], [], [], "é", None),
        ([r"^\w*\W"], [], [], "a.", {0}),
        ([r"^\d"], [], [], "\u0663", None),
    ],
)
def test_partition_table(
    pats: list[str], names: list[str], required: list[str], key: str, matched: set[int] | None
) -> None:
    dfa, classes = automaton.partition(pats, names, required)
    found = [k for k, states in classes.items() if dfa.end(key) in states]
    assert found == ([] if matched is None else [frozenset(matched)])


def test_a_product_over_the_cap_raises() -> None:
    with pytest.raises(automaton.TooLarge):
        automaton.partition(["a{600}"], [])
    with pytest.raises(GrammarError, match="anchor"):
        automaton.search_nfa("a^b")


def test_keys_are_written_as_json_string_bodies() -> None:
    dfa, classes = automaton.partition(["\n", '"'], [])
    rules = RuleSet()
    start = automaton.to_gbnf(dfa, classes[frozenset({0, 1})], rules, "k")
    assert start is not None
    text = rules.text(start)
    assert '"\\\\n"' in text and '"\\\\\\""' in text  # the escapes \n and \" of JSON
    assert automaton.to_gbnf(dfa, [], rules, "k") is None


# schema grammars -------------------------------------------------------------------------------
OVERLAP = {"patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}}}
SCHEMAS: list[tuple[dict[str, Any], list[Any], list[Any]]] = [
    (OVERLAP, [{"a": 21}, {"a": 21, "aaaa": 18}, {"b": 3}, {}], [{"aaaa": 21}, {"a": "x"}]),
    (
        {"patternProperties": {"^x-": {"type": "integer"}, "^y-": {"type": "string"}}},
        [{"x-a": 1, "y-b": "s", "z": None}, {"zz": [1]}],
        [{"x-a": "s"}, {"y-b": 1}],
    ),
    (
        {
            "patternProperties": {"^x-": {"type": "integer"}, "^y-": {"type": "string"}},
            "additionalProperties": False,
        },
        [{"x-a": 1, "y-b": "s"}, {}],
        [{"z": None}, {"x-a": 1, "zz": 2}],
    ),
    (
        {
            "properties": {"x-a": {"minimum": 5}, "other": {"type": "null"}},
            "patternProperties": {"^x-": {"type": "integer"}, "b": False},
            "additionalProperties": {"type": "boolean"},
        },
        [{"x-a": 7, "other": None, "x-c": 1, "q": True}],  # declared ones first, in order
        [{"x-a": 3}, {"x-a": 5.5}, {"ab": 1}, {"q": 1}, {"other": 1}],
    ),
    (
        {
            "propertyNames": {"pattern": "^[a-z]+$"},
            "patternProperties": {"^a": {"type": "integer"}},
        },
        [{"ab": 1, "cd": "x"}],
        [{"Ab": 1}, {"ab": "x"}],
    ),
]


def _valid(schema: dict[str, Any], value: Any) -> bool:
    return bool(validator(schema).is_valid(value))


@pytest.mark.parametrize(("schema", "valid", "invalid"), SCHEMAS)
def test_pattern_keys_take_exactly_their_patterns_schemas(
    model: lcgen.Model, schema: dict[str, Any], valid: list[Any], invalid: list[Any]
) -> None:
    assert all(_valid(schema, v) for v in valid) and not any(_valid(schema, v) for v in invalid)
    with Grammar.from_json_schema(schema).state(model) as state:
        for value in valid:
            assert state.accepts_text(json.dumps(value)), value
        for value in invalid:
            assert not state.accepts_text(json.dumps(value)), value
        walks = [random_walk(model, state, seed, json.dumps(valid[0])) for seed in range(4)]
    finished = [text for text in walks if text is not None]
    assert finished
    for text in finished:
        assert _valid(schema, json.loads(text)), text


def test_too_many_states_falls_back_to_the_narrower_grammar(model: lcgen.Model) -> None:
    schema = {"patternProperties": {"a{600}": {"type": "integer"}, "b": {"type": "integer"}}}
    with Grammar.from_json_schema(schema).state(model) as state:
        assert state.accepts_text('{"b": 1}')
        assert not state.accepts_text('{"b": "x"}')
