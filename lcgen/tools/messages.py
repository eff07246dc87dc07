"""Chat messages for the template: checked, the functions told in the system message, and the
calls and results of earlier turns written out as text.

The model is told the functions in the (first) system message and asked to call one by
replying with only ``{"name": ..., "arguments": ...}``, or several at once with a JSON array
of those. Earlier turns go back into the prompt in the same shapes: an assistant's calls as
that JSON, a tool's result as a user message naming the function (chat templates differ in the
roles they know; every one knows ``user``).
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections import Counter
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

from lcgen.decoding.results import ToolCall
from lcgen.errors import warn
from lcgen.tools.define import Tool
from lcgen.tools.schema import parameters

# Message keys that say a turn calls functions or answers a call: written out as text.
_TOOL_KEYS = ("tool_calls", "tool_call_id")


def check_messages(messages: object) -> list[dict[str, Any]]:
    """Chat messages as dicts, each with a str role and content (OpenAI's list of text parts,
    ``[{"type": "text", "text": ...}]``, is joined into one). An assistant message may carry
    ``tool_calls`` (:class:`~lcgen.ToolCall` s or OpenAI's call dicts) with content None; a
    ``"tool"`` message answers one by its ``tool_call_id``.

    Raises:
        TypeError: not a list of mappings (a lone string is named), or a call of another shape.
        ValueError: no message, a message without a str role or content, ``tool_calls`` on
            another role than the assistant's, or a tool message without ``tool_call_id``.
    """
    if isinstance(messages, str) or not isinstance(messages, Seq):
        raise TypeError(
            f"chat takes a list of messages, got {messages!r:.200}: use "
            "[{'role': 'user', 'content': ...}]"
        )
    if not messages:
        raise ValueError("chat takes at least one message, got []")
    return [_checked(i, message) for i, message in enumerate(messages)]


def _checked(i: int, message: object) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"chat message {i} is not a mapping: {message!r:.200}")
    out = dict(message)
    parts = out.get("content")
    if isinstance(parts, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in parts
    ):
        out["content"] = "".join(p["text"] for p in parts)
    calls = out.get("tool_calls")
    if calls is not None:
        if out.get("role") != "assistant":
            raise ValueError(f"chat message {i} has tool_calls, which only an assistant's has")
        if isinstance(calls, str | Mapping) or not isinstance(calls, Seq):
            raise TypeError(f"chat message {i}: tool_calls is a list of calls, got {calls!r:.200}")
        for call in calls:
            _written(call, i)
        if calls and out.get("content") is None:
            out["content"] = ""
    if out.get("role") == "tool" and not isinstance(out.get("tool_call_id"), str):
        raise ValueError(
            f"chat message {i} is a tool message without a str tool_call_id (the id of the "
            f"call it answers): {message!r:.200}"
        )
    for key in ("role", "content"):
        if not isinstance(out.get(key), str):
            raise ValueError(
                f"chat message {i} needs a str {key!r} (or, for content, a list of "
                f"text parts): {message!r:.200}"
            )
    role = out["role"]
    if role == "developer":  # OpenAI's newer name for the system message, which templates know
        out["role"] = "system"
    elif role not in _ROLES and (close := difflib.get_close_matches(role, _ROLES, n=1)):
        warn(f"chat message {i} has the role {role!r}: did you mean {close[0]!r}?")
    return out


# Roles chat templates know (a template may take others: those close to one of these warn).
_ROLES = ("system", "user", "assistant", "tool", "developer")


class _Written(NamedTuple):
    """A call of an earlier turn, as the prompt writes it."""

    id: str
    name: str
    arguments: Any  # parsed JSON; the text as given where it is not JSON


def _written(call: object, i: int = 0) -> _Written:
    """A call of an assistant message: a ToolCall, or OpenAI's dict (``arguments`` as JSON
    text, or as the object itself).

    Raises:
        TypeError: another shape (named, with the message's index ``i``).
    """
    if isinstance(call, ToolCall):
        return _Written(call.id, call.name, call.arguments)
    function = call.get("function") if isinstance(call, Mapping) else None
    if (
        isinstance(call, Mapping)
        and call.get("type", "function") == "function"
        and isinstance(call.get("id"), str)
        and isinstance(function, Mapping)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str | Mapping)
    ):
        arguments = function["arguments"]
        if isinstance(arguments, str):
            # not JSON, or nested too deep to read: written as given
            with contextlib.suppress(json.JSONDecodeError, RecursionError):
                arguments = json.loads(arguments)
        return _Written(call["id"], function["name"], arguments)
    raise TypeError(
        f"chat message {i}: a tool call is an lcgen.ToolCall or {{'id': ..., 'type': "
        f"'function', 'function': {{'name': ..., 'arguments': <JSON text>}}}}, got {call!r:.200}"
    )


def instructions(
    tools: Seq[Tool], required: bool, parallel: bool = False, formatted: bool = False
) -> str:
    """The system message's text that tells the model the functions and how to call them
    (and, ``formatted``, that a reply that is not calls is JSON: a response_format's)."""
    lines = ["You can call these functions:"]
    for tool in tools:
        entry: dict[str, Any] = {"name": tool.name}
        if tool.description:
            entry["description"] = tool.description
        entry["parameters"] = parameters(tool)
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


def _join_user_turn(out: list[dict[str, Any]], text: Any) -> bool:
    """Add ``text`` to the user turn that ends ``out`` (templates such as Gemma's, Mistral's
    and Llama 2's refuse two user turns in a row); False where either is not plain text
    (content parts), which then stays a turn of its own."""
    last = out[-1]
    if not (isinstance(last["content"], str) and isinstance(text, str)):
        return False
    out[-1] = {**last, "content": f"{last['content']}\n\n{text}"}
    return True


def prompt_messages(
    messages: Seq[Mapping[str, Any]],
    tools: Seq[Tool] = (),
    required: bool = False,
    parallel: bool = False,
    formatted: bool = False,
) -> list[dict[str, Any]]:
    """Messages for the chat template: the tools described in the (first) system message,
    calls and results of earlier turns written out as text (``formatted``: a reply that is
    not calls follows a response_format). Other keys of a message are kept. Results, and a
    user message after them, go into one user turn (chat templates that check that the roles
    alternate refuse two in a row).

    Raises:
        TypeError: a call of an assistant message is of another shape (see
            :func:`check_messages`).
        ValueError: a tool message answers a call that no assistant message before it made.
    """
    names: dict[str, str] = {}  # call id -> how its result names it
    out: list[dict[str, Any]] = []
    result_at = -1  # the index in out of the last user turn that holds a result
    for i, message in enumerate(messages):
        role, text = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [_written(call, i) for call in message["tool_calls"]]
            # A result names its call: by the function, and where the message called it more
            # than once, by its arguments too (results may come back in any order).
            count = Counter(call.name for call in calls)
            names.update(
                (
                    call.id,
                    f"{call.name} (called with {json.dumps(call.arguments, ensure_ascii=False)})"
                    if count[call.name] > 1
                    else call.name,
                )
                for call in calls
            )
            values = [{"name": call.name, "arguments": call.arguments} for call in calls]
            written = json.dumps(values[0] if len(values) == 1 else values, ensure_ascii=False)
            text = f"{text}\n{written}" if text else written
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in names:
                raise ValueError(
                    f"chat message {i} answers the call {call_id!r}, which no assistant message "
                    f"before it made (their calls: {sorted(names) or 'none'})"
                )
            role, text = "user", f"The function {names[call_id]} returned: {text}"
            if out and out[-1]["role"] == "user" and _join_user_turn(out, text):
                result_at = len(out) - 1
                continue
            result_at = len(out)
        elif role == "user" and 0 <= result_at == len(out) - 1 and _join_user_turn(out, text):
            continue  # (a question after the results: the same turn)
        kept = {key: value for key, value in message.items() if key not in _TOOL_KEYS}
        out.append({**kept, "role": role, "content": text})
    if tools:
        told = instructions(tools, required, parallel, formatted)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{told}"}
        else:
            out.insert(0, {"role": "system", "content": told})
    return out
