"""The step machinery: logits in, a sampled token and its streamed text out.

A :class:`Generator` does not run the model. It takes the logits of the next position (from
lcgen's own loop or from anywhere else), samples a token, decodes its text, checks stop
conditions and says when generation is finished. ``Model.stream`` and ``Sequence.stream`` are
built on it, so there is one implementation of all of this.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Unpack, get_args

import numpy as np

from lcgen.constrain import GrammarState
from lcgen.decoding.options import GenerateOptions, Plan, make_plan
from lcgen.decoding.results import Chunk, FinishReason, TokenLogprob, TopLogprob
from lcgen.decoding.sampling import SamplerConfig, log_normalizer, new_rng, sample, top_ids
from lcgen.decoding.text import TextState, decode_flush, decode_step, text_flush, text_step
from lcgen.errors import NoCandidatesError
from lcgen.vocab import HasVocab, Vocab, vocab_of

# Redraws after a grammar rejection before masking the whole vocabulary.
_REDRAWS = 8
# The most characters of forced text looked at per step.
_MAX_FORCED_CHARS = 96
_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class GeneratorState:
    """Everything a :class:`Generator` changes per token, as a value (see ``state``/``restore``)."""

    n_tokens: int
    text: TextState
    heal: bytes
    rng: Mapping[str, Any]
    finish_reason: FinishReason | None
    grammar: GrammarState | None = None
    generator: int = 0  # which generator it was taken from (restore checks it)
    stop_hit: str | None = None  # the stop string that ended generation (finish "stop")


class Generator:
    """Turns the logits of each next position into a token and its text.

    Args:
        model: the model (or its :class:`~lcgen.vocab.Vocab`) whose vocabulary the logits are
            over.
        plan: the generation's options as a :class:`~lcgen.decoding.options.Plan`; or give
            them as keyword ``options`` instead (see :func:`~lcgen.decoding.options.make_plan`:
            max_tokens, stop, temperature, seed, grammar, choice, regex, schema, ...). The
            sampled token is checked against a constraint and the vocabulary is masked only
            when it is rejected; the end-of-generation token is allowed only where the grammar
            is complete, and generation stops where the grammar can only end.
        history: tokens before the first generated one (seen by the repeat penalty).
        rng: the random generator to draw from (a sequence passes its own); None makes one
            from the plan's seed.
        heal: bytes the generated text must start with and that are not emitted (token
            healing: the text of prompt tokens removed so the model can re-tokenize across the
            boundary).

    Raises:
        ValueError: a setting is out of range (the value is named), or options that take
            tokens back (hooks, validators, banned phrases, a schema with ``uniqueItems``),
            which only a sequence's run can.
        TypeError: both a plan and options were given, or an unknown option.
    """

    def __init__(
        self,
        model: Vocab | HasVocab,
        plan: Plan | None = None,
        *,
        history: Sequence[int] = (),
        rng: np.random.Generator | None = None,
        heal: bytes = b"",
        **options: Unpack[GenerateOptions],
    ) -> None:
        if plan is None:
            plan = make_plan(**options)
            if plan.backtracking is not None:  # (a sequence's run drives those: seq.run)
                raise ValueError(
                    "hooks, validators, banned phrases and a schema's uniqueItems take tokens "
                    "back, which a Generator on its own cannot: use model.generate, "
                    "model.stream or seq.run"
                )
        elif options:
            raise TypeError(f"give a plan or options, not both (options: {sorted(options)})")
        vocab = vocab_of(model)
        vocab.check_tokens(plan.stop_tokens)
        vocab.check_tokens(tok for tok, _ in plan.sampler.logit_bias)
        self.vocab = vocab
        self.plan = plan
        self._id = next(_ids)
        self.rng = rng if rng is not None else new_rng(plan.sampler.seed)
        self.tokens: list[int] = []
        self.text_state = TextState()
        self.finish_reason: FinishReason | None = "length" if plan.max_tokens == 0 else None
        self.stop_hit: str | None = None  # the stop string that ended generation
        self.grammar = plan.constraint.state(vocab) if plan.constraint is not None else None
        self.heal = heal  # what is left to re-create
        # The prompt text healing re-creates, which the constraint matches with the output
        # (see lcgen.decoding.results.parse_structured).
        self.healed = heal.decode("utf-8", "replace")
        self._banned = frozenset(t for t, b in plan.sampler.logit_bias if b == -np.inf)
        n_recent = plan.sampler.repeat_last_n
        self._history_tail = tuple(history[len(history) - n_recent :]) if n_recent else ()
        self.recent: deque[int] = deque(self._history_tail, maxlen=n_recent)

    @property
    def max_tokens(self) -> int:
        """The most tokens to generate: the plan's, or where it has None (up to the end of the
        context, which a sequence sets before it makes a generator) no bound of its own."""
        return sys.maxsize if self.plan.max_tokens is None else self.plan.max_tokens

    @property
    def sampler(self) -> SamplerConfig:
        return self.plan.sampler

    @property
    def logprobs(self) -> int | None:
        return self.plan.logprobs

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
            self._id,
            self.stop_hit,
        )

    def check_restorable(self, state: GeneratorState) -> None:
        """Raise what :meth:`restore` would raise for ``state``, changing nothing.

        Raises:
            TypeError: ``state`` is not a :class:`GeneratorState`.
            ValueError: the state was taken from another generator, or lies beyond the tokens
                generated so far.
        """
        if not isinstance(state, GeneratorState):
            raise TypeError(
                "restore takes a GeneratorState (from generator.state), got "
                f"{type(state).__name__} {state!r:.80}"
            )
        if state.generator != self._id:
            raise ValueError("the state was taken from another generator: restore it there")
        if state.n_tokens > len(self.tokens):
            raise ValueError(
                f"cannot restore to token {state.n_tokens}: only {len(self.tokens)} generated"
            )

    def restore(self, state: GeneratorState) -> None:
        """Go back to a state taken earlier from this generator (tokens after it are dropped).

        Raises:
            ValueError: the state was taken from another generator, or lies beyond the tokens
                generated so far.
        """
        self.check_restorable(state)
        del self.tokens[state.n_tokens :]
        self.text_state, self.heal = state.text, state.heal
        self.rng.bit_generator.state = state.rng
        self.finish_reason, self.stop_hit = state.finish_reason, state.stop_hit
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
        logits: np.ndarray | Sequence[float],
        *,
        exclude: Collection[int] = (),
        temperature: float | None = None,
    ) -> Chunk:
        """Sample the next token from ``logits`` (shape (n_vocab,)) and accept it.

        Args:
            logits: the model's logits for the next position: a numpy array (a list of
                numbers is converted to one); -inf bans a token.
            exclude: tokens that must not be drawn here (a ban, or a hook's ``Resample``).
            temperature: use this temperature for this draw instead of the sampler's.

        Raises:
            TypeError: the logits are not numbers.
            ValueError: the logits have the wrong shape, or generation is already finished.
            DecodeError: the logits hold NaN or +inf.
            NoCandidatesError: ``exclude`` and the grammar together leave no token.
        """
        n_vocab = self.vocab.n_vocab
        logits = _as_logits(logits, n_vocab)
        self._check_not_done()
        allowed = logits
        if self.heal:
            allowed = np.full_like(logits, -np.inf)
            ids = self.vocab.tokens_extending(self.heal)
            allowed[ids] = logits[ids]
        if exclude:
            allowed = np.array(allowed, dtype=np.float32)
            allowed[self.vocab.check_tokens(exclude)] = -np.inf
            if np.isneginf(allowed).all():  # (NaN or +inf left: sample says they are broken)
                raise NoCandidatesError(f"all {n_vocab} tokens are excluded here")
        sampler = self.sampler
        if temperature is not None:
            sampler = dataclasses.replace(sampler, temperature=temperature)
        token = sample(allowed, sampler, self.rng, self.recent)
        if self.grammar is not None and not self.grammar.try_accept(token):
            token = self._sample_allowed(allowed, token, sampler)
        if self.logprobs is None:
            return self._accept(token)
        return self._accept_with_logprobs(token, logits, self.logprobs)

    def forced_text(self) -> str:
        """The text the constraint allows next and nothing else (see
        :meth:`~lcgen.GrammarState.forced_text`); empty without a grammar, while healing and
        once done."""
        if self.grammar is None or self.heal or self.is_done:
            return ""
        return self.grammar.forced_text(_MAX_FORCED_CHARS)

    def forced_tokens(self, before: bytes, limit: int) -> list[int]:
        """The tokens the constraint forces next, as the tokenizer writes that text.

        The text is what the grammar allows next and nothing else (see
        :meth:`~lcgen.GrammarState.forced_text`), tokenized as it reads after ``before`` (the
        last token's piece) where the tokenizer keeps the boundary between them, else on its
        own. The last token is left to sampling where the grammar allows a longer token that
        starts with its text (the text after it may join it into that one) or can end after
        it. Empty without a grammar, while healing, and where the tokens do not spell the
        text; cut before a token ``logit_bias`` bans or a stop token.

        Args:
            before: the piece of the last token.
            limit: the most tokens to return.
        """
        text = self.forced_text() if limit > 0 else ""
        if not text:
            return []
        tokens = _tokens_after(self.vocab, before, text.encode("ascii"))
        if tokens and self._leave_last(tokens):
            tokens.pop()
        tokens = tokens[:limit]
        # Never force a token the caller banned (logit_bias -inf) or made a stop token.
        barred = self.plan.stop_tokens | self._banned
        return list(itertools.takewhile(lambda t: t not in barred, tokens))

    def _leave_last(self, tokens: list[int]) -> bool:
        """Whether to leave the last of ``tokens`` to sampling: the grammar, after the others,
        allows a longer token that starts with its text (checked by its next byte first), or
        can end after it (the step that samples it decodes the others, so a finished
        generation keeps one token pending, as without forcing)."""
        assert self.grammar is not None
        last = tokens[-1]
        piece = self.vocab.special_piece(last)
        pieces = self.vocab.all_pieces()
        starting = self.vocab.tokens_starting_with(piece).tolist()
        longer = [t for t in starting if len(pieces[t]) > len(piece)]
        with self.grammar.clone() as probe:
            probe.accept_tokens(tokens[:-1])
            with probe.clone() as after:
                after.accept(last)
                if after.is_complete:
                    return True
                by_byte = self.vocab.byte_tokens
                next_ok: dict[int, bool] = {}
                for token in longer:
                    byte = pieces[token][len(piece)]
                    if byte not in next_ok:
                        next_ok[byte] = byte not in by_byte or after.allows(by_byte[byte])
                    if next_ok[byte] and probe.allows(token):
                        return True
        return False

    def accept(self, token: int, logits: np.ndarray | None = None) -> Chunk:
        """Take ``token`` as the next token (sampled here or chosen elsewhere).

        Args:
            token: the token.
            logits: the logits at its position: with ``logprobs`` set, the chunk then carries
                the token's log-probability (as when sampled).

        Returns:
            The chunk of text this token completes, with the finish reason on the last one.

        Raises:
            ValueError: generation is finished, the token is outside the vocabulary, or it does
                not continue the healed text.
            GrammarError: the grammar forbids the token here.
        """
        self._check_not_done()
        token = self.vocab.check_id(token)  # (a numpy integer as the int it holds)
        self._check_heals(token)  # before the grammar moves: a refused token changes nothing
        if self.grammar is not None:
            self.grammar.accept(token)
        if logits is None or self.logprobs is None:
            return self._accept(token)
        return self._accept_with_logprobs(token, logits, self.logprobs)

    def _accept(self, token: int) -> Chunk:
        healing = bool(self.heal)
        piece = self._healed_piece(token)
        return self._take(token, piece, healing and not piece)

    def _take(self, token: int, piece: bytes, prompt_text: bool = False) -> Chunk:
        """Append ``token`` (``piece``: the bytes it adds to the output). ``prompt_text``: it
        only re-creates the prompt text healing removed, which no stop token ends (as no stop
        string matches it)."""
        self.tokens.append(token)
        self.recent.append(token)
        if (token in self.plan.stop_tokens and not prompt_text) or self.vocab.is_eog(token):
            return self._finish((token,), "stop", None)
        state, text, hit = text_step(self.text_state, piece, self.plan.stops)
        self.text_state = state
        if hit is not None:
            return self._finish((token,), "stop", hit, text)
        if self._grammar_can_only_end():
            return self._finish((token,), "stop", None, text)
        if len(self.tokens) >= self.max_tokens:
            return self._finish((token,), "length", None, text)
        return Chunk(text, (token,))

    def _accept_with_logprobs(self, token: int, logits: np.ndarray, n_top: int) -> Chunk:
        """:meth:`_accept`, with the token's :class:`TokenLogprob` on the chunk."""
        held, healing = self.text_state.held_bytes, bool(self.heal)
        piece = self._healed_piece(token)
        chunk = self._take(token, piece, healing and not piece)
        fields = logprobs_of(logits, token, n_top, self.vocab)
        text = self._own_text(chunk, held, piece)
        entry = TokenLogprob(token, text, fields["logprob"], fields["top_logprobs"])
        return dataclasses.replace(chunk, logprobs=(entry,), **fields)

    def _own_text(self, chunk: Chunk, held: bytes, piece: bytes) -> str:
        """The characters the chunk's token completes, given the bytes held before it (an
        end or stop token adds none); the last token also releases what is still held."""
        token = chunk.tokens[0]
        if token in self.plan.stop_tokens or self.vocab.is_eog(token):
            held_after, text = held, ""
        else:
            held_after, text = decode_step(held, piece)
        return text + decode_flush(held_after) if chunk.finish_reason is not None else text

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
            if self.heal:
                healed = self.heal.decode(errors="replace")
                raise NoCandidatesError(
                    f"token healing must re-create the prompt's {healed!r} and the grammar "
                    "allows no token that does: the grammar sees the healed text too (start "
                    "the constraint with it) or drop token_healing"
                )
            raise NoCandidatesError("the grammar allows none of the tokens not excluded here")
        token = sample(masked, sampler, self.rng, self.recent)
        self.grammar.accept(token)
        return token

    def _check_heals(self, token: int, piece: bytes | None = None) -> None:
        """Raise ValueError when ``token`` (its bytes ``piece``) does not continue the healed
        text left; nothing to look up once healing is done."""
        if not self.heal:
            return
        piece = self.vocab.piece(token) if piece is None else piece
        if not (piece.startswith(self.heal) or (piece and self.heal.startswith(piece))):
            raise ValueError(
                f"token {token} ({piece!r}) does not continue the healed text {self.heal!r}"
            )

    def _healed_piece(self, token: int) -> bytes:
        """The token's bytes less the part that re-creates healed prompt text."""
        piece = self.vocab.piece(token)
        if not self.heal:
            return piece
        self._check_heals(token, piece)
        if piece.startswith(self.heal):
            piece, self.heal = piece[len(self.heal) :], b""
            return piece
        self.heal = self.heal[len(piece) :]
        return b""

    def end(self, reason: FinishReason) -> Chunk:
        """Finish now (no token): release the text held back, with ``reason`` on the chunk.

        Raises:
            ValueError: generation is already finished, or ``reason`` is no finish reason.
        """
        if reason not in get_args(FinishReason):
            raise ValueError(f"a finish reason is one of {get_args(FinishReason)}, got {reason!r}")
        self._check_not_done()
        return self._finish((), reason, None)

    def _finish(
        self, tokens: tuple[int, ...], reason: FinishReason, hit: str | None, text: str = ""
    ) -> Chunk:
        if hit is None:
            rest, hit = text_flush(self.text_state, self.plan.stops)
            text += rest
            reason = "stop" if hit is not None else reason
        self.text_state = TextState()
        self.finish_reason, self.stop_hit = reason, hit
        return Chunk(text, tokens, reason, hit)


def _as_logits(logits: object, n_vocab: int) -> np.ndarray:
    """``logits`` as a float32 array of shape (n_vocab,), as llama.cpp's logits are: a float32
    array as it is, anything else converted (before the NaN and +inf checks, so a float64
    beyond float32's range is refused as the +inf it becomes, not passed on to overflow in
    sampling).

    Raises:
        TypeError: they are not numbers.
        ValueError: their shape is not (n_vocab,).
    """
    given = logits
    if not isinstance(logits, np.ndarray):
        try:
            logits = np.asarray(logits)
        except (TypeError, ValueError, OverflowError):  # a ragged list, or int beyond int64
            logits = np.asarray(None)
    if logits.dtype.kind not in "iuf":
        raise TypeError(
            f"logits must be a numpy array (or a list) of {n_vocab} numbers, got "
            f"{type(given).__name__} {given!r:.80}"
        )
    if logits.shape != (n_vocab,):
        raise ValueError(f"logits must have shape ({n_vocab},), got {logits.shape}")
    if logits.dtype == np.float32 and given is logits:
        return logits
    with np.errstate(over="ignore"):  # beyond float32's range: +-inf (+inf is refused)
        return logits.astype(np.float32)


def _tokens_after(vocab: Vocab, before: bytes, data: bytes) -> list[int]:
    """The tokens of ``data`` as the tokenizer writes it after ``before``, when it puts a token
    boundary between the two; else of ``data`` alone; [] when the tokens do not spell it."""
    for head in (before, b""):
        try:
            text = (head + data).decode("utf-8")
        except UnicodeDecodeError:
            continue
        tokens = vocab.tokenize(text, add_bos=False)
        pieces = [vocab.special_piece(t) for t in tokens]
        at, i = 0, 0
        while at < len(head) and i < len(tokens):
            at, i = at + len(pieces[i]), i + 1
        if at == len(head) and b"".join(pieces[i:]) == data:
            return tokens[i:]
    return []


def logprobs_of(
    logits: np.ndarray, token: int, n_top: int, vocab: Vocab | None = None
) -> dict[str, Any]:
    """The sampled token's log-probability and the ``n_top`` best, under the raw logits, as
    :class:`Chunk` fields (``logprob``, ``top_logprobs``); ``vocab`` gives the best tokens'
    texts."""
    log_norm = log_normalizer(logits)
    best: tuple[TopLogprob, ...] = ()
    if n_top:
        if vocab is None:
            raise ValueError("the texts of the top tokens need the vocabulary")
        best = tuple(
            TopLogprob(int(i), _token_text(vocab, int(i)), float(logits[i]) - log_norm)
            for i in top_ids(logits, n_top)
        )
    return {"logprob": float(logits[token]) - log_norm, "top_logprobs": best}


def _token_text(vocab: Vocab, token: int) -> str:
    """A token's text on its own: control tokens shown, a partial character as U+FFFD."""
    return vocab.special_piece(token).decode("utf-8", "replace")
