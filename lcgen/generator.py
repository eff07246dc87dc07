"""The step machinery: logits in, a sampled token and its streamed text out.

A :class:`Generator` does not run the model. It takes the logits of the next position (from
lcgen's own loop or from anywhere else), samples a token, decodes its text, checks stop
conditions and says when generation is finished. ``Model.stream`` and ``Sequence.stream`` are
built on it, so there is one implementation of all of this.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np

from lcgen.errors import IncompleteOutputError, NoCandidatesError
from lcgen.grammar import Grammar, GrammarState
from lcgen.hooks import Hook, Validator
from lcgen.sampling import SamplerConfig, log_normalizer, new_rng, sample, top_ids
from lcgen.text import Stops, TextState, text_flush, text_step

if TYPE_CHECKING:
    from lcgen.model import Model

FinishReason = Literal["stop", "length", "retries"]
SchemaLike = Mapping[str, Any] | type[Any]
# Redraws after a grammar rejection before masking the whole vocabulary.
_REDRAWS = 8


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
            every token was rejected) on the last chunk.
        stop: the stop string that ended generation, if one did.
        logprob: with ``logprobs`` set, the sampled token's log-probability under the model
            (log-softmax of the raw logits, before temperature and filters).
        top_logprobs: with ``logprobs=n``, the n most likely tokens and their log-probabilities.
        stats: on the last chunk of a sequence's generation, what it cost (tokens decoded,
            rewinds, resamples).
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    stats: GenerationStats | None = None


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """What one generation cost.

    Attributes:
        tokens: tokens generated (kept in the result).
        decoded: tokens passed to ``llama_decode`` for it, pending prompt tokens included.
        redecoded: of those, the ones decoded again because a rewind dropped them (a rewind
            also re-decodes the last kept token, whose logits the next step needs).
        rewinds: rewinds done by hooks, validators and banned phrases.
        resamples: candidates redrawn because a hook returned ``Resample``.
    """

    tokens: int = 0
    decoded: int = 0
    redecoded: int = 0
    rewinds: int = 0
    resamples: int = 0


class Text(str):
    """The text a generation returned (a ``str``), with how it ended.

    Attributes:
        finish_reason: as on the last :class:`Chunk`.
        stop: the stop string that ended it, if one did.
        tokens: the generated token ids.
        stats: what the generation cost (:class:`GenerationStats`).
    """

    finish_reason: FinishReason | None
    stop: str | None
    tokens: tuple[int, ...]
    stats: GenerationStats

    @classmethod
    def of(cls, chunks: Iterable[Chunk]) -> Text:
        """Join a generation's chunks."""
        parts: list[str] = []
        tokens: list[int] = []
        last: Chunk | None = None
        for last in chunks:
            parts.append(last.text)
            tokens.extend(last.tokens)
        text = cls("".join(parts))
        text.finish_reason = last.finish_reason if last else "length"
        text.stop = last.stop if last else None
        text.tokens = tuple(tokens)
        text.stats = (last.stats if last else None) or GenerationStats()
        return text


class GenerateOptions(TypedDict, total=False):
    """Keyword options accepted by every generation call (see :class:`Generator`)."""

    max_tokens: int
    stop: str | Sequence[str] | None
    include_stop: bool
    stop_tokens: Iterable[int]
    sampler: SamplerConfig | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repeat_penalty: float | None
    repeat_last_n: int | None
    seed: int | None
    logit_bias: Mapping[int, float] | None
    logprobs: int | None
    token_healing: bool
    grammar: Grammar | None
    choice: Sequence[str] | None
    regex: str | None
    hooks: Sequence[Hook] | None
    validators: Sequence[Validator] | None
    banned: Sequence[str | re.Pattern[str]] | None
    banned_ignore_case: bool
    max_retries: int
    lookback: int


@dataclass(frozen=True, slots=True)
class GeneratorState:
    """Everything a :class:`Generator` changes per token, as a value (see ``state``/``restore``)."""

    n_tokens: int
    text: TextState
    heal: bytes
    rng: Mapping[str, Any]
    finish_reason: FinishReason | None
    grammar: GrammarState | None = None


class Generator:
    """Turns the logits of each next position into a token and its text.

    Args:
        model: the model whose vocabulary the logits are over.
        max_tokens: the most tokens to generate (finish reason ``"length"``).
        stop: stop string(s); generation ends at the first one to complete in the text.
        include_stop: whether the text ends with the stop string that ended it.
        stop_tokens: token ids that end generation besides the model's end-of-generation ones.
        sampler: sampler settings; the keyword options below override its fields.
        temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, logit_bias:
            see :class:`~lcgen.SamplerConfig`.
        logprobs: report each sampled token's log-probability, and the top ``logprobs``
            alternatives when > 0 (None: off).
        grammar, choice, regex, schema: constrain the output (at most one of them): a
            :class:`~lcgen.Grammar`, one of a list of strings, a regular expression (full
            match), or a JSON Schema dict / pydantic model class. The sampled token is checked
            against the grammar and the vocabulary is masked only when it is rejected; the
            end-of-generation token is allowed only where the grammar is complete, and
            generation stops where the grammar can only end.
        heal: bytes the generated text must start with and that are not emitted (token
            healing: the text of prompt tokens removed so the model can re-tokenize across the
            boundary).
        history: tokens before the first generated one (seen by the repeat penalty).
        rng: the random generator to draw from (a sequence passes its own); None makes one
            from ``seed``.

    Raises:
        ValueError: a setting is out of range (the value is named).
    """

    def __init__(
        self,
        model: Model,
        *,
        max_tokens: int = 256,
        stop: str | Sequence[str] | None = None,
        include_stop: bool = False,
        stop_tokens: Iterable[int] = (),
        sampler: SamplerConfig | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repeat_penalty: float | None = None,
        repeat_last_n: int | None = None,
        seed: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        choice: Sequence[str] | None = None,
        regex: str | None = None,
        schema: SchemaLike | None = None,
        heal: bytes = b"",
        history: Sequence[int] = (),
        rng: np.random.Generator | None = None,
    ) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens!r}")
        if logprobs is not None and not 0 <= logprobs <= 50:
            raise ValueError(f"logprobs must be in [0, 50] or None, got {logprobs!r}")
        self.model = model
        self.max_tokens = max_tokens
        self.sampler = (sampler or SamplerConfig()).with_options(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            seed=seed,
            logit_bias=tuple(logit_bias.items()) if logit_bias else None,
        )
        self.stops = Stops(((stop,) if isinstance(stop, str) else tuple(stop or ())), include_stop)
        self.stop_tokens = frozenset(model.check_tokens(stop_tokens))
        model.check_tokens(tok for tok, _ in self.sampler.logit_bias)
        self.rng = rng if rng is not None else new_rng(self.sampler.seed)
        self.tokens: list[int] = []
        self.text_state = TextState()
        self.finish_reason: FinishReason | None = "length" if max_tokens == 0 else None
        self.stop_hit: str | None = None  # the stop string that ended generation
        self.logprobs = logprobs
        constraint = _grammar_from(grammar=grammar, choice=choice, regex=regex, schema=schema)
        self.grammar = constraint.state(model) if constraint is not None else None
        self.heal = heal
        self._history_tail = tuple(history[len(history) - self.sampler.repeat_last_n :])
        self.recent: deque[int] = deque(self._history_tail, maxlen=self.sampler.repeat_last_n)

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    @property
    def state(self) -> GeneratorState:
        """The generator's state now; :meth:`restore` returns to it."""
        return GeneratorState(
            len(self.tokens),
            self.text_state,
            self.heal,
            self.rng.bit_generator.state,
            self.finish_reason,
            self.grammar.clone() if self.grammar is not None else None,
        )

    def restore(self, state: GeneratorState) -> None:
        """Go back to a state taken earlier from this generator (tokens after it are dropped).

        Raises:
            ValueError: the state lies beyond the tokens generated so far.
        """
        if state.n_tokens > len(self.tokens):
            raise ValueError(
                f"cannot restore to token {state.n_tokens}: only {len(self.tokens)} generated"
            )
        del self.tokens[state.n_tokens :]
        self.text_state, self.heal = state.text, state.heal
        self.rng.bit_generator.state = state.rng
        self.finish_reason = state.finish_reason
        self.stop_hit = None
        if state.grammar is not None:
            self.grammar = state.grammar.clone()
        self.recent.clear()
        self.recent.extend(self._history_tail + tuple(self.tokens))

    def clone(self, rng: np.random.Generator | None = None) -> Generator:
        """An independent copy in the same state (tokens, held text, grammar state), to
        continue on another sequence (a fork).

        Args:
            rng: the random generator the copy draws from (a fork passes its own); None gives
                it a new one in the same state as this one's.
        """
        twin = copy.copy(self)
        twin.tokens = list(self.tokens)
        twin.recent = deque(self.recent, maxlen=self.recent.maxlen)
        if self.grammar is not None:
            twin.grammar = self.grammar.clone()
        if rng is None:
            rng = np.random.Generator(np.random.PCG64())
            rng.bit_generator.state = self.rng.bit_generator.state
        twin.rng = rng
        return twin

    def step(
        self,
        logits: np.ndarray,
        *,
        exclude: Collection[int] = (),
        temperature: float | None = None,
    ) -> Chunk:
        """Sample the next token from ``logits`` (shape (n_vocab,)) and accept it.

        Args:
            logits: the model's logits for the next position.
            exclude: tokens that must not be drawn here (a ban, or a hook's ``Resample``).
            temperature: use this temperature for this draw instead of the sampler's.

        Raises:
            ValueError: the logits have the wrong shape, or generation is already finished.
            NoCandidatesError: ``exclude`` and the grammar together leave no token.
        """
        if logits.shape != (self.model.n_vocab,):
            raise ValueError(f"logits must have shape ({self.model.n_vocab},), got {logits.shape}")
        self._check_not_done()
        allowed = logits
        if self.heal:
            allowed = np.full_like(logits, -np.inf)
            ids = self.model.tokens_extending(self.heal)
            allowed[ids] = logits[ids]
        if exclude:
            allowed = np.array(allowed, dtype=np.float32)
            allowed[self.model.check_tokens(exclude)] = -np.inf
            if not np.isfinite(allowed).any():
                raise NoCandidatesError(f"all {self.model.n_vocab} tokens are excluded here")
        sampler = self.sampler
        if temperature is not None:
            sampler = dataclasses.replace(sampler, temperature=temperature)
        token = sample(allowed, sampler, self.rng, self.recent)
        if self.grammar is not None and not self.grammar.try_accept(token):
            token = self._sample_allowed(allowed, token, sampler)
        chunk = self._accept(token)
        if self.logprobs is None:
            return chunk
        return dataclasses.replace(chunk, **logprobs_of(logits, token, self.logprobs))

    def accept(self, token: int) -> Chunk:
        """Take ``token`` as the next token (sampled here or chosen elsewhere).

        Returns:
            The chunk of text this token completes, with the finish reason on the last one.

        Raises:
            ValueError: generation is finished, the token is outside the vocabulary, or it does
                not continue the healed text.
            GrammarError: the grammar forbids the token here.
        """
        self._check_not_done()
        self.model.check_tokens([token])
        if self.grammar is not None:
            self.grammar.accept(token)
        return self._accept(token)

    def _accept(self, token: int) -> Chunk:
        piece = self._healed_piece(token)
        self.tokens.append(token)
        self.recent.append(token)
        if token in self.stop_tokens or self.model.is_eog(token):
            return self._finish((token,), "stop", None)
        state, text, hit = text_step(self.text_state, piece, self.stops)
        self.text_state = state
        if hit is not None:
            return self._finish((token,), "stop", hit, text)
        if self._grammar_can_only_end():
            return self._finish((token,), "stop", None, text)
        if len(self.tokens) >= self.max_tokens:
            return self._finish((token,), "length", None, text)
        return Chunk(text, (token,))

    def _check_not_done(self) -> None:
        if self.is_done:
            raise ValueError(f"generation is finished ({self.finish_reason}); start a new one")

    def _grammar_can_only_end(self) -> bool:
        if self.grammar is None or not self.grammar.is_complete:
            return False
        allowed = self.grammar.allowed()
        allowed[list(self.grammar.end_tokens)] = False
        return not allowed.any()

    def _sample_allowed(self, logits: np.ndarray, rejected: int, sampler: SamplerConfig) -> int:
        """A token the grammar allows, drawn as if from ``logits`` masked to the grammar.

        Redraws without the rejected tokens first (a few microseconds per check; exact, since
        conditioning on "not rejected" keeps the allowed tokens' relative probabilities), and
        masks the whole vocabulary (milliseconds on large vocabularies) only after a few misses.
        """
        assert self.grammar is not None
        work = np.array(logits, dtype=np.float32)
        work[rejected] = -np.inf
        for _ in range(_REDRAWS):
            if not np.isfinite(work).any():
                break
            token = sample(work, sampler, self.rng, self.recent)
            if self.grammar.try_accept(token):
                return token
            work[token] = -np.inf
        masked = self.grammar.mask(logits)
        if not np.isfinite(masked).any():
            raise NoCandidatesError("the grammar allows none of the tokens not excluded here")
        token = sample(masked, sampler, self.rng, self.recent)
        self.grammar.accept(token)
        return token

    def _healed_piece(self, token: int) -> bytes:
        """The token's bytes less the part that re-creates healed prompt text."""
        piece = self.model.token_piece(token)
        if not self.heal:
            return piece
        if piece.startswith(self.heal):
            piece, self.heal = piece[len(self.heal) :], b""
            return piece
        if piece and self.heal.startswith(piece):
            self.heal = self.heal[len(piece) :]
            return b""
        raise ValueError(
            f"token {token} ({piece!r}) does not continue the healed text {self.heal!r}"
        )

    def end(self, reason: FinishReason) -> Chunk:
        """Finish now (no token): release the text held back, with ``reason`` on the chunk.

        Raises:
            ValueError: generation is already finished.
        """
        self._check_not_done()
        return self._finish((), reason, None)

    def _finish(
        self, tokens: tuple[int, ...], reason: FinishReason, hit: str | None, text: str = ""
    ) -> Chunk:
        if hit is None:
            rest, hit = text_flush(self.text_state, self.stops)
            text += rest
            reason = "stop" if hit is not None else reason
        self.text_state = TextState()
        self.finish_reason, self.stop_hit = reason, hit
        return Chunk(text, tokens, reason, hit)


def logprobs_of(logits: np.ndarray, token: int, n_top: int) -> dict[str, Any]:
    """The sampled token's log-probability and the ``n_top`` best, under the raw logits."""
    log_norm = log_normalizer(logits)
    best: tuple[tuple[int, float], ...] = ()
    if n_top:
        best = tuple((int(i), float(logits[i]) - log_norm) for i in top_ids(logits, n_top))
    return {"logprob": float(logits[token]) - log_norm, "top_logprobs": best}


def _grammar_from(
    *,
    grammar: Grammar | None,
    choice: Sequence[str] | None,
    regex: str | None,
    schema: SchemaLike | None,
) -> Grammar | None:
    """The one constraint given, as a grammar.

    Raises:
        ValueError: more than one constraint was given.
    """
    given = {
        name: value
        for name, value in (
            ("grammar", grammar),
            ("choice", choice),
            ("regex", regex),
            ("schema", schema),
        )
        if value is not None
    }
    if len(given) > 1:
        raise ValueError(f"give at most one of grammar, choice, regex, schema; got {sorted(given)}")
    if grammar is not None:
        return grammar
    if choice is not None:
        return Grammar.choice(list(choice))
    if regex is not None:
        return Grammar.regex(regex)
    if isinstance(schema, Mapping):
        return Grammar.from_json_schema(dict(schema))
    if schema is not None:
        return Grammar.from_pydantic(schema)
    return None


def parse_structured(text: str, schema: SchemaLike) -> Any:
    """The value a schema-constrained generation produced: a dict (JSON Schema) or an instance
    of the pydantic model.

    Raises:
        IncompleteOutputError: generation stopped (max_tokens, a stop string) before the JSON
            value was complete; the partial text is on the exception.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise IncompleteOutputError(
            f"generation stopped before the JSON value was complete ({len(text)} characters): "
            "raise max_tokens",
            text,
        ) from None
    if isinstance(schema, Mapping):
        return value
    return schema.model_validate(value)
