"""JSON Schema and pydantic to grammar: every text the grammar allows validates.

Each schema has valid instances (the grammar must accept them, serialized three ways) and
invalid ones (it must reject them); the tables themselves are checked with ``jsonschema``. Then
random walks through each grammar (random tokens the grammar allows, no model) must produce
JSON that validates, and keywords lcgen cannot enforce must raise, naming the keyword.
"""

from __future__ import annotations

import datetime
import enum
import functools
import json
import re
import uuid
import warnings
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Generic, Literal, TypeVar

import jsonschema
import numpy as np
import pydantic
import pytest
from helpers import validator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcgen
from lcgen.constrain import Grammar, GrammarState
from tests.test_grammar import widest_alternation

DRAFT4 = "http://json-schema.org/draft-04/schema#"
HYPOTHESIS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(text: object) -> bool:
    return not isinstance(text, str) or (
        "T" in text and datetime.datetime.fromisoformat(text).tzinfo is not None
    )


@FORMATS.checks("time", raises=ValueError)
def _is_time(text: object) -> bool:
    return not isinstance(text, str) or datetime.time.fromisoformat(text).tzinfo is not None


@dataclass
class Case:
    name: str
    schema: dict[str, Any] | bool
    valid: list[Any]
    invalid: list[Any] = field(default_factory=list)
    bad_texts: list[str] = field(default_factory=list)


POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
         "required": ["x", "y"], "additionalProperties": False}  # fmt: skip
CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer",
       "minimum": 0, "maximum": 9}}, "required": ["kind", "lives"]}  # fmt: skip
DOG = {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
       "required": ["kind", "good"]}  # fmt: skip
UID = "123e4567-e89b-12d3-a456-426614174000"

CASES = [
    Case(
        "object",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        [{"name": "Ada", "age": 36}, {"name": "", "age": -1}, {"name": '日本 "q" \n', "age": 0}],
        [
            {"name": "Ada"},
            {"name": "Ada", "age": "36"},
            {"name": "Ada", "age": 36, "x": 1},
            {"name": "Ada", "age": 3.5},
            [],
            "Ada",
        ],
        ['{"name": "Ada", "age": 36,}', '{"name": "Ada" "age": 36}', '{"name": "a\nb", "age": 1}'],
    ),
    Case(
        "optional-properties",
        {
            "type": "object",
            "properties": {
                "a": {"type": "string"},
                "b": {"type": "integer"},
                "c": {"type": "boolean"},
            },
            "required": ["b"],
        },
        [{"b": 1}, {"a": "x", "b": 1}, {"a": "x", "b": 1, "c": True}, {"b": 1, "c": False}],
        [{}, {"a": "x"}, {"b": "1"}, {"a": 1, "b": 1}],
    ),
    Case(
        "nested-objects",
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "zip": {"type": "string", "pattern": "^\\d{5}$"},
                            },
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["name", "address"],
                }
            },
            "required": ["person"],
        },
        [{"person": {"name": "Bo", "address": {"city": "Oslo", "zip": "12345"}}}],
        [
            {"person": {"name": "", "address": {"city": "Oslo", "zip": "12345"}}},
            {"person": {"name": "Bo", "address": {"city": "Oslo", "zip": "1234"}}},
            {"person": {"name": "Bo"}},
        ],
    ),
    Case(
        "array-bounds",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
        [[1, 2], [1, 2, 3, 4], [-5, 0, 7]],
        [[1], [1, 2, 3, 4, 5], [1, "2"], []],
        ["[1, 2,]", "[1 2]"],
    ),
    Case(
        "array-of-strings",
        {"type": "array", "items": {"type": "string"}},
        [[], ["a", "b"], ["", "\\", "\u00e9"]],
        [[1], "a", [None]],
    ),
    Case(
        "enum-strings",
        {"enum": ["red", "green", "blue"]},
        ["red", "green", "blue"],
        ["Red", "yellow", 1],
    ),
    Case(
        "enum-mixed",
        {"enum": [1, "one", None, True, [1, 2], {"a": 1}, 2.5]},
        [1, "one", None, True, [1, 2], {"a": 1}, 2.5],
        [2, "two", False, [1], {"a": 2}, 2.4],
    ),
    Case("const-string", {"const": "fixed"}, ["fixed"], ["Fixed", "fixed ", 1]),
    Case(
        "const-object",
        {"const": {"k": [1, 2], "n": None}},
        [{"k": [1, 2], "n": None}],
        [{"k": [1, 2]}, {"k": [2, 1], "n": None}],
    ),
    Case("enum-filtered-by-type", {"type": "string", "enum": ["a", 1, "b"]}, ["a", "b"], [1, "c"]),
    Case(
        "anyOf",
        {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 10}]},
        ["ab", "", 10, 99],
        ["abcd", 9, 1.5, None],
    ),
    Case(
        "oneOf-by-type",
        {"oneOf": [{"type": "string"}, {"type": "boolean"}, {"type": "null"}]},
        ["x", True, None],
        [1, [], {}],
    ),
    Case(
        "oneOf-discriminated",
        {"oneOf": [CAT, DOG]},
        [{"kind": "cat", "lives": 9}, {"kind": "dog", "good": True}],
        [
            {"kind": "cat", "good": True},
            {"kind": "dog", "lives": 3},
            {"kind": "cat", "lives": 10},
            {"kind": "fish"},
        ],
    ),
    Case(
        "type-list", {"type": ["string", "null"], "minLength": 2}, ["ab", None, "xyz"], ["a", 1, ""]
    ),
    Case(
        "nullable-anyOf",
        {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "N"},
        [5, None, -3],
        ["5", 1.5],
    ),
    Case(
        "integer-range",
        {"type": "integer", "minimum": -5, "maximum": 120},
        [-5, 0, 7, 99, 100, 120],
        [-6, 121, 1000, 1.5, "7"],
    ),
    Case(
        "integer-exclusive",
        {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        [1, 5, 9],
        [0, 10, -1, 11],
    ),
    Case(
        "integer-minimum-only",
        {"type": "integer", "minimum": 1000},
        [1000, 1001, 99999999],
        [999, -1000, 0],
    ),
    Case(
        "integer-maximum-negative", {"type": "integer", "maximum": -3}, [-3, -4, -1000], [-2, 0, 5]
    ),
    Case(
        "integer-draft4-exclusive",
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "integer",
            "minimum": 1,
            "exclusiveMinimum": True,
            "maximum": 3,
        },
        [2, 3],
        [1, 4],
    ),
    Case(
        "number-unit-interval",
        {"type": "number", "minimum": 0, "maximum": 1},
        [0, 1, 0.5, 0.999, 1.0, 0.0, 0.25],
        [-0.1, 1.01, 2, -1],
    ),
    Case(
        "number-exclusive",
        {"type": "number", "exclusiveMinimum": -1.5, "exclusiveMaximum": 2.25},
        [-1.49, 0, 2, 2.2499, -1],
        [-1.5, 2.25, 3, -2],
    ),
    Case(
        "number-wide",
        {"type": "number", "minimum": -1e6, "maximum": 1e6},
        [123456.789, -999999, 1000000, 0.001],
        [1000001, -1000000.5],
    ),
    Case(
        "string-length",
        {"type": "string", "minLength": 2, "maxLength": 5},
        ["ab", "héllo", "日本", 'a"b', "🙂🙂🙂"],
        ["a", "abcdef", ""],
    ),
    Case(
        "string-pattern-anchored",
        {"type": "string", "pattern": "^[A-Z]{3}-\\d{3}$"},
        ["ABC-123", "XYZ-000"],
        ["abc-123", "ABC-1234", "ABC123"],
    ),
    Case(
        "string-pattern-search",
        {"type": "string", "pattern": "cat"},
        ["cat", "concatenate", "a cat!", '"cat"\n'],
        ["dog", "ca t", ""],
    ),
    Case(
        # lengths beside a pattern or a format: a part of the texts both allow (each piece
        # its share of the lengths), never one outside them
        "string-pattern-lengths",
        {"type": "string", "pattern": "^[a-z]+[0-9]+$", "minLength": 3, "maxLength": 8},
        ["ab1", "abcd123"],
        ["a1", "abcdefg12", "abc", "abcdefgh"],
    ),
    Case(
        "string-search-lengths",
        {"type": "string", "pattern": "cat", "maxLength": 6},
        ["cat", "a cat", "cats"],
        ["a big cat", "dog", ""],
    ),
    Case(
        "uri-lengths",  # pydantic's AnyUrl: format uri, minLength 1, maxLength 2083
        {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
        ["https://example.com/a?b=1", "mailto:ada@example.com"],
        ["", "x:" + "a" * 2100],
    ),
    Case(
        "email-lengths",
        {"type": "string", "format": "email", "maxLength": 24},
        ["ada@mail.io", "a.b@x.io"],
        ["ada", "ada.lovelace.countess@example.com"],
    ),
    Case(
        "date-lengths",  # the format's texts are all within the lengths
        {"type": "string", "format": "date", "minLength": 10, "maxLength": 12},
        ["2024-02-29"],
        ["2024-2-29", "2023-02-29"],
    ),
    Case(
        "string-pattern-quotes",
        {"type": "string", "pattern": '^"[^"\\\\]*"$'},
        ['"hi"', '""'],
        ["hi", '"a"b"', '"\\"'],
    ),
    Case(
        "format-date",
        {"type": "string", "format": "date"},
        ["2024-02-29", "1999-12-31"],
        ["2023-02-29", "2024-2-29", "2024-13-01"],
    ),
    Case(
        "format-date-time",
        {"type": "string", "format": "date-time"},
        ["2024-01-01T12:00:00Z", "2024-01-01T12:00:00.5+01:00"],
        ["2024-01-01 12:00:00", "2024-01-01T25:00:00Z", "2024-01-01T12:00:00"],
    ),
    Case(
        "format-time",
        {"type": "string", "format": "time"},
        ["12:00:00Z", "23:59:59.999-05:00"],
        ["12:00", "24:00:00Z"],
    ),
    Case(
        "format-uuid",
        {"type": "string", "format": "uuid"},
        [UID, UID.upper()],
        ["not-a-uuid", UID[:-1]],
    ),
    Case(
        "format-email",
        {"type": "string", "format": "email"},
        ["a@b.co", "first.last+x@mail.example.org"],
        ["no-at-sign"],
    ),
    Case(
        "format-ipv4",
        {"type": "string", "format": "ipv4"},
        ["1.2.3.4", "255.255.255.255"],
        ["1.2.3.256", "1.2.3", "01.2.3.4"],
    ),
    Case(
        "ref-defs",
        {
            "$defs": {"point": POINT},
            "type": "array",
            "items": {"$ref": "#/$defs/point"},
            "maxItems": 3,
        },
        [[], [{"x": 1, "y": 2.5}], [{"x": 0, "y": 0}] * 3],
        [[{"x": 1}], [{"x": 1, "y": 2, "z": 3}], [{"x": 0, "y": 0}] * 4],
    ),
    Case(
        "ref-recursive",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["value"],
                }
            },
            "$ref": "#/$defs/node",
        },
        [
            {"value": 1},
            {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, {"value": 4}]},
        ],
        [{"children": []}, {"value": 1, "children": [{"value": "2"}]}],
    ),
    Case(
        "ref-definitions-draft7",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"id": {"type": "integer", "minimum": 1}},
            "type": "object",
            "properties": {"id": {"$ref": "#/definitions/id"}},
            "required": ["id"],
        },
        [{"id": 1}, {"id": 42}],
        [{"id": 0}, {}],
    ),
    Case(
        "tuple-prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        [["a", 1], ["a"], []],
        [["a", "b"], ["a", 1, 2], [1]],
    ),
    # No value satisfies an optional property or an item: objects go without it, arrays
    # end before it (the whole schema was refused).
    Case(
        "optional-property-no-value-satisfies",
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": "string", "minLength": 3, "maxLength": 1},
            },
            "additionalProperties": False,
        },
        [{"a": 1}, {}],
        [{"b": ""}, {"a": 1, "b": "xy"}],
    ),
    Case(
        # a $ref's rule was reserved, then never defined: llama.cpp refused the grammar
        "optional-ref-no-value-satisfies",
        {
            "$defs": {"bad": {"type": "integer", "minimum": 5, "maximum": 3}},
            "type": "object",
            "properties": {
                "a": {"$ref": "#/$defs/bad"},
                "b": {"type": "array", "items": {"$ref": "#/$defs/bad"}},
                "c": {"type": "boolean"},
            },
            "additionalProperties": False,
        },
        [{}, {"b": []}, {"b": [], "c": True}],
        [{"a": 4}, {"b": [4]}],
    ),
    Case(
        # through a $ref, and bounds of an object's properties that cross
        "optional-members-no-value-satisfies-by-ref",
        {
            "$defs": {"never": False},
            "type": "object",
            "properties": {
                "x": {"$ref": "#/$defs/never"},
                "y": {"type": "object", "minProperties": 2, "maxProperties": 1},
                "z": {"type": "array", "items": {"$ref": "#/$defs/never"}},
            },
            "additionalProperties": False,
        },
        [{}, {"z": []}],
        [{"x": 1}, {"y": {}}, {"z": [1]}],
    ),
    Case(
        "items-no-value-satisfies",
        {"type": "array", "items": {"type": "integer", "minimum": 5, "maximum": 3}},
        [[]],
        [[4], [5]],
    ),
    Case(
        "prefix-item-no-value-satisfies",
        {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"type": "integer", "minimum": 5, "maximum": 3}],
        },
        [[], [1]],
        [[1, 2], [1, 5, 3]],
    ),
    Case(
        "tuple-draft7",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "array",
            "items": [{"type": "boolean"}, {"type": "null"}],
            "additionalItems": False,
            "minItems": 2,
        },
        [[True, None]],
        [[True], [True, None, None], [None, True]],
    ),
    Case(
        "prefix-then-items",
        {
            "type": "array",
            "prefixItems": [{"const": "head"}],
            "items": {"type": "integer"},
            "minItems": 2,
            "maxItems": 4,
        },
        [["head", 1], ["head", 1, 2, 3]],
        [["head"], ["head", "x"], [1, 2], ["head", 1, 2, 3, 4]],
    ),
    Case(
        "map",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{}, {"a": 1, "b": 2}, {"日本": -1}],
        [{"a": "x"}, {"a": 1.5}],
    ),
    Case(
        "properties-plus-map",
        {
            "type": "object",
            "properties": {"id": {"type": "integer"}},
            "required": ["id"],
            "additionalProperties": {"type": "string"},
        },
        [{"id": 1}, {"id": 1, "x": "y", "idx": "z"}],
        [{"id": "1"}, {"id": 1, "x": 2}, {"x": "y"}],
        ['{"id": 1, "id": "x"}'],
    ),
    Case(
        "any-value",
        {},
        [1, "x", [1, {"a": None}], None, {"k": [True, 2.5]}],
        [],
        ["{", "NaN", "[1,]"],
    ),
    Case("true-schema", True, [0, "s", [], {}], [], ["'s'"]),
    Case("allOf-single", {"allOf": [{"type": "integer", "minimum": 5}]}, [5, 6], [4, "5"]),
    Case(
        "min-max-properties-settled",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
        },
        [{"a": 1}],
        [{}, {"a": 1, "b": 2}],
    ),
    Case(
        "unique-items-at-most-one",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1},
        [[], [3]],
        [[3, 3], [1, 2]],
    ),
    Case("multipleOf-every-integer", {"type": "integer", "multipleOf": 0.5}, [1, -7], [1.5]),
    Case(
        "nested-arrays",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
            },
        },
        [[], [[[True, False]], []], [[[], [False]]]],
        [[[[True, True, True]]], [[True]]],
    ),
    Case(
        "string-escapes-count-as-one",
        {"type": "string", "maxLength": 3},
        ['a"b', "\n\t\\", "🙂🙂🙂", "\u0000\u001f/", "\ud7ff"],
        ["abcd", "🙂🙂🙂🙂"],
        ['"\\ud800"', '"\\udc00x"', '"\\ud83dx"'],
    ),
    # keywords that combine, branch or negate (the Test Suite walk covers them in breadth) --
    Case("multipleOf-integer", {"type": "integer", "multipleOf": 3}, [0, 3, -12, 99], [1, 4, -7]),
    # a step of 1 with a value excluded: the empty range below it is left out, not an error
    Case(
        "multipleOf-1-not-const",
        {"type": "number", "multipleOf": 1, "minimum": 1, "not": {"const": 1}},
        [2, 3, 40],
        [1, 0, 2.5],
    ),
    Case(
        "multipleOf-1-empty-branch",
        {"anyOf": [{"type": "integer", "multipleOf": 1, "minimum": 5, "maximum": 3}, {}]},
        ["x", 4, None],
        [],
    ),
    Case(
        "multipleOf-bounded",
        {"type": "integer", "multipleOf": 5, "minimum": 7, "maximum": 31},
        [10, 30],
        [5, 35, 12],
    ),
    Case(
        "multipleOf-cents",
        {"type": "number", "multipleOf": 0.01},
        [1, -20, 300, 1.11, 19.99, -0.07],
        [0.001, 2.555],
        bad_texts=["1.110", "1e-2"],  # at most two places, no exponent: fewer, never more
    ),
    Case(
        "multipleOf-decimal-step",
        {"type": "number", "multipleOf": 1.5},
        [0, 3, 4.5, -7.5, 150],
        [1, 2.25, 1.6],
    ),
    Case(
        "multipleOf-listed",
        {"type": "number", "multipleOf": 0.25, "exclusiveMinimum": 0, "maximum": 2},
        [0.25, 1, 1.75, 2],
        [0, 0.3, 2.25],
    ),
    Case(
        "multipleOf-cents-bounded",
        {"type": "number", "multipleOf": 0.01, "minimum": -5.5, "maximum": 1000},
        [-5.5, -5.49, 0, 999.99, 1000],
        [-5.51, 1000.01, 0.001],
    ),
    Case("not-string", {"not": {"type": "string"}}, [1, None, [], {}], ["x"]),
    # A number const or enum under not excludes those numbers only.
    Case("not-const-integer", {"type": "integer", "not": {"const": 0}}, [1, -3, 10], [0, 1.5]),
    Case(
        "not-enum-numbers",
        {"not": {"enum": [0, 1, 2.5]}},
        [2, -3, 1.5, 3, "a", None],
        [0, 1, 1.0, 2.5],
    ),
    # Negated twice: exact where each negation is (a string enum, types, lengths).
    Case("not-not-enum-strings", {"not": {"not": {"enum": ["a", "b"]}}}, ["a", "b"], ["c", 1]),
    Case(
        "not-not-string-length",
        {"not": {"not": {"type": "string", "minLength": 2}}},
        ["ab", "abc"],
        ["a", 1, None],
    ),
    Case(
        "if-not-type",
        {"if": {"not": {"type": "string"}}, "then": {"type": "integer"}, "else": {"maxLength": 2}},
        [1, "ab"],
        ["abc", None, 1.5],
    ),
    Case("const-in-enum", {"const": 1, "enum": [1, 2]}, [1], [2, "1"]),
    Case(
        "not-const-beside-types",
        {"type": ["integer", "string"], "not": {"const": 0}},
        [1, 11, "x"],
        [0, 0.5],
    ),
    Case(
        "if-then-else",
        {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}},
        ["ab", 3],
        ["a", 2.5, None],
    ),
    Case(
        "pattern-properties",
        {
            "type": "object",
            "patternProperties": {"^x-": {"type": "integer"}},
            "additionalProperties": False,
        },
        [{}, {"x-a": 1, "x-b": 2}],
        [{"x-a": "1"}, {"y": 1}],
    ),
    Case(
        "property-names",
        {"type": "object", "propertyNames": {"maxLength": 3}},
        [{}, {"abc": 1}, {"a": [], "bc": None}],
        [{"abcd": 1}],
    ),
    Case(
        "dependent-required",
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
            "dependentRequired": {"card": ["billing"]},
            "additionalProperties": False,
        },
        [{}, {"billing": "x"}, {"card": "1", "billing": "x"}],
        [{"card": "1"}],
    ),
    Case(
        "contains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10}},
        [[10], [1, 2, 30], [11, 1]],
        [[], [1, 2], ["x", 10]],
    ),
    Case(  # items counted beside the matches: every place the matches may take
        "contains-with-item-counts",
        {
            "type": "array",
            "items": {"type": "integer"},
            "contains": {"minimum": 10},
            "minContains": 2,
            "minItems": 3,
            "maxItems": 4,
        },
        [[10, 11, 1], [1, 10, 11], [10, 1, 11, 2], [10, 10, 10, 10]],
        [[10, 11], [10, 1, 1], [10, 11, 1, 2, 3], [1, 2, 3, 10]],
    ),
    Case(
        "contains-with-min-items",
        {"type": "array", "contains": {"type": "string"}, "minItems": 3},
        [[1, 2, "a"], ["a", 1, 2, 3], ["a", "b", "c"]],
        [["a", 1], [1, 2, 3], []],
    ),
    Case(
        "contains-with-max-contains",
        {"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxContains": 3},
        [["a", "b"], [1, "a", 2, "b", "c", None], ["a", 1, 2, 3, 4, 5, "b"]],
        [["a"], ["a", "b", "c", "d"], [], [1, 2]],
    ),
    Case(
        "contains-none-or-few",
        {
            "type": "array",
            "items": {"type": "integer"},
            "contains": {"minimum": 5},
            "minContains": 0,
            "maxContains": 1,
        },
        [[], [1, 2], [7], [1, 9, 2]],
        [[5, 6], [9, 1, 9], ["a"]],
    ),
    Case(
        "contains-beside-prefix-items",
        {
            "type": "array",
            "prefixItems": [{"type": "string"}, {"type": "integer"}],
            "items": {"type": "boolean"},
            "contains": {"type": "integer"},
            "maxContains": 1,
            "maxItems": 4,
        },
        [["a", 1], ["a", 1, True, False], ["a", 1, True, True]],
        [["a"], [], ["a", 1, 2], ["a", "b"], ["a", 1, True, True, True]],
    ),
    Case(
        "all-of-merged",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"a": {"minimum": 3}, "b": {"type": "string"}}},
            ]
        },
        [{"a": 3}, {"a": 4, "b": "x"}],
        [{"a": 2}, {"b": "x"}, {"a": 3, "b": 1}],
    ),
    Case(
        "any-of-beside-type",
        {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        [{"a": 1}, {"b": None}, {"a": 1, "b": 2}],
        [{}, {"c": 1}, 3],
    ),
    Case(
        "ref-beside-keywords",
        {"$ref": "#/$defs/n", "maximum": 9, "$defs": {"n": {"type": "integer", "minimum": 1}}},
        [1, 9],
        [0, 10, 2.5],
    ),
    Case(
        "keywords-apply-to-their-type-only",
        {"minimum": 5, "maxLength": 2},
        [5, "ab", None, [1], {"a": 1}, True],
        [4, "abc"],
    ),
    Case(
        "additional-properties-open-by-default",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        [{"a": 1}, {"a": 1, "b": "x", "c": [None]}],
        [{"a": "1"}, {"b": 1}],
        ['{"a": 1, "a": "x"}'],
    ),
    Case(
        "defs-named-like-lcgen-rules",
        {
            "type": "object",
            "properties": {
                "label": {"$ref": "#/$defs/number"},
                "price": {"$ref": "#/$defs/string"},
                "next": {"$ref": "#/$defs/root"},
            },
            "required": ["label", "price"],
            "additionalProperties": False,
            "$defs": {
                "number": {"enum": ["one", "two"]},
                "string": {"type": "number"},
                "root": {"type": "boolean"},
            },
        },
        [{"label": "two", "price": 2.5}, {"label": "one", "price": 1, "next": True}],
        [{"label": "two", "price": "two"}, {"label": 1, "price": 1}],
    ),
    Case(
        "unknown-keywords-are-annotations",
        {"type": "integer", "id": "x", "javaType": "Long", "nullable": True, "example": 3},
        [3, -1],
        ["3", None],
    ),
    Case(
        "hostname",
        {"type": "string", "format": "hostname"},
        ["a.example", "x-1"],
        bad_texts=['"-a"', '""', '"a..b"'],
    ),
    Case(
        "not-an-integer",
        {"type": "number", "not": {"type": "integer"}, "minimum": 1, "exclusiveMaximum": 3},
        [1.5, 2.25, 1.0625, 2.999],
        [1, 2, 3, 2.0, 0.5, 3.5, "1.5"],
        ['"1.5"', "1.50", "2.0"],
    ),
    Case(
        "oneOf-that-may-overlap",
        {
            "oneOf": [
                {"type": "integer"},
                {"type": "number", "minimum": 2},
                {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
                {"type": "object", "required": ["b"]},
            ]
        },
        [1, -4, 2.5, {"a": 1}, {"b": 1}, {"a": 2, "b": 0}],
        [2, 7, 1.5, {"a": 1, "b": 1}, {}, {"c": 1}, "x"],
    ),
    Case(
        "not-a-pattern",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z]+$", "not": {"pattern": "^tmp"}},
                "code": {"oneOf": [{"pattern": "^[0-9]+$"}, {"pattern": "^[0-9a-f]+$"}]},
                "word": {"enum": ["apple", "tmpfile", 7], "not": {"pattern": "^t"}},
            },
            "propertyNames": {"not": {"pattern": "^x-"}},
        },
        [{"id": "abc"}, {"code": "ab"}, {"word": "apple"}, {"y-a": 1}],
        [
            {"id": "tmpx"},
            {"id": "AB"},
            {"code": "12"},
            {"code": 12},
            {"word": "tmpfile"},
            {"x-a": 1},
        ],
    ),
    Case(  # a double reads a number of over 15 significant digits back as an integer
        "not-an-integer-reads-back-as-none",
        {"type": "number", "not": {"type": "integer"}},
        [0.5, -2.25, 123456789.123456],
        [1, 2.0, 1e300],
        ["12345678901234567.5", "1000000000.5", "0.1234567"],
    ),
    Case(  # a discriminator makes its property required: not under a not
        "discriminator-under-a-not",
        {
            "oneOf": [
                {"type": "object"},
                {
                    "discriminator": {"propertyName": "kind"},
                    "oneOf": [
                        {"type": "object", "properties": {"kind": {"const": "cat"}}},
                        {"type": "array"},
                    ],
                },
            ]
        },
        [{"kind": "dog"}, [1]],
        [{}, {"a": 1}, {"kind": "cat"}, "s"],
    ),
    Case(  # overlapping ranges: most of the options joined with the others' nots contradict
        "oneOf-of-overlapping-ranges",
        {
            "oneOf": [
                {"type": "integer", "minimum": 10 * i, "maximum": 10 * i + 10} for i in range(5)
            ]
        },
        [0, 5, 15, 49, 50],
        [10, 20, 40, -1, 51, 5.5],
    ),
    Case(  # minContains is no keyword before 2019-09: contains asks for one match
        "min-contains-in-draft-7",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "array",
            "contains": {"const": 1},
            "minContains": 0,
        },
        [[1], [2, 1]],
        [[], [2, 3]],
    ),
    Case(  # recursion through the not beside maxContains, and through a oneOf's negations
        "recursion-through-negations",
        {
            "type": "object",
            "properties": {
                "list": {"$ref": "#/$defs/list"},
                "node": {"$ref": "#/$defs/d0"},
            },
            "$defs": {
                "list": {
                    "type": "array",
                    "items": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/list"}]},
                    "contains": {"type": "integer"},
                    "maxContains": 2,
                },
                "d0": {
                    "properties": {"a": {"oneOf": [{"$ref": "#/$defs/d0"}, {"$ref": "#/$defs/d1"}]}}
                },
                "d1": {"properties": {"a": {"type": "integer"}}},
            },
        },
        [{"list": [1, [2, [3]], 4]}, {"node": {}}, {"node": {"a": {"a": 1}}}],
        [{"list": [1, 2, 3]}, {"list": [[1]]}, {"node": {"a": 1}}],
    ),
    Case(
        "oneOf-of-a-type-and-its-subset",
        {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]},
        ["abcd", "abcdefgh"],
        ["", "abc", 1, None],
    ),
    Case(
        "unevaluated-properties-see-in-place-subschemas",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "allOf": [{"properties": {"b": {"type": "string"}}}],
            "$ref": "#/$defs/c",
            "if": {"properties": {"i": {"const": 1}}, "required": ["i"]},
            "then": {"properties": {"t": {}}},
            "else": {"properties": {"e": {}}},
            "dependentSchemas": {"d": {"properties": {"d": {}, "dd": {}}}},
            "unevaluatedProperties": False,
            "$defs": {"c": {"patternProperties": {"^c": {"type": "boolean"}}}},
        },
        [
            {"a": 1, "b": "x", "c1": True, "cc": False},
            {"i": 1, "t": 0},
            {"e": 0},
            {"d": 0, "dd": 0},
            {},
        ],
        [{"z": 1}, {"i": 1, "e": 0}, {"t": 0}, {"dd": 0}, {"c1": 1}, {"a": "1"}],
    ),
    Case(
        "unevaluated-properties-not-nor-cousins-nor-failed-branches",
        {
            "properties": {"a": {}},
            "allOf": [
                {"not": {"properties": {"n": {"const": 1}}, "required": ["n"]}},
                {"unevaluatedProperties": False, "properties": {"b": {}}},
            ],
            "anyOf": [{"properties": {"x": {"const": 1}}}, {"properties": {"y": {"const": 1}}}],
            "unevaluatedProperties": {"type": "string"},
        },
        [{"b": 1}, {}],
        [{"a": 1}, {"n": 2}, {"b": 1, "a": 1}, {"x": 1}],
    ),
    Case(
        "unevaluated-properties-count-every-anyof-branch-that-validates",
        {
            "type": "object",
            "anyOf": [
                {"properties": {"x": {"const": 1}}, "required": ["x"]},
                {"properties": {"y": {"const": 2}}, "required": ["y"]},
                {"maxProperties": 1},
            ],
            "unevaluatedProperties": {"type": "string"},
        },
        [{"x": 1, "y": 2}, {"x": 1, "z": "s"}, {"y": 2}, {"p": "a"}, {}],
        [{"x": 1, "y": 3}, {"x": 1, "z": 1}, {"p": 1}, {"x": 2}, {"p": "a", "q": "b"}],
    ),
    Case(
        "unevaluated-properties-nested-scopes",
        {
            "allOf": [{"properties": {"a": {}}, "unevaluatedProperties": True}],
            "properties": {"o": {"properties": {"p": {}}, "unevaluatedProperties": False}},
            "unevaluatedProperties": False,
        },
        [{"a": 1, "z": 2}, {"o": {"p": 1}}, {"o": {}, "q": None}],
        [{"o": {"q": 1}}, {"o": {"p": 1, "z": 0}}],
    ),
    Case(
        "unevaluated-properties-see-an-if-that-validates-alone",
        {"if": {"patternProperties": {"^f": {"type": "string"}}}, "unevaluatedProperties": False},
        [{"foo": "a"}, {}, 3],
        [{"bar": "a"}, {"foo": 1}],
    ),
    Case(  # dependentSchemas applies to objects only: its prefixItems evaluate no array's items
        "unevaluated-items-and-dependent-schemas",
        {"dependentSchemas": {"a": {"prefixItems": [True]}}, "unevaluatedItems": False},
        [[], {"a": 1}, "x"],
        [[1], [{"a": 1}]],
    ),
    Case(  # dependencies is no keyword since 2019-09: held to, but it evaluates nothing
        "unevaluated-properties-and-dependencies",
        {
            "properties": {"a": True},
            "dependencies": {"a": {"properties": {"b": True}}},
            "unevaluatedProperties": False,
        },
        [{"a": 1}, {}],
        [{"a": 1, "b": 2}, {"b": 2}],
    ),
    Case(  # before 2019-09 they are unknown keywords: annotations
        "unevaluated-in-draft-7",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "properties": {"a": True},
            "items": [True],
            "unevaluatedProperties": False,
            "unevaluatedItems": "x",
        },
        [{"a": 1, "b": 1}, [1, 2]],
    ),
    Case(  # before 2020-12 prefixItems is no keyword: items says what every item is
        "prefix-items-in-draft-7",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "prefixItems": [{"type": "string"}],
            "items": {"type": "integer"},
        },
        [[1], [], [1, 2]],
        [["a"], [1, "a"]],
    ),
    Case(
        "unevaluated-items",
        {
            "type": "array",
            "prefixItems": [{"type": "integer"}],
            "allOf": [{"prefixItems": [True, {"type": "string"}]}],
            "anyOf": [{"prefixItems": [True, True, {"type": "boolean"}]}, {"maxItems": 2}],
            "unevaluatedItems": {"type": "null"},
        },
        [[1], [1, "a"], [1, "a", True], [1, "a", True, None, None], []],
        [[1, "a", None], [1, "a", True, 2], ["a"], [1, 2]],
    ),
    Case(
        "unevaluated-items-after-items-anywhere-in-place",
        {
            "allOf": [{"items": {"type": "integer"}}],
            "unevaluatedItems": False,
            "properties": {"l": {"prefixItems": [{}], "unevaluatedItems": False}},
        },
        [[1, 2, 3], {"l": [1]}, []],
        [[1, "a"], {"l": [1, 2]}],
    ),
    Case(
        "object-count-bounds",
        {
            "type": "object",
            "properties": {"a": {}, "b": {}},
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": False,
        },
        [{"a": 1}, {"b": 2}],
        [{}, {"a": 1, "b": 2}],
    ),
]


def _serializations(value: Any) -> list[str]:
    return [
        json.dumps(value, ensure_ascii=False),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        json.dumps(value, ensure_ascii=False, indent=2),
    ]


def _is_valid(schema: dict[str, Any] | bool, value: Any) -> bool:
    return bool(validator(schema, FORMATS).is_valid(value))


@functools.cache
def _grammar(name: str) -> Grammar:
    case = next(c for c in CASES if c.name == name)
    return Grammar.from_json_schema(case.schema)


def test_at_least_thirty_schemas() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_table_agrees_with_jsonschema(case: Case) -> None:
    assert all(_is_valid(case.schema, v) for v in case.valid)
    assert not any(_is_valid(case.schema, v) for v in case.invalid)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_schema_grammar_accepts_valid_instances(model: lcgen.Model, case: Case) -> None:
    grammar = _grammar(case.name)
    with grammar.state(model) as state:
        for value in case.valid:
            for text in _serializations(value):
                assert state.accepts_text(text), text


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_schema_grammar_rejects_invalid_instances(model: lcgen.Model, case: Case) -> None:
    grammar = _grammar(case.name)
    with grammar.state(model) as state:
        for value in case.invalid:
            for text in _serializations(value)[:2]:
                assert not state.accepts_text(text), text
        for text in case.bad_texts:
            assert not state.accepts_text(text), text


# random walks: generation without a model ------------------------------------------------------
@functools.cache
def _short_tokens(model: lcgen.Model) -> np.ndarray:
    """Tokens with pieces of 1-2 bytes: the random walks' alphabet."""
    return np.array([t for t in range(model.n_vocab) if 1 <= len(model.token_piece(t)) <= 2])


def random_walk(
    model: lcgen.Model, state: GrammarState, seed: int, guide: str, max_tokens: int = 400
) -> str | None:
    """Random tokens the grammar allows, until it may end and a coin says stop.

    The walk follows the tokens of ``guide`` (a valid text) for a random while, then leaves it:
    it prefers the characters ``guide`` uses (so that patterns can be finished), then any
    short token, then any allowed token. Returns None when it did not finish.
    """
    rng = np.random.default_rng(seed)
    path = model.tokenize(guide)[: int(rng.integers(0, len(model.tokenize(guide)) + 1))]
    favored = np.array(
        sorted({t for ch in set(guide) | {'"', "}", "]"} for t in model.tokenize(ch)[:1]})
    )
    tokens: list[int] = []
    with state.clone() as walker:
        walker.accept_tokens(path)
        tokens += path
        for _ in range(max_tokens):
            if walker.is_complete and (rng.random() < 0.4 or len(tokens) > max_tokens // 2):
                return model.detokenize(tokens)
            order = rng.permutation(_short_tokens(model))
            if rng.random() < 0.7:
                order = np.concatenate([rng.permutation(favored), order])
            token = next((int(t) for t in order if walker.try_accept(int(t))), None)
            if token is None:  # only longer tokens fit here: take one from the full mask
                allowed = [t for t in np.flatnonzero(walker.allowed()) if not model.is_eog(t)]
                if not allowed:
                    return model.detokenize(tokens)
                token = int(rng.choice(allowed))
                walker.accept(token)
            tokens.append(token)
    return None


WALKS = 6


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_random_walks_through_the_grammar_validate(model: lcgen.Model, case: Case) -> None:
    guides = [json.dumps(v, ensure_ascii=False) for v in case.valid]
    with _grammar(case.name).state(model) as state:
        texts = [
            random_walk(model, state, seed, guides[seed % len(guides)]) for seed in range(WALKS)
        ]
    finished = [t for t in texts if t is not None]
    assert len(finished) >= WALKS // 2
    for text in finished:
        assert _is_valid(case.schema, json.loads(text)), text


# exactness of ranges and lengths -----------------------------------------------------------------
@HYPOTHESIS
@given(
    lo=st.none() | st.integers(-(10**6), 10**6),
    hi=st.none() | st.integers(-(10**6), 10**6),
    exclusive=st.booleans(),
    x=st.integers(-2 * 10**6, 2 * 10**6),
)
def test_integer_ranges_are_exact(
    model: lcgen.Model, lo: int | None, hi: int | None, exclusive: bool, x: int
) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        schema["exclusiveMinimum" if exclusive else "minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    try:
        grammar = Grammar.from_json_schema(schema)
    except lcgen.GrammarError:
        assert lo is not None and hi is not None and lo + exclusive > hi
        return
    assert grammar.accepts(model, str(x)) == _is_valid(schema, x)


@HYPOTHESIS
@given(
    lo=st.none() | st.decimals(-1000, 1000, places=2),
    hi=st.none() | st.decimals(-1000, 1000, places=2),
    lo_exclusive=st.booleans(),
    hi_exclusive=st.booleans(),
    x=st.decimals(-2000, 2000, places=4),
    fraction=st.booleans(),
)
def test_number_ranges_are_exact(
    model: lcgen.Model,
    lo: Decimal | None,
    hi: Decimal | None,
    lo_exclusive: bool,
    hi_exclusive: bool,
    x: Decimal,
    fraction: bool,
) -> None:
    """Every number in the range, written as JSON writes it (``fraction``: the numbers that
    are not integers, written without trailing zeros: 2.50 and 2.0 are not)."""
    schema: dict[str, Any] = {"type": "number"}
    if fraction:
        schema["not"] = {"type": "integer"}
        x = x.normalize()
    if lo is not None:
        schema["exclusiveMinimum" if lo_exclusive else "minimum"] = float(lo)
    if hi is not None:
        schema["exclusiveMaximum" if hi_exclusive else "maximum"] = float(hi)
    try:
        grammar = Grammar.from_json_schema(schema)
    except lcgen.GrammarError as exc:
        assert "no number" in str(exc) or "no value" in str(exc)
        return
    text = format(x, "f")
    if x == 0 and text.startswith("-"):
        text = text[1:]  # the grammar writes zero without a sign
    assert grammar.accepts(model, text) == _is_valid(schema, json.loads(text)), text


STEPS = ["0.01", "0.001", "0.0001", "0.25", "1.5", "0.3", "2.5", "0.05", "0.125", "7", "0.5"]
STEPS += ["10", "3"]


@HYPOTHESIS
@given(
    step=st.sampled_from(STEPS),
    integer=st.booleans(),
    lo=st.none() | st.integers(-400, 400),  # quarters: the same value as a double
    hi=st.none() | st.integers(-400, 400),
    x=st.decimals(-200, 200, places=4),
    k=st.none() | st.integers(-800, 800),  # x = k * step instead
)
def test_multiples_are_exact(
    model: lcgen.Model,
    step: str,
    integer: bool,
    lo: int | None,
    hi: int | None,
    x: Decimal,
    k: int | None,
) -> None:
    """Every text the grammar accepts is an exact multiple within the bounds; every such text
    written without an exponent and with no more places than the step is accepted where the
    step is a power of ten, the multiples can be listed, or only a lower bound <= 0 is set;
    and every integer multiple within any bounds where the grammar writes integers (an integer
    schema, or an integer step), but negatives under a lower bound alone."""
    schema: dict[str, Any] = {"type": "integer" if integer else "number"}
    schema["multipleOf"] = float(step) if "." in step else int(step)
    if lo is not None:
        schema["minimum"] = lo / 4
    if hi is not None:
        schema["maximum"] = hi / 4
    try:
        grammar = Grammar.from_json_schema(schema)
    except lcgen.GrammarError as exc:
        assert "no" in str(exc) or "multipleOf" in str(exc), exc
        return
    if k is not None:
        x = k * Decimal(step)
    text = format(x.normalize(), "f")
    text = "0" if text == "-0" else text
    valid = (
        x % Decimal(step) == 0
        and (not integer or x == x.to_integral_value())
        and (lo is None or x >= Decimal(lo) / 4)
        and (hi is None or x <= Decimal(hi) / 4)
    )
    accepted = grammar.accepts(model, text)
    assert not accepted or valid, (schema, text)
    places = max(0, -Decimal(step).as_tuple().exponent)  # type: ignore[operator]
    written = max(0, -x.normalize().as_tuple().exponent)  # type: ignore[operator]
    power_of_ten = Decimal(step).as_tuple().digits == (1,)  # any bounds: a decimal range
    listed = lo is not None and hi is not None and Decimal(hi - lo) / 4 / Decimal(step) < 256
    unsigned = hi is None and (lo is None or (lo <= 0 and x >= 0))  # digit by digit
    if valid and written <= places and (power_of_ten or listed or unsigned):
        assert accepted, (schema, text)
    integral = written == 0 and (integer or Decimal(step) % 1 == 0)
    if valid and integral and not (hi is None and lo is not None and x < 0):
        assert accepted, (schema, text)


@HYPOTHESIS
@given(
    low=st.integers(0, 4),
    extra=st.integers(0, 4),
    text=st.text(st.characters(exclude_categories=["Cs"]), max_size=10),
    ascii_only=st.booleans(),
)
def test_string_lengths_are_exact(
    model: lcgen.Model, low: int, extra: int, text: str, ascii_only: bool
) -> None:
    schema = {"type": "string", "minLength": low, "maxLength": low + extra}
    serialized = json.dumps(text, ensure_ascii=ascii_only)
    try:
        accepted = Grammar.from_json_schema(schema).accepts(model, serialized)
    except lcgen.GrammarError as exc:  # SmolLM2 has no token for some bytes (e.g. 0xF1)
        assert "no tokens for bytes" in str(exc)
        return
    assert accepted == (low <= len(text) <= low + extra)


@pytest.mark.parametrize(
    ("pattern", "accepted", "refused"),
    [
        # Python's re.search takes "\n" before the end as "$", and any Unicode digit or letter
        # for \d and \w; ECMA-262 (JSON Schema's dialect, and pydantic's) does not.
        ("^\\d{5}$", ["12345"], ["12345\n", "\u06f8\u06f8\u06f8\u06f8\u06f8", "1234\u0663"]),
        ("^\\w+$", ["a_Z9"], ["\u00e9t\u00e9", "ab\n"]),
        ("^[^\\d]+$", ["abc"], ["\u0663", "a1"]),  # negated: neither side's digits
        ("^\\D$", ["x"], ["\u0663", "5"]),
        ("^\\s$", [" ", "\t", "\u3000"], ["\u001c", "\u0085", "\ufeff"]),
        ("^a.b$", ["axb", "a\u00e9b"], ["a\rb", "a\u2028b", "a\nb"]),
    ],
)
def test_patterns_match_only_what_ecma_262_and_python_agree_on(
    model: lcgen.Model, pattern: str, accepted: list[str], refused: list[str]
) -> None:
    grammar = Grammar.from_json_schema({"type": "string", "pattern": pattern})
    for text in accepted:
        assert re.search(pattern, text)
        assert grammar.accepts(model, json.dumps(text)), text
    for text in refused:
        assert not grammar.accepts(model, json.dumps(text)), text
    # regex= keeps Python's meaning (re.fullmatch), as documented
    assert Grammar.regex("\\d{5}").accepts(model, "\u06f8" * 5)


# what cannot be enforced raises ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "number", "multipleOf": 99.7, "maximum": 10**30}, "multipleOf 99.7 with"),
        ({"type": "number", "multipleOf": 0.0000123}, "multipleOf 0.0000123"),
        ({"type": "integer", "multipleOf": 997, "minimum": 1}, "multipleOf 997 with"),
        ({"not": {"format": "date"}}, "not of format"),
        ({"type": "string", "maxLength": 3, "not": {"pattern": "^a"}}, "not of pattern with"),
        # A not negates what it can and leaves the rest out, which only narrows: negated
        # again (a not inside a not, or an if, whose else is its negation), that would widen.
        ({"not": {"not": {"format": "date", "minLength": 2}}}, "negates a not of format"),
        (
            {"if": {"not": {"format": "date", "minLength": 2}}, "then": {"maxLength": 1}},
            "negates a not of format",
        ),
        ({"not": {"not": {"enum": [[1], "a"]}}}, "enum (the arrays and objects"),
        ({"const": True, "enum": [1, 2]}, "no value of enum/const"),  # the const is no option
        ({"contains": {"type": "string"}, "unevaluatedItems": False}, "unevaluatedItems at #"),
        (
            {
                "unevaluatedProperties": False,
                "anyOf": [{"properties": {c: {}}} for c in "abcdefghi"],
            },
            "anyOf at #/anyOf has too many branches beside unevaluatedProperties",
        ),
        (
            {"allOf": [{"contains": {"const": 1}}, {"contains": {"const": 2}}]},
            "two contains at # (joined by allOf or $ref) are not supported",
        ),
        ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
        ({"type": "string", "pattern": "(?=a)"}, "lookahead"),
        ({"type": "string", "pattern": "^a", "format": "date"}, "date with ^a"),
        ({"type": "string", "format": "uuid", "maxLength": 30}, "uuid with minLength/maxLength"),
        ({"type": "string", "format": "date", "maxLength": 3}, "date with minLength/maxLength"),
        (
            {
                "type": "object",
                "patternProperties": {"^a": {}},
                "additionalProperties": False,
                "minProperties": 2,
            },
            "minProperties 2 on extra properties",
        ),
        (
            {"oneOf": [{"type": "string"}, {"format": "date"}]},
            "oneOf at #: alternatives 0 and 1 may both match a value, and lcgen cannot exclude 1 "
            "where 0 matches (not of format (at #/oneOf/1) is not supported)",
        ),
        ({"$ref": "http://example.com/s.json"}, "which lcgen was not given"),
        ({"$ref": "#/$defs/missing"}, "does not resolve"),
        ({"$ref": "#", "minimum": 1}, "refers to itself"),
        ({"type": "string", "minLength": 5000}, "2000"),
        ({"type": "array", "maxItems": 5000}, "2000"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
        ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "no number"),
        (False, "false"),
        (
            {"type": "object", "properties": {"a": False}, "required": ["a"]},
            "required property 'a' at # is not allowed",
        ),
        (
            {"type": "object", "required": ["a"], "additionalProperties": False},
            "required property 'a'",
        ),
        ({"type": "strin"}, "invalid JSON Schema"),
        ({"type": "string", "minLength": -1}, "invalid JSON Schema"),
    ],
)
def test_unenforceable_schema_raises_naming_it(schema: dict[str, Any] | bool, named: str) -> None:
    with pytest.raises(lcgen.GrammarError) as info:
        Grammar.from_json_schema(schema)
    assert named.replace("# :", "#:") in str(info.value)


def test_an_enum_beside_boolean_items_and_additional_items(model: lcgen.Model) -> None:
    """The enum's values are checked against the other keywords by jsonschema, which takes
    len() of a boolean items beside additionalItems (a TypeError came out of lcgen)."""
    draft7 = "http://json-schema.org/draft-07/schema#"
    schema = {"$schema": draft7, "enum": [[], None], "items": True, "additionalItems": False}
    grammar = Grammar.from_json_schema(schema)
    assert [grammar.accepts(model, t) for t in ("[]", "null", "[1]", "0")] == [1, 1, 0, 0]


@pytest.mark.parametrize(
    ("schema", "texts"),
    [
        ({"$schema": DRAFT4, "oneOf": [{"const": 5}, {"type": "integer"}]}, ["3", "5", "2.5"]),
        ({"$schema": DRAFT4, "not": {"const": 5}}, ["3", "5"]),
        (
            {
                "$schema": DRAFT4,
                "discriminator": {"propertyName": "k"},
                "oneOf": [
                    {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                    {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
                ],
            },
            ['{"k": "a"}', '{"k": "c"}'],
        ),
        (
            {
                "$schema": "http://json-schema.org/draft-06/schema#",
                "oneOf": [
                    {"if": {"type": "integer"}, "then": {"minimum": 10}},
                    {"type": "integer"},
                ],
            },
            ["3", "12", "2.5", '"s"'],
        ),
        ({"oneOf": [{"dependencies": {"a": ["b"]}}, {"type": "object"}]}, ['{"a": 1}', '"x"']),
        ({"type": "object", "not": {"dependencies": {"a": ["b"]}}}, ['{"a": 1}', "{}"]),
    ],
)
def test_keywords_a_draft_lacks_never_widen_under_a_not(
    model: lcgen.Model, schema: dict[str, Any], texts: list[str]
) -> None:
    """lcgen holds to a keyword the schema's draft lacks (const in draft 4, dependencies since
    2019-09...) as its user meant it, which narrows; under a not (a oneOf negates its other
    options) it is true, as the draft reads it: negated, it let invalid JSON through."""
    try:
        grammar = Grammar.from_json_schema(schema)
    except lcgen.GrammarError:
        return  # refused: nothing is let through
    for text in texts:
        if grammar.accepts(model, text):
            assert _is_valid(schema, json.loads(text)), text


def test_equal_subschemas_keep_their_own_property_order(model: lcgen.Model) -> None:
    """Subschemas equal but for the order of their properties are not one (the memo of equal
    subschemas read them as one, and wrote the second in the first's order)."""
    first = {
        "type": "object",
        "properties": {"answer": {}, "why": {}},
        "required": ["answer", "why"],
    }
    second = {
        "type": "object",
        "properties": {"why": {}, "answer": {}},
        "required": ["why", "answer"],
    }
    grammar = Grammar.from_json_schema({"type": "array", "prefixItems": [first, second]})
    assert grammar.accepts(model, '[{"answer": 1, "why": 2}, {"why": 3, "answer": 4}]')


def test_decimals_from_a_json_reader_are_numbers(model: lcgen.Model) -> None:
    text = (
        '{"type": "object", "properties": {"r": {"enum": [0.5, 2, [1.5]]}, "m": {"maximum": 2.5}}}'
    )
    grammar = Grammar.from_json_schema(json.loads(text, parse_float=Decimal))
    accepted = [grammar.accepts(model, f'{{"r": {v}}}') for v in ("0.5", "2", "[1.5]", "1")]
    assert accepted == [True, True, True, False]


def test_errors_inside_unevaluated_subschemas_name_their_keyword() -> None:
    for key in ("unevaluatedProperties", "unevaluatedItems"):
        with pytest.raises(lcgen.GrammarError, match=f"at #/{key}\\) does not resolve"):
            Grammar.from_json_schema({key: {"$ref": "#/$defs/missing"}})


def test_equal_subschemas_are_written_once() -> None:
    """Eight copies of an object whose anyOf beside unevaluatedProperties makes 63
    alternatives, under an outer anyOf of 8 (255 alternatives): each alternative wrote every
    copy out again (1.2 MB of GBNF, 20 s; llguidance then refused it as too large)."""
    groups = ["name", "email", "phone", "address", "company", "title", "notes", "tags"]
    contact = {
        "type": "object",
        "anyOf": [{"properties": {f"{g}_1": {"type": "string"}}} for g in groups[:6]],
        "unevaluatedProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {g: json.loads(json.dumps(contact)) for g in groups},
        "anyOf": [{"properties": {g: True}, "required": [g]} for g in groups],
        "unevaluatedProperties": False,
    }
    assert len(Grammar.from_json_schema(schema).gbnf) < 150_000  # measured: 70,395


def test_schema_as_json_text_and_bad_text() -> None:
    assert Grammar.from_json_schema('{"type": "integer"}') == Grammar.from_json_schema(
        {"type": "integer"}
    )
    with pytest.raises(lcgen.GrammarError, match="not valid JSON"):
        Grammar.from_json_schema("{type: integer}")
    with pytest.raises(TypeError):
        Grammar.from_json_schema(3)  # type: ignore[arg-type]


# pydantic -------------------------------------------------------------------------------------
class Color(enum.StrEnum):
    red = "red"
    green = "green"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(min_length=1, max_length=40)
    zip: str = pydantic.Field(pattern=r"^\d{5}$")


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int = pydantic.Field(ge=0, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Person(pydantic.BaseModel):
    name: str
    email: str | None = None
    favorite: Color
    tags: list[str] = pydantic.Field(default_factory=list, max_length=3)
    address: Address
    pet: Cat | Dog = pydantic.Field(discriminator="kind")
    born: datetime.date
    id: uuid.UUID
    score: float = pydantic.Field(ge=0, le=1)
    counts: dict[str, int] = {}
    seen: datetime.datetime | None = None


PEOPLE = [
    Person(name="Ada", favorite=Color.red, address=Address(city="London", zip="12345"),
           pet=Cat(kind="cat", lives=9), born=datetime.date(1815, 12, 10),
           id=uuid.UUID(UID), score=1.0),
    Person(name="Bo \"B\" 日本", email="bo@x.io", favorite=Color.green, tags=["a", "b"],
           address=Address(city="Oslo", zip="00000"), pet=Dog(kind="dog", good=True),
           born=datetime.date(2000, 2, 29), id=uuid.UUID(int=1), score=0.25,
           counts={"x": 1}, seen=datetime.datetime(2024, 1, 1, 12, tzinfo=datetime.UTC)),
]  # fmt: skip


def test_pydantic_instances_are_accepted(model: lcgen.Model) -> None:
    with pytest.raises(TypeError, match=r"Grammar\.from_pydantic"):
        Grammar.from_json_schema(Person)  # type: ignore[arg-type]
    grammar = Grammar.from_pydantic(Person)
    for person in PEOPLE:
        assert grammar.accepts(model, person.model_dump_json())
        assert grammar.accepts(model, person.model_dump_json(indent=2))


def test_pydantic_random_walks_validate(model: lcgen.Model) -> None:
    guides = [p.model_dump_json() for p in PEOPLE]
    with Grammar.from_pydantic(Person).state(model) as state:
        texts = [random_walk(model, state, seed, guides[seed % 2], 600) for seed in range(WALKS)]
    finished = [t for t in texts if t is not None]
    assert len(finished) >= WALKS // 2
    for text in finished:
        Person.model_validate_json(text)


class Link(pydantic.BaseModel):
    url: pydantic.AnyUrl  # format uri with minLength 1 and maxLength 2083
    code: str = pydantic.Field(pattern=r"^[A-Z]{2,4}$", max_length=4)
    slug: str = pydantic.Field(pattern=r"^[a-z-]+$", min_length=3, max_length=12)


def test_pydantic_lengths_beside_patterns_and_formats(model: lcgen.Model) -> None:
    guide = Link(url=pydantic.AnyUrl("https://example.com/x"), code="AB", slug="a-b-c")
    with Grammar.from_pydantic(Link).state(model) as state:
        assert state.accepts_text(guide.model_dump_json())
        texts = [random_walk(model, state, seed, guide.model_dump_json()) for seed in range(WALKS)]
    finished = [t for t in texts if t is not None]
    assert len(finished) >= WALKS // 2
    for text in finished:
        Link.model_validate_json(text)


def test_pydantic_rejects_what_it_cannot_enforce() -> None:
    class Tagged(pydantic.BaseModel):
        tags: set[str]
        due: pydantic.FutureDate

    class Even(pydantic.BaseModel):
        n: float = pydantic.Field(multiple_of=99.7, ge=1, le=10**30)

    with pytest.raises(lcgen.GrammarError, match="future-date"):
        Grammar.from_pydantic(Tagged)
    with pytest.raises(lcgen.GrammarError, match="multipleOf"):
        Grammar.from_pydantic(Even)
    with pytest.raises(TypeError):
        Grammar.from_pydantic(dict)


def test_pydantic_names_that_are_not_gbnf_names(model: lcgen.Model) -> None:
    """Model names become rule names only after cleaning: ``Inner_Model`` and generic
    ``Page[Item]`` used to produce GBNF that llama.cpp rejected."""
    T = TypeVar("T")

    class Inner_Model(pydantic.BaseModel):
        x: int

    class Item(pydantic.BaseModel):
        name: str

    class Page(pydantic.BaseModel, Generic[T]):
        items: list[T]
        inner: Inner_Model

    cls = Page[Item]
    grammar = Grammar.from_pydantic(cls)
    value = cls(items=[Item(name="a")], inner=Inner_Model(x=1))
    assert grammar.accepts(model, value.model_dump_json())
    assert not grammar.accepts(model, '{"items": [{"name": 1}], "inner": {"x": 1}}')


def test_pydantic_models_follow_their_extra_setting(model: lcgen.Model) -> None:
    class Ignoring(pydantic.BaseModel):
        a: int

    class Allowing(pydantic.BaseModel, extra="allow"):
        a: int

    text = '{"a": 1, "b": 2}'
    assert not Grammar.from_pydantic(Ignoring).accepts(model, text)
    assert Grammar.from_pydantic(Allowing).accepts(model, text)
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert Grammar.from_json_schema(open_schema).accepts(model, text)
    assert not Grammar.from_json_schema(open_schema, close_objects=True).accepts(model, text)


def test_a_reference_to_the_root_recurses(model: lcgen.Model) -> None:
    schema = {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}
    grammar = Grammar.from_json_schema(schema)
    for text in ("[]", "[[], [[]]]"):
        assert grammar.accepts(model, text)
    assert not grammar.accepts(model, "[1]")
    with pytest.raises(lcgen.GrammarError, match="refers only to itself"):
        Grammar.from_json_schema({"$ref": "#"})


def test_a_long_enum_keeps_the_values_its_other_keywords_allow(model: lcgen.Model) -> None:
    # Each value was checked against its own enum too (a scan of the list per value): 2,000
    # values took 0.9 s to compile (now 0.09 s), 60,000 over two minutes (now 7 s, most of it
    # llama.cpp's check of the grammar): a server request within the body limit.
    values: list[Any] = [f"v{i}" for i in range(5000)] + [7, "toolongvalue"]
    grammar = Grammar.from_json_schema({"enum": values, "type": "string", "maxLength": 6})
    for text in ('"v0"', '"v4999"'):
        assert grammar.accepts(model, text)
    for text in ("7", '"toolongvalue"', '"v5000"'):
        assert not grammar.accepts(model, text)


def test_an_enum_is_a_prefix_tree() -> None:
    # llama.cpp walks every alternative alive each token: values share their prefixes, a
    # number keeps its optional zeros, an object stays whole.
    gbnf = Grammar.from_json_schema({"enum": ["v10", "v1", "v2", 1, 1.5, {"a": 1}]}).gbnf
    assert gbnf.startswith(
        'root ::= ("\\"v" ("1" ("0\\"" | "\\"") | "2\\"") '
        '| "1" (("." "0"{1,20})? | ".5" "0"{0,19}) | "{" ws'
    )


def test_an_enum_or_const_number_takes_the_places_any_number_has(model: lcgen.Model) -> None:
    """Its zeros were unbounded: SmolLM2 wrote ``1.000…`` for a rating enum until max_tokens
    (IncompleteOutputError at every seed); a number the schema bounds has 20 places at most."""
    for schema in ({"enum": [1, 2, 3, 4, 5]}, {"const": 1}, {"enum": [1.5, "x"]}):
        grammar = Grammar.from_json_schema(schema)
        first = schema.get("const", schema.get("enum", [None])[0])
        shortest = json.dumps(first)
        zeros = "0" * (21 - len(shortest.partition(".")[2]))
        point = "" if "." in shortest else "."
        assert grammar.accepts(model, shortest + point + zeros[1:])  # 20 places
        assert not grammar.accepts(model, shortest + point + zeros)  # 21
    prompt = "Review: 'Great food, slow service.'\nRating from 1 to 5:"
    for seed in range(3):
        rating = model.generate(prompt, schema={"enum": [1, 2, 3, 4, 5]}, seed=seed, max_tokens=40)
        assert rating in {1, 2, 3, 4, 5}


def test_a_large_enum_keeps_few_alternatives_alive(model: lcgen.Model) -> None:
    # 20,000 values: the widest group is the ten digits or the closing quote (a flat
    # alternation held 20,000, which llama.cpp walked at every token).
    values = [f"v{i}" for i in range(20_000)]
    grammar = Grammar.from_json_schema({"enum": values})
    assert widest_alternation(grammar.gbnf) == 11
    for text in ('"v0"', '"v19999"', '"v123"'):
        assert grammar.accepts(model, text)
    for text in ('"v"', '"v20000"', '"v01"', "v1"):
        assert not grammar.accepts(model, text)


_ENUM_STRINGS = st.text(st.sampled_from(["a", "b", '"', "\\", "\n", "é", "🙂", "/"]), max_size=4)
_ENUM_VALUES = st.one_of(
    _ENUM_STRINGS, st.integers(-12, 12), st.sampled_from([1.5, 10.25, True, False, None])
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=st.lists(_ENUM_VALUES, min_size=1, max_size=10), others=st.lists(_ENUM_VALUES))
def test_an_enum_accepts_exactly_its_values(
    model: lcgen.Model, values: list[Any], others: list[Any]
) -> None:
    # Every JSON text of each value (raw or escaped non-ASCII, 1 as 1.0) and nothing else:
    # not the prefixes of a value's text (other values among them) or other values.
    grammar = Grammar.from_json_schema({"enum": values})
    for value in values:
        for text in {json.dumps(value), json.dumps(value, ensure_ascii=False)}:
            assert grammar.accepts(model, text)
            for n in range(len(text)):
                prefix_ok = any(_equal(json.loads(text[:n]), v) for v in values if _loads(text[:n]))
                assert grammar.accepts(model, text[:n]) == prefix_ok
        if isinstance(value, int) and not isinstance(value, bool):
            assert grammar.accepts(model, f"{value}.00")
    for other in others:
        member = any(_equal(other, v) for v in values)
        assert grammar.accepts(model, json.dumps(other)) == member


def _loads(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _equal(a: Any, b: Any) -> bool:
    """JSON Schema's equality: numbers by value, booleans apart from numbers."""
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))
    return (numbers or type(a) is type(b)) and a == b


@pytest.mark.parametrize("const", [12345678901234567890, -9223372036854775809, 1e300, 2.0**60])
def test_a_constant_past_2_53_is_written_only_as_text_that_reads_back_equal(
    model: lcgen.Model, const: float
) -> None:
    # 12345678901234567890.0 was allowed for the int: read back, 1.2345678901234567e+19
    grammar = Grammar.from_json_schema({"const": const})
    whole = str(int(Decimal(repr(const)))) if isinstance(const, float) else str(const)
    accepted = [t for t in (whole, whole + ".0", whole + ".00") if grammar.accepts(model, t)]
    assert accepted and all(json.loads(t) == const for t in accepted), accepted


def test_an_enum_beside_a_format_keeps_the_values_the_format_allows(model: lcgen.Model) -> None:
    # Checked by jsonschema, whose date-time, time, duration, hostname and uri checks need
    # optional packages: without them "tomorrow" went out as a date-time.
    dates = ["tomorrow", "2024-02-29T10:00:00Z", "2023-02-29T10:00:00Z"]
    grammar = Grammar.from_json_schema({"type": "string", "format": "date-time", "enum": dates})
    assert [grammar.accepts(model, json.dumps(d)) for d in dates] == [False, True, False]
    for fmt, value in [("time", "bb"), ("duration", "P"), ("hostname", "-bb-"), ("uri", "b b")]:
        with pytest.raises(lcgen.GrammarError, match="satisfies the other keywords"):
            Grammar.from_json_schema({"const": value, "format": fmt})
    names = Grammar.from_json_schema(
        {"properties": {"bb": {"type": "integer"}}, "propertyNames": {"format": "date-time"}}
    )
    assert not names.accepts(model, '{"bb": 1}') and names.accepts(model, "{}")


@pytest.mark.parametrize("lengths", [{}, {"maxLength": 40}])  # a rule; a bounded pattern
def test_uris_follow_rfc_3986(model: lcgen.Model, lengths: dict[str, int]) -> None:
    # Any URI character after a scheme passed: "http://x:y" (a port of letters), two "#".
    # (With lengths, a pattern is cut to a part of its texts that fits them: the good ones
    # are checked on the rule.)
    uri = Grammar.from_json_schema({"type": "string", "format": "uri", **lengths})
    good = ["a:b?c#d", "http://h:80/p", "mailto:me@x.org", "urn:isbn:0451450523", "file:///x"]
    bad = ["http://x:y", "a:b#c#d", "a://u@v@w", "no scheme", "1a:b", "a://[zz]", "a://[::1"]
    assert all(uri.accepts(model, json.dumps(t)) for t in good[: 5 if not lengths else 1])
    assert uri.accepts(model, '"http://[2001:db8::7]:80/p"') != bool(lengths)  # an IP literal
    assert not any(uri.accepts(model, json.dumps(t)) for t in bad)
    ref = Grammar.from_json_schema({"type": "string", "format": "uri-reference", **lengths})
    good = [*good, "/a:b", "a/b:c", "?q", "#f", "", "//host/p", "../up"]
    bad = [":x", ":", "a#b#c", "//x:y"]  # a first segment with ":" is a scheme's
    assert all(ref.accepts(model, json.dumps(t)) for t in good if not lengths or len(t) < 4)
    assert not any(ref.accepts(model, json.dumps(t)) for t in bad)


def test_bounds_too_close_for_the_places_written_say_so() -> None:
    # "no number satisfies the bounds": 1.5e-300 does; none with at most 20 places does
    for schema in (
        {"type": "number", "minimum": 1e-300, "maximum": 2e-300},
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-30},
    ):
        with pytest.raises(lcgen.GrammarError, match="at most 20 decimal places"):
            Grammar.from_json_schema(schema)
    with pytest.raises(lcgen.GrammarError, match="no number satisfies the bounds"):
        Grammar.from_json_schema({"type": "number", "minimum": 2, "maximum": 1})
    # an alternative that cannot be written still leaves the others
    either = {"anyOf": [{"type": "number", "minimum": 1e-300, "maximum": 2e-300}, {"const": 1}]}
    assert Grammar.from_json_schema(either)


def test_unknown_keywords_are_ignored_and_misspellings_warn() -> None:
    with pytest.warns(
        UserWarning, match="'proprties' at # is ignored .did you mean 'properties'"
    ) as said:
        Grammar.from_json_schema({"type": "object", "proprties": {"a": {}}})
    assert [w.filename for w in said] == [__file__]  # the line that passed the schema
    with pytest.warns(UserWarning, match="'requird' at #/properties/a") as said:
        Grammar.from_json_schema({"properties": {"a": {"type": "object", "requird": []}}})
    assert [w.filename for w in said] == [__file__]  # however deep in lcgen it was found
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Grammar.from_json_schema({"type": "string", "javaType": "x", "example": "y"})


def test_compact_whitespace(model: lcgen.Model) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {}}}}
    compact = Grammar.from_json_schema(schema, whitespace="compact")
    assert compact.accepts(model, '{"a":[1,{"b":null}]}')
    assert not compact.accepts(model, '{"a": [1]}')
    assert Grammar.from_json_schema(schema).accepts(model, '{"a": [1]}')
    small = {
        "type": "object",
        "required": ["a"],
        "additionalProperties": False,
        "properties": {
            "a": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
            }
        },
    }
    prompt = "A JSON object with a list of numbers:\n"
    chunks = list(model.stream(prompt, schema=small, json_whitespace="compact", max_tokens=80))
    assert chunks[-1].finish_reason == "stop"
    text = "".join(c.text for c in chunks)
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    with pytest.raises(ValueError, match="json_whitespace"):
        model.generate("x", schema=schema, json_whitespace="tight")  # type: ignore[typeddict-item]
    for constraint in ({"grammar": Grammar.bundled("json")}, {"choice": ["a"]}, {"regex": "a"}):
        with pytest.raises(ValueError, match="'tight'"):  # (checked with any constraint)
            lcgen.make_plan(json_whitespace="tight", **constraint)  # type: ignore[arg-type]


def _recursive_models() -> tuple[type[pydantic.BaseModel], type[pydantic.BaseModel]]:
    class LNode(pydantic.BaseModel):
        value: int
        next: LNode | None = None

    class Tree(pydantic.BaseModel):
        name: str
        children: list[Tree] = []
        parent: Tree | None = None

    LNode.model_rebuild(_types_namespace={"LNode": LNode})
    Tree.model_rebuild(_types_namespace={"Tree": Tree})
    return LNode, Tree


def _generations_validate(model: lcgen.Model, schema: Any, check: Any) -> None:
    """Random generations under ``schema`` all validate (``check`` raises otherwise); cut
    short by max_tokens is allowed (a small model at temperature 1 may nest until it runs out:
    4 seeds of 8 did on one build), but one at least completes."""
    completed = 0
    for seed in range(8):
        try:
            value = model.generate(
                "A JSON value:\n", schema=schema, temperature=1.0, seed=seed, max_tokens=200
            )
        except lcgen.IncompleteOutputError:
            continue
        check(value)
        completed += 1
    assert completed, "no generation completed"


def test_recursion_through_anyof_oneof_and_type_lists(model: lcgen.Model) -> None:
    # A $ref to an enclosing schema inside anyOf/oneOf (or beside a type list) was expanded
    # in place again at every level: "nests too deeply". It is now a rule that refers to itself.
    def nullable(key: str) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"next": {key: [{"$ref": "#"}, {"type": "null"}]}},
        }

    typed = {
        "type": ["object", "null"],
        "properties": {"next": {"type": ["object", "null"], "$ref": "#"}},
    }
    valid = ["{}", '{"next": null}', '{"next": {"next": {"next": null}}}', '{"next": {}, "a": 1}']
    invalid = ['{"next": 1}', '{"next": {"next": []}}', '{"next": {"next": "x"}}', "[]"]
    for schema in (nullable("anyOf"), nullable("oneOf"), typed):
        grammar = Grammar.from_json_schema(schema)
        for text in valid:
            assert grammar.accepts(model, text), (schema, text)
        for text in invalid:
            assert not grammar.accepts(model, text), (schema, text)
    assert Grammar.from_json_schema(typed).accepts(model, "null")
    assert not Grammar.from_json_schema(nullable("anyOf")).accepts(model, "null")
    # An object that must be an object, its next one an object of the same shape (a $ref
    # beside a type list: null fails the root's own type).
    inner = {"type": "object", "properties": {"next": {"type": ["object", "null"], "$ref": "#"}}}
    grammar = Grammar.from_json_schema(inner)
    assert grammar.accepts(model, '{"next": {"next": {}}}')
    assert not grammar.accepts(model, '{"next": null}')
    closed = {
        "type": "object",
        "required": ["v"],
        "additionalProperties": False,
        "properties": {
            "v": {"type": "integer", "minimum": 0, "maximum": 9},
            "next": {"oneOf": [{"$ref": "#"}, {"type": "null"}]},
        },
    }
    grammar = Grammar.from_json_schema(closed)
    assert grammar.accepts(model, '{"v": 1, "next": {"v": 2, "next": {"v": 3}}}')
    assert not grammar.accepts(model, '{"v": 1, "next": {"next": null}}')
    check = validator(closed)
    _generations_validate(model, closed, check.validate)


def test_pydantic_optional_self_and_trees(model: lcgen.Model) -> None:
    lnode, tree = _recursive_models()
    grammar = Grammar.from_pydantic(lnode)
    for text in ('{"value": 1}', '{"value": 1, "next": {"value": 2, "next": null}}'):
        assert grammar.accepts(model, text)
        lnode.model_validate_json(text)
    for text in ('{"next": null}', '{"value": 1, "next": {"next": null}}', '{"value": "1"}'):
        assert not grammar.accepts(model, text)
    grammar = Grammar.from_pydantic(tree)
    text = '{"name": "a", "children": [{"name": "b", "parent": {"name": "a"}}], "parent": null}'
    assert grammar.accepts(model, text)
    tree.model_validate_json(text)
    for text in ('{"name": "a", "children": [{}]}', '{"name": "a", "parent": {"children": []}}'):
        assert not grammar.accepts(model, text)
    for cls in (lnode, tree):
        _generations_validate(model, cls, lambda value, cls=cls: isinstance(value, cls))


def test_recursion_that_never_ends_names_its_ref() -> None:
    cases = [
        ({"type": ["object", "null"], "$ref": "#"}, "$ref '#' at # is not supported"),
        ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "$ref '#' at #/anyOf/0 is not supported"),
        (
            {"type": "object", "required": ["n"], "properties": {"n": {"anyOf": [{"$ref": "#"}]}}},
            "the recursion of $ref '#' at #/properties/n/anyOf/0 (back to #/properties/n) never",
        ),
        (
            {"type": "object", "required": ["n"], "properties": {"n": {"$ref": "#"}}},
            "the recursion of $ref '#' at #/properties/n (back to #) never ends",
        ),
        (
            {
                "$ref": "#/$defs/a",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            },
            "refers only to itself",
        ),
    ]
    for schema, message in cases:
        with pytest.raises(lcgen.GrammarError, match=re.escape(message)):
            Grammar.from_json_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "contains": {"type": "integer"}, "unevaluatedItems": False},
        {"type": "string", "format": "regex", "minLength": 2},
        {"type": "string", "pattern": "a(?=b)"},
        {"type": "string", "pattern": "a$b"},  # an anchor inside
        {"type": "string", "minLength": 3000},  # past llama.cpp's bound on a repetition
        # a not lcgen writes in part left nothing: "no value satisfies the schema" (1.5, {"z": 0}
        # and "bcd" do)
        {"type": "object", "not": {"const": {}}},
        {"type": "array", "items": {"type": "integer"}, "not": {"const": [1, 2]}},
        {
            "if": {"type": "string", "format": "date"},
            "then": {"type": "number"},
            "else": {"type": "string"},
        },
        {"type": "array", "allOf": [{"contains": {"type": "integer"}}, {"contains": {}}]},
        {"type": "array", "contains": {"const": 1}, "maxContains": 1, "maxItems": 1000},
        {"type": "string", "pattern": "^\\p{L}+$"},  # ECMA-262 escapes Python's re lacks
        {"type": "string", "pattern": "^\\u{1F600}$"},
        {"type": "array", "minItems": 100000},
        {"type": ["object", "null"], "$ref": "#"},
        # extra keys lcgen writes in part (several rules judge them; patterns no automaton
        # splits exactly): no value was left, but {"ax": "s"}, {"name": "s"} validate
        {
            "type": "object",
            "propertyNames": {"maxLength": 10},
            "patternProperties": {"^a": {"type": "string"}},
            "additionalProperties": False,
            "minProperties": 1,
        },
        {
            "type": "object",
            "propertyNames": {"maxLength": 10},
            "additionalProperties": {"type": "string"},
            "patternProperties": {"^x-": {"type": "integer"}},
            "minProperties": 1,
        },
        {
            "type": "object",
            "patternProperties": {"^a{1000}$": {"type": "integer"}, "^a{999}": {"type": "string"}},
            "additionalProperties": False,
            "minProperties": 1,
        },
    ],
)
def test_what_lcgen_cannot_enforce_is_unsupported(schema: dict[str, Any]) -> None:
    """A valid schema lcgen cannot enforce is an UnsupportedSchemaError: a caller may fall
    back to a looser grammar (lcgen serve does where a response_format is not strict)."""
    with pytest.raises(lcgen.UnsupportedSchemaError):
        Grammar.from_json_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 5, "maximum": 3},
        False,
        {"enum": []},
        {"$ref": "#/$defs/nope"},
        {"$ref": "#"},
        {"type": "foo"},
        {"type": "string", "minLength": 3, "maxLength": 2},
        {"type": "string", "pattern": "(a"},
        {"not": {"minLength": 0}},  # (a not of what every value satisfies)
        {"not": {"required": [], "properties": {}}},
        # no value, whatever the not lcgen writes in part beside it (a server falls back to a
        # looser grammar for unsupported ones: a 200 where no reply can be valid)
        {
            "allOf": [
                {"not": {"type": "string", "pattern": "^x"}},
                {"type": "integer", "maximum": -1, "minimum": 0},
            ]
        },
        {
            "type": "object",
            "properties": {
                "a": {"not": {"type": "integer"}},
                "b": {"minLength": 5, "maxLength": 2, "type": "string"},
            },
            "required": ["a", "b"],
        },
        # no key is allowed: no object of one property
        {
            "type": "object",
            "patternProperties": {"^a": False},
            "additionalProperties": False,
            "minProperties": 1,
        },
        # the arrays must reach an item no value satisfies
        {"type": "array", "items": {"type": "integer", "minimum": 5, "maximum": 3}, "minItems": 1},
        {
            "type": "array",
            "prefixItems": [
                {"type": "integer"},
                {"type": "string", "maxLength": 1, "minLength": 2},
            ],
            "minItems": 2,
        },
    ],
)
def test_an_invalid_schema_or_one_no_value_validates_is_not_unsupported(
    schema: dict[str, Any] | bool,
) -> None:
    with pytest.raises(lcgen.GrammarError) as info:
        Grammar.from_json_schema(schema)
    assert not isinstance(info.value, lcgen.UnsupportedSchemaError), info.value


NOT_EMPTY = {"type": "object", "not": {"const": {}}}  # a not lcgen writes in part


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"x": NOT_EMPTY, "n": {"type": "integer"}}},
        {"type": "array", "items": NOT_EMPTY},
        {"type": "array", "prefixItems": [{"type": "integer"}, NOT_EMPTY]},
    ],
)
def test_an_optional_member_lcgen_cannot_write_is_not_left_out(schema: dict[str, Any]) -> None:
    """Left out are only members no value satisfies; one lcgen writes nothing of, though
    values exist ({"x": {"a": 1}}), was dropped without a word: it stays unsupported."""
    with pytest.raises(lcgen.UnsupportedSchemaError, match="writes only in part the not"):
        Grammar.from_json_schema(schema)


def test_a_number_lcgen_cannot_write_is_not_left_out() -> None:
    """Equal inclusive bounds hold one number: with more places than lcgen writes it is
    refused, not taken for a member no value satisfies (and left out)."""
    one = {"type": "number", "minimum": 1.5e-25, "maximum": 1.5e-25}
    with pytest.raises(lcgen.GrammarError, match="at most 20 decimal places"):
        Grammar.from_json_schema({"type": "object", "properties": {"x": one}})


def test_property_count_bounds_compile_in_polynomial_steps(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Exactly one of these 20 options" (minProperties = maxProperties = 1) tried each of the
    # 2**20 ways to reach a count that broke the bounds (a failure was not remembered): 1 s at
    # 20 options, 17 s at 24, minutes at 30.
    from lcgen.constrain.json_values import ValueCompiler

    calls = 0
    chain = ValueCompiler.member_chain

    def counted(self: ValueCompiler, *args: Any) -> str:
        nonlocal calls
        calls += 1
        return chain(self, *args)

    monkeypatch.setattr(ValueCompiler, "member_chain", counted)
    options = {f"p{i}": {"type": "integer"} for i in range(20)}
    one = {"type": "object", "properties": options, "additionalProperties": False}
    grammar = Grammar.from_json_schema({**one, "minProperties": 1, "maxProperties": 1})
    assert calls < 1000, calls  # (each (property, first, count) state once: 21 * 2 * 3 of them)
    assert grammar.accepts(model, '{"p7": 1}')
    assert not grammar.accepts(model, "{}") and not grammar.accepts(model, '{"p1": 1, "p2": 2}')
    calls = 0
    Grammar.from_json_schema({**one, "properties": {**options, "q": {}}, "minProperties": 18})
    assert calls < 10000, calls


@pytest.mark.parametrize(
    ("fmt", "valid", "invalid"),
    [
        (  # RFC 3339's ABNF, which JSON Schema cites: a unit is left out only at the end
            "duration",
            ["P1Y2M3DT4H5M6S", "P1Y2M", "PT4H5M", "P3DT4H", "PT36H", "P4W", "PT1M1S", "P1M"],
            ["PT1H1S", "P1Y1D", "P1DT5H30S", "P", "PT", "P2D1Y", "P1Y2W"],
        ),
        (  # a top-level domain ends in a letter (pydantic's EmailStr refuses others)
            "email",
            ["a@b.co", "x@a-1.b2c", "x@1.io"],
            ["a@example.com1", "a@x.123", "a@localhost", "a@x.-c", "a@x.c-"],
        ),
    ],
)
def test_formats_keep_to_their_rfcs(
    model: lcgen.Model, fmt: str, valid: list[str], invalid: list[str]
) -> None:
    # (jsonschema's own checks are lax here, or need packages it leaves optional)
    grammar = Grammar.from_json_schema({"type": "string", "format": fmt})
    for text in valid:
        assert grammar.accepts(model, json.dumps(text)), text
    for text in invalid:
        assert not grammar.accepts(model, json.dumps(text)), text
