"""OpenAI's response and chunk objects, built from lcgen's chunks.

A :class:`Reply` knows one request's id, model name and kind (chat or text completion); each
choice's output is gathered in an :class:`Output` as its pieces arrive, both for a streamed
reply (an event per piece) and for a whole one.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import lcgen
from lcgen import Chunk, TokenLogprob
from lcgen.tools import parse_calls, starts_call

# lcgen's finish reasons as OpenAI's: "retries" (banned phrases, or items of a uniqueItems
# array that kept repeating others, rejected more than max_retries candidates) is the closest
# OpenAI has to a refusal by a filter.
FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "retries": "content_filter",
    "tool_calls": "tool_calls",
}

Kind = Literal["chat", "text"]
# An echoed prompt (``echo`` on /v1/completions): its text and, with log-probabilities, its
# first token and the log-probabilities of the others.
# An echoed prompt: its text, its tokens' log-probabilities (the first token's id and the
# others' entries), and the text of its last token where token healing re-creates it.
Echo = tuple[str, tuple[int, list[TokenLogprob]] | None, str]


@dataclass(slots=True)
class Output:
    """One choice as it grows: text, tokens, log-probabilities, how it ended."""

    index: int
    parts: list[str] = field(default_factory=list)
    n_chars: int = 0
    n_tokens: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    _calls: list[dict[str, Any]] | None = None
    start: int = 0  # where the generated text starts (after an echoed prompt)
    token_chars: int = 0  # the characters of the tokens so far (a stop string may cut them)
    # Entries of tokens whose text is still held back (a possible stop string): sent once
    # the text reaches them, dropped if a stop string cuts it first.
    held: list[dict[str, Any]] = field(default_factory=list)
    n_streamed: int = 0  # entries sent in stream chunks so far
    healed: int = 0  # characters of an echoed prompt's end that token healing re-creates

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def tool_calls(
        self, parallel: bool, names: Collection[str] | None = None
    ) -> list[dict[str, Any]] | None:
        """The finished output as tool calls of the functions ``names`` (the same ids however
        often asked), or None."""
        if self._calls is None:
            calls = parse_calls(self.text, parallel, names)
            self._calls = None if calls is None else [call.as_openai() for call in calls]
        return self._calls


class Reply:
    """The objects of one request's reply.

    Args:
        kind: ``"chat"`` (chat.completion) or ``"text"`` (text_completion).
        model_name: the model name the reply gives.
        model: for the text of tokens in log-probabilities.
        logprobs: whether the request asked for log-probabilities.
        tools: the functions a reply may call, by name (calls start with ``{``: streamed as
            one ``tool_calls`` delta when the reply ends; a reply that starts so but is not
            calls, JSON of a ``response_format``, is streamed whole at its end).
        parallel: whether a reply may be several calls (a JSON array: it starts with ``[``).
        plans: the choices' generation plans (to tell a constrained reply cut short).
        include_usage: a stream ends with a usage chunk (``stream_options.include_usage``):
            the chunks before it carry ``"usage": null``, as OpenAI's.
        fingerprint: the ``system_fingerprint`` every object carries (the model's
            :attr:`~lcgen.Model.system_fingerprint`).
    """

    def __init__(
        self,
        kind: Kind,
        model_name: str,
        model: lcgen.Model,
        logprobs: bool,
        tools: Collection[str] = (),
        parallel: bool = False,
        plans: list[lcgen.Plan] | None = None,
        include_usage: bool = False,
        fingerprint: str | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.kind, self.model_name, self.model, self.with_logprobs = (
            kind,
            model_name,
            model,
            logprobs,
        )
        self.tools, self.tool_names, self.parallel = bool(tools), frozenset(tools), parallel
        self.plans = plans or []
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    # gathering -------------------------------------------------------------------------
    def take(self, out: Output, chunk: Chunk, healed: str = "") -> list[dict[str, Any]]:
        """Add a chunk to a choice; returns its log-probability entries (empty without).

        A stop string cuts the text, not the tokens: an entry is returned once the text
        reaches its token, and entries of tokens that start past the returned text are
        dropped where a stop string ended it (they describe text the reply does not have;
        else they are tokens with no text, a special token's, returned at the end). A constrained
        choice that a stop string or token cut before it matched ends with ``"length"``, the
        reason OpenAI's clients read as cut short (``"stop"`` would pass it off as complete).
        """
        new = self._logprobs(chunk, out.token_chars) if self.with_logprobs else []
        if new and out.healed:  # the token that re-creates the healed text starts at it
            new[0]["text_offset"] -= out.healed
            out.healed = 0
        held = out.held + new
        out.token_chars += sum(len(each.text) for each in chunk.logprobs)
        out.parts.append(chunk.text)
        out.n_chars += len(chunk.text)
        out.n_tokens += len(chunk.tokens)
        entries = [e for e in held if e["text_offset"] < out.n_chars]  # offsets only grow
        out.held = held[len(entries) :]
        if chunk.finish_reason is not None:
            if chunk.stop is None:  # no stop string cut the text: tokens with none stand
                entries = held
            out.held = []  # else their text was cut
            out.finish_reason = FINISH_REASONS[chunk.finish_reason]
            if chunk.finish_reason == "stop" and self._cut_short(out, chunk, healed):
                out.finish_reason = "length"
        out.logprobs += entries
        return entries

    def _cut_short(self, out: Output, chunk: Chunk, healed: str) -> bool:
        """Whether a choice that stopped is constrained and does not match its constraint
        (after ``healed``, the prompt's text token healing had it re-create)."""
        plan = self.plans[out.index] if out.index < len(self.plans) else None
        if plan is None or plan.constraint is None:
            return False
        text = lcgen.Text(out.text[out.start :])
        text.finish_reason, text.stop, text.tokens = "stop", chunk.stop, chunk.tokens
        try:
            plan.check_complete(text, self.model.vocab, healed)
        except lcgen.IncompleteOutputError:
            return True
        return False

    def echo(
        self, out: Output, text: str, scored: tuple[int, list[TokenLogprob]] | None, healed: str
    ) -> None:
        """Start a choice with its echoed prompt (text and, when asked, log-probabilities:
        none for the first token). ``healed``: the text of its last token, which token healing
        has the generation re-create: the generated token that does is its entry (the text
        stays the prompt's, the generated text goes on after it)."""
        out.parts.append(text)
        out.n_chars += len(text)
        out.start = out.token_chars = out.n_chars
        out.healed = len(healed)
        if self.with_logprobs and scored is not None:
            first, rest = scored
            rest = rest[: len(rest) - 1] if healed else rest
            # A special token the prompt's text wrote is that text (a text prompt's special
            # tokens were read so); one it does not hold (a BOS added, a special token of
            # a prompt of ids) has none, as before.
            head = self._echoed((first,), text, 0)
            entry = {**head, "logprob": None, "top_logprobs": None}
            # Offsets count the characters each token completes (a character the first one
            # begins is the next one's).
            vocab = self.model.vocab
            first_piece = vocab.piece(first)
            after = len(head["token"]) if vocab.is_special(first) else len(_complete(first_piece))
            out.logprobs += [
                {**entry, "text_offset": 0},
                *self._entries(rest, after, echoed=text),
            ]

    def _logprobs(self, chunk: Chunk, offset: int) -> list[dict[str, Any]]:
        """An entry per token of the chunk."""
        return self._entries(chunk.logprobs, offset)

    def _entries(
        self, logprobs: Iterable[TokenLogprob], offset: int, echoed: str | None = None
    ) -> list[dict[str, Any]]:
        """An entry per token; ``echoed``: the echoed prompt's text these tokens are of (a
        special token it writes at the token's offset is that text). A top token that is
        special is named by its text (``<|im_end|>``): it wrote none, and every special token
        was the one key ``""`` of a completion's top tokens."""
        entries = []
        special = echoed is not None
        for each in logprobs:
            top = [{**self._token((t.token,), True), "logprob": t.logprob} for t in each.top]
            if echoed is None:
                token = self._token((each.token,))
            else:
                token = self._echoed((each.token,), echoed, offset)
            entry = {**token, "logprob": each.logprob, "top_logprobs": top}
            entries.append({**entry, "text_offset": offset})
            is_special = special and self.model.vocab.is_special(each.token)
            offset += len(token["token"]) if is_special else len(each.text)
        return entries

    def _echoed(self, tokens: tuple[int, ...], text: str, offset: int) -> dict[str, Any]:
        """An echoed prompt token: a special one as its text where ``text`` holds that at
        ``offset``, else none."""
        written = self._token(tokens, special=True)
        if written["token"] and text.startswith(written["token"], offset):
            return written
        return self._token(tokens)

    def _token(self, tokens: tuple[int, ...], special: bool = False) -> dict[str, Any]:
        vocab = self.model.vocab
        piece = b"".join((vocab.special_piece if special else vocab.piece)(t) for t in tokens)
        return {"token": piece.decode("utf-8", "replace"), "bytes": list(piece)}

    # objects ---------------------------------------------------------------------------
    def _object(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        out = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model_name,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if chunk and self.include_usage:
            out["usage"] = None
        return out

    def _logprobs_object(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        if self.kind == "chat":
            return {"content": [_without(e, "text_offset") for e in entries]}
        return {
            "tokens": [_text_token(e) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            # "The API will always return the logprob of the sampled token" (OpenAI's API
            # reference): a token sampled outside the top ones is added.
            "top_logprobs": [
                None
                if e["top_logprobs"] is None
                else {
                    **{_text_token(top): top["logprob"] for top in e["top_logprobs"]},
                    _text_token(e): e["logprob"],
                }
                for e in entries
            ],
            "text_offset": [e["text_offset"] for e in entries],
        }

    def _choice(
        self, index: int, text: str, entries: list[dict[str, Any]], reason: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.kind == "text":
            choice["text"] = text
        choice["logprobs"] = self._logprobs_object(entries) if entries else None
        choice["finish_reason"] = reason
        return choice

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of a choice: the assistant's role."""
        choice = self._choice(index, "", [], None)
        choice["delta"] = {"role": "assistant", "content": ""}
        return self._object([choice], True)

    @property
    def role_first(self) -> bool:
        """Whether a chat stream opens each choice with :meth:`role_chunk` at once; with tools
        it waits for the choice's first chunk (:meth:`opening`): a tool call's role comes with
        the call, ``content: null``, as OpenAI sends it."""
        return self.kind == "chat" and not self.tools

    def opening(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks that open a choice whose role waited (see :attr:`role_first`), its first
        ``chunk`` among them."""
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        if "tool_calls" in delta:
            choice["delta"] = {"role": "assistant", "content": None, **delta}
            return [chunk]
        return [self.role_chunk(choice["index"]), chunk]

    def piece_chunk(
        self, out: Output, chunk: Chunk, entries: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """A stream chunk with a piece's text (None when it has neither text nor entries, or
        the output is a tool call, sent whole at its end). ``out`` has taken the chunk."""
        if (not chunk.text and not entries) or self._holds_call(out):
            return None
        out.n_streamed += len(entries)
        choice = self._choice(out.index, chunk.text, entries, None)
        if self.kind == "chat":
            choice["delta"] = {"content": chunk.text}
        return self._object([choice], True)

    def _holds_call(self, out: Output) -> bool:
        """Whether a choice's text is held back from the stream: a tool call, sent whole at
        its end."""
        return self.tools and starts_call(out.text, self.parallel)

    def _calls(self, out: Output) -> list[dict[str, Any]] | None:
        return out.tool_calls(self.parallel, self.tool_names) if self.tools else None

    def echo_chunk(self, out: Output) -> dict[str, Any]:
        """A text stream's first chunk of a choice with an echoed prompt."""
        return self._object([self._choice(out.index, out.text, list(out.logprobs), None)], True)

    def end_chunks(self, out: Output) -> list[dict[str, Any]]:
        """The stream chunks that end a choice: what it held back (its tool calls whole, or a
        tool call cut short as the text it is, with their tokens' log-probabilities), then its
        finish reason alone, as OpenAI sends it (the client's stream helper reports a call's
        end only from a later chunk)."""
        chunks = []
        calls = self._calls(out)
        unsent = out.logprobs[out.n_streamed :]  # those of the text held back
        if calls is not None:
            choice = self._choice(out.index, "", unsent, None)
            choice["delta"] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
            chunks.append(self._object([choice], True))
        elif self.kind == "chat" and self._holds_call(out):
            choice = self._choice(out.index, "", unsent, None)
            choice["delta"] = {"content": out.text}
            chunks.append(self._object([choice], True))
        reason = "tool_calls" if calls is not None else out.finish_reason or "stop"
        choice = self._choice(out.index, "", [], reason)
        if self.kind == "chat":
            choice["delta"] = {}
        return [*chunks, self._object([choice], True)]

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The stream's last chunk with ``stream_options.include_usage``: no choices."""
        return {**self._object([], True), "usage": usage}

    def whole(self, outputs: list[Output], usage: dict[str, Any]) -> dict[str, Any]:
        """The reply when it is not streamed."""
        choices = []
        for out in outputs:
            calls = self._calls(out)
            reason = "tool_calls" if calls is not None else out.finish_reason or "stop"
            choice = self._choice(out.index, out.text, [], reason)
            choice["logprobs"] = self._logprobs_object(out.logprobs)
            if calls is not None:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            elif self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": out.text}
            choices.append(choice)
        return {**self._object(choices, False), "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _text_token(entry: dict[str, Any]) -> str:
    """A completion's token as a string, which has no ``bytes`` beside it: part of a UTF-8
    character as ``bytes:`` and its bytes escaped (``bytes:\\xf0\\x9f``), as OpenAI's API
    writes it, so such tokens stay apart (each was U+FFFD)."""
    data = bytes(entry["bytes"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _without(entry: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != key}


def _complete(piece: bytes) -> str:
    """The characters a token's bytes ``piece`` complete, at the start of a text (a character
    they only begin: none)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(piece)
