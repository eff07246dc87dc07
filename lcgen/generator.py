"""The step machinery: logits in, a sampled token and its streamed text out.

A :class:`Generator` does not run the model. It takes the logits of the next position (from
lcgen's own loop or from anywhere else), samples a token, decodes its text, checks stop
conditions and says when generation is finished. ``Model.stream`` and ``Sequence.stream`` are
built on it, so there is one implementation of all of this.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict

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
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop: str | None = None


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
        history: Sequence[int] = (),
        rng: np.random.Generator | None = None,
    ) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens!r}")
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
        self.recent: deque[int] = deque(maxlen=self.sampler.repeat_last_n)
        self.recent.extend(history)

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    def step(self, logits: np.ndarray) -> Chunk:
        """Sample the next token from ``logits`` (shape (n_vocab,)) and accept it.

        Raises:
            ValueError: the logits have the wrong shape, or generation is already finished.
        """
        if logits.shape != (self.model.n_vocab,):
            raise ValueError(f"logits must have shape ({self.model.n_vocab},), got {logits.shape}")
        return self.accept(sample(logits, self.sampler, self.rng, self.recent))

    def accept(self, token: int) -> Chunk:
        """Take ``token`` as the next token (sampled here or chosen elsewhere).

        Returns:
            The chunk of text this token completes, with the finish reason on the last one.
        """
        if self.is_done:
            raise ValueError(f"generation is finished ({self.finish_reason}); start a new one")
        self.tokens.append(token)
        self.recent.append(token)
        if token in self.stop_tokens or self.model.is_eog(token):
            return self._finish(token, "stop", None)
        state, text, hit = text_step(self.text_state, self.model.token_piece(token), self.stops)
        self.text_state = state
        if hit is not None:
            return self._finish(token, "stop", hit, text)
        if len(self.tokens) >= self.max_tokens:
            return self._finish(token, "length", None, text)
        return Chunk(text, (token,))

    def _finish(self, token: int, reason: FinishReason, hit: str | None, text: str = "") -> Chunk:
        if hit is None:
            rest, hit = text_flush(self.text_state, self.stops)
            text += rest
            reason = "stop" if hit is not None else reason
        self.text_state = TextState()
        self.finish_reason = reason
        return Chunk(text, (token,), reason, hit)
