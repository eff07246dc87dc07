"""Sampling from logits: a frozen config, and a seeded RNG whose state is a plain value.

The filter order follows llama.cpp's default chain (penalties, top-k, top-p, min-p, temperature),
so settings carried over from llama.cpp behave the same.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from lcgen._numbers import plain
from lcgen.errors import DecodeError, NoCandidatesError

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_MAX_LAST_N = 2**31 - 1  # llama.cpp's positions are int32
_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
)


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerConfig:
    """How the next token is chosen from the logits.

    Args:
        temperature: 0 picks the most likely token (greedy); above 0 (and finite) samples.
        top_k: keep the k most likely tokens (0 keeps all; slower on large vocabularies).
        top_p: keep the smallest set of tokens whose probability sums to at least top_p.
        min_p: drop tokens less likely than min_p times the most likely one.
        repeat_penalty: divide positive (multiply negative) logits of recent tokens; 1 is off.
        repeat_last_n: how many recent tokens the penalties look at.
        seed: makes sampling reproducible (an int >= 0); None draws a fresh seed.
        logit_bias: added to the logits of the given token ids, a mapping of token id to
            number (or pairs of them): -inf bans a token, +inf forces it (among the tokens
            given +inf that are allowed, equally likely; greedy takes the first); NaN is
            refused.
        frequency_penalty: subtracted from a recent token's logit once per time it occurs
            (OpenAI's ``frequency_penalty``), after the repeat penalty; 0 is off.
        presence_penalty: subtracted once from the logit of every recent token (OpenAI's
            ``presence_penalty``); 0 is off.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Derived: whether every bias only lowers a logit, and which tokens carry one.
    only_bans: bool = dataclasses.field(default=True, init=False, repr=False, compare=False)
    biased: frozenset[int] = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in (*_NUMBERS, "top_k", "repeat_last_n", "seed"):
            object.__setattr__(self, name, plain(getattr(self, name)))
        for name in _NUMBERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {value!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("top_k", "repeat_last_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        check_seed(self.seed)
        if not 0 <= self.temperature < math.inf:  # inf: every token alike, banned ones too
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps all), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if not 0 < self.repeat_penalty < math.inf:
            raise ValueError(f"repeat_penalty must be > 0 and finite, got {self.repeat_penalty!r}")
        if not 0 <= self.repeat_last_n <= _MAX_LAST_N:
            raise ValueError(
                f"repeat_last_n must be >= 0 and at most {_MAX_LAST_N} (more than any context "
                f"holds), got {self.repeat_last_n!r}"
            )
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for tok, bias in self.logit_bias:
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise TypeError(f"logit_bias keys are token ids (int), got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise TypeError(f"logit_bias values are numbers, got {bias!r} for token {tok}")
            if bias != bias:
                raise ValueError(
                    "logit_bias values must not be NaN (a number: -inf bans the token, +inf "
                    f"forces it), got {bias!r} for token {tok}"
                )
        object.__setattr__(self, "only_bans", all(bias <= 0 for _, bias in self.logit_bias))
        object.__setattr__(self, "biased", frozenset(tok for tok, _ in self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Whether recent tokens change the logits (a repeat, frequency or presence penalty)."""
        active = (self.repeat_penalty != 1.0, self.frequency_penalty, self.presence_penalty)
        return self.repeat_last_n > 0 and any(active)

    def with_options(self, **options: Any) -> SamplerConfig:
        """A copy with the given fields replaced; options that are None are ignored."""
        return dataclasses.replace(self, **{k: v for k, v in options.items() if v is not None})


def check_seed(seed: object) -> int | None:
    """``seed`` if it is a seed: an int >= 0 (not a bool), or None.

    Raises:
        ValueError: it is not one (the value is named).
    """
    seed = plain(seed)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be an int >= 0 or None, got {seed!r:.80}")
    return seed


def _bias_pairs(bias: object) -> tuple[tuple[Any, Any], ...]:
    """``logit_bias`` as (token, bias) pairs: from a mapping, or from pairs already.

    Raises:
        TypeError: it is neither.
    """
    if isinstance(bias, Mapping):
        return tuple((plain(tok), plain(value)) for tok, value in bias.items())
    if isinstance(bias, tuple | list) and all(
        isinstance(pair, tuple | list) and len(pair) == 2 for pair in bias
    ):
        return tuple((plain(tok), plain(value)) for tok, value in bias)
    raise TypeError(
        "logit_bias takes a mapping of token id to number (e.g. {28: -inf} bans token 28), "
        f"got {type(bias).__name__} {bias!r:.80}"
    )


def new_rng(seed: int | None) -> np.random.Generator:
    """A PCG64 generator; its ``bit_generator.state`` is a plain dict that can be restored.

    Raises:
        ValueError: ``seed`` is not an int >= 0 or None.
    """
    if check_seed(seed) is None:
        seed = int.from_bytes(os.urandom(8), "little")
    return np.random.Generator(np.random.PCG64(seed))


def log_normalizer(logits: np.ndarray) -> float:
    """``log(sum(exp(logits)))`` in float64: a log-probability is a logit minus this.

    Raises:
        DecodeError: the logits hold NaN or +inf.
    """
    top = float(logits.max())
    _check_raw(top)
    return top + float(np.log(np.exp(logits - top, dtype=np.float64).sum()))


def top_ids(logits: np.ndarray, n: int) -> np.ndarray:
    """Ids of the ``n`` largest logits, largest first; among equal logits the lower id first
    (which of several equal logits at the cut are kept is arbitrary)."""
    n = min(n, logits.shape[0])
    ids = np.sort(np.argpartition(logits, -n)[-n:])
    return ids[np.argsort(-logits[ids], kind="stable")]


def _adjusted_logits(logits: np.ndarray, cfg: SamplerConfig, recent: Iterable[int]) -> np.ndarray:
    if not cfg.logit_bias and not cfg.penalizes:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    if cfg.penalizes:
        # llama.cpp's penalties sampler: the repeat penalty, then the frequency and presence
        # penalties, over the recent tokens.
        ids, counts = np.unique(np.fromiter(recent, dtype=np.int64), return_counts=True)
        if ids.size:
            vals = out[ids]
            # float32 as llama.cpp computes it; a penalty beyond float32's range is its limit
            # (0 or the largest float32), and a logit that overflows becomes the largest one.
            # A banned (-inf) logit stays banned (-inf * 0 would be NaN).
            p = np.float32(min(cfg.repeat_penalty, _FLOAT32_MAX))
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                new = vals
                if p != 1.0:  # (0 / 0 in the branch not taken is no concern)
                    new = np.where(new > 0, new / p, new * p)
                    new = np.clip(new, -_FLOAT32_MAX, _FLOAT32_MAX)
                new = new - (counts * cfg.frequency_penalty + cfg.presence_penalty)
            out[ids] = np.where(np.isfinite(vals), np.clip(new, -_FLOAT32_MAX, _FLOAT32_MAX), vals)
    for tok, bias in cfg.logit_bias:
        if out[tok] != -np.inf:  # a token banned here stays banned (-inf + inf would be NaN)
            # A finite bias past float32's range lifts the logit to float32's largest, which
            # is no +inf (only a +inf bias forces a token).
            biased = float(out[tok]) + bias
            out[tok] = biased if math.isinf(bias) else min(max(biased, -_FLOAT32_MAX), _FLOAT32_MAX)
    return out


def _candidates(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and logits of the top-k tokens, most likely first."""
    n = logits.shape[0]
    ids = np.argpartition(logits, n - top_k)[n - top_k :] if 0 < top_k < n else np.arange(n)
    order = np.argsort(-logits[ids], kind="stable")
    ids = ids[order]
    return ids, logits[ids].astype(np.float64)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[0])
    return e / e.sum()  # type: ignore[no-any-return]


def _check_raw(top: float) -> None:
    """Raise where the largest of the logits as given (before any bias) shows them broken: NaN
    (what np.argmax and max return where there is one) or +inf (no probabilities follow from
    it; -inf is a banned token, and a +inf ``logit_bias`` forces one)."""
    if top != top:
        raise DecodeError("the logits hold NaN: the model's weights or settings are broken")
    if top == math.inf:
        raise DecodeError(
            "the logits hold +inf, which is not finite: a logit must be a finite number or -inf "
            "(a banned token); the model's weights or settings are broken, or broken logits "
            "were handed in"
        )


def _check_best(logit: float) -> None:
    """Raise where the best logit shows the logits rule out every token or are broken (NaN
    is what np.argmax returns where there is one, and what sorting puts last)."""
    if logit != logit:
        raise DecodeError("the logits hold NaN: the model's weights or settings are broken")
    if logit == -math.inf:
        raise NoCandidatesError(
            "every token's logit is -inf here (a logit_bias, or the logits given, ban them all)"
        )


def sample(
    logits: np.ndarray,
    cfg: SamplerConfig,
    rng: np.random.Generator,
    recent: Iterable[int] = (),
) -> int:
    """Choose the next token.

    Args:
        logits: the model's logits over the vocabulary, shape (n_vocab,).
        cfg: the sampler settings.
        rng: the random generator (unused when greedy, so greedy leaves its state untouched).
        recent: the tokens the penalties look at (the last ``repeat_last_n``).

    Returns:
        The chosen token id.

    Raises:
        NoCandidatesError: every logit is -inf once biased (``logit_bias`` bans every token).
        DecodeError: the logits hold NaN or +inf (a broken model, or broken logits handed in).
    """
    if cfg.is_greedy and not cfg.penalizes and cfg.only_bans:
        # Biases that only lower logits leave the raw argmax standing unless it carries one.
        best = int(np.argmax(logits))
        _check_raw(float(logits[best]))
        if best not in cfg.biased:
            _check_best(float(logits[best]))
            return best
    else:
        _check_raw(float(logits.max()))
    logits = _adjusted_logits(logits, cfg, recent)
    if cfg.is_greedy:
        best = int(np.argmax(logits))
        _check_best(float(logits[best]))
        return best
    ids, vals = _candidates(logits, cfg.top_k)
    _check_best(float(vals[-1] if np.isnan(vals[-1]) else vals[0]))
    if vals[0] == math.inf:  # a +inf bias forces its tokens: draw among them, equally likely
        ids = ids[vals == math.inf]
        vals = np.zeros(len(ids))
    probs = _softmax(vals)
    keep = len(ids)
    if cfg.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), cfg.top_p)) + 1)
    if cfg.min_p > 0:
        keep = min(keep, int(np.count_nonzero(probs >= cfg.min_p * probs[0])))
    keep = max(keep, 1)
    # Scale the gaps to the best logit, not the logits: a tiny temperature then sends every gap
    # to -inf (greedy, the limit) instead of the logits to +-inf and their difference to NaN.
    with np.errstate(over="ignore"):
        final = _softmax((vals[:keep] - vals[0]) / cfg.temperature)
    # The draw walks the kept tokens in id order, not by likelihood: logits that moved by
    # rounding (another batch shape, other cells) then move the edges between tokens only as
    # much, where two near-equal logits trading places moved every draw that fell on either.
    kept = np.argsort(ids[:keep])
    cdf = np.cumsum(final[kept])
    idx = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[kept[min(idx, keep - 1)]])
