"""Function calling: OpenAI's ``tools`` and ``tool_choice``, with calls that always parse.

The model is told the functions in the system message and asked to call one by replying with
only ``{"name": ..., "arguments": ...}``, or several at once with a JSON array of those (unless
``parallel_tool_calls`` is false). The reply is constrained so that every call is valid: with
``tool_choice`` ``"required"`` or a named function it must be calls whose arguments validate
against their function's ``parameters``; with ``"auto"`` it is either such calls (a reply that
starts with ``{``, or ``[`` for several) or text that starts with neither. A reply that is
calls comes back as ``tool_calls`` with ``finish_reason`` ``"tool_calls"``.

Earlier turns go back into the prompt in the same shapes: an assistant's calls as that JSON,
a tool's result as a user message naming the function (chat templates differ in the roles
they know; every one knows ``user``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

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


def instructions(tools: list[Tool], required: bool, parallel: bool = False) -> str:
    """The system message's text that tells the model the functions and how to call them."""
    lines = ["You can call these functions:"]
    for tool in tools:
        fn = tool.function
        entry: dict[str, Any] = {"name": fn.name}
        if fn.description:
            entry["description"] = fn.description
        entry["parameters"] = fn.parameters or {"type": "object"}
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines.append(
        'To call a function, reply with only a JSON object: {"name": <the function\'s name>, '
        '"arguments": <an object of its parameters>}.'
        + (" To call several at once, reply with only a JSON array of them." if parallel else "")
        + (" Reply with a function call." if required else " Otherwise reply in text.")
    )
    return "\n".join(lines)


def grammar(tools: list[Tool], required: bool, parallel: bool = False) -> lcgen.Grammar:
    """The reply's constraint: a call of one of ``tools`` (or, with ``parallel``, a JSON array
    of 1 to ``MAX_PARALLEL`` calls), or (unless ``required``) text that does not start as
    calls do.

    Raises:
        lcgen.GrammarError: a function's parameters are not a JSON Schema lcgen supports.
    """
    calls = []
    for tool in tools:
        params = tool.function.parameters or {"type": "object"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = one
    if parallel:
        several = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL}
        schema = {"anyOf": [one, several]}
    call = lcgen.Grammar.from_json_schema(schema)
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


def prompt_messages(
    messages: list[dict[str, Any]], tools: list[Tool], required: bool, parallel: bool = False
) -> list[dict[str, str]]:
    """Messages for the chat template: the tools described in the (first) system message,
    calls and results of earlier turns written out as text."""
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
        told = instructions(tools, required, parallel)
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


def parse_calls(text: str, parallel: bool) -> list[dict[str, Any]] | None:
    """The reply as OpenAI tool calls, or None when it is text (or calls cut short)."""
    if not starts_call(text, parallel):
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(
        isinstance(v, dict) and set(v) == {"name", "arguments"} for v in values
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
