"""pydantic's own types under ``schema=``: every text the grammar allows is one pydantic
accepts, and the values pydantic writes are allowed; a type no grammar can hold to is refused,
naming it and where it is.

pydantic's JSON Schema says less than pydantic checks (a Decimal's digits, a dict's int keys,
a Json field's content, a UUID's version, a network's host bits...): for each type, random
walks through the grammar (no model), texts near valid ones (hypothesis) and a few real
generations must validate with ``Model.model_validate_json``.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import functools
import ipaddress
import pathlib
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import types as pt
from pydantic.color import Color
from pydantic.json_schema import SkipJsonSchema
from test_schemas import WALKS, Cat, Dog, random_walk

import lcgen
from lcgen.constrain import Grammar


class Shade(enum.IntEnum):
    dark = 1
    light = 2


class Mixed(enum.Enum):
    word = "x"
    number = 2


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    name: str


class Strict(pydantic.BaseModel, extra="forbid"):
    n: pydantic.conint(strict=True)  # type: ignore[valid-type]
    flag: pydantic.StrictBool


class Open(pydantic.BaseModel, extra="allow"):
    n: int


# pydantic's tagged union as its documentation writes it: the tag has a default, yet a value
# without it is refused (union_tag_not_found), so every value has it.
class Tabby(pydantic.BaseModel):
    kind: Literal["cat"] = "cat"
    lives: int


class Hound(pydantic.BaseModel):
    kind: Literal["dog"] = "dog"
    good: bool


# pydantic.color.Color and PaymentCardNumber are deprecated, and still served.
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")


class Tree(pydantic.BaseModel):
    data: pydantic.Json[int]
    kids: list[Tree] = []


class Loop(pydantic.BaseModel):
    inner: pydantic.Json[Loop] | None = None


T = TypeVar("T")


class Page(pydantic.BaseModel, Generic[T]):
    items: list[T]
    total: int


DAY = datetime.date(2001, 2, 3)
MOMENT = datetime.datetime(2001, 2, 3, 4, 5, 6, tzinfo=datetime.UTC)
UID = "123e4567-e89b-12d3-a456-426614174000"


@dataclass(frozen=True)
class Case:
    name: str
    type: Any
    values: tuple[Any, ...]  # valid values: pydantic writes them (model_dump_json)
    config: tuple[tuple[str, Any], ...] = ()  # the model's ConfigDict


CASES = [
    Case("decimal", decimal.Decimal, (decimal.Decimal("1.5"), decimal.Decimal("-0.001"), 7)),
    Case(
        "condecimal",
        pydantic.condecimal(max_digits=5, decimal_places=2),
        (decimal.Decimal("123.45"), decimal.Decimal("1.50"), decimal.Decimal("-0.01")),
    ),
    Case(
        "condecimal-digits",
        pydantic.condecimal(max_digits=3, ge=decimal.Decimal("0.3")),
        (decimal.Decimal("0.31"), decimal.Decimal("12.5"), decimal.Decimal("999")),
    ),
    Case(
        "condecimal-places",
        pydantic.condecimal(max_digits=3, decimal_places=5),
        (decimal.Decimal("0.001"), decimal.Decimal("-0.12")),
    ),
    Case("dict-int-keys", dict[int, str], ({1: "a", -20: "b"}, {})),
    Case("dict-float-keys", dict[float, int], ({1.5: 1, -2.0: 2},)),
    Case("dict-bool-keys", dict[bool, int], ({True: 1, False: 0},)),
    Case("dict-literal-keys", dict[Literal["a", "b"], int], ({"a": 1},)),
    Case("dict-mixed-literal-keys", dict[Literal[1, "a"], int], ({"a": 1},)),
    Case("dict-intenum-keys", dict[Shade, int], ({Shade.dark: 1},)),
    Case("dict-enum-keys", dict[Mixed, int], ({Mixed.word: 1},)),
    Case("dict-uuid-keys", dict[uuid.UUID, int], ({uuid.UUID(UID): 1},)),
    Case("dict-decimal-keys", dict[decimal.Decimal, int], ({decimal.Decimal("1.5"): 1},)),
    Case(  # pydantic's JSON Schema puts the pattern in patternProperties, leaving others open
        "dict-pattern-keys",
        dict[Annotated[str, pydantic.StringConstraints(pattern=r"^[A-Z]{3}$")], float],
        ({"USD": 1.0, "EUR": 0.5}, {}),
    ),
    Case("dict-short-keys", dict[pydantic.constr(max_length=2), int], ({"ab": 1},)),
    Case("json-list", pydantic.Json[list[int]], ("[1, 2, 3]", "[]")),
    Case("json-any", pydantic.Json[Any], ('{"a": [1, "x\\n"]}', '"quoted"')),
    Case("json-model", pydantic.Json[Pet], ('{"kind": "cat", "name": "Tom \\"T\\""}',)),
    Case("json-in-recursion", Tree, (Tree(data="1", kids=[Tree(data="-2")]),)),
    Case("past-date", pydantic.PastDate, (DAY,)),
    Case("past-datetime", pydantic.PastDatetime, (MOMENT,)),
    Case("aware-datetime", pydantic.AwareDatetime, (MOMENT,)),
    Case("naive-datetime", pydantic.NaiveDatetime, (MOMENT.replace(tzinfo=None),)),
    Case("time-tz", datetime.time, (datetime.time(4, 5, tzinfo=datetime.UTC),)),
    Case("timedelta", datetime.timedelta, (datetime.timedelta(days=1, seconds=5),)),
    *(
        Case(f"uuid{n}", getattr(pt, f"UUID{n}"), (uuid.UUID(UID[:14] + str(n) + UID[15:]),))
        for n in (1, 3, 4, 5, 6, 7, 8)
    ),
    Case("ip-any-address", pydantic.IPvAnyAddress, (ipaddress.ip_address("10.0.0.1"),)),
    Case(
        "ip-any-network",
        pydantic.IPvAnyNetwork,
        (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::/32")),
    ),
    Case("ip-any-interface", pydantic.IPvAnyInterface, (ipaddress.ip_interface("10.0.0.1/8"),)),
    Case("ipv4-network", ipaddress.IPv4Network, (ipaddress.IPv4Network("192.168.4.0/22"),)),
    Case("ipv6-network", ipaddress.IPv6Network, (ipaddress.IPv6Network("fe80::/10"),)),
    Case("ipv4-interface", ipaddress.IPv4Interface, (ipaddress.IPv4Interface("1.2.3.4/24"),)),
    Case("ipv6-interface", ipaddress.IPv6Interface, (ipaddress.IPv6Interface("::1/128"),)),
    Case("base64-bytes", pydantic.Base64Bytes, (b"aGVsbG8=", b"", b"YWI=")),
    Case("base64-str", pydantic.Base64Str, ("aGVsbG8=", "YQ==")),
    Case("base64url-bytes", pydantic.Base64UrlBytes, (b"aGk_Pg==",)),
    Case("base64url-str", pydantic.Base64UrlStr, ("aGk=",)),
    Case("bytes", bytes, (b"abc",)),
    Case(
        "bytes-read-as-base64",
        bytes,
        (b"hi",),
        (("val_json_bytes", "base64"), ("ser_json_bytes", "base64")),
    ),
    Case(
        "bytes-read-as-hex", bytes, (b"hi",), (("val_json_bytes", "hex"), ("ser_json_bytes", "hex"))
    ),
    Case("conbytes", pydantic.conbytes(max_length=4), (b"ab",)),
    Case("secret", pydantic.SecretStr, ()),
    Case("path", pathlib.Path, (pathlib.Path("a/b.txt"),)),
    Case("complex", complex, (1 + 2j, 3.5)),
    Case("bytesize", pydantic.ByteSize, (1024,)),
    Case("http-url", pydantic.HttpUrl, (pydantic.HttpUrl("https://example.com/a?b=1#c"),)),
    Case("any-url", pydantic.AnyUrl, (pydantic.AnyUrl("ftp://files.example.org:21/x"),)),
    Case("stripped", pydantic.constr(strip_whitespace=True, min_length=2), ("ab", "a b")),
    Case("stripped-config", str, ("ab",), (("str_strip_whitespace", True), ("str_min_length", 2))),
    Case("pattern", re.Pattern, (re.compile("abc"),)),
    Case("color", Color, ("#123456",)),
    Case("strict", Strict, (Strict(n=3, flag=True),)),
    Case("open", Open, (Open(n=1),)),
    Case("literal", Literal[1, "a", None, True], (1, "a", None, True)),
    Case("intenum", Shade, (Shade.dark,)),
    Case("enum", Mixed, (Mixed.word, Mixed.number)),
    Case("generic", Page[Pet], (Page[Pet](items=[Pet(kind="dog", name="Rex")], total=1),)),
    Case(
        "discriminated",
        list[Cat | Dog],
        ([Cat(kind="cat", lives=3), Dog(kind="dog", good=False)],),
    ),
    Case(
        "discriminated-default-tag",
        list[Annotated[Tabby | Hound, pydantic.Field(discriminator="kind")]],
        ([Tabby(lives=3), Hound(good=False)],),
    ),
]


# Texts the grammar allowed before, which pydantic refuses (the x of {"x": ...}).
REFUSED_BY_PYDANTIC = [
    ("condecimal", "1234.5"), ("condecimal", '"abc"'), ("condecimal", "0.001"),
    ("decimal", '"x"'), ("condecimal-places", "0.00001"),
    ("condecimal-places", "0"), ("condecimal-places", "-0.0"), ("dict-int-keys", '{"a": "b"}'),
    ("dict-float-keys", '{"x": 1}'), ("dict-intenum-keys", '{"3": 1}'),
    ("dict-mixed-literal-keys", '{"1": 1}'), ("dict-pattern-keys", '{"euro": 1.1}'),
    ("dict-pattern-keys", '{"USD": 1, "usd": 1}'), ("dict-pattern-keys", '{"USD\\n": 1}'),
    ("dict-short-keys", '{"abc": 1}'),
    ("json-list", '"[1, \\"a\\"]"'), ("json-list", '"x"'),
    ("json-model", '"{}"'), ("uuid4", f'"{UID}"'), ("ip-any-network", '"10.0.0.1/8"'),
    ("ipv6-network", '"fe80::1/10"'), ("ip-any-interface", '"10.0.0.1/33"'),
    ("base64-bytes", '"YQ"'), ("base64-bytes", '"YQ="'), ("base64-str", '"/w=="'),
    ("conbytes", '"日日"'), ("complex", '"x"'), ("bytesize", '"1.5xyz"'),
    ("http-url", '"a:b"'), ("any-url", '"http:"'), ("stripped", '" a"'),
    ("stripped-config", '" a"'), ("bytes-read-as-base64", '"!"'), ("bytes-read-as-hex", '"0g"'),
    ("pattern", '"("'), ("color", '"#fffffff"'),
    ("discriminated-default-tag", '[{"lives": 1}]'),
]  # fmt: skip


def _model(case: Case) -> type[pydantic.BaseModel]:
    return pydantic.create_model(
        f"M_{case.name.replace('-', '_')}",
        __config__=pydantic.ConfigDict(**dict(case.config)),  # type: ignore[typeddict-item]
        x=(case.type, ...),
    )


@functools.cache
def _compiled(name: str) -> tuple[type[pydantic.BaseModel], Grammar, list[str]]:
    """The case's model, its grammar and the texts of its valid values."""
    case = next(c for c in CASES if c.name == name)
    model_cls = _model(case)
    texts = []
    for value in case.values:
        instance = model_cls(x=value)
        texts.append(instance.model_dump_json(round_trip=True))
        texts.append(instance.model_dump_json(round_trip=True, indent=2))
    return model_cls, Grammar.from_pydantic(model_cls), texts


def _validates(model_cls: type[pydantic.BaseModel], text: str) -> bool:
    try:
        model_cls.model_validate_json(text)
    except pydantic.ValidationError:
        return False
    return True


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_values_pydantic_writes_are_allowed(model: lcgen.Model, case: Case) -> None:
    model_cls, grammar, texts = _compiled(case.name)
    with grammar.state(model) as state:
        for text in texts:
            assert _validates(model_cls, text), text
            assert state.accepts_text(text), text


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_random_walks_through_the_grammar_validate(model: lcgen.Model, case: Case) -> None:
    model_cls, grammar, texts = _compiled(case.name)
    guides = texts[::2] or ['{"x": ""}']
    with grammar.state(model) as state:
        walks = [
            random_walk(model, state, seed, guides[seed % len(guides)]) for seed in range(WALKS)
        ]
    finished = [t for t in walks if t is not None]
    assert len(finished) >= WALKS // 2
    for text in finished:
        assert _validates(model_cls, text), text


@pytest.mark.parametrize(("name", "x"), REFUSED_BY_PYDANTIC)
def test_what_pydantic_refuses_is_not_allowed(model: lcgen.Model, name: str, x: str) -> None:
    model_cls, grammar, _ = _compiled(name)
    text = f'{{"x": {x}}}'
    assert not _validates(model_cls, text)
    assert not grammar.accepts(model, text)


# Texts near valid ones: a valid text with a span replaced by characters that matter to these
# types (digits, signs, hex, separators, escapes, padding).
_NEAR = st.sampled_from(list('0123456789abcdefABCDEF.-+:/=_eE "\\nutxXjZT[]{},%#@?'))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_texts_near_valid_ones_are_allowed_only_when_valid(
    model: lcgen.Model, data: st.DataObject
) -> None:
    case = data.draw(st.sampled_from([c for c in CASES if c.values]), label="case")
    model_cls, grammar, texts = _compiled(case.name)
    text = data.draw(st.sampled_from(texts[::2]), label="valid")
    start = data.draw(st.integers(0, len(text)), label="start")
    end = data.draw(st.integers(start, min(len(text), start + 4)), label="end")
    middle = "".join(data.draw(st.lists(_NEAR, max_size=4), label="middle"))
    near = text[:start] + middle + text[end:]
    try:
        accepted = grammar.accepts(model, near)
    except lcgen.GrammarError:  # the vocabulary cannot spell it
        return
    if accepted:
        assert _validates(model_cls, near), near


@pytest.mark.parametrize(
    ("name", "kind", "named"),
    [
        ("future-date", pydantic.FutureDate, "'lcgen-future-date' at #/properties/x"),
        ("future-datetime", pydantic.FutureDatetime, "'lcgen-future-date-time' at #/properties/x"),
        ("file-path", pydantic.FilePath, "'file-path' at #/properties/x"),
        ("directory-path", pydantic.DirectoryPath, "'directory-path' at #/properties/x"),
        ("new-path", pydantic.NewPath, "'new-path' at #/properties/x"),
        ("socket-path", pydantic.SocketPath, "'socket-path' at #/properties/x"),
        ("card", pt.PaymentCardNumber, "'payment-card-number' at #/properties/x"),
        ("postgres", pydantic.PostgresDsn, "'multi-host-uri' at #/properties/x"),
        (
            "after",
            pydantic.condate(gt=DAY),
            "'lcgen-bounded-date' at #/properties/x is not supported: gt/ge",
        ),
        ("since", Annotated[datetime.datetime, pydantic.Field(ge=MOMENT)], "bounded-date-time"),
        (
            "before-noon",
            Annotated[datetime.time, pydantic.Field(lt=datetime.time(12))],
            "bounded-time",
        ),
        (
            "positive",
            Annotated[datetime.timedelta, pydantic.Field(gt=datetime.timedelta(0))],
            "bounded-duration",
        ),
        ("json-of-itself", Loop, "contentSchema at #/[$]defs/Loop/properties/inner .* refers back"),
        ("callable", Callable[[int], int], "no JSON Schema: .*CallableSchema"),
        ("object", type("Custom", (), {}), "no JSON Schema: .*Custom"),
        ("skipped", SkipJsonSchema[int], "required field is left out .* give it a default"),
    ],
)
def test_types_no_grammar_holds_to_are_refused(name: str, kind: Any, named: str) -> None:
    model_cls = pydantic.create_model(
        f"R_{name.replace('-', '_')}",
        __config__=pydantic.ConfigDict(arbitrary_types_allowed=True),
        x=(kind, ...),
    )
    with pytest.raises(lcgen.GrammarError, match=named):
        Grammar.from_pydantic(model_cls)


def test_a_skipped_field_with_a_default_and_a_function_with_no_schema() -> None:
    """Left out with a default, a field is no error; a tool's argument with no JSON Schema is
    refused as the model's field is (not with pydantic's own exception)."""
    model_cls = pydantic.create_model("Skips", a=(int, ...), b=(SkipJsonSchema[int], 3))
    gbnf = Grammar.from_pydantic(model_cls).gbnf
    assert '\\"a\\"' in gbnf and '\\"b\\"' not in gbnf

    def apply(f: Callable[[int], int]) -> int:
        """Apply f."""
        return f(1)

    with pytest.raises(lcgen.UnsupportedSchemaError, match="arguments have no JSON Schema"):
        lcgen.Tool.of(apply)


class _NestedAlias(pydantic.BaseModel):
    x: int = pydantic.Field(validation_alias=pydantic.AliasPath("a", "b"))


class _NestedAliasOrName(_NestedAlias, populate_by_name=True):
    pass


class _NestedAliasOrPlain(pydantic.BaseModel):
    x: int = pydantic.Field(validation_alias=pydantic.AliasChoices(pydantic.AliasPath("a"), "y"))


def test_a_field_pydantic_reads_from_a_path_is_refused_unless_its_name_reads(
    model: lcgen.Model,
) -> None:
    """pydantic's schema names such a field ``x``, and its validation refused every output."""
    with pytest.raises(lcgen.UnsupportedSchemaError, match=r"validation_alias a\.b"):
        Grammar.from_pydantic(_NestedAlias)
    for model_cls, text in ((_NestedAliasOrName, '{"x": 1}'), (_NestedAliasOrPlain, '{"a": 1}')):
        assert Grammar.from_pydantic(model_cls).accepts(model, text)
        assert _validates(model_cls, text)


def test_plain_json_schema_formats_keep_their_meaning(model: lcgen.Model) -> None:
    uuid4 = Grammar.from_json_schema({"type": "string", "format": "uuid4"})
    assert uuid4.accepts(model, '"123e4567-e89b-42d3-a456-426614174000"')
    assert not uuid4.accepts(model, '"123e4567-e89b-12d3-a456-426614174000"')
    content = {"type": "string", "contentMediaType": "application/json"}
    as_json = Grammar.from_json_schema({**content, "contentSchema": {"type": "integer"}})
    assert as_json.accepts(model, '"12"')
    assert not as_json.accepts(model, '"x"')
    pydantic_1 = Grammar.from_json_schema({"type": "string", "format": "json-string"})
    assert pydantic_1.accepts(model, '"[1, {\\"a\\": null}]"')
    assert not pydantic_1.accepts(model, '"[1"')
    encoded = Grammar.from_json_schema({**content, "contentEncoding": "base64"})
    assert encoded.accepts(model, '"x"')  # base64 content: an annotation, as before
    assert Grammar.from_json_schema({"type": "string", "format": "file"}).accepts(model, '"x"')


GENERATED = {
    "condecimal": "a price under 1000 with cents",
    "dict-int-keys": "a map from years to events",
    "dict-float-keys": "a map from temperatures to words",
    "json-list": "a list of numbers, as JSON text",
    "json-model": "a cat named Tom, as JSON text",
    "uuid4": "a random UUID",
    "ip-any-network": "a network",
    "http-url": "a web address",
    "base64-str": 'base64 of "hello", which is "aGVsbG8="',
    "complex": "a complex number",
}


@pytest.mark.parametrize("name", GENERATED)
def test_generations_are_instances(model: lcgen.Model, name: str) -> None:
    model_cls, _, _ = _compiled(name)
    prompt = f'A JSON object whose "x" is {GENERATED[name]}:\n'
    completed = 0
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        try:
            value = model.generate(prompt, schema=model_cls, max_tokens=200, **options)
        except lcgen.IncompleteOutputError:
            continue  # cut short by max_tokens: nothing was claimed valid
        assert isinstance(value, model_cls)
        completed += 1
    assert completed, "no generation completed"
