"""References across JSON Schema resources: ``$id`` bases, anchors and other documents
(:mod:`lcgen.constrain.bundle`), checked against jsonschema's own resolution."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.exceptions
import referencing.jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import lcgen
from lcgen.constrain.bundle import DOCUMENTS, unresolved_ref

DRAFT7 = "http://json-schema.org/draft-07/schema#"
HYPOTHESIS_RELOCATION = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
DRAFT4 = "http://json-schema.org/draft-04/schema#"

ADDRESS = {
    "$id": "https://example.com/schemas/address.json",
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"$ref": "#/$defs/zip"}},
    "required": ["city", "zip"],
    "additionalProperties": False,
    "$defs": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
}
PHONE = {"$defs": {"number": {"type": "string", "pattern": "^\\+[0-9]{6,9}$"}}}
PERSON = {
    "$id": "https://example.com/schemas/person.json",
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "address": {"$ref": "address.json"},
        "phone": {"$ref": "https://example.com/schemas/phone.json#/$defs/number"},
        "tags": {"$ref": "#tags"},
    },
    "required": ["name", "address", "phone"],
    "additionalProperties": False,
    "$defs": {"tags": {"$anchor": "tags", "type": "array", "items": {"enum": ["a", "b"]}}},
}
DOCS = {
    "https://example.com/schemas/address.json": ADDRESS,
    "https://example.com/schemas/phone.json#": PHONE,  # (an empty fragment is no fragment)
}


def _valid(schema: Any, docs: dict[str, Any], text: str) -> bool:
    """jsonschema's verdict, with ``docs`` in its registry."""
    draft = jsonschema.validators.validator_for(schema)
    spec = referencing.jsonschema.specification_with(draft.META_SCHEMA["$schema"])
    registry: referencing.Registry[Any] = referencing.Registry().with_resources(
        (uri, spec.create_resource(doc)) for uri, doc in docs.items()
    )
    return bool(draft(schema, registry=registry).is_valid(json.loads(text)))


# (schema, documents, texts): each text accepted exactly where jsonschema says valid
CASES = [
    pytest.param(
        PERSON,
        DOCS,
        [
            '{"name": "Ada", "address": {"city": "Paris", "zip": "75001"}, "phone": "+3312345"}',
            '{"name": "Ada", "address": {"city": "Paris", "zip": "7500"}, "phone": "+3312345"}',
            '{"name": "Ada", "address": {"city": "Paris", "zip": "75001"}, "phone": "3312345"}',
            '{"name": "Ada", "address": {"city": "Paris", "zip": "75001"}, "phone": "+3312345",'
            ' "tags": ["a", "c"]}',
            '{"name": "Ada", "address": {"city": "Paris", "zip": "75001"}, "phone": "+3312345",'
            ' "tags": ["b"]}',
        ],
        id="documents-by-relative-and-absolute-uri",
    ),
    pytest.param(
        {
            "$id": "http://example.com/root.json",
            "properties": {"a": {"$ref": "item.json"}, "b": {"$ref": "folder/item.json"}},
            "$defs": {
                "item": {"$id": "item.json", "type": "integer"},
                "folder": {
                    "$id": "folder/",
                    "$defs": {"item": {"$id": "item.json", "type": "string"}},
                },
            },
        },
        {},
        ['{"a": 1, "b": "x"}', '{"a": "x"}', '{"b": 1}'],
        id="embedded-resources-with-nested-bases",
    ),
    pytest.param(
        {
            "$id": "urn:uuid:deadbeef-1234-ffff-ffff-4321feebdaed",
            "properties": {"a": {"$ref": "#/$defs/a"}, "b": {"$ref": "urn:x:b#/$defs/b"}},
            "$defs": {
                "a": {"type": "boolean"},
                "other": {"$id": "urn:x:b", "$defs": {"b": {"const": "b"}}},
            },
        },
        {},
        ['{"a": true, "b": "b"}', '{"a": 1}', '{"b": "c"}'],
        id="urn-bases",
    ),
    pytest.param(
        {
            "$schema": DRAFT7,
            "$id": "http://localhost:1234/sibling_id/base/",
            "definitions": {
                "foo": {"$id": "http://localhost:1234/sibling_id/foo.json", "type": "string"},
                "base_foo": {"$id": "foo.json", "type": "number"},
            },
            "allOf": [{"$id": "http://localhost:1234/sibling_id/", "$ref": "foo.json"}],
        },
        {},
        ['"a"', "1"],
        id="draft7-ref-ignores-a-sibling-id",
    ),
    pytest.param(
        {
            "$schema": DRAFT4,
            "id": "http://example.com/root.json",
            "properties": {"a": {"$ref": "#loc"}, "b": {"$ref": "inner.json#/definitions/c"}},
            "definitions": {
                "loc": {"id": "#loc", "type": "integer"},
                "inner": {"id": "inner.json", "definitions": {"c": {"enum": [1, 2]}}},
            },
        },
        {},
        ['{"a": 1, "b": 2}', '{"a": "x"}', '{"b": 3}'],
        id="draft4-ids-and-location-independent-identifiers",
    ),
    pytest.param(
        {
            "$defs": {
                "unknown": {
                    "not": {"x-schemas": [{"$id": "https://e.com/id.json", "type": "null"}]}
                },
                "real": {"$id": "https://e.com/id.json", "type": "string"},
            },
            "$ref": "https://e.com/id.json",
            "enum": ["a", 1, {"$id": "https://e.com/id.json"}],
        },
        {},
        ['"a"', "1", "null"],
        id="an-id-outside-a-subschema-names-nothing",
    ),
    pytest.param(
        {"$schema": DRAFT7, "$ref": "http://json-schema.org/draft-07/schema#"},
        {},
        ['{"minLength": 1}', '{"minLength": -1}', '{"type": "string"}', '{"type": "strin"}'],
        id="the-draft7-meta-schema",
    ),
    pytest.param(
        {"$ref": "http://localhost:1234/tree.json"},
        {
            "http://localhost:1234/tree.json": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "node.json"}}},
                "additionalProperties": False,
            },
            "http://localhost:1234/node.json": {
                "properties": {"v": {"type": "integer"}, "t": {"$ref": "tree.json"}}
            },
        },
        ['{"kids": [{"v": 1, "t": {"kids": []}}]}', '{"kids": [{"t": {"kids": [{"v": "x"}]}}]}'],
        id="documents-that-refer-to-each-other-recursively",
    ),
    pytest.param(
        {"properties": {"a~/b%c d": {"type": "integer"}}, "$ref": "#/properties/a~0~1b%25c%20d"},
        {},
        ["1", '"x"', '{"a~/b%c d": 1}'],
        id="pointer-escapes",
    ),
]


@pytest.mark.parametrize(("schema", "docs", "texts"), CASES)
def test_references_resolve_as_jsonschema_resolves_them(
    model: lcgen.Model, schema: Any, docs: dict[str, Any], texts: list[str]
) -> None:
    grammar = lcgen.Grammar.from_json_schema(schema, documents=docs)
    verdicts = [(text, grammar.accepts(model, text)) for text in texts]
    assert verdicts == [(text, _valid(schema, docs, text)) for text in texts]


@pytest.mark.parametrize(("schema", "docs", "texts"), CASES)
def test_a_bundle_is_one_document_that_validates_alike(
    schema: Any, docs: dict[str, Any], texts: list[str]
) -> None:
    bundled = lcgen.bundle_schema(schema, lambda uri: docs.get(uri) or docs.get(uri + "#"))
    refs: list[str] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for key, value in node.items():
                if key not in ("enum", "const"):
                    collect(value)
        elif isinstance(node, list):
            for item in node:
                collect(item)

    collect(bundled)
    assert all(ref.startswith("#") for ref in refs), refs
    for text in texts:  # (jsonschema alone, no documents: the bundle holds them)
        assert _valid(bundled, {}, text) == _valid(schema, docs, text), text


def test_a_schema_of_local_pointers_comes_back_as_the_same_object() -> None:
    class Inner(BaseModel):
        x: int

    class Outer(BaseModel):
        inner: Inner
        more: list[Inner]

    schema = Outer.model_json_schema()
    assert lcgen.bundle_schema(schema) is schema
    assert lcgen.bundle_schema(True) is True


def test_generation_through_documents_validates(model: lcgen.Model) -> None:
    schema = lcgen.bundle_schema(PERSON, DOCS)
    assert DOCUMENTS in schema
    out = model.generate("A person as JSON:", schema=schema, max_tokens=200, seed=3)
    assert _valid(PERSON, DOCS, json.dumps(out)), out


def test_unique_items_reached_through_a_document_are_held(model: lcgen.Model) -> None:
    docs = {
        "https://e.com/set.json": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}
    }
    grammar = lcgen.Grammar.from_json_schema({"$ref": "https://e.com/set.json"}, documents=docs)
    assert grammar.accepts(model, "[1, 2]")
    assert not grammar.accepts(model, "[1, 1]")


def test_an_unused_reference_that_does_not_resolve_refuses_nothing(model: lcgen.Model) -> None:
    schema = {
        "type": "integer",
        "$defs": {"a": {"$ref": "https://e.com/never-given.json"}, "b": {"$ref": "#nope"}},
    }
    grammar = lcgen.Grammar.from_json_schema(schema)
    assert grammar.accepts(model, "7")
    assert lcgen.bundle_schema(schema) is schema


@pytest.mark.parametrize(
    ("schema", "docs", "message"),
    [
        (
            {"properties": {"a": {"$ref": "https://e.com/a.json"}}},
            {},
            "$ref 'https://e.com/a.json' (at #/properties/a) refers to the document "
            "'https://e.com/a.json', which lcgen was not given: it fetches nothing "
            "(Grammar.from_json_schema and lcgen.bundle_schema take documents by URI: "
            "documents={'https://e.com/a.json': ...})",
        ),
        (
            {"$ref": "https://e.com/a.json"},
            {"https://e.com/a.json": {"$schema": DRAFT7, "type": "string"}},
            "refers to 'https://e.com/a.json', a schema of another draft",
        ),
        (
            {"$ref": "https://e.com/a.json"},
            {"https://e.com/a.json": {"type": "strin"}},
            "invalid JSON Schema: type at #: 'strin' is not valid under any of the given schemas "
            "(in the document 'https://e.com/a.json', named by $ref 'https://e.com/a.json' (at #))",
        ),
        (
            {"$ref": "https://e.com/a.json#/$defs/b"},
            {"https://e.com/a.json": {"$defs": {"c": {}}}},
            "$ref 'https://e.com/a.json#/$defs/b' (at #) does not resolve",
        ),
        (
            {"$id": "https://e.com/r.json", "$ref": "#b"},
            {},
            "$ref '#b' (at #): no anchor 'b' is defined in 'https://e.com/r.json'",
        ),
        (
            {"$ref": "https://e.com/d.json"},
            {"https://e.com/d.json": {"$schema": DRAFT7, "$id": "https://e.com/d.json",
                                      "$ref": "#/definitions/b",
                                      "definitions": {"b": {"type": "string"}}}},
            "another draft",
        ),
        ({"$defs": {"a": {"anyOf": [{}]}}, "$ref": "#/$defs/a/anyOf/²"}, {}, "does not resolve"),
        ({"$ref": "http://[::1#/x"}, {}, "is no URI"),
        ({"$id": "https://e.com/", "$defs": {"a": {"$id": "http://[::1"}}}, {}, "is no URI"),
        ({"$schema": ["x"]}, {}, "$schema of the JSON Schema is ['x']: a URI"),
        ({"$ref": "a.json"}, {"a.json": {"$schema": 7}}, "$schema of the document 'a.json'"),
        (
            {"$id": "https://e.com/s/p.json", "$ref": "a.json"},
            {"a.json": {}},
            "documents has 'a.json': references resolve against the $id",
        ),
        (
            {"$ref": "https://e.com/a.json"},
            {"https://e.com/a.json": {"properties": {"c": {"$ref": "c.json"}}}},
            "$ref 'c.json' (at https://e.com/a.json#/properties/c) refers to the document "
            "'https://e.com/c.json'",
        ),
        (
            {"$schema": DRAFT7, "$defs": {"a": {"$id": "http://x.example/a.json"}},
             "$ref": "http://x.example/a.json"},
            {},
            "refers to the document 'http://x.example/a.json', which lcgen was not given",
        ),

        (
            {"$schema": DRAFT7, "$ref": "https://json-schema.org/draft/2020-12/schema"},
            {},
            "several documents, whose dynamic references depend on the path",
        ),
    ],
)  # fmt: skip
def test_a_reference_that_does_not_resolve_is_named(
    schema: dict[str, Any], docs: dict[str, Any], message: str
) -> None:
    with pytest.raises(lcgen.GrammarError) as info:
        lcgen.Grammar.from_json_schema(schema, documents=docs)
    assert message in str(info.value)


def test_documents_are_keyed_by_uri() -> None:
    with pytest.raises(TypeError, match="documents are keyed by URI"):
        lcgen.bundle_schema({"$ref": "a.json"}, {1: {}})  # type: ignore[dict-item]


ITEM_WITHOUT_NAME = {
    "$id": "https://example.com/root.json",
    "properties": {"name": {"$ref": "#/$defs/name"}, "item": {"$ref": "item.json"}},
    "$defs": {
        "name": {"type": "integer"},
        "item": {"$id": "item.json", "properties": {"name": {"$ref": "#/$defs/name"}}},
    },
}


def test_a_bundle_keeps_what_an_unresolved_reference_means() -> None:
    """item.json has no $defs/name: its $id dropped, the reference as written would name the
    root's; written as a pointer to nowhere that names it, it resolves to nothing anywhere."""
    with pytest.raises(lcgen.GrammarError, match="does not resolve"):
        lcgen.Grammar.from_json_schema(ITEM_WITHOUT_NAME)
    bundled = lcgen.bundle_schema(ITEM_WITHOUT_NAME)
    ref = bundled["$defs"]["item"]["properties"]["name"]["$ref"]
    assert unresolved_ref(ref) == "https://example.com/item.json#/$defs/name"
    with pytest.raises(lcgen.GrammarError) as info:
        lcgen.Grammar.from_json_schema(bundled)
    # (the bundle holds no resource of that URI: named, with the documents that could)
    assert "$ref 'https://example.com/item.json#/$defs/name' (at " in str(info.value)
    with pytest.raises(referencing.exceptions.Unresolvable):
        _valid(bundled, {}, '{"item": {"name": 1}}')


def test_an_anchor_missing_in_a_document_stays_an_error_through_a_bundle() -> None:
    docs = {"https://e.com/p.json": {"properties": {"name": {"$ref": "#nme"}}}}
    schema = {"$ref": "https://e.com/p.json"}
    with pytest.raises(lcgen.GrammarError, match="no anchor 'nme'"):
        lcgen.Grammar.from_json_schema(schema, documents=docs)
    with pytest.raises(lcgen.GrammarError, match="no anchor 'nme'"):  # (its mark names it)
        lcgen.Grammar.from_json_schema(lcgen.bundle_schema(schema, docs), documents=docs)
    with pytest.raises(lcgen.GrammarError, match=r"'https://e\.com/p\.json#nme' .* not given"):
        lcgen.Grammar.from_json_schema(lcgen.bundle_schema(schema, docs))


def test_an_unresolved_anchor_is_caught_by_no_anchor_of_another_resource(
    model: lcgen.Model,
) -> None:
    """#nope names no anchor of the root; e's anchor, kept in a bundle without e's $id,
    would have caught it."""
    schema = {
        "properties": {"a": {"$ref": "#nope"}},
        "$defs": {"e": {"$id": "http://e.example/e", "$anchor": "nope", "type": "integer"}},
    }
    bundled = lcgen.bundle_schema(schema)
    assert "$anchor" not in bundled["$defs"]["e"]
    for one in (schema, bundled):
        with pytest.raises(lcgen.GrammarError, match="nope"):
            lcgen.Grammar.from_json_schema(one)


def test_the_same_reference_text_failing_elsewhere_refuses_nothing(model: lcgen.Model) -> None:
    schema = {
        "properties": {"a": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"type": "integer"}, "other": {"$id": "other.json", "$ref": "#/$defs/x"}},
    }
    grammar = lcgen.Grammar.from_json_schema(schema)
    assert grammar.accepts(model, '{"a": 1}') and not grammar.accepts(model, '{"a": "1"}')


@pytest.mark.parametrize("first", [True, False])
def test_a_resource_inside_a_given_document_is_found_in_any_order(first: bool) -> None:
    docs = {"https://x.org/lib.json": {"$defs": {"e": {"$id": "inner/e.json", "type": "string"}}}}
    props = {"e": {"$ref": "https://x.org/inner/e.json"}, "l": {"$ref": "https://x.org/lib.json"}}
    order = ["l", "e"] if first else ["e", "l"]
    schema = {"properties": {key: props[key] for key in order}}
    assert isinstance(lcgen.Grammar.from_json_schema(schema, documents=docs), lcgen.Grammar)


def test_a_missing_document_is_asked_for_once() -> None:
    asked: list[str] = []

    def documents(uri: str) -> None:
        asked.append(uri)

    schema = {"type": "integer", "$defs": {str(i): {"$ref": "gone.json"} for i in range(50)}}
    assert lcgen.bundle_schema(schema, documents) is schema
    assert asked == ["gone.json"]


def test_a_draft7_document_with_an_id_beside_its_ref(model: lcgen.Model) -> None:
    doc = {"$schema": DRAFT7, "$id": "https://e.com/d.json", "$ref": "#/definitions/b",
           "definitions": {"b": {"type": "integer"}}}  # fmt: skip
    schema = {"$schema": DRAFT7, "$ref": "https://e.com/d.json"}
    grammar = lcgen.Grammar.from_json_schema(schema, documents={"https://e.com/d.json": doc})
    assert grammar.accepts(model, "3") and not grammar.accepts(model, '"3"')


def test_bundle_schema_reads_json_text_and_refuses_other_types() -> None:
    docs = {"a.json": {"type": "integer"}}
    assert lcgen.bundle_schema('{"$ref": "a.json"}', docs)[DOCUMENTS] == [{"type": "integer"}]
    for wrong in (5, None, [1]):
        with pytest.raises(TypeError, match="a JSON Schema is a dict, a bool or JSON text"):
            lcgen.bundle_schema(wrong)
    for documents in (["a.json"], "a.json"):
        with pytest.raises(TypeError, match="documents is a mapping of URI"):
            lcgen.bundle_schema({"$ref": "a.json"}, documents)  # type: ignore[arg-type]


def test_tool_parameters_with_an_embedded_resource(model: lcgen.Model) -> None:
    from lcgen.tools.schema import calls_schema

    params = {
        "type": "object",
        "properties": {"addr": {"$ref": "https://x.org/addr.json"}},
        "required": ["addr"],
        "$defs": {
            "addr": {
                "$id": "https://x.org/addr.json",
                "type": "object",
                "properties": {"zip": {"$ref": "#/$defs/zip"}},
                "required": ["zip"],
                "additionalProperties": False,
                "$defs": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            }
        },
        "additionalProperties": False,
    }
    wrapper = calls_schema([lcgen.Tool(name="ship", parameters=params)])
    grammar = lcgen.Grammar.from_json_schema(wrapper)
    call = '{"name": "ship", "arguments": {"addr": {"zip": "%s"}}}'
    assert grammar.accepts(model, call % "12345")
    assert not grammar.accepts(model, call % "1234")


def test_references_in_content_schemas_and_anchors_by_the_given_uri(model: lcgen.Model) -> None:
    schema = {
        "$id": "http://e.com/root",
        "$defs": {
            "x": {"type": "string"},
            "inner": {
                "$id": "http://e.com/inner",
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": "#/$defs/x"},
                "$defs": {"x": {"type": "integer"}},
            },
        },
        "properties": {"c": {"$ref": "inner"}, "n": {"$ref": "http://a.example/x.json#num"}},
    }
    doc = {"$id": "http://b.example/y.json", "$defs": {"n": {"$anchor": "num", "type": "null"}}}
    docs = {"http://a.example/x.json": doc}
    grammar = lcgen.Grammar.from_json_schema(schema, documents=docs)
    assert grammar.accepts(model, '{"c": "5", "n": null}')
    assert not grammar.accepts(model, '{"c": "\\"s\\""}')
    assert not grammar.accepts(model, '{"n": 1}')


def test_bundle_schema_refuses_dynamic_references_it_would_change() -> None:
    schema = {"$id": "http://e.com/r", "$defs": {"a": {"$id": "a", "$dynamicRef": "#x"}}}
    with pytest.raises(lcgen.GrammarError, match=r"\$dynamicRef '#x' .* no anchor 'x'"):
        lcgen.bundle_schema(schema)


TREE = {
    "$id": "https://e.com/tree.json",
    "$dynamicAnchor": "node",
    "type": "object",
    "properties": {"data": True, "children": {"type": "array", "items": {"$dynamicRef": "#node"}}},
}
STRICT_TREE = {
    "$id": "https://e.com/strict-tree.json",
    "$dynamicAnchor": "node",
    "$ref": "tree.json",
    "unevaluatedProperties": False,
}
RECURSIVE_TREE = {
    "$schema": "https://json-schema.org/draft/2019-09/schema",
    "$id": "https://e.com/r/tree.json",
    "$recursiveAnchor": True,
    "type": "object",
    "properties": {"data": True, "children": {"type": "array", "items": {"$recursiveRef": "#"}}},
}
STRICT_RECURSIVE_TREE = {
    "$schema": "https://json-schema.org/draft/2019-09/schema",
    "$id": "https://e.com/r/strict-tree.json",
    "$recursiveAnchor": True,
    "$ref": "tree.json",
    "unevaluatedProperties": False,
}
TREE_TEXTS = [
    '{"children": [{"data": 1, "children": []}]}',
    '{"children": [{"daat": 1}]}',
    '{"children": [{"data": 1, "children": [{"dta": 2}]}]}',
    '{"data": 1, "extra": 2}',
]


@pytest.mark.parametrize(
    ("schema", "docs"),
    [
        (STRICT_TREE, {"https://e.com/tree.json": TREE}),
        (TREE, {}),
        (STRICT_RECURSIVE_TREE, {"https://e.com/r/tree.json": RECURSIVE_TREE}),
        (RECURSIVE_TREE, {}),
    ],
)
def test_dynamic_references_the_root_extends(
    model: lcgen.Model, schema: dict[str, Any], docs: dict[str, Any]
) -> None:
    """The outermost dynamic anchor wins: the root's, which every dynamic scope holds."""
    grammar = lcgen.Grammar.from_json_schema(schema, documents=docs)
    verdicts = [grammar.accepts(model, text) for text in TREE_TEXTS]
    assert verdicts == [_valid(schema, docs, text) for text in TREE_TEXTS]
    bundled = lcgen.bundle_schema(schema, docs)
    assert "$dynamicRef" not in json.dumps(bundled) and "$recursiveRef" not in json.dumps(bundled)
    for text in TREE_TEXTS:
        assert _valid(bundled, {}, text) == _valid(schema, docs, text), text


def test_a_dynamic_reference_whose_target_depends_on_the_path_is_refused() -> None:
    """Two resources have the anchor and the root has none: which one wins depends on the
    resources met on the way."""
    schema = {
        "$id": "https://e.com/root",
        "$ref": "list",
        "$defs": {
            "foo": {"$dynamicAnchor": "items", "type": "string"},
            "list": {
                "$id": "list",
                "type": "array",
                "items": {"$dynamicRef": "#items"},
                "$defs": {"items": {"$dynamicAnchor": "items"}},
            },
        },
    }
    del schema["$defs"]["foo"]  # (the root's anchor: then it is the root's, and supported)
    schema["$defs"]["other"] = {"$id": "other", "$dynamicAnchor": "items", "type": "string"}
    with pytest.raises(lcgen.UnsupportedSchemaError, match=r"\$dynamicRef"):
        lcgen.Grammar.from_json_schema(schema)
    with pytest.raises(lcgen.UnsupportedSchemaError, match=r"\$dynamicRef"):
        lcgen.bundle_schema(schema)


# Relocation: the same definitions kept local, made embedded resources, given as documents or
# named by anchors, referred to relatively or absolutely: the grammar accepts the same texts.
ROOT_URI = "https://e.com/root.json"
DEFS: dict[str, Any] = {
    "Order": {
        "type": "object",
        "properties": {
            "id": {"$ref": "Id"},
            "lines": {"type": "array", "items": {"$ref": "Line"}, "maxItems": 3},
            "note": {"$ref": "Note"},
        },
        "required": ["id", "lines"],
        "additionalProperties": False,
    },
    "Line": {
        "type": "object",
        "properties": {"sku": {"$ref": "Id"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"],
        "additionalProperties": False,
    },
    "Id": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
    "Note": {"anyOf": [{"type": "null"}, {"$ref": "Note2"}]},
    "Note2": {
        "type": "object",
        "properties": {"next": {"$ref": "Note"}},
        "additionalProperties": False,
    },
}
ORDERS = [
    '{"id": "A12", "lines": []}',
    '{"id": "A12", "lines": [{"sku": "B34", "qty": 2}]}',
    '{"id": "A1", "lines": []}',
    '{"id": "A12", "lines": [{"sku": "B34", "qty": 0}]}',
    '{"id": "A12", "lines": [], "note": {"next": {"next": null}}}',
    '{"id": "A12", "lines": [], "note": {"next": {"next": 1}}}',
    '{"id": "A12", "lines": [], "extra": 1}',
    '{"lines": []}',
]


def _relocated(modes: dict[str, str], absolute: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The order schema with each definition where ``modes`` puts it: "local" ($defs),
    "embedded" ($defs with an $id), "document" (given by URI) or "anchor" ($defs with an
    $anchor); references written from the root relatively unless ``absolute``."""
    uris = {
        "local": lambda n: f"{ROOT_URI}#/$defs/{n}",
        "embedded": lambda n: f"https://e.com/defs/{n}.json",
        "document": lambda n: f"https://e.com/docs/{n}.json",
        "anchor": lambda n: f"{ROOT_URI}#{n}",
    }

    def ref(name: str, from_root: bool) -> str:
        uri = uris[modes[name]](name)
        if from_root and not absolute:
            return uri.removeprefix(ROOT_URI).removeprefix("https://e.com/")
        return uri

    def write(node: Any, from_root: bool) -> Any:
        if isinstance(node, dict):
            if set(node) == {"$ref"}:
                return {"$ref": ref(node["$ref"], from_root)}
            return {k: write(v, from_root) for k, v in node.items()}
        if isinstance(node, list):
            return [write(v, from_root) for v in node]
        return node

    root: dict[str, Any] = {"$id": ROOT_URI, "$ref": ref("Order", True), "$defs": {}}
    documents = {}
    for name, body in DEFS.items():
        mode = modes[name]
        if mode == "document":
            documents[uris["document"](name)] = write(body, False)
        elif mode == "embedded":
            root["$defs"][name] = {"$id": uris["embedded"](name), **write(body, False)}
        else:
            extra = {"$anchor": name} if mode == "anchor" else {}
            root["$defs"][name] = {**extra, **write(body, True)}
    return root, documents


@HYPOTHESIS_RELOCATION
@given(
    modes=st.fixed_dictionaries(
        {name: st.sampled_from(["local", "embedded", "document", "anchor"]) for name in DEFS}
    ),
    absolute=st.booleans(),
)
def test_where_definitions_live_does_not_change_the_grammar(
    model: lcgen.Model, modes: dict[str, str], absolute: bool
) -> None:
    schema, documents = _relocated(modes, absolute)
    grammar = lcgen.Grammar.from_json_schema(schema, documents=documents)
    verdicts = [grammar.accepts(model, text) for text in ORDERS]
    assert verdicts == [_valid(schema, documents, text) for text in ORDERS]
    assert verdicts == [True, True, False, False, True, False, False, False]
    bundled = lcgen.bundle_schema(schema, documents)
    assert [_valid(bundled, {}, text) for text in ORDERS] == verdicts


def test_drafts_without_if_name_no_resource_in_then(model: lcgen.Model) -> None:
    draft6 = "http://json-schema.org/draft-06/schema#"
    schema = {
        "$schema": draft6,
        "definitions": {
            "w": {"then": {"$id": "http://x.example/a.json",
                           "properties": {"p": {"$ref": "#/definitions/q"}}}},
            "q": {"type": "string"},
        },
        "allOf": [{"$ref": "#/definitions/w/then"}],
    }  # fmt: skip
    grammar = lcgen.Grammar.from_json_schema(schema)
    assert grammar.accepts(model, '{"p": "s"}') and not grammar.accepts(model, '{"p": 5}')
    with pytest.raises(lcgen.GrammarError, match="which lcgen was not given"):
        lcgen.Grammar.from_json_schema({**schema, "allOf": [{"$ref": "http://x.example/a.json"}]})


@pytest.mark.parametrize("first", [True, False])
def test_a_resource_inside_a_document_a_function_gives_is_found_in_any_order(first: bool) -> None:
    store = {"https://x.org/lib.json": {"$defs": {"e": {"$id": "inner/e.json", "type": "string"}}}}
    props = {"e": {"$ref": "https://x.org/inner/e.json"}, "l": {"$ref": "https://x.org/lib.json"}}
    order = ["l", "e"] if first else ["e", "l"]
    schema = {"properties": {key: props[key] for key in order}}
    assert isinstance(lcgen.Grammar.from_json_schema(schema, documents=store.get), lcgen.Grammar)


def test_documents_that_are_no_schemas_are_named() -> None:
    for value in (5, "a $schema b", [1]):
        with pytest.raises(lcgen.GrammarError, match=r"the document 'https://e\.com/d\.json'.*is"):
            lcgen.Grammar.from_json_schema(
                {"$ref": "https://e.com/d.json"}, documents={"https://e.com/d.json": value}
            )
    # (a None value is no document: as if not given)
    with pytest.raises(lcgen.GrammarError, match="which lcgen was not given"):
        lcgen.Grammar.from_json_schema(
            {"$ref": "https://e.com/d.json"}, documents={"https://e.com/d.json": None}
        )


def test_an_unused_document_adds_nothing_to_a_bundle() -> None:
    docs = {
        "https://x.org/tree.json": {"items": {"$dynamicRef": "#node"}, "$dynamicAnchor": "node"},
        "https://x.org/lib.json": {"$defs": {"e": {"$id": "e.json", "type": "string"}}},
    }
    bundled = lcgen.bundle_schema({"$ref": "https://x.org/e.json"}, docs)
    assert bundled[DOCUMENTS] == [{"$defs": {"e": {"type": "string"}}}]


def test_warnings_inside_documents_name_the_document() -> None:
    docs = {"https://e.com/d.json": {"type": "string", "maxLenght": 3}}
    with pytest.warns(UserWarning, match=r"'maxLenght' at https://e\.com/d\.json# is ignored"):
        lcgen.Grammar.from_json_schema({"$ref": "https://e.com/d.json"}, documents=docs)


class Limits(BaseModel):
    low: int


def configure(default: Limits) -> None:
    """Set the limits (a parameter named as a keyword of data)."""


def test_tools_keep_each_function_to_its_own_anchors_and_names(model: lcgen.Model) -> None:
    from lcgen.tools.schema import calls_schema

    a = lcgen.Tool(name="a", parameters={"type": "object", "properties": {"x": {"$ref": "#num"}}})
    b = lcgen.Tool(
        name="b",
        parameters={"type": "object", "$defs": {"n": {"$anchor": "num", "type": "integer"}}},
    )
    with pytest.raises(lcgen.GrammarError, match="'#num'"):
        lcgen.Grammar.from_json_schema(calls_schema([a, b]))
    grammar = lcgen.Grammar.from_json_schema(calls_schema([lcgen.Tool.of(configure)]))
    assert grammar.accepts(model, '{"name": "configure", "arguments": {"default": {"low": 1}}}')
    assert not grammar.accepts(model, '{"name": "configure", "arguments": {"default": 1}}')


def test_draft7_tool_parameters_with_a_root_ref_are_still_an_object() -> None:
    from lcgen.tools.schema import calls_schema

    params = {"$schema": DRAFT7, "type": "object", "$ref": "#/definitions/n",
              "definitions": {"n": {"type": "integer"}}}  # fmt: skip
    with pytest.raises(lcgen.GrammarError, match="no value satisfies"):
        lcgen.Grammar.from_json_schema(calls_schema([lcgen.Tool(name="f", parameters=params)]))


def test_refs_expanded_on_many_paths_are_bounded() -> None:
    """Each level's allOf of two $refs to the level below doubles the expansions: 2**30 of
    them compiled for hours (a 2 kB schema, one server request); now an error past a bound."""
    defs: dict[str, Any] = {"b0": {"type": "integer"}, "c0": {"type": "integer"}}
    for i in range(1, 31):
        defs[f"b{i}"] = defs[f"c{i}"] = {
            "allOf": [{"$ref": f"#/$defs/b{i - 1}"}, {"$ref": f"#/$defs/c{i - 1}"}]
        }
    with pytest.raises(lcgen.UnsupportedSchemaError, match=r"expands \$refs .* over 20000 times"):
        lcgen.Grammar.from_json_schema({"$ref": "#/$defs/b30", "$defs": defs})
    assert isinstance(
        lcgen.Grammar.from_json_schema({"$ref": "#/$defs/b10", "$defs": defs}), lcgen.Grammar
    )


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"type": "object", "properties": {"city": {"$ref": "#/$defs/Cty"}}},
            "the parameters of function 'weather': $ref '#/$defs/Cty' (at #/properties/city) "
            "does not resolve",
        ),
        (
            {"$ref": "#/$defs/P", "$defs": {"P": {"type": "string"}}},
            "the parameters of function 'weather': no value satisfies",
        ),
        ({"$id": 5, "type": "object"}, "the parameters of function 'weather': invalid JSON Schema"),
    ],
)
def test_tool_parameters_that_cannot_be_called_name_the_function(
    parameters: dict[str, Any], message: str
) -> None:
    """Beside another function, too: one whose parameters admit no object was left out of
    the calls without a word."""
    from lcgen.tools import grammar

    search = lcgen.Tool(name="search", parameters={"type": "object", "properties": {}})
    weather = lcgen.Tool(name="weather", parameters=parameters)
    with pytest.raises(lcgen.GrammarError) as info:
        grammar([search, weather], required=True)
    assert message in str(info.value)


DRAFT2019 = "https://json-schema.org/draft/2019-09/schema"


def test_dynamic_references_keep_their_meaning_in_every_spelling(model: lcgen.Model) -> None:
    """A document named by another URI than its $id is still the one with the anchor (the
    root's anchor wins); 2019-09 has no $dynamicAnchor (no anchor at all there); a
    $recursiveRef is "#" only."""
    root = {
        "$id": "https://example.com/root.json",
        "$dynamicAnchor": "node",
        "properties": {"data": {"type": "integer"},
                       "x": {"$dynamicRef": "http://alias.example/t#node"}},
        "additionalProperties": False,
    }  # fmt: skip
    tree = {"$id": "https://example.com/tree.json", "$dynamicAnchor": "node",
            "properties": {"data": True}}  # fmt: skip
    docs = {"http://alias.example/t": tree}
    grammar = lcgen.Grammar.from_json_schema(root, documents=docs)
    texts = ['{"x": {"data": "s"}}', '{"x": {"data": 1}}']
    assert [grammar.accepts(model, t) for t in texts] == [_valid(root, docs, t) for t in texts]
    assert lcgen.bundle_schema(root, docs)["properties"]["x"] == {"$ref": "#"}
    no_anchor = {"$schema": DRAFT2019, "properties": {"a": {"$ref": "#x"}},
                 "$defs": {"d": {"$dynamicAnchor": "x", "type": "integer"}}}  # fmt: skip
    with pytest.raises(lcgen.GrammarError, match="no anchor 'x'"):
        lcgen.Grammar.from_json_schema(no_anchor)
    pointer = {"$schema": DRAFT2019, "properties": {"a": {"$recursiveRef": "#/$defs/i"}},
               "$defs": {"i": {"type": "integer"}}}  # fmt: skip
    with pytest.raises(lcgen.UnsupportedSchemaError, match="a \\$recursiveRef is '#'"):
        lcgen.Grammar.from_json_schema(pointer)
