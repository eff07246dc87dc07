"""The step machinery: logits in, a sampled token and its streamed text out.

A :class:`Generator` does not run the model. It takes the logits of the next position (from
lcgen's own loop or from anywhere else), samples a token, decodes its text, checks stop
conditions and says when generation is finished. ``Model.stream`` and ``Sequence.stream`` are
built on it, so there is one implementation of all of this.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np

from lcgen.sampling import SamplerConfig, new_rng, sample
from lcgen.text import Stops, TextState, text_flush, text_step

if TYPE_CHECKING:
    from lcgen.model import Model

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one generation step produced.

    Attributes:
        text: the text that became final with this step (may be empty while a UTF-8 character
            or a possible stop string is held back).
        tokens: the token(s) sampled in this step.
        finish_reason: None while generating; ``"stop"`` (end-of-generation token, stop token
            or stop string) or ``"length"`` (``max_tokens`` reached) on the last chunk.
        stop: the stop string that ended generation, if one did.
        logprob: with ``logprobs`` set, the sampled token's log-probability under the model
            (log-softmax of the raw logits, before temperature and filters).
        top_logprobs: with ``logprobs=n``, the n most likely tokens and their log-probabilities.
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


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


@dataclass(frozen=True, slots=True)
class GeneratorState:
    """Everything a :class:`Generator` changes per token, as a value (see ``state``/``restore``)."""

    n_tokens: int
    text: TextState
    heal: bytes
    rng: Mapping[str, Any]
    finish_reason: FinishReason | None


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
        self.logprobs = logprobs
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
        self.recent.clear()
        self.recent.extend(self._history_tail + tuple(self.tokens))

    def step(self, logits: np.ndarray) -> Chunk:
        """Sample the next token from ``logits`` (shape (n_vocab,)) and accept it.

        Raises:
            ValueError: the logits have the wrong shape, or generation is already finished.
        """
        if logits.shape != (self.model.n_vocab,):
            raise ValueError(f"logits must have shape ({self.model.n_vocab},), got {logits.shape}")
        allowed = logits
        if self.heal:
            allowed = np.full_like(logits, -np.inf)
            ids = self.model.tokens_extending(self.heal)
            allowed[ids] = logits[ids]
        token = sample(allowed, self.sampler, self.rng, self.recent)
        chunk = self.accept(token)
        if self.logprobs is None:
            return chunk
        return dataclasses.replace(chunk, **_logprobs(logits, token, self.logprobs))

    def accept(self, token: int) -> Chunk:
        """Take ``token`` as the next token (sampled here or chosen elsewhere).

        Returns:
            The chunk of text this token completes, with the finish reason on the last one.

        Raises:
            ValueError: generation is finished, or the token does not continue the healed text.
        """
        if self.is_done:
            raise ValueError(f"generation is finished ({self.finish_reason}); start a new one")
        piece = self._healed_piece(token)
        self.tokens.append(token)
        self.recent.append(token)
        if token in self.stop_tokens or self.model.is_eog(token):
            return self._finish(token, "stop", None)
        state, text, hit = text_step(self.text_state, piece, self.stops)
        self.text_state = state
        if hit is not None:
            return self._finish(token, "stop", hit, text)
        if len(self.tokens) >= self.max_tokens:
            return self._finish(token, "length", None, text)
        return Chunk(text, (token,))

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

    def _finish(self, token: int, reason: FinishReason, hit: str | None, text: str = "") -> Chunk:
        if hit is None:
            rest, hit = text_flush(self.text_state, self.stops)
            text += rest
            reason = "stop" if hit is not None else reason
        self.text_state = TextState()
        self.finish_reason = reason
        return Chunk(text, (token,), reason, hit)


def _logprobs(logits: np.ndarray, token: int, n_top: int) -> dict[str, Any]:
    """The sampled token's log-probability and the ``n_top`` best, under the raw logits."""
    top = logits.max()
    log_norm = float(top + np.log(np.exp(logits - top, dtype=np.float64).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if n_top:
        ids = np.argpartition(logits, -n_top)[-n_top:]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        best = tuple((int(i), float(logits[i]) - log_norm) for i in ids)
    return {"logprob": float(logits[token]) - log_norm, "top_logprobs": best}
