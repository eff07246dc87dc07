"""Non-ASCII characters inside JSON strings that a grammar spells out (pattern classes,
constants, property names) pass raw or as ``\\uXXXX`` escapes, as ``json.dumps`` writes them by
default; beyond U+FFFF as surrogate pairs."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

import lcgen
from lcgen.constrain import Grammar
from lcgen.constrain.escapes import escapes

NON_ASCII = st.integers(0x80, 0x10FFFF).filter(lambda cp: not 0xD800 <= cp <= 0xDFFF)


def _spellings(cp: int) -> list[str]:
    """``chr(cp)`` as a JSON string body: raw, escaped (lower and upper hex)."""
    escaped = json.dumps(chr(cp))[1:-1]
    return [chr(cp), escaped, escaped.upper().replace("\\U", "\\u")]


@settings(max_examples=60, deadline=None)
@given(lo=NON_ASCII, width=st.integers(0, 3000), probe=NON_ASCII)
def test_an_escape_range_holds_exactly_its_code_points(
    model: lcgen.Model, lo: int, width: int, probe: int
) -> None:
    hi = min(lo + width, 0x10FFFF)
    if lo <= 0xD7FF < hi:
        hi = 0xD7FF
    body = escapes(((lo, hi),))
    assert body is not None
    grammar = Grammar(f"root ::= {body}")
    for cp in {lo, hi, (lo + hi) // 2, probe}:
        for text in _spellings(cp)[1:]:
            assert grammar.accepts(model, text) == (lo <= cp <= hi), (hex(cp), text)


def test_ascii_has_no_escape_here() -> None:
    assert escapes(((0x20, 0x7E),)) is None
    assert escapes(((0x7F, 0x7F),)) is not None  # (DEL: json.dumps writes "\u007f")


def test_constants_names_and_patterns_take_both_spellings(model: lcgen.Model) -> None:
    enum = Grammar.from_json_schema({"enum": ["café", "naïve", "plain"]})
    for value in ["café", "naïve", "plain"]:
        assert enum.accepts(model, json.dumps(value))
        assert enum.accepts(model, json.dumps(value, ensure_ascii=False))
    assert enum.accepts(model, '"caf\\u00E9"') and not enum.accepts(model, '"cafe"')
    names = Grammar.from_json_schema(
        {"properties": {"größe": {"type": "integer"}}, "required": ["größe"]}
    )
    assert names.accepts(model, json.dumps({"größe": 3}))
    assert names.accepts(model, json.dumps({"größe": 3}, ensure_ascii=False))
    emoji = Grammar.from_json_schema({"type": "string", "pattern": "^[😀-😏]+$"})
    assert emoji.accepts(model, json.dumps("😀😏"))  # surrogate pairs
    assert emoji.accepts(model, json.dumps("😀😏", ensure_ascii=False))
    assert not emoji.accepts(model, json.dumps("😐"))
    keys = Grammar.from_json_schema(
        {"patternProperties": {"^á": {"type": "integer"}}, "additionalProperties": False}
    )
    assert keys.accepts(model, json.dumps({"ármányos": 2}))
    assert not keys.accepts(model, json.dumps({"ármányos": "2"}))
    assert not keys.accepts(model, json.dumps({"armanyos": 2}))


def test_extra_keys_and_del_take_both_spellings(model: lcgen.Model) -> None:
    # A key of additionalProperties and DEL as json.dumps writes them ("caf\u00e9",
    # "\u007f") were refused (a key beside declared ones is still written raw: an escape could
    # spell a declared name).
    for schema, value in [
        ({"type": "object", "additionalProperties": {"type": "integer"}}, {"café": 2, "😀": 3}),
        ({"type": "string", "pattern": "a"}, "\x7fa"),
        ({"const": "\x7f"}, "\x7f"),
        ({"type": "object", "properties": {"\x7f": {}}, "required": ["\x7f"]}, {"\x7f": 1}),
    ]:
        for whitespace in ("flexible", "compact"):
            grammar = Grammar.from_json_schema(schema, whitespace=whitespace)
            compact = whitespace == "compact"
            for text in (
                json.dumps(value, separators=(",", ":") if compact else None),
                json.dumps(value, ensure_ascii=False, separators=(",", ":") if compact else None),
            ):
                assert grammar.accepts(model, text), (schema, text)
