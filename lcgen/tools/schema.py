"""The JSON Schema and grammar of a reply that calls functions, and reading the calls back.

A reply that is calls is one ``{"name": ..., "arguments": ...}`` object, or (``parallel``) a
JSON array of 1 to :data:`MAX_PARALLEL` of them; a reply that is text starts with neither
``{`` nor (``parallel``) ``[``, so the first character tells them apart.

Arguments are always a JSON object: a function without ``parameters`` takes none (``{}``),
and parameters that name no type are still an object. Each function's parameters sit in the
reply's schema under a name of their own, their root-relative ``$ref`` s rewritten to point
there, so ``$defs``, ``definitions``, ``#`` and a root ``$id`` work as they do on their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from collections.abc import Sequence as Seq
from typing import Any, Literal
from urllib.parse import urldefrag

from lcgen.constrain import Grammar, bundle_schema
from lcgen.constrain.bundle import BY_NAME, unresolved_mark, unresolved_ref
from lcgen.decoding.results import ToolCall
from lcgen.errors import GrammarError
from lcgen.tools.define import Tool, checked_parameters

MAX_PARALLEL = 16  # calls in one reply
_TEXT_RULE = "lcgen-reply-text"


def _call_starts(parallel: bool) -> str:
    """The characters a reply that is calls starts with: ``{`` (one), ``[`` (several)."""
    return "{[" if parallel else "{"


def grammar(
    tools: Seq[Tool],
    required: bool,
    parallel: bool = False,
    reply_format: Any = None,
    *,
    whitespace: Literal["flexible", "compact"] = "flexible",
) -> Grammar:
    """The reply's constraint: a call of one of ``tools`` (or, with ``parallel``, a JSON array
    of 1 to ``MAX_PARALLEL`` calls), or (unless ``required``) text that does not start as
    calls do, or with a ``reply_format`` (the JSON Schema of ``response_format``) JSON text
    valid against it. ``whitespace`` is the calls' JSON's (and the format's): ``"flexible"``
    or ``"compact"`` (see :meth:`lcgen.Grammar.from_json_schema`).

    Raises:
        GrammarError: a function's parameters (as pydantic checks them) are not a
            JSON Schema lcgen supports.
        ValueError: another ``whitespace``.
    """
    if reply_format is not None and not required:
        schema = calls_schema(tools, parallel, reply_format)
        return _compiled(schema, tools, whitespace)
    call = _compiled(calls_schema(tools, parallel), tools, whitespace)
    if required:
        return call
    # The schema's grammar defines its root on the first line and never refers to it.
    first, rest = call.gbnf.split("\n", 1)
    assert first.startswith("root ::= ") and not re.search(rf"^{_TEXT_RULE} ", rest, re.M)
    body = first.removeprefix("root ::= ")
    not_a_call = "[^" + _call_starts(parallel).replace("[", "\\[") + " \\t\\n\\r]"
    text = f"root ::= ({body}) | {_TEXT_RULE}\n{rest}{_TEXT_RULE} ::= {not_a_call} .*\n"
    return Grammar(text, unique=call.unique)


def _compiled(
    schema: dict[str, Any], tools: Seq[Tool], whitespace: Literal["flexible", "compact"]
) -> Grammar:
    """The wrapper's grammar; where it cannot be made, the error of the function whose
    parameters cause it, named (the wrapper's places are lcgen's)."""
    try:
        return Grammar.from_json_schema(schema, whitespace=whitespace)
    except GrammarError:
        for tool in tools:
            try:
                Grammar.from_json_schema(constraint(tool))
            except GrammarError as exc:
                raise _of(tool, exc) from None
        raise


NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_OLD_DRAFTS = ("Draft3Validator", "Draft4Validator", "Draft6Validator", "Draft7Validator")


def parameters(tool: Tool) -> dict[str, Any]:
    """A function's ``parameters``; none given: no parameters (OpenAI's meaning), an empty
    object that takes no properties."""
    if tool.parameters is None:
        return dict(NO_PARAMETERS)
    return tool.parameters


def constraint(tool: Tool) -> dict[str, Any]:
    """The JSON Schema a call's arguments are held to: what pydantic checks where it made the
    parameters (see :func:`~lcgen.tools.define.checked_parameters`), else the parameters."""
    checked = checked_parameters(tool)
    return parameters(tool) if checked is None else checked


def calls_schema(
    tools: Seq[Tool], parallel: bool = False, reply_format: Any = None
) -> dict[str, Any]:
    """The JSON Schema of a reply that is calls: one (or, with ``parallel``, an array of 1 to
    ``MAX_PARALLEL``), each ``{"name": <a function's name>, "arguments": <an object valid for
    its parameters (its constraint, where it has one)>}``; with ``reply_format`` (a JSON
    Schema), calls or a value of it.

    Each function's parameters go under the wrapper's definitions (``tool0``, ``tool1``, ...),
    so that their root-relative ``$ref`` s (``#``, ``#/$defs/...``, ``#/definitions/...``,
    pointers into their properties, anchors, refs through a root ``$id``) are rewritten to
    point there; the root ``$id`` is dropped. The wrapper is of the draft they name.

    Raises:
        GrammarError: parameters that cannot describe an object, or functions whose
            parameters name different JSON Schema drafts.
    """
    import jsonschema

    draft = _draft(tools, reply_format)
    validator = jsonschema.validators.validator_for({} if draft is None else {"$schema": draft})
    old = validator.__name__ in _OLD_DRAFTS  # $defs is "definitions", anchors are "$id"s
    id_key = "id" if validator.__name__ in _OLD_DRAFTS[:2] else "$id"
    defs_key = "definitions" if old else "$defs"
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        params = constraint(tool)
        named = params.get("type")
        if (
            named is not None
            and named != "object"
            and not (isinstance(named, list) and "object" in named)
        ):
            raise GrammarError(
                f"the parameters of function {tool.name!r} must describe an object "
                f'("type": "object"), not type {named!r}: arguments are always a JSON object'
            )
        key = f"tool{i}"
        if id_key in params:  # (dropped below: checked here, as the wrapper is)
            try:
                validator.check_schema({id_key: params[id_key]})
                urldefrag(params[id_key])
            except (jsonschema.SchemaError, ValueError) as exc:
                reason = exc.message if isinstance(exc, jsonschema.SchemaError) else str(exc)
                raise GrammarError(
                    f"the parameters of function {tool.name!r}: invalid JSON Schema: {id_key} "
                    f"at #: {reason}"
                ) from None
        try:
            defs[key] = _rehome(params, f"/{defs_key}/{key}", id_key, draft)
        except GrammarError as exc:
            raise _of(tool, exc) from None
        target = {"$ref": f"#/{defs_key}/{key}"}
        # Arguments are always an object, whatever the parameters say (or leave out; up to
        # draft 7 a root $ref makes the type beside it say nothing).
        plain = named == "object" and not (old and "$ref" in params)
        arguments = target if plain else {"type": "object", "allOf": [target]}
        if not plain:  # (an object they may not allow: said, not left out of the calls)
            alone = {"$schema": draft, **arguments} if draft else arguments
            _check_alone(tool, {**alone, defs_key: defs})
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [tool.name]}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = one
    if parallel:
        several = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL}
        schema = {"anyOf": [one, several]}
    if reply_format is not None:
        if isinstance(reply_format, dict):
            reply_format = _rehome(reply_format, f"/{defs_key}/format", id_key, draft)
        defs["format"] = reply_format
        schema = {"anyOf": [schema, {"$ref": f"#/{defs_key}/format"}]}
    out = {**schema, defs_key: defs}
    if draft is not None:
        out = {"$schema": draft, **out}
    return out


def _of(tool: Tool, exc: GrammarError) -> GrammarError:
    """``exc``, said of ``tool``'s parameters."""
    return type(exc)(f"the parameters of function {tool.name!r}: {exc}")


def _check_alone(tool: Tool, arguments: dict[str, Any]) -> None:
    """Raise where no arguments satisfy ``tool``'s parameters (``arguments``: their schema
    as the wrapper has it, with the wrapper's definitions so far)."""
    try:
        Grammar.from_json_schema(arguments)
    except GrammarError as exc:
        raise _of(tool, exc) from None


def _draft(tools: Seq[Tool], reply_format: Any = None) -> str | None:
    """The ``$schema`` the functions' parameters (and ``reply_format``) name (None: the
    latest draft, as a schema that names none is read).

    Raises:
        GrammarError: they are of different drafts (one wrapper schema holds them all).
    """
    import jsonschema

    schemas = [constraint(t) for t in tools]
    if isinstance(reply_format, dict):
        schemas.append(reply_format)
    named = {s.get("$schema") if isinstance(s.get("$schema"), str) else None for s in schemas}
    latest = jsonschema.validators.validator_for({})
    drafts = {
        latest if d is None else jsonschema.validators.validator_for({"$schema": d}) for d in named
    }
    if len(drafts) > 1:
        raise GrammarError(
            "the functions' parameters are of different JSON Schema drafts ($schema "
            f"{sorted(map(str, named))}, None: the latest): give them all one draft"
        )
    return next((d for d in named if d is not None), None)


# Keywords whose values are data, not schemas: no $ref or anchor inside them is one.
_DATA = frozenset(["const", "enum", "default", "examples"])


def _rehome(params: dict[str, Any], where: str, id_key: str, draft: str | None) -> Any:
    """A copy of a function's parameters that works at ``#{where}`` of another document (whose
    draft is ``draft``): made one document first (:func:`bundle_schema`: refs to anchors, to
    embedded resources and through the root's ``$id`` become JSON pointers), whose pointers
    then point under ``where``; the root's ``$id`` and ``$schema`` are dropped."""
    one = bundle_schema(params if draft is None else {"$schema": draft, **params})

    def walk(node: Any, top: bool, names: bool = False) -> Any:
        """``node`` rehomed (``names``: an object of subschemas by name, not a schema)."""
        if isinstance(node, list):
            return [walk(item, False) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if names:
                out[key] = walk(value, False)
            elif top and key in ("$schema", id_key):
                continue
            elif key in _DATA:
                out[key] = value
            elif key == "$ref" and isinstance(value, str):
                out[key] = value
                if value[:2] in ("#", "#/") and not unresolved_ref(value):
                    out[key] = f"#{where}{value[1:]}"
                elif not unresolved_ref(value):  # (a bundle's other references resolve nowhere)
                    out[key] = unresolved_mark(value)
            else:
                out[key] = walk(value, False, key in BY_NAME)
        return out

    return walk(one, True)


def starts_call(text: str, parallel: bool) -> bool:
    """Whether a reply (so far) is calls rather than text: calls start with ``{``, or with
    ``parallel`` ``[`` for several; text does not start so (see :func:`grammar`)."""
    return text.startswith(tuple(_call_starts(parallel)))


def parse_calls(
    text: str, parallel: bool, names: Collection[str] | None = None
) -> tuple[ToolCall, ...] | None:
    """The reply as calls, each with a new id, or None when it is text (or calls cut short,
    or JSON that is not calls: with ``names``, calls name one of them)."""
    if not starts_call(text, parallel):
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(
        isinstance(v, dict)
        and set(v) == {"name", "arguments"}
        and isinstance(v["name"], str)
        and isinstance(v["arguments"], dict)
        and (names is None or v["name"] in names)
        for v in values
    ):
        return None
    return tuple(ToolCall.new(v["name"], v["arguments"]) for v in values)
