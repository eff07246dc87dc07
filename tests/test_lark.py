"""lcgen's GBNF in llguidance's Lark dialect (:mod:`lcgen.constrain.lark`) matches exactly the
texts llama.cpp's grammar matches: every instance of the JSON-Schema-Test-Suite, every bundled
grammar's table, and random JSON texts and their cuts, walked token by token through both
engines on the same vocabulary, with the same verdict and the same "can end here"."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

import lcgen
from bench.schema_compile import SUITE, suite_groups
from lcgen.constrain import Grammar, GrammarState, llg
from lcgen.constrain.lark import Cls, Seq, parse, to_lark
from lcgen.errors import GrammarError
from tests.test_grammar import BUNDLED


@pytest.fixture(scope="module")
def tokenizer(model: lcgen.Model) -> Any:
    return llg.tokenizer(model.vocab)


def _verdicts(
    grammar: Grammar, model: lcgen.Model, tokenizer: Any, texts: list[str]
) -> Iterator[tuple[str, tuple[bool, bool], tuple[bool, bool]]]:
    """For each text: (accepted as a prefix, complete) by llama.cpp and by llguidance."""
    compiled = LLMatcher.grammar_from_lark(to_lark(grammar.gbnf, grammar.root))
    for text in texts:
        with GrammarState(grammar, model) as state:
            tokens = model.vocab.spell(text.encode("utf-8"))
            matcher = LLMatcher(tokenizer, compiled, log_level=0)
            assert not matcher.is_error(), matcher.get_error()
            ours = theirs = True
            for token in tokens:
                ours = state.try_accept(token)
                theirs = matcher.consume_token(token) and not matcher.is_error()
                if not (ours and theirs):
                    break
            yield (
                text,
                (ours, ours and state.is_complete),
                (theirs, theirs and matcher.is_accepting()),
            )


def test_the_test_suite_reads_the_same(model: lcgen.Model, tokenizer: Any) -> None:
    assert SUITE.is_dir(), f"{SUITE} is missing: run `make test` (it unpacks the suite)"
    compared = with_spans = 0
    for name, group in suite_groups():
        try:
            grammar = Grammar.from_json_schema(group["schema"])
        except GrammarError:
            continue
        with_spans += "\nT0: " in to_lark(grammar.gbnf)
        texts = [json.dumps(case["data"]) for case in group["tests"]]
        for text, ours, theirs in _verdicts(grammar, model, tokenizer, texts):
            assert ours == theirs, (name, text)
            compared += 1
    assert compared > 2000
    assert with_spans > 400  # most schema grammars keep their strings as one lexeme each


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_grammars_read_the_same(model: lcgen.Model, tokenizer: Any, name: str) -> None:
    good, bad = BUNDLED[name]
    grammar = Grammar.bundled(name)
    cuts = [t[:k] for t in good for k in range(0, len(t), 3)]
    for text, ours, theirs in _verdicts(grammar, model, tokenizer, good + bad + cuts):
        assert ours == theirs, text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values, cut=st.integers(0, 60), indent=st.sampled_from([None, 1]))
def test_random_json_and_its_cuts_read_the_same(
    model: lcgen.Model, tokenizer: Any, value: Any, cut: int, indent: int | None
) -> None:
    text = json.dumps(value, indent=indent)
    grammar = Grammar.from_json_schema({"type": "object", "additionalProperties": True})
    texts = [text, text[:cut], text + "}", '{"a": ' + text + "}"]
    for each, ours, theirs in _verdicts(grammar, model, tokenizer, texts):
        assert ours == theirs, each


def test_prefix_trees_read_the_same(model: lcgen.Model, tokenizer: Any) -> None:
    # A choice or an enum is a prefix tree (shared prefixes, options that are prefixes of
    # others, deep nodes in rules of their own): the same verdicts, prefixes included.
    options = ["a" * n for n in range(1, 40)] + ["ab", 'a"b', "a\\", "é", "v1", "v10", "v2"]
    values: list[Any] = [*options, 1, 10, 1.5, None, [1], {"a": "é"}]
    for grammar, texts in (
        (Grammar.choice(options), options),
        (Grammar.from_json_schema({"enum": values}), [json.dumps(v) for v in values]),
    ):
        probes = [t[:n] for t in texts for n in range(len(t) + 1)] + [t + "0" for t in texts]
        for each, ours, theirs in _verdicts(grammar, model, tokenizer, probes):
            assert ours == theirs, each


def test_an_enum_of_strings_is_one_lexeme() -> None:
    # The prefix tree of JSON strings reads as one JSON string: one span, no one-character
    # lexemes (inside a string a mask is the lexer's work alone).
    lark = to_lark(Grammar.from_json_schema({"enum": [f"v{i}" for i in range(300)]}).gbnf)
    assert "\nT0: " in lark and "T1" not in lark


def test_strings_become_one_lexeme_only_where_no_lone_quote_can_match() -> None:
    schema = Grammar.from_json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    assert "\nT0: " in to_lark(schema.gbnf)
    # A quote matched on its own next to a string span would make the span's lexeme the
    # longer match and hide the other path: no spans then.
    mixed = 'root ::= "\\"" "x" | "\\"xy\\""'
    assert "T0" not in to_lark(mixed)
    assert "T0" in to_lark('root ::= "\\"xy\\"" | "\\"" [a-z]* "\\""')


@pytest.mark.parametrize(
    ("gbnf", "message"),
    [
        ("root ::= <[1000]>", "unexpected '<'"),
        ('root ::= "a" other', "no rule 'other'"),
        ('start ::= "a"', "no rule 'root'"),
        ('root ::= "\\q"', "unknown escape"),
        ('root ::= "abc', "unterminated string"),
        ("root ::= [abc", "unterminated character class"),
        ('root ::= ("a"', "expected ')'"),
        ('root ::= "a"{2,x}', "bad repetition"),
        ('root ::= "a"\nroot ::= "b"', "rule 'root' is defined twice (lines 1 and 2)"),
        ('root ::= "\\U00110000"', "the escape \\U00110000 in a literal on line 1"),
        ("root ::= [a-\\U00110000]", "\\U00110000 in a character class on line 1"),
        ('root ::= "\\uDBFF"', "lone surrogate (U+DBFF)"),
        ('root ::= "\udbff"', "lone surrogate U+DBFF"),
    ],
)
def test_what_it_does_not_take_is_a_grammar_error(gbnf: str, message: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        to_lark(gbnf)


def test_parse_follows_llama_cpp_layout() -> None:
    rules = parse('root ::= a |\n  "b"  # a comment\na ::= ("x"\n  "y")+ [^\\n]{2,} . | "z"')
    assert set(rules) == {"root", "a"}
    assert "Alt" in type(rules["a"]).__name__


def test_surrogates_leave_classes() -> None:
    """No UTF-8 text holds a surrogate (llama.cpp's would match one, lcgen keeps text valid
    UTF-8); llguidance's regular expressions take no surrogate as a character."""
    rules = parse("root ::= [\\uD800-\\uDFFF] [a\\uD7F0-\\uE00F] [^\\uDC00z]")
    assert rules["root"] == Seq(
        (
            Cls(False, ()),
            Cls(False, ((0x61, 0x61), (0xD7F0, 0xD7FF), (0xE000, 0xE00F))),
            Cls(True, ((0x7A, 0x7A),)),
        )
    )


def test_a_class_over_surrogates_reads_the_same(model: lcgen.Model, tokenizer: Any) -> None:
    grammar = Grammar("root ::= [\\u00E0-\\uDFFF]+ [^\\uD800-\\uDFFF]?")
    texts = ["é", "éa", "\ud7ff\ue000", "\ue000", "日本語", "a"]
    for text, ours, theirs in _verdicts(grammar, model, tokenizer, texts):
        assert ours == theirs, text
