"""A chat's tool options made into one value at the edge: :class:`ToolPlan` (what the prompt
tells, what the reply may be, how it is read back, whole or streamed)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any, Literal

from lcgen.constrain import Grammar
from lcgen.decoding.results import Chunk, Text, cut_reason
from lcgen.errors import IncompleteOutputError
from lcgen.tools.define import Tool, active, tool_list
from lcgen.tools.messages import prompt_messages
from lcgen.tools.schema import grammar, parse_calls, starts_call

# The generation options that constrain a reply: tools make their own constraint.
_CONSTRAINTS = ("schema", "grammar", "choice", "regex")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The functions a chat reply may call, and how.

    Attributes:
        tools: the functions the reply may call (one where ``tool_choice`` names it).
        required: the reply must be calls (``tool_choice`` ``"required"`` or a name); else
            calls or text.
        parallel: a reply may call several at once (a JSON array of calls).
        reply_format: a JSON Schema that a reply that is not calls follows (the server's
            ``response_format``); None: text.
    """

    tools: tuple[Tool, ...]
    required: bool = False
    parallel: bool = True
    reply_format: Any = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.name for tool in self.tools)

    def messages(self, messages: Seq[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages for the chat template, the functions told (see
        :func:`~lcgen.tools.prompt_messages`)."""
        formatted = self.reply_format is not None
        return prompt_messages(messages, self.tools, self.required, self.parallel, formatted)

    def grammar(self, whitespace: Literal["flexible", "compact"] = "flexible") -> Grammar:
        """The reply's constraint (see :func:`~lcgen.tools.grammar`), its JSON of
        ``whitespace`` (a chat's ``json_whitespace``).

        Raises:
            GrammarError: a function's parameters are not a JSON Schema lcgen supports.
            ValueError: another ``whitespace``.
        """
        return grammar(
            self.tools, self.required, self.parallel, self.reply_format, whitespace=whitespace
        )

    def reply(self, text: Text) -> Text:
        """The generated ``text`` as the chat's reply: with its calls in ``tool_calls`` (and
        the text ``""``) where it is calls, else as it is."""
        calls = parse_calls(text, self.parallel, self.names)
        return text if calls is None else text.calling(calls)

    def stream(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        """The generated ``chunks`` as the chat reply's stream. A reply that is text streams
        as it comes. One that is calls (its first character says so) streams no text: its
        chunks come with ``text`` ``""`` (their tokens and log-probabilities kept), and the
        last carries the calls in ``tool_calls`` and ``finish_reason`` ``"tool_calls"``; so the
        stream joined (:meth:`Text.of`) is :meth:`reply` of the whole text. With a
        ``reply_format``, a reply that starts as calls but is not (JSON of the format) comes
        whole in its last chunk.

        Raises:
            IncompleteOutputError: the calls were cut short (max_tokens, a stop string or
                token) before they were complete; the partial text is on the exception.
        """
        held = ""  # a reply that is calls, not streamed
        chunks = iter(chunks)
        for chunk in chunks:
            if not held and chunk.text and not starts_call(chunk.text, self.parallel):
                yield chunk
                yield from chunks  # text
                return
            held += chunk.text
            yield replace(chunk, text="") if chunk.finish_reason is None else self._end(chunk, held)

    def _end(self, last: Chunk, held: str) -> Chunk:
        """The last chunk of a reply that is calls (or, with a ``reply_format``, JSON)."""
        calls = parse_calls(held, self.parallel, self.names)
        if calls is not None:
            return replace(last, text="", finish_reason="tool_calls", tool_calls=calls)
        if not held or self.reply_format is not None:
            return replace(last, text=held)
        reason = cut_reason(last.finish_reason, last.stop)
        raise IncompleteOutputError(
            f"the reply's tool call is incomplete: {reason} ({len(held)} characters)"
            f"{': raise max_tokens' * (last.finish_reason == 'length')}",
            held,
        )


def make_tool_plan(
    tools: object, tool_choice: object = "auto", parallel_tool_calls: object = True
) -> ToolPlan | None:
    """Check a chat's tool options and make them into a :class:`ToolPlan`; None where the reply
    calls nothing (no tools, or ``tool_choice="none"``).

    Args:
        tools: a list of tools (see :meth:`lcgen.Tool.of`), or None.
        tool_choice: ``"auto"``, ``"required"``, ``"none"``, a function's name or OpenAI's
            ``{"type": "function", "function": {"name": ...}}``.
        parallel_tool_calls: whether one reply may call several functions.

    Raises:
        TypeError: an option of the wrong type, or an item of ``tools`` that is not a tool
            (named).
        ValueError: two tools of one name, a bad name, or a tool_choice that names no tool
            (or ``"required"`` without tools).
    """
    if not isinstance(parallel_tool_calls, bool):
        raise TypeError(f"parallel_tool_calls must be True or False, got {parallel_tool_calls!r}")
    listed = [] if tools is None else tool_list(tools)
    callable_tools, required = active(listed, tool_choice)
    if not callable_tools:
        return None
    return ToolPlan(tuple(callable_tools), required, parallel_tool_calls)


def check_options(plan: ToolPlan | None, schema: object, options: Mapping[str, Any]) -> None:
    """Refuse a constraint given with tools: the reply is calls or text, under the tools' own
    grammar (a chat with ``tool_choice="none"`` takes one).

    Raises:
        ValueError: ``schema``, ``grammar``, ``choice`` or ``regex`` given with tools.
    """
    if plan is None:
        return
    given = {"schema": schema, **options}
    named = [name for name in _CONSTRAINTS if given.get(name) is not None]
    if named:
        raise ValueError(
            f"tools cannot be combined with {', '.join(named)} in Model.chat: the reply is "
            "calls or text under the tools' own grammar, not a value of another constraint "
            f"(with tool_choice='none' the tools are left out and {named[0]} applies)"
        )
