"""What generation returns: a :class:`Chunk` per step, a :class:`Text` for a whole call (with the
:class:`ToolCall` s of a chat reply that calls functions), what it cost
(:class:`GenerationStats`), and the parsed value of a schema-constrained call."""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from lcgen.constrain import Grammar
    from lcgen.errors import IncompleteOutputError
    from lcgen.vocab import Vocab

# "tool_calls": a chat reply that calls functions (``Model.chat`` and ``chat_stream`` with tools).
FinishReason = Literal["stop", "length", "retries", "tool_calls"]
# A JSON Schema (a dict, JSON text, or true / false) or a pydantic model class.
SchemaLike = Mapping[str, Any] | str | bool | type[Any]


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """What one generation cost.

    Attributes:
        tokens: tokens generated (kept in the result).
        decoded: tokens passed to ``llama_decode`` for it, pending prompt tokens and draft
            tokens included.
        redecoded: of those, the ones decoded again because a rewind dropped them (a rewind
            also re-decodes the last kept token, whose logits the next step needs).
        rewinds: rewinds done in it: by hooks, validators, banned phrases or the caller (the
            one past ``max_retries``, which removes what was rejected and ends the
            generation, is not a retry and is not counted).
        resamples: candidates redrawn because a hook returned ``Resample`` (within
            ``max_retries``).
        steps: decode steps it took (one batch each); without speculation, one per token.
        drafted: draft tokens verified (with ``speculate``).
        accepted: of those, the ones that equalled the token sampled there (each saved a
            step).
        forced: tokens a constraint forced, appended without sampling (``fast_forward``).
    """

    tokens: int = 0
    decoded: int = 0
    redecoded: int = 0
    rewinds: int = 0
    resamples: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0

    @property
    def tokens_per_step(self) -> float:
        """Tokens generated per decode step (above 1 where drafts were accepted or tokens
        were forced)."""
        return self.tokens / self.steps if self.steps else 0.0


class TopLogprob(NamedTuple):
    """One of the most likely tokens at a position: ``(token, text, logprob)``.

    Attributes:
        token: the token id.
        text: the token's own text (control tokens shown, e.g. ``"<|im_end|>"``; a piece that
            holds only part of a UTF-8 character reads U+FFFD).
        logprob: its log-probability under the model (log-softmax of the raw logits).
    """

    token: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token with its log-probability and the most likely tokens at its position.

    Attributes:
        token: the token id.
        text: the text the token adds to the output: the characters its bytes complete (``""``
            for an end-of-generation or stop token, and for a token that only starts a
            character). The texts of a generation's tokens join to its text as decoded before
            a stop string cut it.
        logprob: its log-probability under the model (log-softmax of the raw logits, before
            temperature and filters).
        top: with ``logprobs=n``, the n most likely tokens at its position, best first.
    """

    token: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one generation step produced.

    Attributes:
        text: the text that became final with this step (may be empty while a UTF-8 character
            or a possible stop string is held back).
        tokens: the token(s) sampled in this step.
        finish_reason: None while generating; ``"stop"`` (end-of-generation token, stop token
            or stop string), ``"length"`` (``max_tokens`` reached) or ``"retries"`` (hooks,
            validators or banned phrases rejected more than ``max_retries`` candidates, or
            every token was rejected) on the last chunk; ``"tool_calls"`` on the last chunk of a
            chat reply that calls functions (``Model.chat_stream`` with tools).
        stop: the stop string that ended generation, if one did.
        logprob: with ``logprobs`` set, the sampled token's log-probability under the model
            (log-softmax of the raw logits, before temperature and filters).
        top_logprobs: with ``logprobs=n``, the n most likely tokens at the position of the
            chunk's one token, best first, as :class:`TopLogprob` ``(token, text, logprob)``
            (a chunk of several tokens carries each one's in ``logprobs``).
        logprobs: with ``logprobs`` set, one :class:`TokenLogprob` per token of this chunk
            (with speculation, hooks, validators or banned phrases a chunk can release several
            tokens; ``logprob`` is then their sum).
        stats: on the last chunk of a sequence's generation, what it cost (tokens decoded,
            rewinds, resamples).
        tool_calls: on the last chunk of a streamed chat reply that calls functions, the
            calls (as :class:`Text`'s ``tool_calls``); empty elsewhere.
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    stats: GenerationStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of a function that a chat reply asked for (see ``Model.chat``'s ``tools``).

    Attributes:
        id: ``"call_"`` and 24 hex digits, new for each call: the tool message that gives its
            result names it (``tool_call_id``).
        name: the function's name.
        arguments: the arguments, parsed JSON: an object valid for the function's parameters
            (the reply was constrained to them).
    """

    id: str
    name: str
    arguments: dict[str, Any]

    @classmethod
    def new(cls, name: str, arguments: dict[str, Any]) -> ToolCall:
        """A call with a fresh id."""
        return cls("call_" + uuid.uuid4().hex[:24], name, arguments)

    def as_openai(self) -> dict[str, Any]:
        """The call in OpenAI's shape (``arguments`` as JSON text), as its API returns it and
        takes it back in an assistant message's ``tool_calls``."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


class Text(str):
    """The text a generation returned (a ``str``), with how it ended.

    Attributes:
        finish_reason: as on the last :class:`Chunk`: ``"tool_calls"`` for a chat reply that
            calls functions.
        stop: the stop string that ended it, if one did.
        tokens: the generated token ids.
        stats: what the generation cost (:class:`GenerationStats`).
        logprobs: with ``logprobs`` set, one :class:`TokenLogprob` per generated token (its
            id, text, log-probability and the most likely alternatives); None without
            ``logprobs``. A token a hook put in with ``Override`` has its log-probability
            under the model too.
        tool_calls: from a chat with ``tools``, the functions the reply calls (the text is then
            ``""``); empty when the reply is text, and on every other call's text.
    """

    finish_reason: FinishReason | None
    stop: str | None
    tokens: tuple[int, ...]
    stats: GenerationStats
    logprobs: tuple[TokenLogprob, ...] | None
    tool_calls: tuple[ToolCall, ...] = ()

    @classmethod
    def of(cls, chunks: Iterable[Chunk], logprobs: bool | None = None) -> Text:
        """Join a generation's chunks; ``logprobs``: whether they were asked for (None: where
        every token has an entry), so a generation that kept no token has ``()``."""
        parts: list[str] = []
        tokens: list[int] = []
        entries: list[TokenLogprob] = []
        each_token_has_one = True
        last: Chunk | None = None
        for last in chunks:
            if not isinstance(last, Chunk):
                raise TypeError(f"Text.of joins a generation's Chunks, got {last!r:.60}")
            parts.append(last.text)
            tokens.extend(last.tokens)
            entries.extend(last.logprobs)
            each_token_has_one &= len(last.logprobs) == len(last.tokens)
        text = cls("".join(parts))
        text.finish_reason = last.finish_reason if last else "length"
        text.stop = last.stop if last else None
        text.tokens = tuple(tokens)
        text.stats = (last.stats if last else None) or GenerationStats()
        if logprobs is None:
            logprobs = bool(entries) and each_token_has_one
        text.logprobs = tuple(entries) if logprobs else None
        text.tool_calls = last.tool_calls if last else ()
        return text

    def calling(self, calls: Iterable[ToolCall]) -> Text:
        """This result as a chat reply that calls functions: the text ``""``, the calls in
        ``tool_calls`` and ``finish_reason`` ``"tool_calls"`` (its stop string, tokens, stats
        and log-probabilities kept)."""
        out = Text("")
        out.__dict__.update(self.__dict__)
        out.tool_calls, out.finish_reason = tuple(calls), "tool_calls"
        return out


def check_complete(
    text: Text,
    constraint: Grammar | None,
    vocab: Vocab,
    stop_tokens: Collection[int] = (),
    healed: str = "",
) -> None:
    """Raise when a constrained generation stopped before its output matched the constraint
    (a cut choice, a half-written JSON value, a stop string or one of ``stop_tokens`` part way):
    it never comes back as if it were complete. ``healed``: the prompt's text that token
    healing had the generation re-create (the constraint matched it before ``text``).

    Raises:
        IncompleteOutputError: with the partial text.
    """
    error = incomplete(text, constraint, vocab, stop_tokens, healed)
    if error is not None:
        raise error


def incomplete(
    text: Text,
    constraint: Grammar | None,
    vocab: Vocab,
    stop_tokens: Collection[int] = (),
    healed: str = "",
) -> IncompleteOutputError | None:
    """The error saying how a constrained generation was cut short, or None when its output
    matches the constraint (or there is none); see :func:`check_complete`."""
    from lcgen.errors import GrammarError, IncompleteOutputError

    if constraint is None:
        return None
    by_token = bool(text.tokens) and text.tokens[-1] in stop_tokens
    if text.finish_reason == "stop" and not text.stop and not by_token:
        # an end token (allowed only where the grammar is complete), or the grammar could
        # only end there
        return None
    try:
        if constraint.accepts(vocab, healed + str(text)):
            # A cut where it could end: complete, unless max_tokens cut a value that could
            # go on (-1 of -10000, "yes" of "yes please"; see Grammar.values).
            cut = text.finish_reason == "length" and constraint.values
            if not cut or not _goes_on(constraint, vocab, text.tokens):
                return None
            return IncompleteOutputError(
                "the output may be incomplete: generation reached max_tokens where its "
                f"constraint allows more ({len(str(text))} characters): raise max_tokens",
                str(text),
            )
    except GrammarError:
        pass
    stop_token = text.tokens[-1] if by_token else None
    return IncompleteOutputError(
        f"the output is incomplete: {cut_reason(text.finish_reason, text.stop, stop_token)} "
        f"before it matched its constraint ({len(str(text))} characters)"
        f"{': raise max_tokens' * (text.finish_reason == 'length')}",
        str(text),
    )


def _goes_on(constraint: Grammar, vocab: Vocab, tokens: Seq[int]) -> bool:
    """Whether ``constraint``, after the generated ``tokens``, allows a token other than an
    end of generation."""
    with constraint.state(vocab) as state:
        if not all(state.try_accept(t) for t in tokens):
            return False
        allowed = state.allowed()
        allowed[list(state.end_tokens)] = False
        return bool(allowed.any())


def cut_reason(finish_reason: str | None, stop: str | None, stop_token: int | None = None) -> str:
    """Why a generation ended before its output was complete, in words (for errors)."""
    if stop:
        return f"the stop string {stop!r} cut it"
    if finish_reason == "length":
        return "generation reached max_tokens"
    if finish_reason == "retries":
        return "the retries ran out"
    return f"the stop token{'' if stop_token is None else f' {stop_token}'} (stop_tokens) ended it"


def check_parsed(schema: SchemaLike | None, logprobs: int | None) -> None:
    """Refuse ``logprobs`` where the result is ``schema``'s parsed value, which has no place for
    them (they were computed, then lost: a dict came back).

    Raises:
        ValueError: both are given.
    """
    if schema is not None and logprobs is not None:
        raise ValueError(
            f"logprobs={logprobs} with schema=: the result is the parsed value, which holds no "
            "log-probabilities; use stream(..., schema=...), or grammar=Grammar.from_json_schema"
            "(...) (or from_pydantic) for a Text with .logprobs, and parse its text"
        )


def parse_structured(text: str, schema: SchemaLike, healed: str = "") -> Any:
    """The value a schema-constrained generation produced: a dict (JSON Schema) or an instance
    of the pydantic model. ``healed``: the prompt's text that token healing had the generation
    re-create (not in ``text``, yet the constraint matched it: the value starts with it).

    Raises:
        IncompleteOutputError: generation stopped (max_tokens, a stop string) before the JSON
            value was complete; the partial text is on the exception.
        SchemaValidationError: the JSON matched the pydantic model's JSON Schema, but the
            model's own validation (which checks more than its schema says) refused it.
    """
    from lcgen.errors import IncompleteOutputError

    text = healed + text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise IncompleteOutputError(
            f"generation stopped before the JSON value was complete ({len(text)} characters): "
            "raise max_tokens",
            text,
        ) from None
    # From the JSON text, as pydantic validates JSON (a strict model takes "2024-01-31" for a
    # date there, and refused the Python str).
    validate = getattr(schema, "model_validate_json", None)
    return value if validate is None else _validated(validate, text, text, schema)


def _validated(validate: Any, value: Any, text: str, model: Any, call: str | None = None) -> Any:
    """``validate(value)``, its pydantic ValidationError made an lcgen error; ``call``: the
    id of the tool call whose arguments these are (which may have been made by hand)."""
    import pydantic

    from lcgen.errors import SchemaValidationError

    try:
        return validate(value)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False)
        name = getattr(model, "__name__", repr(model))
        listed = "; ".join(_describe(e) for e in errors[:3]) + "; ..." * (len(errors) > 3)
        counted = f"{len(errors)} error{'s' * (len(errors) != 1)}: {listed}"
        if call is not None:
            message = (
                f"{name}'s validation refused the arguments of the call {call} ({counted}): "
                "a call made or changed by hand must match the tool's parameters; one the "
                "model wrote matches their JSON Schema, so where it is refused the function "
                "checks more than its schema says (use a type whose schema says it all)"
            )
        else:
            message = (
                f"the output matched the JSON Schema of {name}, but {name}'s own validation "
                f"refused it ({counted}): the model checks more than its JSON Schema says, "
                "which the grammar cannot enforce; use a type whose schema says it all, or "
                "catch SchemaValidationError (.text holds the JSON)"
            )
        raise SchemaValidationError(message, text, [dict(e) for e in errors]) from exc


def _describe(error: Mapping[str, Any]) -> str:
    """One pydantic error as ``field.sub: message (input ...)``."""
    where = ".".join(str(part) for part in error.get("loc", ())) or "(the value)"
    return f"{where}: {error.get('msg', '')} (input {error.get('input')!r:.60})"
