"""Constrained generation on the real model: every output validates, rollback keeps the grammar
in step, and impossible requests fail cleanly."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
from helpers import first_logits, validate
from test_schemas import CASES, FORMATS

import lcgen
from lcgen.registry import resolve

SCHEMAS = [case for case in CASES if isinstance(case.schema, dict)]


def prompt_for(schema: dict[str, Any]) -> str:
    return f"Write one JSON value that follows this JSON Schema.\nSchema: {json.dumps(schema)}\n"


@pytest.mark.parametrize("case", SCHEMAS, ids=[case.name for case in SCHEMAS])
def test_every_output_validates(model: lcgen.Model, case: Any) -> None:
    for seed in (1, 2, 3):
        try:
            value = model.generate(
                prompt_for(case.schema),
                schema=case.schema,
                max_tokens=128,
                temperature=0.8,
                seed=seed,
            )
        except lcgen.IncompleteOutputError as exc:
            # Cut by max_tokens: what was generated is still a valid prefix of the grammar.
            state = lcgen.Grammar.from_json_schema(case.schema).state(model)
            assert state.accepts_text(exc.text, complete=False)
            continue
        validate(value, case.schema, format_checker=FORMATS)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=16)
    kind: str = pydantic.Field(pattern=r"^(cat|dog|bird)$")
    age: int = pydantic.Field(ge=0, le=25)
    vaccinated: bool


def test_pydantic_schema_returns_validated_instances(model: lcgen.Model) -> None:
    prompt = "A pet as JSON with name, kind, age and vaccinated:\n"
    pets = [
        model.generate(prompt, schema=Pet, max_tokens=80, temperature=0.8, seed=s) for s in range(4)
    ]
    assert all(isinstance(p, Pet) for p in pets)
    batch = model.generate([prompt] * 3, schema=Pet, max_tokens=80)
    assert all(isinstance(p, Pet) for p in batch) and batch[0] == model.generate(
        prompt, schema=Pet, max_tokens=80
    )


@pytest.mark.parametrize("name", ["object", "enum-strings", "integer-range", "format-date"])
def test_bounded_schemas_complete(model: lcgen.Model, name: str) -> None:
    (case,) = [c for c in SCHEMAS if c.name == name]
    value = model.generate(prompt_for(case.schema), schema=case.schema, max_tokens=128)
    validate(value, case.schema, format_checker=FORMATS)


def test_incomplete_output_carries_the_partial_text(model: lcgen.Model) -> None:
    with pytest.raises(lcgen.IncompleteOutputError, match="raise max_tokens") as info:
        model.generate("A pet as JSON:\n", schema=Pet, max_tokens=4)
    assert info.value.text.startswith("{")
    chunks = list(model.stream("A pet as JSON:\n", schema=Pet, max_tokens=4))
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_choice_and_regex(model: lcgen.Model, seed: int) -> None:
    options = ["red", "green", "blue", "light blue"]
    got = model.generate("My favourite colour is", choice=options, temperature=1.0, seed=seed)
    assert got in options
    pattern = r" ?\(\d{3}\) \d{3}-\d{4}"
    phone = model.generate("Call us at", regex=pattern, temperature=1.0, seed=seed)
    assert re.fullmatch(pattern, phone)


def test_a_choice_or_enum_of_20000_options_generates_one(model: lcgen.Model) -> None:
    # A prefix tree: each token is checked against the few options still alive (a flat
    # alternation walked all 20,000 at each step: seconds a token). One option comes back,
    # the rest of it forced once the digits tell it apart.
    options = [f"v{i}" for i in range(20_000)]
    got = model.generate("JSON:", choice=options, max_tokens=10, temperature=1.0, seed=3)
    assert got in options and got.stats.steps <= got.stats.tokens <= 6
    value = model.generate("JSON:", schema={"enum": options}, max_tokens=10, seed=3)
    assert value in options


@pytest.mark.parametrize("name", ["json", "json_array", "iso_date", "yes_no", "arithmetic"])
def test_bundled_grammars_generate_accepted_text(model: lcgen.Model, name: str) -> None:
    grammar = lcgen.Grammar.from_file(name)
    chunks = list(
        model.stream(
            f"Example of {name}:\n", grammar=grammar, max_tokens=60, temperature=0.7, seed=2
        )
    )
    text = "".join(c.text for c in chunks)
    complete = chunks[-1].finish_reason == "stop"
    assert grammar.state(model).accepts_text(text, complete=complete)
    if name in {"json", "json_array"} and complete:
        json.loads(text)


def test_rewind_inside_a_json_object_stays_valid(model: lcgen.Model) -> None:
    prompt = "A pet as JSON:\n"
    with model.sequence(prompt, seed=4) as seq:
        run = seq.run(schema=Pet, max_tokens=80, temperature=0.8)
        chunks: list[lcgen.Chunk] = []
        saved: list[tuple[lcgen.Checkpoint, int]] = []
        while not run.is_done:
            chunks.append(run.step())
            saved.append((run.checkpoint(), len(chunks)))
        first = "".join(c.text for c in chunks)
        Pet.model_validate_json(first)
        cp, n = saved[len(saved) // 2]  # the middle of the object
        run.rewind(cp)
        again = list(chunks[:n])
        while not run.is_done:
            again.append(run.step())
        assert "".join(c.text for c in again) == first  # the RNG and grammar were restored
        # From the same point with another seed: a different, still valid, object.
        for seed in (7, 8):
            run.rewind(cp)
            seq.reseed(seed)
            other = list(chunks[:n])
            while not run.is_done:
                other.append(run.step())
            Pet.model_validate_json("".join(c.text for c in other))


def test_forbidden_token_and_impossible_grammars(model: lcgen.Model) -> None:
    gen = lcgen.Generator(model, choice=["yes", "no"])
    forbidden = model.tokenize(" maybe")[0]
    with pytest.raises(lcgen.GrammarError):
        gen.accept(forbidden)
    assert gen.tokens == []  # the state is unchanged
    with pytest.raises(lcgen.GrammarError):
        lcgen.Grammar('root ::= "a" (')
    # A grammar that never ends stops at max_tokens instead of hanging.
    chunks = list(
        model.stream("Letters:", grammar=lcgen.Grammar('root ::= "a" root'), max_tokens=12)
    )
    assert chunks[-1].finish_reason == "length"
    assert set("".join(c.text for c in chunks)) == {"a"}
    with pytest.raises(ValueError, match="at most one of"):
        model.generate("x", choice=["a"], regex="b")


def test_token_healing_with_a_grammar(model: lcgen.Model) -> None:
    # The grammar sees each generated token whole, healed prompt text included.
    out = model.generate("The answer is: ye", token_healing=True, choice=[" yes", " yellow"])
    assert out in {"s", "llow"}
    # a constraint that does not start with the healed text can never be met: said so
    with pytest.raises(lcgen.NoCandidatesError, match=r"re-create the prompt's ' ye'"):
        model.generate("The answer is: ye", token_healing=True, choice=["no", "0"])


def test_a_schema_value_starts_with_the_text_healing_re_created(model: lcgen.Model) -> None:
    # The prompt's "{" is healed: the grammar matched it with the output, which does not hold
    # it. The value was parsed from the output alone: IncompleteOutputError, "raise max_tokens".
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    prompt = "Answer in JSON:\n{"
    with model.sequence(prompt) as seq:
        assert seq.run(token_healing=True).generator.heal == b"{"
    text = model.generate(
        prompt, grammar=lcgen.Grammar.from_json_schema(schema), token_healing=True
    )
    assert text.finish_reason == "stop" and not text.startswith("{")
    value = model.generate(prompt, schema=schema, token_healing=True)
    assert value == json.loads("{" + text)
    validate(value, schema)
    assert model.generate([prompt, prompt], schema=schema, token_healing=True) == [value, value]


def test_gemma_schema_output_validates(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
              "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}  # fmt: skip
    with lcgen.Model(resolve("gemma3-270m", download=False), n_ctx=1024, n_seq_max=1) as gemma:
        for seed in (1, 2):
            value = gemma.generate(
                prompt_for(schema), schema=schema, max_tokens=60, temperature=0.8, seed=seed
            )
            validate(value, schema)


def test_rejected_token_is_replaced_by_the_best_allowed_one(model: lcgen.Model) -> None:
    logits = first_logits(model, "My favourite colour is")
    grammar = lcgen.Grammar.choice([" green", " purple", " orange"])
    allowed = grammar.state(model).allowed()
    assert not allowed[int(logits.argmax())]  # the model's favourite is rejected first
    best = int(np.where(allowed, logits, -np.inf).argmax())
    gen = lcgen.Generator(model, grammar=grammar, max_tokens=1)
    assert gen.step(logits).tokens == (best,)


# minProperties over extra properties ------------------------------------------------------------
MAP_OF_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 2}
MAP_WITH_NAMES = {
    "type": "object",
    "properties": {"a1": {"type": "integer"}, "x": {"type": "integer"}},
    "required": ["x"],
    "additionalProperties": {"type": "string"},
    "minProperties": 4,
    "maxProperties": 5,
}
NAMED_BY_ENUM = {  # c is no name propertyNames allows
    "type": "object",
    "properties": {"b": {"type": "number"}, "c": {"type": "number"}},
    "propertyNames": {"enum": ["a", "b", "q"]},
    "minProperties": 2,
}
NAMED_BY_LENGTH = {  # (a key no automaton spells: an extra one never counts beside b)
    "type": "object",
    "properties": {"b": {"type": "number"}},
    "propertyNames": {"maxLength": 2},
    "minProperties": 1,
    "maxProperties": 2,
}


@pytest.mark.parametrize(
    ("schema", "text", "accepted"),
    [
        (MAP_OF_STRINGS, '{"id_1": "a", "id_2": "b"}', True),
        (MAP_OF_STRINGS, '{"1": "a", "x2": "b", "x2": "c", "free": "d"}', True),
        (MAP_OF_STRINGS, '{"a1": "a", "a1": "b"}', False),  # one property after parsing
        (MAP_OF_STRINGS, '{"a1": "a"}', False),
        (MAP_OF_STRINGS, "{}", False),
        (MAP_OF_STRINGS, '{"a": "a", "b": "b"}', False),  # narrowed: keys end in 1, 2, ...
        (MAP_WITH_NAMES, '{"a1": 1, "x": 2, "k2": "s", "k3": "t"}', True),
        (MAP_WITH_NAMES, '{"x": 2, "k2": "s", "k3": "t", "k4": "u", "v": "w"}', True),
        (MAP_WITH_NAMES, '{"x": 2, "k2": "s", "k3": "t", "k4": "u", "v": "w", "y": "z"}', False),
        (MAP_WITH_NAMES, '{"x": 2, "k1": "s", "k2": "t", "k3": "u"}', False),  # "1" ends a1
        (MAP_WITH_NAMES, '{"x": 2, "k2": "s", "k3": "t"}', False),
        (NAMED_BY_ENUM, '{"b": 6, "b": 3}', False),  # a declared key repeated: one property
        (NAMED_BY_ENUM, '{"b": 6, "a": 3}', True),
        (NAMED_BY_LENGTH, '{"b": 1}', True),
        (NAMED_BY_LENGTH, '{"b": 1, "xy": 2}', True),
        (NAMED_BY_LENGTH, '{"xy": 2}', True),
    ],
)
def test_min_properties_counts_only_distinct_extra_keys(
    model: lcgen.Model, schema: dict[str, Any], text: str, accepted: bool
) -> None:
    """Extra keys that count toward minProperties are distinct by construction: each ends in
    its own number (one no declared name ends in), so a repeated key never makes up the count."""
    assert lcgen.Grammar.from_json_schema(schema).accepts(model, text) == accepted
    if accepted:
        validate(json.loads(text), schema)


class Scores(pydantic.BaseModel):
    scores: dict[str, int] = pydantic.Field(min_length=2, max_length=4)


def test_min_properties_on_maps_generates_valid_objects(model: lcgen.Model) -> None:
    prompt = "A JSON object mapping names to cities:\n"
    value = model.generate(prompt, schema=MAP_OF_STRINGS, max_tokens=120)
    validate(value, MAP_OF_STRINGS)
    scores = model.generate("Three players' scores as JSON:\n", schema=Scores, max_tokens=120)
    assert isinstance(scores, Scores) and 2 <= len(scores.scores) <= 4


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "object", "patternProperties": {"^a": {}}, "additionalProperties": False,
             "minProperties": 2},
            "minProperties 2 on extra properties (at #) is not supported",
        ),
        (
            {"properties": {"d": {"type": "object", "propertyNames": {"maxLength": 3},
                                  "minProperties": 3}}},
            "minProperties 3 on extra properties (at #/properties/d) is not supported",
        ),
        (
            {"type": "object", "properties": {"a": {}}, "additionalProperties": False,
             "minProperties": 2},
            "no object satisfies minProperties 2 at #",
        ),
        (  # an extra key could repeat the required c (it counted as a second property)
            {"type": "object", "properties": {"c": {"type": "object"}}, "required": ["c"],
             "propertyNames": {"pattern": "^[a-e]+$"}, "minProperties": 2},
            "minProperties 2 on extra properties (at #) is not supported",
        ),
    ],
)  # fmt: skip
def test_min_properties_that_cannot_be_written_says_why(
    schema: dict[str, Any], message: str
) -> None:
    with pytest.raises(lcgen.GrammarError) as info:
        lcgen.Grammar.from_json_schema(schema)
    assert message in str(info.value) and "cannot be met" not in str(info.value)


# pydantic types whose format says what their validation checks ---------------------------------
class Span(pydantic.BaseModel):
    span: datetime.timedelta
    host: pydantic.IPvAnyAddress


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('{"span": "P999999Y999999M999999DT999999H999999M999999S", "host": "::1"}', True),
        ('{"span": "P3W", "host": "10.0.0.255"}', True),
        ('{"span": "P1000000D", "host": "::1"}', False),  # over a timedelta's range at 10**9
        ('{"span": "P1D", "host": "localhost"}', False),
        ('{"span": "P1D", "host": "256.0.0.1"}', False),
    ],
)
def test_durations_and_ip_addresses_are_what_pydantic_accepts(
    model: lcgen.Model, text: str, accepted: bool
) -> None:
    assert lcgen.Grammar.from_pydantic(Span).accepts(model, text) == accepted
    if accepted:
        Span.model_validate_json(text)


def test_wild_durations_and_addresses_validate(model: lcgen.Model) -> None:
    hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 200}
    for seed in (2, 5):
        assert isinstance(model.generate("JSON:", schema=Span, seed=seed, **hot), Span)
