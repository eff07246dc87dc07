"""``uniqueItems``: arrays whose items must differ, held to while the JSON is generated (no
grammar can say it): the scan's verdicts agree with jsonschema's, every output validates, a
generation that would repeat an item draws another token there and is otherwise the same."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lcgen
from lcgen import Grammar, generate
from lcgen.constrain.unique import UniqueItems
from lcgen.continuous import continuous

UNIQUE_ARRAY = {"type": "array", "uniqueItems": True}
DIGITS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 6,
    "maxItems": 6,
    "uniqueItems": True,
}
REPEATS = "Six ones: [1, 1, 1, 1, 1, 1]. Six ones again, as a JSON array:"

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([1.0, 0.0, -2.5, 2.50])
    | st.sampled_from(["", "a", "b", 'q"', "é"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(json_values, max_size=5), st.sampled_from([None, 1, "\t"]))
def test_the_scan_judges_repeats_as_jsonschema_does(items: list[Any], indent: Any) -> None:
    # JSON equality: 1 is 1.0, true is not 1, objects whatever their key order.
    text = json.dumps(items, indent=indent)
    valid = jsonschema.Draft202012Validator(UNIQUE_ARRAY).is_valid(items)
    assert UniqueItems.of(UNIQUE_ARRAY).duplicate_in(text) is not valid, text


def test_only_the_arrays_the_schema_marks_are_held() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "uniqueItems": True},
            "free": {"type": "array"},
            "rows": {"type": "array", "items": {"$ref": "#/$defs/row"}},
        },
        "patternProperties": {"^s_": {"type": "array", "uniqueItems": True}},
        "$defs": {"row": {"anyOf": [{"type": "null"}, {"type": "array", "uniqueItems": True}]}},
    }
    unique = UniqueItems.of(schema)
    assert unique.duplicate_in('{"tags": [1, 2, 1]}')
    assert unique.duplicate_in('{"tags": [[1, "a"], [1, "a"]]}')
    assert not unique.duplicate_in('{"tags": [1, 2], "free": [1, 1]}')
    assert unique.duplicate_in('{"rows": [null, [3, 3]]}')  # through $ref and anyOf
    assert not unique.duplicate_in('{"rows": [null, null]}')  # the outer array is free
    assert unique.duplicate_in('{"s_x": ["a", "a"]}')
    assert not unique.duplicate_in('{"t_x": ["a", "a"]}')
    assert not unique.duplicate_in('{"tags": ["a", "b"')  # open: nothing repeated yet
    assert unique.duplicate_in('{"tags": ["a", "a"')  # the string ended: it repeats
    assert unique.duplicate_in('{"tags": [10, 10 ')  # a number ends at what follows it
    assert not unique.duplicate_in('{"tags": [10, 10')  # ...which may be another digit
    assert not unique.duplicate_in("plain text [1, 1]")  # not JSON: nothing is held


def test_a_scan_reports_where_the_repeat_ended() -> None:
    scan = UniqueItems.of(UNIQUE_ARRAY).scan('["ab", "a')
    assert scan.held_from == len('["ab", ')  # the open item: a rewind may reach back there
    assert scan.copy().feed('b"') == len('["ab", "ab')  # a copy reads on its own
    assert scan.feed('c"') is None and scan.held_from is None


def test_schemas_and_pydantic_sets_compile_and_accept_only_unique_items(
    model: lcgen.Model,
) -> None:
    class Post(pydantic.BaseModel):
        title: str
        tags: set[str]
        ids: frozenset[int]

    grammar = Grammar.from_pydantic(Post)
    assert grammar.unique is not None
    assert grammar.accepts(model, '{"title": "x", "tags": ["a", "b"], "ids": [1, 2]}')
    assert not grammar.accepts(model, '{"title": "x", "tags": ["a", "a"], "ids": [1, 2]}')
    assert not grammar.accepts(model, '{"title": "x", "tags": [], "ids": [1, 1.0]}')
    assert Grammar.from_json_schema({"type": "array"}).unique is None
    assert Grammar.from_json_schema({**UNIQUE_ARRAY, "maxItems": 1}).unique is None
    # a state part way: the items before it count
    with grammar.state(model) as state:
        for token in model.tokenize('{"title": "x", "tags": ["a"'):
            state.accept(token)
        assert state.accepts_text(', "b"], "ids": []}')
        assert not state.accepts_text(', "a"], "ids": []}')


def test_items_of_few_values_bound_the_array() -> None:
    flags = {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}
    with pytest.raises(lcgen.GrammarError, match=r"uniqueItems with minItems 3 .* 2 values"):
        Grammar.from_json_schema({**flags, "minItems": 3})
    days = {"type": "array", "items": {"enum": ["mon", "tue", 1, 1.0]}, "uniqueItems": True}
    grammar = Grammar.from_json_schema(days)  # three values: 1 and 1.0 are one
    assert "{0,2}" in grammar.gbnf  # at most three items: the grammar ends the array there


def _scan_all(schema: dict[str, Any], text: str) -> int | None:
    return UniqueItems.of(schema).scan().feed(text)


def test_a_generation_that_would_repeat_draws_another_token(model: lcgen.Model) -> None:
    free = {key: value for key, value in DIGITS.items() if key != "uniqueItems"}
    chunks = list(model.stream(REPEATS, schema=free, temperature=0, fast_forward=False))
    plain = "".join(c.text for c in chunks)
    at = _scan_all(DIGITS, plain)
    assert at is not None, plain  # the model repeats itself without uniqueItems
    out = model.generate(REPEATS, schema=DIGITS, temperature=0, max_tokens=60)
    jsonschema.validate(out, DIGITS)
    text = json.dumps(out)
    assert _scan_all(DIGITS, text) is None
    # The same until the item that repeated an earlier one (where no other token could end
    # the item, "1" of at most 9, the token before was taken back: inside the item only).
    item = UniqueItems.of(DIGITS).scan(plain[:at]).held_from
    assert item is not None and plain[item] == "1"
    streamed = model.stream(REPEATS, schema=DIGITS, temperature=0, max_tokens=60)
    unique_text = "".join(c.text for c in streamed)
    assert unique_text.startswith(plain[:item]) and unique_text != plain
    assert json.loads(unique_text) == out
    stats = model.generate(REPEATS, grammar=Grammar.from_json_schema(DIGITS), temperature=0)
    assert stats.stats.resamples > 0  # what kept the items apart
    for seed in range(4):
        value = model.generate(REPEATS, schema=DIGITS, temperature=0.8, seed=seed, max_tokens=60)
        jsonschema.validate(value, DIGITS)


def test_a_stream_joins_to_what_generate_returns(model: lcgen.Model) -> None:
    days = {
        "type": "object",
        "required": ["days"],
        "additionalProperties": False,
        "properties": {
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "minItems": 5,
                "uniqueItems": True,
            }
        },
    }
    prompt = 'All weekdays, each once, as JSON like {"days": ["mon", "mon", "mon"]}:'
    for seed in range(3):
        options: dict[str, Any] = {"temperature": 0.9, "seed": seed, "max_tokens": 80}
        text = model.generate(prompt, grammar=Grammar.from_json_schema(days), **options)
        chunks = list(model.stream(prompt, schema=days, **options))
        assert "".join(c.text for c in chunks) == text
        value = json.loads(text)
        jsonschema.validate(value, days)
        assert sorted(value["days"]) == sorted(days["properties"]["days"]["items"]["enum"])


def test_a_repeat_no_token_can_avoid_ends_as_incomplete(model: lcgen.Model) -> None:
    # The second item must be 1, as the first is: no output validates; the retries end it.
    stuck = {"type": "array", "prefixItems": [{"const": 1}], "items": {"const": 1}}
    schema = {**stuck, "minItems": 2, "uniqueItems": True}
    with pytest.raises(lcgen.IncompleteOutputError):
        model.generate("Ones:", schema=schema, temperature=0, max_tokens=20)


def test_beams_keep_the_items_apart(model: lcgen.Model) -> None:
    # A candidate that would repeat an item is no beam's continuation.
    with continuous(generate.json(model, DIGITS, beams=3, max_tokens=60))(REPEATS) as state:
        assert state.shape[1] >= 2
        for text in state.texts[0]:
            jsonschema.validate(json.loads(text.removeprefix(REPEATS)), DIGITS)


def test_a_tool_taking_a_set_gets_unique_items(model: lcgen.Model) -> None:
    def tag(labels: set[Literal["news", "sports", "tech"]]) -> str:
        """Tag the document with labels."""
        return ",".join(sorted(labels))

    tool = lcgen.Tool.of(tag)
    messages = [{"role": "user", "content": "Tag this article with news, news and news."}]
    reply = model.chat(
        messages, tools=[tool], tool_choice="required", max_tokens=80, json_whitespace="compact"
    )
    (call,) = reply.tool_calls
    labels = call.arguments["labels"]
    assert len(labels) == len(set(labels)), labels
    assert tool.invoke(call) == ",".join(sorted(set(labels)))
