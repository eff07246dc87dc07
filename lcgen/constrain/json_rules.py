"""The tables and value helpers of :mod:`lcgen.constrain.json_schema`: which keywords exist
and which are supported, the GBNF of JSON's primitives and of the string formats, bounds as
decimals."""

from __future__ import annotations

import calendar
import datetime
import json
import math
import sys
from decimal import Decimal
from typing import Any

from lcgen.constrain import gbnf as g
from lcgen.errors import GrammarError, UnsupportedSchemaError

Conj = list[dict[str, Any]]  # a conjunction of plain (applicator-free) schemas
# Marks a member made by negating "type": "integer": its numbers are no integers.
NOT_INTEGER = "$lcgen-not-integer"
# A member made by negating "pattern": its strings match none of these patterns.
NOT_MATCHING = "$lcgen-not-matching"


class Unsatisfiable(GrammarError):
    """No value of one alternative validates (other alternatives may). Internal: the schema
    compiler raises it to users as a plain :class:`GrammarError`."""


class NoValue(Unsatisfiable):
    """Provably no value validates (``false``, bounds that cross, an empty enum), not only
    none that lcgen writes: an optional property or an item of it is left out."""


ANNOTATIONS = frozenset(
    ["title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly", "discriminator", "contentEncoding", "contentMediaType", "contentSchema", "$defs",
     "definitions", "$anchor"]
)  # fmt: skip
# What the properties and items no other keyword of a location evaluated must be.
UNEVALUATED = frozenset(["unevaluatedProperties", "unevaluatedItems"])
APPLICATORS = frozenset(
    ["$ref", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependencies",
     "dependentRequired", "dependentSchemas", *UNEVALUATED]
)  # fmt: skip
# The keywords whose annotations say which properties or items a location evaluated.
ANNOTATING = frozenset(
    ["properties", "patternProperties", "additionalProperties", "prefixItems", "items",
     "additionalItems", "contains"]
)  # fmt: skip
GENERIC = frozenset(["type", "enum", "const", *APPLICATORS])
BY_TYPE = {
    "string": frozenset(["minLength", "maxLength", "pattern", "format"]),
    "number": frozenset(
        ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]
    ),
    "object": frozenset(
        ["properties", "required", "additionalProperties", "minProperties", "maxProperties",
         "patternProperties", "propertyNames"]
    ),
    "array": frozenset(
        ["items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
         "contains", "minContains", "maxContains"]
    ),
}  # fmt: skip
CONSTRAINING = GENERIC.union(*BY_TYPE.values())
# Keywords whose value is a number: a bound or a step; and those whose value is a count.
NUMBERS = BY_TYPE["number"]
COUNTS = frozenset(
    ["minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
     "minContains", "maxContains"]
)  # fmt: skip
UNSUPPORTED = frozenset(["$dynamicRef", "$recursiveRef"])
KNOWN = sorted(
    ANNOTATIONS
    | CONSTRAINING
    | UNSUPPORTED
    | {"$schema", "$id", "id", "$vocabulary", "$dynamicAnchor", "$recursiveAnchor"}
)
# Common annotations of other vocabularies (OpenAPI...), close to keywords but not misspelt.
QUIET = frozenset(["example", "nullable", "readonly", "writeonly", "links", "media"])
TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
NON_NUMERIC = ("null", "boolean", "string", "array", "object")

WS = "[ \\t\\n]{0,24}"
HEX = "[0-9a-fA-F]"
# One character of a JSON string; \\u escapes of surrogates only as a pair (one character).
RAW_RANGES = g.subtract(((0x20, g.MAX_CODEPOINT),), ((0x22, 0x22), (0x5C, 0x5C), *g.SURROGATES))
RAW_CHAR = g.char_class(RAW_RANGES)
CHAR = (
    f'{RAW_CHAR} | "\\\\" (["\\\\/bfnrt] | "u" ('
    f"[0-9a-cA-CefEF] {HEX}{{3}} | [dD] [0-7] {HEX}{{2}} | "
    f'[dD] [89abAB] {HEX}{{2}} "\\\\u" [dD] [c-fC-F] {HEX}{{2}}))'
)
NUMBER = (
    f'"-"? ("0" | [1-9] [0-9]{{0,{g.MAX_DIGITS - 1}}}) ("." [0-9]{{1,{g.MAX_PLACES}}})? '
    "([eE] [-+]? [0-9]{1,2})?"
)


def _date(year: str, leap_year: str) -> str:
    return (
        f'({year} "-" ("0" [13578] | "1" [02]) "-" (day28 | "29" | "30" | "31") | {year} "-" '
        f'("0" [469] | "11") "-" (day28 | "29" | "30") | {year} "-02-" day28 | '
        f'{leap_year} "-02-29")'
    )


DATE = _date("year", "leap-year")
LEAP_YY = '("0" [48] | [2468] [048] | [13579] [26])'


def past_date(today: datetime.date) -> str:
    """Dates in the years 1000 to the one before that of two days before ``today``: dates
    before today in every time zone, and still when the grammar is used later (the past only
    grows; a future date would stop being one)."""
    last = (today - datetime.timedelta(days=2)).year - 1
    years = ['"1" [0-9]{3}'] + [f'"{y}"' for y in range(2000, last + 1)]
    leap = [f'"1" [0-9] {LEAP_YY}', '"1200"', '"1600"']
    leap += [f'"{y}"' for y in range(2000, last + 1) if calendar.isleap(y)]
    return _date(f"({' | '.join(years)})", f"({' | '.join(leap)})")


HOUR = '([01] [0-9] | "2" [0-3])'
# URI characters that need no escape in a JSON string (RFC 3986: unreserved, reserved, %XX).


def _ipv6() -> str:
    """Eight groups, or fewer around one "::" (RFC 4291, without the IPv4 tail)."""

    def groups(n: int) -> str:
        return ' ":" '.join(["h16"] * n) if n else '""'

    compressed = [f'{groups(a)} "::" {groups(b)}' for a in range(8) for b in range(8 - a)]
    return " | ".join([groups(8), *compressed])


def _each(chars: str) -> g.Ranges:
    return g.ranges_of((ord(c), ord(c)) for c in chars)


def _ipv4_network() -> str:
    """An address whose bits after the prefix length are all 0, then the length (pydantic's
    IPv4Network refuses host bits)."""
    options = []
    for length in range(33):
        full, part = divmod(length, 8)
        octets = ["octet"] * full
        if full < 4:
            octets.append(g.alternatives(g.literal(str(v)) for v in range(0, 256, 2 ** (8 - part))))
            octets += ['"0"'] * (3 - full)
        options.append(' "." '.join(octets) + f' "/{length}"')
    return " | ".join(options)


def _ipv6_network() -> str:
    """As :func:`_ipv4_network`: the groups the prefix covers, the group it ends in as four
    digits, then "::" for the zero groups after them."""
    options = []
    for length in range(129):
        full, part = divmod(length, 16)
        groups = ["h16"] * full
        if part:
            digits, bits = divmod(part, 4)
            last = [HEX] * digits
            if bits:
                last.append("[" + "".join(f"{v:x}" for v in range(0, 16, 2 ** (4 - bits))) + "]")
            groups.append(" ".join(last + ['"0"'] * (4 - len(last))))
        address = ' ":" '.join(groups)
        if len(groups) < 8:
            address = f'{address} "::"' if groups else '"::"'
        options.append(f'{address} "/{length}"')
    return " | ".join(options)


def _base64(alphabet: str) -> str:
    """Canonical padded base64 of ASCII bytes: pydantic's Base64Str also decodes the bytes as
    UTF-8, and its JSON Schema says "base64" for both it and Base64Bytes. In each group of four
    characters (24 bits), the bits that start each byte are 0."""

    def sextets(keep: Any) -> str:
        return g.char_class(_each("".join(c for v, c in enumerate(alphabet) if keep(v))))

    first, second = sextets(lambda v: v < 32), sextets(lambda v: not v & 8)
    third = sextets(lambda v: not v & 2)
    group = f"{first} {second} {third} {sextets(lambda v: True)}"
    one = f'{first} {sextets(lambda v: v % 16 == 0)} "=="'
    two = f'{first} {second} {sextets(lambda v: v % 4 == 0)} "="'
    return f"({group})* ({one} | {two})?"


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# Characters that are no regular expression's syntax, and need no escape in JSON.
_REGEX_PLAIN = g.char_class(g.subtract(RAW_RANGES, _each("^$.|?*+()[]{}")))
_UUID_GROUPS = [f"{HEX}{{8}}", f"{HEX}{{4}}", f"{HEX}{{3}}", f"[89abAB] {HEX}{{3}}", f"{HEX}{{12}}"]
DURATION = '"P" (dur-date ("T" dur-time)? | "T" dur-time | [0-9]{1,6} "W")'
PRIMITIVES = {
    "ws": WS,
    "char": CHAR,
    "string": '"\\"" char* "\\""',
    "number": NUMBER,
    "value": 'object | array | string | number | ("true" | "false") | "null"',
    "object": '"{" ws (string ws ":" ws value ws ("," ws string ws ":" ws value ws)*)? "}"',
    "array": '"[" ws (value ws ("," ws value ws)*)? "]"',
    "year": '[0-9]{3} [1-9] | [0-9]{2} [1-9] "0" | [0-9] [1-9] "00" | [1-9] "000"',
    "leap-year": f'[0-9]{{2}} {LEAP_YY} | {LEAP_YY} "00"',
    "h16": f"{HEX}{{1,4}}",
    # At most 6 digits a field: every such duration fits a timedelta (under 10**9 days). As
    # RFC 3339's ABNF has it, a unit is left out only at the end: "P1Y1D" and "PT1H1S" are no
    # durations (the month, the minute is missing between).
    "dur-date": 'dur-n "Y" (dur-n "M" (dur-n "D")?)? | dur-n "M" (dur-n "D")? | dur-n "D"',
    "dur-time": 'dur-n "H" (dur-n "M" (dur-n "S")?)? | dur-n "M" (dur-n "S")? | dur-n "S"',
    "dur-n": "[0-9]{1,6}",
    "day28": '"0" [1-9] | "1" [0-9] | "2" [0-8]',
    "date": DATE,
    "time": f'{HOUR} ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{{1,6}})? '
    f'("Z" | [+-] {HOUR} ":" [0-5] [0-9])',
    "date-time": 'date "T" time',
    # pydantic's NaiveDatetime (Grammar.from_pydantic names it so): a date-time with no offset.
    "lcgen-naive-date-time": 'date "T" naive-time',
    "naive-time": f'{HOUR} ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{{1,6}})?',
    "uuid": ' "-" '.join(f"{HEX}{{{n}}}" for n in (8, 4, 4, 4, 12)),
    # The top-level domain ends in a letter (no TLD is all digits; pydantic's EmailStr, by
    # email-validator, refuses "a@example.com1").
    "email": '[A-Za-z0-9_%+-]+ ("." [A-Za-z0-9_%+-]+)* "@" label ("." label)* "." tld',
    "label": "[A-Za-z0-9] ([A-Za-z0-9-]* [A-Za-z0-9])?",
    "tld": "([A-Za-z0-9] [A-Za-z0-9-]*)? [A-Za-z]",
    "ipv4": 'octet "." octet "." octet "." octet',
    # hostname: RFC 1123 labels; at most 8 of at most 30 characters keep it under 253 in all.
    "hostname": 'hlabel ("." hlabel){0,7}',
    "hlabel": "[A-Za-z0-9] ([A-Za-z0-9-]{0,28} [A-Za-z0-9])?",
    "ipv6": _ipv6(),
    # RFC 3986's URI and URI-reference (IPvFuture hosts left out): a port is digits, a
    # "#" comes once, a relative path's first segment has no ":" (any URI character let through
    # "http://x:y" and ":x").
    "uri": 'uri-scheme ":" uri-hier uri-tail',
    "uri-reference": "uri | uri-relative",
    "uri-relative": '("//" uri-auth uri-abempty | "/" (uri-pchar+ uri-abempty)? '
    '| (uri-unres | "@")+ uri-abempty)? uri-tail',
    "uri-scheme": "[a-zA-Z] [a-zA-Z0-9+.-]*",
    "uri-hier": '("//" uri-auth uri-abempty | "/" (uri-pchar+ uri-abempty)? '
    "| uri-pchar+ uri-abempty)?",
    "uri-tail": '("?" uri-query)? ("#" uri-query)?',
    "uri-auth": '((uri-unres | ":")* "@")? uri-host (":" [0-9]*)?',
    "uri-host": '"[" ipv6 "]" | uri-unres*',
    "uri-abempty": '("/" uri-pchar*)*',
    "uri-pchar": "uri-unres | [:@]",
    "uri-unres": f'[a-zA-Z0-9._~!$&\'()*+,;=-] | "%" {HEX} {HEX}',
    "uri-query": "(uri-pchar | [/?])*",
    "duration": DURATION,
    "octet": '"25" [0-5] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9] [0-9] | [0-9]',
    # pydantic's IPvAnyAddress: either address
    "ipvanyaddress": "ipv4 | ipv6",
    # pydantic's networks (no host bits), interfaces (an address, perhaps a prefix length).
    "ipv4network": _ipv4_network(),
    "ipv6network": _ipv6_network(),
    "ipvanynetwork": "ipv4network | ipv6network",
    "ipv4interface": 'ipv4 ("/" ([12]? [0-9] | "3" [0-2]))?',
    "ipv6interface": 'ipv6 ("/" ([1-9]? [0-9] | "1" [01] [0-9] | "12" [0-8]))?',
    "ipvanyinterface": "ipv4interface | ipv6interface",
    "base64": _base64(_B64 + "+/"),
    "base64url": _base64(_B64 + "-_"),
    # Any text (pydantic's bytes, SecretStr, Path); bytes count UTF-8 bytes, so with
    # minLength/maxLength these are ASCII (FORMAT_PATTERNS).
    "binary": "char*",
    "password": "char*",
    "path": "char*",
    "regex": f"{_REGEX_PLAIN}*",  # a pattern that matches itself: always compiles
    "color": f'"#" ({HEX}{{3}} | {HEX}{{6}})',
    "lcgen-hex": f"({HEX} {HEX})*",  # bytes as pydantic's val_json_bytes='hex' reads them
    # pydantic's PastDatetime ("lcgen-past-date" is made when a grammar is: DATED).
    "lcgen-past-date-time": 'lcgen-past-date "T" time',
    # pydantic's complex (its schema says only "string"): Python's complex() reads these.
    "lcgen-complex": '"-"? real ([+-] real "j")? | "-"? real "j"',
    "real": '[0-9]{1,15} ("." [0-9]{1,15})?',
    # pydantic's UUID1 to UUID8: the version digit, and the RFC 4122 variant.
    **{
        f"uuid{n}": ' "-" '.join([*_UUID_GROUPS[:2], f'"{n}" {_UUID_GROUPS[2]}', *_UUID_GROUPS[3:]])
        for n in range(1, 9)
    },
}
DEPENDS = {"value": ("object", "array", "string", "number"), "object": ("ws", "string", "value"),
           "array": ("ws", "value"), "string": ("char",), "date": ("year", "leap-year", "day28"),
           "date-time": ("date", "time"), "lcgen-naive-date-time": ("date", "naive-time"),
           "email": ("label", "tld"), "ipv4": ("octet",),
           "uri": ("uri-scheme", "uri-hier", "uri-tail"),
           "uri-reference": ("uri", "uri-relative"),
           "uri-relative": ("uri-auth", "uri-abempty", "uri-pchar", "uri-unres", "uri-tail"),
           "uri-hier": ("uri-auth", "uri-abempty", "uri-pchar"),
           "uri-tail": ("uri-query",), "uri-auth": ("uri-host",),
           "uri-host": ("uri-unres", "ipv6"), "uri-abempty": ("uri-pchar",),
           "uri-pchar": ("uri-unres",), "uri-query": ("uri-pchar",),
           "hostname": ("hlabel",), "ipv6": ("h16",), "ipvanyaddress": ("ipv4", "ipv6"),
           "duration": ("dur-date", "dur-time", "dur-n"), "dur-date": ("dur-n",),
           "dur-time": ("dur-n",), "ipv4network": ("octet",), "ipv6network": ("h16",),
           "ipvanynetwork": ("ipv4network", "ipv6network"), "ipv4interface": ("ipv4",),
           "ipv6interface": ("ipv6",), "ipvanyinterface": ("ipv4interface", "ipv6interface"),
           "binary": ("char",), "password": ("char",), "path": ("char",),
           "lcgen-complex": ("real",), "lcgen-past-date": ("day28",),
           "lcgen-past-date-time": ("lcgen-past-date", "time")}  # fmt: skip
# Formats with no longest text, as patterns (the same strings as their rules above, but a
# URI's host is no IP literal here): with minLength/maxLength they are bounded like a pattern
# is (lcgen.constrain.regex.within_lengths).
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_TLD = "(?:[A-Za-z0-9][A-Za-z0-9-]*)?[A-Za-z]"
_UNRES = "(?:[a-zA-Z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})"
_PCHAR = f"(?:{_UNRES}|[:@])"
_ABEMPTY = f"(?:/{_PCHAR}*)*"
_AUTH = f"(?:(?:{_UNRES}|:)*@)?{_UNRES}*(?::[0-9]*)?"
_TAIL = f"(?:\\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
_URI = f"[a-zA-Z][a-zA-Z0-9+.-]*:(?://{_AUTH}{_ABEMPTY}|/(?:{_PCHAR}+{_ABEMPTY})?|{_PCHAR}+{_ABEMPTY})?{_TAIL}"
_RELATIVE = f"(?://{_AUTH}{_ABEMPTY}|/(?:{_PCHAR}+{_ABEMPTY})?|(?:{_UNRES}|@)+{_ABEMPTY})?{_TAIL}"
FORMAT_PATTERNS = {
    "uri": f"^{_URI}$",
    "uri-reference": f"^(?:{_URI}|{_RELATIVE})$",
    "email": f"^[A-Za-z0-9_%+-]+(?:\\.[A-Za-z0-9_%+-]+)*@{_LABEL}(?:\\.{_LABEL})*\\.{_TLD}$",
    **dict.fromkeys(["binary", "password", "path"], "^[\\x00-\\x7f]*$"),
}
# The fewest and most characters of the other formats' texts.
FORMAT_LENGTHS = {"date": (10, 10), "time": (9, 21), "date-time": (20, 32), "uuid": (36, 36),
                  "ipv4": (7, 15), "ipv6": (2, 39), "hostname": (1, 247), "duration": (3, 44),
                  "ipvanyaddress": (2, 39), "lcgen-naive-date-time": (19, 26),
                  "lcgen-past-date": (10, 10), "lcgen-past-date-time": (20, 32),
                  **dict.fromkeys([f"uuid{n}" for n in range(1, 9)], (36, 36))}  # fmt: skip
FORMATS = ("date", "time", "date-time", "uuid", "email", "ipv4", "ipv6", "hostname", "uri",
           "uri-reference", "duration", "ipvanyaddress", "lcgen-naive-date-time", "ipv4network",
           "ipv6network", "ipvanynetwork", "ipv4interface", "ipv6interface", "ipvanyinterface",
           "base64", "base64url", "binary", "password", "path", "regex", "color", "lcgen-hex",
           "lcgen-complex", "lcgen-past-date", "lcgen-past-date-time",
           *(f"uuid{n}" for n in range(1, 9)))  # fmt: skip
# Formats whose rules depend on the day the grammar is made (pydantic's PastDate/PastDatetime).
DATED = {"lcgen-past-date": past_date}
# Formats no grammar can keep to (pydantic's, where its JSON Schema says too little): why.
REFUSED_FORMATS = {
    **dict.fromkeys(
        ["file-path", "directory-path", "new-path", "socket-path"],
        "pydantic checks the file system, which a grammar cannot see",
    ),
    "payment-card-number": "pydantic's PaymentCardNumber checks a brand's lengths and a checksum",
    "multi-host-uri": "its JSON Schema does not say which schemes pydantic allows",
    "lcgen-stripped-pattern": "pydantic strips whitespace before it checks minLength, and a "
    "pattern may allow whitespace at the ends",
    **dict.fromkeys(
        [f"lcgen-bounded-{kind}" for kind in ("date", "date-time", "time", "duration")],
        "gt/ge/lt/le on a date, time, datetime or timedelta (pydantic's JSON Schema leaves "
        "them out, and lcgen does not bound these texts)",
    ),
    **dict.fromkeys(
        ["lcgen-future-date", "lcgen-future-date-time"],
        "pydantic's FutureDate/FutureDatetime: a date after today stops being one at midnight, "
        "so a grammar (which may be kept and reused) cannot hold to it",
    ),
}


def holds_json(schema: dict[str, Any]) -> bool:
    """Whether a string schema says its text is JSON (``contentMediaType`` application/json,
    not encoded; pydantic 1's ``json-string`` format), which lcgen holds to."""
    plain = schema.get("contentMediaType") == "application/json" and "contentEncoding" not in schema
    return plain or schema.get("format") == "json-string"


def type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float | Decimal) and value % 1 == 0):
        return "integer"
    kinds = {float: "number", Decimal: "number", str: "string", list: "array", dict: "object"}
    return kinds[type(value)]


def not_finite(value: Any) -> float | Decimal | None:
    """The first NaN or infinity in ``value`` (a number, or one inside a list or object), which
    JSON cannot write; None when there is none."""
    if isinstance(value, float | Decimal):
        return None if math.isfinite(value) else value
    if isinstance(value, list | tuple | dict):
        for item in value.values() if isinstance(value, dict) else value:
            found = not_finite(item)
            if found is not None:
                return found
    return None


def constants(schema: Any) -> set[str] | None:
    """Canonical texts of the values a const/enum schema allows (None: not a const/enum)."""
    if not isinstance(schema, dict) or not ("const" in schema or "enum" in schema):
        return None
    values = [schema["const"]] if "const" in schema else schema["enum"]
    return {json.dumps(canonical(v), sort_keys=True) for v in values}


def canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    return value


def bound(schema: dict[str, Any], key: str, exclusive_key: str) -> g.Bound | None:
    """(exact value, exclusive) of the tighter of ``key`` and ``exclusive_key``."""
    value, exclusive = schema.get(key), schema.get(exclusive_key)
    candidates: list[g.Bound] = []
    if isinstance(value, int | float | Decimal) and not isinstance(value, bool):
        candidates.append((Decimal(value), exclusive is True))
    if isinstance(exclusive, int | float | Decimal) and not isinstance(exclusive, bool):
        candidates.append((Decimal(exclusive), True))
    if not candidates:
        return None
    lower = key == "minimum"
    return max(candidates) if lower else min(candidates, key=lambda b: (b[0], not b[1]))


def within(value: Decimal, lo: g.Bound | None, hi: g.Bound | None) -> bool:
    """Whether ``value`` and the double a JSON parser reads it as both lie within the bounds."""
    return all(
        (lo is None or x > lo[0] or (x == lo[0] and not lo[1]))
        and (hi is None or x < hi[0] or (x == hi[0] and not hi[1]))
        for x in (value, Decimal(float(value)))
    )


def as_float(bound: g.Bound | None, upper: bool) -> g.Bound | None:
    """The bound as the decimal text of a double: a text within it parses to a float within
    the original bound (json parses fractions as doubles, which round)."""
    if bound is None:
        return None
    value, exclusive = bound
    try:
        d = float(value)
    except OverflowError:
        d = math.inf
    if math.isinf(d):
        d = math.copysign(sys.float_info.max, d)
    exact = Decimal(d)
    if (exact > value if upper else exact < value) or (exclusive and exact == value):
        d = math.nextafter(d, -math.inf if upper else math.inf)
    if math.isinf(d):
        raise UnsupportedSchemaError(f"the bound {value} is beyond the range of a double")
    return Decimal(repr(d)), False


def item_key(value: Any) -> Any:
    """A hashable form of a JSON value in which equal values are equal, as jsonschema and
    pydantic compare what ``json.loads`` reads: numbers by value (``1`` and ``1.0``; a
    fraction as a float: ``1.00000000000000001`` is ``1``), booleans apart from numbers,
    objects whatever their key order."""
    if isinstance(value, bool) or value is None:
        return ("c", value)
    if isinstance(value, int | float):
        return ("n", value)  # (Python's int and float hash and compare by value)
    if isinstance(value, Decimal):
        return ("n", float(value))
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("a", tuple(item_key(v) for v in value))
    return ("o", frozenset((k, item_key(v)) for k, v in value.items()))
