"""``uniqueItems``: arrays whose items must differ, held to while the JSON is generated (no
grammar can say it): the scan's verdicts agree with jsonschema's, every output validates, a
generation that would repeat an item draws another token there and is otherwise the same."""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import pickle
from typing import Any, Literal

import jsonschema
import pydantic
import pytest
from helpers import UNIQUE_DIGITS
from hypothesis import given, settings
from hypothesis import strategies as st

import lcgen
from lcgen import Grammar, generate
from lcgen.constrain.unique import UniqueItems
from lcgen.continuous import continuous

UNIQUE_ARRAY = {"type": "array", "uniqueItems": True}
DIGITS = UNIQUE_DIGITS
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


def test_unevaluated_subschemas_and_the_draft_s_items_are_walked() -> None:
    """unevaluatedProperties/unevaluatedItems hold the values no other keyword names (their
    uniqueItems arrays were let through), and before 2020-12 prefixItems is no keyword:
    ``items`` holds every item."""
    unique_set = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    props = {"properties": {"a": {"type": "array"}}, "unevaluatedProperties": unique_set}
    assert UniqueItems.of(props).duplicate_in('{"b": [1, 1]}')
    assert not UniqueItems.of(props).duplicate_in('{"a": [1, 1]}')
    items = {"prefixItems": [{"type": "array"}], "unevaluatedItems": unique_set}
    assert UniqueItems.of(items).duplicate_in("[0, [1, 1]]")
    assert not UniqueItems.of(items).duplicate_in("[[1, 1]]")
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "prefixItems": [{}]}
    assert UniqueItems.of({**draft7, "items": unique_set}).duplicate_in("[[1, 1]]")
    # an if's schema holds where its then applies (the grammar's then branch is the if too)
    assert UniqueItems.of({"if": unique_set, "else": False}).duplicate_in("[1, 1]")


def test_a_scan_reports_where_the_repeat_ended() -> None:
    scan = UniqueItems.of(UNIQUE_ARRAY).scan('["ab", "a')
    assert scan.held_from == len('["ab"')  # (a rewind may take back the separator too)
    trial = scan.copy()  # a copy reads on its own
    assert trial.feed('b"') == len('["ab", "ab') and trial.repeated == len('["ab", ')
    assert scan.feed('c"') is None and scan.keep().held_from == len('["ab", "ac"')
    # numbers as jsonschema and pydantic read them: a fraction past a float's digits is equal
    assert UniqueItems.of(UNIQUE_ARRAY).duplicate_in("[1.00000000000000001, 1]")
    assert not UniqueItems.of(UNIQUE_ARRAY).duplicate_in("[12345678901234567890, 1.0]")


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
    scan = UniqueItems.of(DIGITS).scan()
    assert scan.feed(plain) is not None, plain  # the model repeats itself without uniqueItems
    out = model.generate(REPEATS, schema=DIGITS, temperature=0, max_tokens=60)
    jsonschema.validate(out, DIGITS)
    text = json.dumps(out)
    assert _scan_all(DIGITS, text) is None
    # The same until the item that repeated an earlier one (a number is taken back whole).
    item = scan.repeated
    assert plain[item] == "1"
    streamed = model.stream(REPEATS, schema=DIGITS, temperature=0, max_tokens=60)
    unique_text = "".join(c.text for c in streamed)
    assert unique_text.startswith(plain[:item]) and unique_text != plain
    assert json.loads(unique_text) == out
    stats = model.generate(REPEATS, grammar=Grammar.from_json_schema(DIGITS), temperature=0)
    assert stats.stats.rewinds + stats.stats.resamples > 0  # what kept the items apart
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


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_items_of_a_domain_used_up_end_the_array(model: lcgen.Model, whitespace: str) -> None:
    # Every value used, the next item can only repeat one: the separator before it is taken
    # back too (it was streamed already, and the generation ended as out of retries), and the
    # array closes. A repeated number is taken back whole: "0" padded to "0.0", "0.00", ...
    # (equal values) used the retries up one character at a time.
    small = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2}}
    zeros = {"type": "array", "items": {"enum": [0, 1, 2]}}
    floats = {"type": "array", "items": {"type": "number"}, "maxItems": 5}
    for prompt, schema in [
        ("Numbers: [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]. Again: ", small),
        ("Zeros: [0, 0, 0, 0, 0, 0, 0]. Again: ", zeros),
        ("Scores: [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]. Again: [2.0, 2.0,", floats),
    ]:
        schema = {**schema, "uniqueItems": True}
        options: dict[str, Any] = {"temperature": 0, "max_tokens": 80}
        chunks = list(model.stream(prompt, schema=schema, json_whitespace=whitespace, **options))
        assert chunks[-1].finish_reason == "stop", (prompt, chunks[-1])
        jsonschema.validate(json.loads("".join(c.text for c in chunks)), schema)


def test_an_enum_by_reference_bounds_the_array_too(model: lcgen.Model) -> None:
    class Color(enum.Enum):
        RED = "red"
        GREEN = "green"
        BLUE = "blue"

    class Palette(pydantic.BaseModel):
        colors: set[Color]

    assert "{0,2}" in Grammar.from_pydantic(Palette).gbnf  # (pydantic writes a $ref to it)
    by_ref = {
        "type": "array",
        "items": {"$ref": "#/$defs/c"},
        "uniqueItems": True,
        "minItems": 4,
        "$defs": {"c": {"allOf": [{"enum": ["r", "g", "b", "y"]}, {"enum": ["r", "g", "b"]}]}},
    }
    with pytest.raises(lcgen.GrammarError, match="3 values"):
        Grammar.from_json_schema(by_ref)
    prompt = 'Colors as JSON: {"colors": ["red", "red", "red", "red", "red"]}. Again: '
    value = model.generate(prompt, schema=Palette, temperature=0, max_tokens=60)
    assert isinstance(value, Palette) and value.colors


def test_a_schema_with_annotations_json_lacks_and_a_used_grammar_pickle(model: lcgen.Model) -> None:
    schema = {
        "type": "array",
        "uniqueItems": True,
        "default": datetime.date(2020, 1, 1),  # (an annotation JSON has no form for)
        "items": {"type": "number", "maximum": decimal.Decimal("1.5")},
    }
    grammar = Grammar.from_json_schema(schema)
    assert grammar.unique is not None and grammar.unique.duplicate_in("[1, 1.0]")
    assert grammar.accepts(model, "[1, 0.5]") and not grammar.accepts(model, "[1, 1.0]")
    list(model.stream("Numbers:", grammar=grammar, temperature=0, max_tokens=8))
    assert pickle.loads(pickle.dumps(grammar)) == grammar


def test_what_takes_tokens_back_needs_a_sequence_and_healing_errors_stay_clear(
    model: lcgen.Model,
) -> None:
    # A Generator on its own cannot rewind: it ignored hooks and bans, and returned repeats.
    for options in ({"schema": DIGITS}, {"banned": ["x"]}, {"hooks": [lambda step: None]}):
        with pytest.raises(ValueError, match="take tokens back"):
            lcgen.Generator(model, **options)  # type: ignore[arg-type]
    # A constraint that cannot start with the healed text says so, as without uniqueItems
    # (it said "the retries ran out").
    prompt = "Six ones again, as a JSON array: [1, 1"
    with pytest.raises(lcgen.NoCandidatesError, match="token healing"):
        model.generate(prompt, schema=DIGITS, token_healing=True, temperature=0, max_tokens=30)


def test_a_repeated_object_changes_its_last_value_not_its_whitespace(model: lcgen.Model) -> None:
    # Only its "}" was refused: the model wrote whitespace before it instead (24 allowed), and
    # the retries went on taking that back one token at a time (2 of 3 seeds ran out).
    item = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "qty": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "qty"],
        "additionalProperties": False,
    }
    array = {"type": "array", "items": item, "minItems": 8, "maxItems": 8, "uniqueItems": True}
    schema = {"type": "object", "properties": {"items": array}, "required": ["items"]}
    for seed in range(3):
        value = model.generate(
            "A grocery list as JSON with 8 items: ",
            schema=schema,
            max_tokens=400,
            temperature=0.7,
            seed=seed,
        )
        jsonschema.validate(value, schema)


def test_what_reads_outside_the_items_of_unique_arrays_is_measured() -> None:
    schema = {"type": "object", "properties": {"tags": UNIQUE_ARRAY, "free": {"type": "array"}}}
    scan = UniqueItems.of(schema).scan('{"free": [1, 1], ')
    assert scan.outside('"tags": [ 1]') == len('"tags": [ ')  # up to its first item
    assert scan.outside('"other": [2, 2]}') == len('"other": [2, 2]}')
    assert scan.text == '{"free": [1, 1], '  # nothing was read
    assert UniqueItems.of(schema).scan('{"tags": [1, 1').outside("]") == 0  # a repeat
    closing = '], "free": [3, 3]}'
    assert UniqueItems.of(schema).scan('{"tags": [1, 2').outside(closing) == len(closing)


def test_an_item_start_given_up_holds_for_the_later_items_of_its_array() -> None:
    # Every token after '"ru' led to a repeat: no later item may start so, in any tokens.
    scan = UniqueItems.of({"type": "array", "items": UNIQUE_ARRAY}).scan('[["rust", "ru')
    assert scan.give_up_item()
    at = '[["rust", '
    again = scan.reread(at)  # (a rewind to the item's start keeps it)
    trial = again.copy()
    assert trial.feed('"rug"') == len(at) + 2 and trial.repeated == len(at)
    assert again.copy().feed('"rx", "ru') == len(at) + 8  # ...and later items
    # Not the items before it, nor another array, nor after a rewind past its start.
    assert again.reread('[["ru').feed('st", "x"], ["ru"]]') is None
    assert scan.reread('[["rust",').feed(' "rug"]') is None
    assert not UniqueItems.of(UNIQUE_ARRAY).scan("[1, ").give_up_item()  # no item open


def test_an_item_that_repeats_in_every_spelling_is_given_up_once(model: lcgen.Model) -> None:
    # '"rust' repeated: "rust" spelled again in other tokens ("r" "ust", "ru" "st", ...) for
    # this item and each later one used the retries up (64). Its start is given up for them.
    skills = {"type": "array", "items": {"enum": ["python", "rust", "go", "sql", "java"]}}
    schema = {"type": "object", "properties": {"skills": {**skills, "uniqueItems": True}}}
    prompt = '{"skills": ["rust", "rust", "rust", "rust"]}\nThe same JSON again:\n'
    out = model.generate(prompt, grammar=Grammar.from_json_schema(schema), temperature=0)
    value = json.loads(out)
    jsonschema.validate(value, schema)
    assert sorted(value["skills"]) == sorted(skills["items"]["enum"])  # the model's wish: more


def test_inside_an_item_of_a_unique_array_its_start_is_given_up_not_an_inner_one() -> None:
    # '"c' in the inner array can be refused because the inner array would then repeat the
    # outer's first item: a later inner item may still be "c".
    sets = {"type": "array", "uniqueItems": True, "items": UNIQUE_ARRAY}
    scan = UniqueItems.of(sets).scan('[["a", "b", "c"], ["a", "b", "c')
    assert scan.give_up_item()
    later = scan.reread('[["a", "b", "c"], ["a", "b", ')
    assert later.copy().feed('"x", "c"]]') is None  # "c" is fine later in the inner array
    again = scan.reread('[["a", "b", "c"], ')
    assert again.copy().feed('["a", "b", "c') is not None  # the outer item's start is given up


def test_a_full_array_rewound_into_its_last_item_takes_items_again() -> None:
    # Marked full after "b", the take-back ended inside "b" (the token '",'): the reread
    # stopped at the array's first "," and saw no repeat after it.
    flat = {"type": "array", "uniqueItems": True, "items": {"enum": ["a", "b", "c"]}}
    scan = UniqueItems.of(flat).scan('["a","b",')
    assert scan.close_last() == len('["a","b"')
    kept = scan.reread('["a","b"')  # a rewind to the end of the last item keeps the mark
    assert kept.copy().feed(",") == len('["a","b"')
    again = kept.reread('["a","b')  # ...one into it does not
    assert again.copy().feed('","a"]') == len('["a","b","a"') - 1  # the repeat is seen


def test_nested_unique_arrays_never_repeat_an_item(model: lcgen.Model) -> None:
    # The second list repeated the first: '[["a","b","c"],["a","b","c"]]' ended as "stop".
    inner = {"type": "array", "uniqueItems": True, "minItems": 3, "maxItems": 3}
    schema = {
        "type": "array",
        "uniqueItems": True,
        "minItems": 2,
        "maxItems": 2,
        "items": {**inner, "items": {"enum": ["a", "b", "c"]}},
    }
    prompt = 'Two lists: [["a","b","c"],["a","b","c"]]\nAgain:'
    try:
        value = model.generate(prompt, schema=schema, temperature=0, max_tokens=200)
    except lcgen.IncompleteOutputError:
        return  # (the retries may run out: never a repeat)
    jsonschema.validate(value, schema)


def test_a_repeated_object_takes_back_its_innermost_last_value(model: lcgen.Model) -> None:
    # Its inner "]" was taken back: the number before it grew ("2.0", "2.00", ...: the same
    # value) and the retries ran out.
    item = {
        "type": "object",
        "required": ["k", "v"],
        "additionalProperties": False,
        "properties": {
            "k": {"enum": ["x", "y"]},
            "v": {"type": "array", "maxItems": 2, "items": {"enum": [1, 2]}},
        },
    }
    schema = {"type": "array", "uniqueItems": True, "maxItems": 3, "items": item}
    prompt = '[{"k": "x", "v": [1, 2]}, {"k": "x", "v": [1, 2]}, {"k": "x", "v": [1, 2]}]\nAgain:\n'
    value = model.generate(prompt, schema=schema, temperature=0, max_tokens=200)
    jsonschema.validate(value, schema)
