"""The JSON Schema of a pydantic model as a grammar needs it: what pydantic checks beyond the
schema it writes (a Decimal's digits, a URL's host, a dict's key type, a past date...) said
in JSON Schema or in lcgen's own formats, which :mod:`lcgen.constrain.json_rules` enforces
or refuses by name."""

from __future__ import annotations

import decimal
import functools
import re
from collections.abc import Callable
from typing import Any

from lcgen.errors import UnsupportedSchemaError


@functools.cache
def _precise_schema_generator() -> type[Any]:
    """pydantic's JSON Schema generator, saying what its schema leaves out and a grammar can
    keep, in JSON Schema or lcgen's own formats (other validators take an unknown format as an
    annotation): a naive datetime has no offset, a past date is one (FutureDate is refused: see
    :mod:`lcgen.constrain.json_rules`), a Decimal keeps its digits and places in its number and
    in its string, a URL has a host and the schemes pydantic allows, a complex number and a
    ByteSize read as pydantic reads them, and a dict's keys spell its key type."""
    from pydantic.json_schema import GenerateJsonSchema
    from pydantic_core import PydanticOmit

    class Precise(GenerateJsonSchema):
        def datetime_schema(self, schema: Any) -> Any:
            out = _temporal(super().datetime_schema(schema), schema)
            if out.get("format") == "date-time" and schema.get("tz_constraint") == "naive":
                out = {**out, "format": "lcgen-naive-date-time"}
            return out

        def date_schema(self, schema: Any) -> Any:
            return _temporal(super().date_schema(schema), schema)

        def time_schema(self, schema: Any) -> Any:
            return _temporal(super().time_schema(schema), schema)

        def timedelta_schema(self, schema: Any) -> Any:
            return _temporal(super().timedelta_schema(schema), schema)

        def decimal_schema(self, schema: Any) -> Any:
            if self.mode != "validation":
                return super().decimal_schema(schema)
            number = _decimal_number(schema)
            text = {"type": "string", "contentMediaType": "application/json"}
            return {"anyOf": [number, {**text, "contentSchema": number}]}

        def url_schema(self, schema: Any) -> Any:
            out = {k: v for k, v in super().url_schema(schema).items() if k != "format"}
            return {**out, "pattern": _url_pattern(schema.get("allowed_schemes"))}

        def complex_schema(self, schema: Any) -> Any:
            return {"type": "string", "format": "lcgen-complex"}

        def str_schema(self, schema: Any) -> Any:
            out = super().str_schema(schema)
            strips = schema.get("strip_whitespace") or self._config.str_strip_whitespace
            if strips and out.get("minLength"):  # lengths count what stripping leaves
                if "pattern" in out:
                    return {**out, "format": "lcgen-stripped-pattern"}
                out["pattern"] = r"^(?:\S.*\S|\S)$"
            return out

        def bytes_schema(self, schema: Any) -> Any:
            out = super().bytes_schema(schema)
            reads = self._config.val_json_bytes  # what pydantic reads: not what it writes
            if out.get("format") in ("binary", "base64url") and reads in ("base64", "hex"):
                return {**out, "format": "base64" if reads == "base64" else "lcgen-hex"}
            return out

        def function_after_schema(self, schema: Any) -> Any:
            out = super().function_after_schema(schema)
            name = getattr(schema["function"]["function"], "__qualname__", "")
            if name in _CHECKED_FORMATS:  # (the format is set after this: mark it)
                out = {**out, _FORMAT: _CHECKED_FORMATS[name]}
            return out

        def model_field_schema(self, schema: Any) -> Any:
            self.check_alias(schema)
            return self.kept(schema, super().model_field_schema)

        def dataclass_field_schema(self, schema: Any) -> Any:
            self.check_alias(schema)
            return self.kept(schema, super().dataclass_field_schema)

        def typed_dict_field_schema(self, schema: Any) -> Any:
            self.check_alias(schema)
            return self.kept(schema, super().typed_dict_field_schema)

        def kept(self, field: Any, write: Callable[[Any], Any]) -> Any:
            """``write(field)``; refusing a required field left out of the schema
            (``SkipJsonSchema``): no object the grammar allows would have it, and pydantic
            refuses every object without it."""
            try:
                return write(field)
            except PydanticOmit:
                if not self.field_is_required(field, total=True):
                    raise
                name = field.get("name") or field.get("serialization_alias") or ""
                raise UnsupportedSchemaError(
                    f"the required field {name + ' ' if name else ''}is left out of the JSON "
                    "Schema (SkipJsonSchema): pydantic refuses every object without it, and "
                    "no object the grammar allows has it; give it a default"
                ) from None

        def check_alias(self, field: Any) -> None:
            """Refuse a field whose name in pydantic's schema is not one pydantic reads: a
            ``validation_alias`` that is only paths (``AliasPath``) leaves the field's own name
            in the schema, which validation refuses unless names are taken too."""
            alias = field.get("validation_alias")
            if self.mode != "validation" or not isinstance(alias, list):
                return
            paths = alias if alias and isinstance(alias[0], list) else [alias]
            if any(len(p) == 1 and isinstance(p[0], str) for p in paths):
                return  # (pydantic's schema names the field so)
            config = self._config
            if getattr(config, "validate_by_name", False) or config.populate_by_name:
                return
            raise UnsupportedSchemaError(
                f"a field's validation_alias {' or '.join('.'.join(map(str, p)) for p in paths)} "
                "is a path into nested JSON, which pydantic's JSON Schema does not say (it "
                "names the field, which its validation refuses): give a plain alias, an "
                "AliasChoices with one, or validate_by_name"
            )

        def dict_schema(self, schema: Any) -> Any:
            out = super().dict_schema(schema)
            if "keys_schema" in schema:
                names = self.key_names(schema["keys_schema"])
                if names is not None:
                    out["propertyNames"] = names
                    # pydantic writes a key pattern as patternProperties, whose search lets a
                    # key end in a newline before the pattern's "$"; the key's own schema
                    # reads the pattern as the values' patterns are read
                    patterns = out.get("patternProperties", {})
                    if list(patterns) == [names.get("pattern")]:
                        out["additionalProperties"] = out.pop("patternProperties")[names["pattern"]]
            return out

        def key_names(self, core: Any) -> Any:
            """``propertyNames`` for keys of a type that is not text (None: as pydantic says):
            pydantic reads a key as it reads a string, so numbers and booleans are JSON texts
            in it, and literals and enums keep their str values (a key "1" is no int literal)."""
            if core.get("type") == "literal":
                return _str_values(core["expected"])
            key = self.generate_inner(core)
            if "$ref" in key:
                key = self.get_schema_from_definitions(key["$ref"]) or {}
            if key.get("type") in ("integer", "number", "boolean"):
                content = {k: v for k, v in key.items() if k != "title"}
                return {"type": "string", "contentMediaType": "application/json",
                        "contentSchema": content}  # fmt: skip
            if key.get("type") == "string" and key.keys() - {"type", "title"}:
                return {k: v for k, v in key.items() if k != "title"}  # (a pattern, lengths)
            texts = [b for b in key.get("anyOf", ()) if b.get("type") == "string"]
            if texts:
                return texts[0] if len(texts) == 1 else {"anyOf": texts}
            if "enum" in key and "type" not in key:
                return _str_values(key["enum"])
            return None

    return Precise


def _temporal(out: dict[str, Any], schema: Any) -> dict[str, Any]:
    """A date, time, datetime or timedelta's schema saying what pydantic's leaves out: that
    it is past or future (PastDate...), or bounded (gt/ge/lt/le)."""
    fmt = out.get("format")
    if fmt not in ("date", "date-time", "time", "duration"):  # (written as a number)
        return out
    if schema.get("now_op"):
        return {**out, "format": f"lcgen-{schema['now_op']}-{fmt}"}
    if any(schema.get(key) is not None for key in ("gt", "ge", "lt", "le")):
        return {**out, "format": f"lcgen-bounded-{fmt}"}
    return out


def _str_values(values: list[Any]) -> dict[str, Any]:
    """The keys of a literal or enum type pydantic can read: its str values."""
    strings = [v for v in values if isinstance(v, str)]
    return {"enum": strings} if strings else {"not": {}}


def _bound(value: Any) -> Any:
    """A Decimal bound as JSON Schema holds it: an int where whole (a float could round)."""
    return int(value) if value == int(value) else value


def _decimal_number(schema: Any) -> dict[str, Any]:
    """The JSON numbers a pydantic Decimal takes: its bounds and step, exactly, and
    ``max_digits``/``decimal_places`` as bounds and steps (pydantic counts the digits of the
    number without trailing zeros: the whole part's, then the places)."""
    number: dict[str, Any] = {"type": "number"}
    for key, name in (("le", "maximum"), ("ge", "minimum"), ("lt", "exclusiveMaximum"),
                      ("gt", "exclusiveMinimum"), ("multiple_of", "multipleOf")):  # fmt: skip
        if schema.get(key) is not None:
            number[name] = _bound(schema[key])
    digits, places = schema.get("max_digits"), schema.get("decimal_places")
    splits: list[tuple[int | None, int | None]] = [(None, places)]  # (whole digits, places)
    if digits is not None and places is not None:  # pydantic: whole <= digits - places
        splits = [(max(digits - places, 0), min(places, digits))]
    elif digits is not None:
        splits = [(whole, digits - whole) for whole in range(digits + 1)]
    options = []
    for whole, after in splits:
        ranges: list[tuple[int, int] | None] = [None]
        if whole is not None:
            ranges = [(-(10**whole), 10**whole)]
        if whole == 0:  # pydantic counts 0 as a whole digit: two ranges without it
            ranges = [(-1, 0), (0, 1)]
        for bounds in ranges:
            option: dict[str, Any] = {}
            if bounds is not None:
                option = {"exclusiveMinimum": bounds[0], "exclusiveMaximum": bounds[1]}
            if after is not None:
                option["multipleOf"] = decimal.Decimal(1).scaleb(-after)
            options.append(option)
    if options != [{}]:
        number["anyOf"] = options
    return number


_URL_CHAR = "(?:[a-zA-Z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
_PORT = "(?:[0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"


def _url_pattern(schemes: list[str] | None) -> str:
    """URLs pydantic (the WHATWG parser) takes: a scheme, a host of letters and digits whose
    last label starts with a letter (one of digits would read as an IPv4 number, "xn--" as
    punycode), a port, then path, query and fragment of URI characters."""
    scheme = "|".join(map(re.escape, schemes)) if schemes else "[a-zA-Z][a-zA-Z0-9+.-]*"
    host = "(?:[a-zA-Z0-9]{1,30}\\.){0,6}[a-zA-Z][a-zA-Z0-9]{0,29}"
    rest = f"(?:/{_URL_CHAR}*)*(?:\\?(?:{_URL_CHAR}|[/?])*)?(?:#(?:{_URL_CHAR}|[/?])*)?"
    return f"^(?:{scheme})://{host}(?::{_PORT})?{rest}$"


# pydantic's ByteSize: its schema's pattern is not anchored at the end (any unit passes it).
_BYTE_SIZE = r"^\s*(\d*\.?\d+)\s*(\w+)?"
_BYTE_UNITS = "b|kb|mb|gb|tb|pb|eb|kib|mib|gib|tib|pib|eib|bit|kbit|mbit|gbit|k|m|g|t|KB|MB|GB"
_EXACT_BYTE_SIZE = f"^[0-9]{{1,15}}(?:\\.[0-9]{{1,6}})? ?(?:{_BYTE_UNITS})?$"


_FORMAT = "$lcgen-format"  # (a key validators ignore)
# pydantic types that check more than their schema says (NewPath: "path", any text; a payment
# card: any 12 to 19 characters), by their check: the format that names what it checks.
_CHECKED_FORMATS = {
    "PathType.validate_new": "new-path",
    "PathType.validate_socket": "socket-path",
    "PaymentCardNumber.validate": "payment-card-number",
}


def _exact(schema: Any) -> Any:
    """``schema`` with pydantic's loose patterns (ByteSize's) made exact, and the formats of
    :data:`_CHECKED_FORMATS` said."""
    if isinstance(schema, list):
        return [_exact(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _exact(v) for k, v in schema.items() if k != _FORMAT}
    if out.get("pattern") == _BYTE_SIZE:
        out["pattern"] = _EXACT_BYTE_SIZE
    if _FORMAT in schema:
        out["format"] = schema[_FORMAT]
    return out


def pydantic_schema(model_cls: type[Any]) -> dict[str, Any]:
    """The JSON Schema of a pydantic model, saying what pydantic's own leaves out and a grammar
    can hold to (see :func:`_precise_schema_generator`)."""
    from pydantic.errors import PydanticInvalidForJsonSchema

    try:
        schema: dict[str, Any] = model_cls.model_json_schema(
            schema_generator=_precise_schema_generator()
        )
    except PydanticInvalidForJsonSchema as exc:  # (a Callable, an arbitrary class)
        raise UnsupportedSchemaError(
            f"{model_cls.__name__} has no JSON Schema: {_first_line(exc)}"
        ) from None
    return dict(_exact(schema))


def adapter_schema(adapter: Any) -> dict[str, Any]:
    """:func:`pydantic_schema` of a ``pydantic.TypeAdapter`` (a function's arguments)."""
    from pydantic.errors import PydanticInvalidForJsonSchema

    try:
        schema: dict[str, Any] = adapter.json_schema(schema_generator=_precise_schema_generator())
    except PydanticInvalidForJsonSchema as exc:
        raise UnsupportedSchemaError(
            f"the arguments have no JSON Schema: {_first_line(exc)}"
        ) from None
    return dict(_exact(schema))


def _first_line(exc: Exception) -> str:
    """pydantic's message without its link to the docs."""
    return str(exc).strip().split("\n", 1)[0]
