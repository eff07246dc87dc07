"""Function calling: OpenAI's ``tools`` and ``tool_choice``, with calls that always parse.

The model is told the functions in the system message and asked to call one by replying with
only ``{"name": ..., "arguments": ...}``, or several at once with a JSON array of those (unless
``parallel_tool_calls`` is false). The reply is constrained so that every call is valid: with
``tool_choice`` ``"required"`` or a named function it must be calls whose arguments validate
against their function's ``parameters``; with ``"auto"`` it is either such calls (a reply that
starts with ``{``, or ``[`` for several) or text that starts with neither. A reply that is
calls comes back as ``tool_calls`` with ``finish_reason`` ``"tool_calls"``. With a
``response_format`` too, the reply that is not calls is JSON text valid for its schema.

Arguments are always a JSON object: a function without ``parameters`` takes none (``{}``),
and parameters that name no type are still an object. Each function's parameters sit in the
reply's schema under a name of their own, their root-relative ``$ref`` s rewritten to point
there, so ``$defs``, ``definitions``, ``#`` and a root ``$id`` work as they do on their own.

Earlier turns go back into the prompt in the same shapes: an assistant's calls as that JSON,
a tool's result as a user message naming the function (chat templates differ in the roles
they know; every one knows ``user``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from typing import Annotated, Any, Literal
from urllib.parse import quote, unquote, urldefrag, urljoin

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

import lcgen

MAX_TOOLS = 128
MAX_PARALLEL = 16  # calls in one reply
_TEXT_RULE = "lcgen-reply-text"


def _call_starts(parallel: bool) -> str:
    """The characters a reply that is calls starts with: ``{`` (one), ``[`` (several)."""
    return "{[" if parallel else "{"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


def active(tools: list[Tool] | None, choice: ToolChoice | None) -> list[Tool]:
    """The tools the reply may call: none without tools or with ``tool_choice: "none"``, the
    named one, or all.

    Raises:
        ValueError: the named function is not among the tools.
    """
    if not tools or choice == "none":
        return []
    if isinstance(choice, NamedChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            names = [t.function.name for t in tools]
            raise ValueError(f"names {choice.function.name!r}, which is not in tools {names}")
        return named
    return tools


def instructions(
    tools: list[Tool], required: bool, parallel: bool = False, formatted: bool = False
) -> str:
    """The system message's text that tells the model the functions and how to call them
    (and, ``formatted``, that a reply that is not calls is JSON: a response_format's)."""
    lines = ["You can call these functions:"]
    for tool in tools:
        fn = tool.function
        entry: dict[str, Any] = {"name": fn.name}
        if fn.description:
            entry["description"] = fn.description
        entry["parameters"] = parameters(fn)
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines.append(
        'To call a function, reply with only a JSON object: {"name": <the function\'s name>, '
        '"arguments": <an object of its parameters>}.'
        + (" To call several at once, reply with only a JSON array of them." if parallel else "")
        + _otherwise(required, formatted)
    )
    return "\n".join(lines)


def _otherwise(required: bool, formatted: bool) -> str:
    if required:
        return " Reply with a function call."
    if formatted:
        return " Otherwise reply with only JSON in the format asked for."
    return " Otherwise reply in text."


def grammar(
    tools: list[Tool], required: bool, parallel: bool = False, reply_format: Any = None
) -> lcgen.Grammar:
    """The reply's constraint: a call of one of ``tools`` (or, with ``parallel``, a JSON array
    of 1 to ``MAX_PARALLEL`` calls), or (unless ``required``) text that does not start as
    calls do, or with a ``reply_format`` (the JSON Schema of ``response_format``) JSON text
    valid against it.

    Raises:
        lcgen.GrammarError: a function's parameters are not a JSON Schema lcgen supports.
    """
    if reply_format is not None and not required:
        return lcgen.Grammar.from_json_schema(calls_schema(tools, parallel, reply_format))
    call = lcgen.Grammar.from_json_schema(calls_schema(tools, parallel))
    if required:
        return call
    # The schema's grammar defines its root on the first line and never refers to it.
    first, rest = call.gbnf.split("\n", 1)
    assert first.startswith("root ::= ") and not re.search(rf"^{_TEXT_RULE} ", rest, re.M)
    body = first.removeprefix("root ::= ")
    not_a_call = "[^" + _call_starts(parallel).replace("[", "\\[") + " \\t\\n\\r]"
    return lcgen.Grammar(
        f"root ::= ({body}) | {_TEXT_RULE}\n{rest}{_TEXT_RULE} ::= {not_a_call} .*\n"
    )


NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_OLD_DRAFTS = ("Draft3Validator", "Draft4Validator", "Draft6Validator", "Draft7Validator")


def parameters(fn: FunctionDef) -> dict[str, Any]:
    """A function's ``parameters``; none given: no parameters (OpenAI's meaning), an empty
    object that takes no properties."""
    if fn.parameters is None:
        return dict(NO_PARAMETERS)
    return fn.parameters


def calls_schema(
    tools: list[Tool], parallel: bool = False, reply_format: Any = None
) -> dict[str, Any]:
    """The JSON Schema of a reply that is calls: one (or, with ``parallel``, an array of 1 to
    ``MAX_PARALLEL``), each ``{"name": <a function's name>, "arguments": <an object valid for
    its parameters>}``; with ``reply_format`` (a JSON Schema), calls or a value of it.

    Each function's parameters go under the wrapper's definitions (``tool0``, ``tool1``, ...),
    so that their root-relative ``$ref`` s (``#``, ``#/$defs/...``, ``#/definitions/...``,
    pointers into their properties, anchors, refs through a root ``$id``) are rewritten to
    point there; the root ``$id`` is dropped. The wrapper is of the draft they name.

    Raises:
        lcgen.GrammarError: parameters that cannot describe an object, or functions whose
            parameters name different JSON Schema drafts.
    """
    draft = _draft(tools, reply_format)
    validator = jsonschema.validators.validator_for({} if draft is None else {"$schema": draft})
    old = validator.__name__ in _OLD_DRAFTS  # $defs is "definitions", anchors are "$id"s
    id_key = "id" if validator.__name__ in _OLD_DRAFTS[:2] else "$id"
    defs_key = "definitions" if old else "$defs"
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        fn = tool.function
        params = parameters(fn)
        named = params.get("type")
        if (
            named is not None
            and named != "object"
            and not (isinstance(named, list) and "object" in named)
        ):
            raise lcgen.GrammarError(
                f"the parameters of function {fn.name!r} must describe an object "
                f'("type": "object"), not type {named!r}: arguments are always a JSON object'
            )
        key = f"tool{i}"
        defs[key] = _rehome(params, f"/{defs_key}/{key}", id_key, old)
        target = {"$ref": f"#/{defs_key}/{key}"}
        # Arguments are always an object, whatever the parameters say (or leave out).
        arguments = target if named == "object" else {"type": "object", "allOf": [target]}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [fn.name]}, "arguments": arguments},
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
            reply_format = _rehome(reply_format, f"/{defs_key}/format", id_key, old)
        defs["format"] = reply_format
        schema = {"anyOf": [schema, {"$ref": f"#/{defs_key}/format"}]}
    out = {**schema, defs_key: defs}
    if draft is not None:
        out = {"$schema": draft, **out}
    return out


def _draft(tools: list[Tool], reply_format: Any = None) -> str | None:
    """The ``$schema`` the functions' parameters (and ``reply_format``) name (None: the
    latest draft, as a schema that names none is read).

    Raises:
        lcgen.GrammarError: they are of different drafts (one wrapper schema holds them all).
    """
    schemas = [parameters(t.function) for t in tools]
    if isinstance(reply_format, dict):
        schemas.append(reply_format)
    named = {s.get("$schema") if isinstance(s.get("$schema"), str) else None for s in schemas}
    latest = jsonschema.validators.validator_for({})
    drafts = {
        latest if d is None else jsonschema.validators.validator_for({"$schema": d}) for d in named
    }
    if len(drafts) > 1:
        raise lcgen.GrammarError(
            "the functions' parameters are of different JSON Schema drafts ($schema "
            f"{sorted(map(str, named))}, None: the latest): give them all one draft"
        )
    return next((d for d in named if d is not None), None)


# Keywords whose values are data, not schemas: no $ref or anchor inside them is one.
_DATA = frozenset(["const", "enum", "default", "examples"])


def _rehome(params: dict[str, Any], where: str, id_key: str, old: bool) -> Any:
    """A copy of a function's parameters that works at ``#{where}`` of another document:
    root-relative refs (``#``, ``#/...``, and refs through the root's ``$id``) point under
    ``where``, refs to anchors point to where the anchor is (two functions' anchors may share
    a name), the root's ``$id`` and ``$schema`` are dropped."""
    root_id = params.get(id_key)
    base = root_id if isinstance(root_id, str) and not root_id.startswith("#") else ""
    anchors: dict[str, str] = {}  # name: a JSON pointer, as a URI fragment writes it

    def find(node: Any, pointer: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                find(item, f"{pointer}/{i}")
            return
        if not isinstance(node, dict):
            return
        anchor = node.get(id_key) if old else node.get("$anchor")
        if isinstance(anchor, str) and (anchor.startswith("#") or not old):
            anchors.setdefault(anchor.removeprefix("#") if old else anchor, pointer)
        for key, value in node.items():
            if key not in _DATA:
                part = quote(str(key).replace("~", "~0").replace("/", "~1"), safe="$")
                find(value, f"{pointer}/{part}")

    find(params, "")

    def ref(value: str) -> str:
        if value.startswith("#"):
            frag = value[1:]
        elif base and urldefrag(urljoin(base, value))[0] == urldefrag(base)[0]:
            frag = urldefrag(urljoin(base, value))[1]
        else:
            return value  # another document: the converter says it is not supported
        if frag == "" or frag.startswith("/"):
            return f"#{where}{frag}"
        name = unquote(frag)
        return f"#{where}{anchors[name]}" if name in anchors else value

    def walk(node: Any, top: bool) -> Any:
        if isinstance(node, list):
            return [walk(item, False) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if top and key == "$schema":
                continue
            if top and key == id_key and not (old and str(value).startswith("#")):
                continue  # (drafts up to 7 write an anchor as an $id that is a bare fragment)
            if key in _DATA:
                out[key] = value
            elif key == "$ref" and isinstance(value, str):
                out[key] = ref(value)
            else:
                out[key] = walk(value, False)
        return out

    return walk(params, True)


def prompt_messages(
    messages: list[dict[str, Any]],
    tools: list[Tool],
    required: bool,
    parallel: bool = False,
    formatted: bool = False,
) -> list[dict[str, str]]:
    """Messages for the chat template: the tools described in the (first) system message,
    calls and results of earlier turns written out as text (``formatted``: a reply that is
    not calls follows a response_format)."""
    names: dict[str, str] = {}  # call id -> function name
    out: list[dict[str, str]] = []
    for message in messages:
        role, text = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                names[call.id] = call.function.name
                calls.append(_call_value(call))
            written = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            text = f"{text}\n{written}" if text else written
        elif role == "tool":
            name = names.get(message.get("tool_call_id") or "", "a function")
            role, text = "user", f"The function {name} returned: {text}"
        out.append({"role": role, "content": text})
    if tools:
        told = instructions(tools, required, parallel, formatted)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{told}"}
        else:
            out.insert(0, {"role": "system", "content": told})
    return out


def _call_value(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested too deep to read
        arguments = call.function.arguments
    return {"name": call.function.name, "arguments": arguments}


def starts_call(text: str, parallel: bool) -> bool:
    """Whether a reply (so far) is calls rather than text: calls start with ``{``, or with
    ``parallel`` ``[`` for several; text does not start so (see :func:`grammar`)."""
    return text.startswith(tuple(_call_starts(parallel)))


def parse_calls(
    text: str, parallel: bool, names: Collection[str] | None = None
) -> list[dict[str, Any]] | None:
    """The reply as OpenAI tool calls, or None when it is text (or calls cut short, or JSON
    that is not calls: with ``names``, calls name one of them)."""
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
        and (names is None or v["name"] in names)
        for v in values
    ):
        return None
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {
                "name": v["name"],
                "arguments": json.dumps(v["arguments"], ensure_ascii=False),
            },
        }
        for v in values
    ]
