"""What post-sampling hooks see and return, and the banned-phrase matcher.

A hook is any callable ``hook(step) -> None | Override | Resample | Rewind`` run on each sampled
candidate (see :class:`lcgen.Sequence`'s ``hooks`` option); a validator is a callable
``validator(text) -> None | Rewind`` run on the text generated so far after each token.
"""

from __future__ import annotations

import math
import re
import re._constants
import re._parser  # the stdlib's own regex parser: the widths a pattern can match
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from lcgen._numbers import plain
from lcgen.decoding.sampling import log_normalizer, top_ids
from lcgen.decoding.text import check_no_surrogate, check_prefix_cost
from lcgen.vocab import Vocab

__all__ = ["BannedPhrases", "Hook", "Override", "Resample", "Rewind", "Step", "Validator"]

# The candidates a Step lists: the most likely tokens under the raw logits.
N_CANDIDATES = 10


@dataclass(frozen=True, slots=True)
class Override:
    """Take ``token`` instead of the sampled candidate (the next hooks see it).

    Raises (at generation): ``GrammarError`` when the grammar forbids the token here.
    """

    token: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", plain(self.token))
        if isinstance(self.token, bool) or not isinstance(self.token, int):
            raise TypeError(f"Override takes a token id (int), got {self.token!r}")


@dataclass(frozen=True, slots=True)
class Resample:
    """Draw another candidate at this position.

    Attributes:
        exclude: tokens the redraw must not produce (they stay excluded for the rest of the
            retries at this position); the rejected candidate is not excluded unless listed.
        temperature: the temperature for the redraw (None: the generation's own).

    Raises:
        TypeError: ``exclude`` is not a list of token ids (a lone id: give ``[5]``), or
            ``temperature`` is not a number.
        ValueError: ``temperature`` is below 0, infinite or NaN.
    """

    exclude: tuple[int, ...] = ()
    temperature: float | None = None

    def __init__(self, exclude: Iterable[int] = (), temperature: float | None = None) -> None:
        if temperature is not None:
            if isinstance(temperature, bool) or not isinstance(temperature, int | float):
                raise TypeError(f"Resample temperature must be a number, got {temperature!r}")
            if not 0 <= temperature < math.inf:  # NaN too
                raise ValueError(
                    f"Resample temperature must be >= 0 and finite, got {temperature!r}"
                )
        object.__setattr__(self, "exclude", _token_ids(exclude))
        object.__setattr__(self, "temperature", temperature)


def _token_ids(exclude: object) -> tuple[int, ...]:
    """Resample's ``exclude``: token ids (ints, numpy's too), not bools, strings or floats."""
    if isinstance(exclude, int | np.integer) and not isinstance(exclude, bool):
        raise TypeError(
            f"Resample exclude takes a list of token ids, got {exclude!r}: use "
            f"exclude=[{exclude!r}]"
        )
    if isinstance(exclude, str | bytes | bytearray) or not isinstance(exclude, Iterable):
        raise TypeError(f"Resample exclude takes a list of token ids, got {exclude!r:.80}")
    ids = []
    for token in exclude:
        if isinstance(token, bool | np.bool_) or not isinstance(token, int | np.integer):
            raise TypeError(
                f"Resample exclude takes a list of token ids (int), got {token!r:.80} in it"
            )
        ids.append(int(token))
    return tuple(ids)


@dataclass(frozen=True, slots=True)
class Rewind:
    """Go back and generate again: ``n`` tokens (the candidate counts as the last one), or as
    many tokens as hold the last ``chars`` characters of the text (for validators, which see
    text).

    Attributes:
        n: tokens to drop, >= 1 (default 1 when ``chars`` is not given); at most the
            generation's ``lookback`` and the tokens it has.
        ban: forbid the first dropped token at its position for the retries there, so the
            same span cannot simply come back.
        chars: characters to drop from the end of the text, >= 1; the rewind goes to the token
            where the first of them starts.

    Raises:
        TypeError: ``n`` or ``chars`` is not an int (True is not 1), ``ban`` not a bool.
        ValueError: ``n`` or ``chars`` is below 1, or both are given.
    """

    n: int | None = None
    ban: bool = False
    chars: int | None = None

    def __post_init__(self) -> None:
        if self.n is not None and self.chars is not None:
            raise ValueError(
                f"give Rewind n or chars, not both (n={self.n!r}, chars={self.chars!r})"
            )
        for name, value in (("n", self.n), ("chars", self.chars)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):  # True was Rewind(1)
                raise TypeError(f"Rewind takes {name} as an int, got {value!r}")
            if value < 1:
                raise ValueError(f"Rewind needs {name} >= 1, got {value!r}")
        if not isinstance(self.ban, bool):
            raise TypeError(f"Rewind takes ban as True or False, got {self.ban!r}")


class Step:
    """A sampled candidate, as a hook sees it (read-only).

    Attributes:
        position: the candidate's position in the sequence (prompt included).
        index: its index among the generated tokens (0 for the first).
        token: the candidate token id.
        piece: its text (special tokens render as their text).
        text: the generated text so far, ending with the candidate's (complete characters
            only; text after a stop string is cut).
        logits: the raw logits it was drawn from (a read-only copy).
    """

    __slots__ = ("_logsumexp", "_vocab", "index", "logits", "position", "text", "token")

    def __init__(
        self, vocab: Vocab, position: int, index: int, token: int, text: str, logits: np.ndarray
    ) -> None:
        self._vocab = vocab
        self.position, self.index, self.token, self.text = position, index, token, text
        copy = np.array(logits)  # the decode buffer is reused by the next step
        copy.flags.writeable = False
        self.logits = copy
        self._logsumexp: float | None = None

    @property
    def piece(self) -> str:
        return self._vocab.special_piece(self.token).decode("utf-8", "replace")

    def _norm(self) -> float:
        if self._logsumexp is None:
            self._logsumexp = log_normalizer(self.logits)
        return self._logsumexp

    @property
    def logprob(self) -> float:
        """The candidate's log-probability under the raw logits (before sampler settings)."""
        return float(self.logits[self.token]) - self._norm()

    @property
    def prob(self) -> float:
        return float(np.exp(self.logprob))

    def top(self, n: int = N_CANDIDATES) -> list[tuple[int, float]]:
        """The ``n`` most likely tokens and their probabilities, most likely first."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        norm = self._norm()
        return [
            (int(i), float(np.exp(float(self.logits[i]) - norm))) for i in top_ids(self.logits, n)
        ]

    @property
    def candidates(self) -> list[tuple[int, float]]:
        """``top(10)``."""
        return self.top()

    def __repr__(self) -> str:
        return f"<Step index={self.index} token={self.token} {self.piece!r}>"


Action = Union[Override, Resample, Rewind, None]  # noqa: UP007 -- a runtime alias
Hook = Callable[[Step], Action]
Validator = Callable[[str], Union[Rewind, None]]  # noqa: UP007


class BannedPhrases:
    """Strings (literal) and compiled regular expressions that must not appear in the output.

    A literal occurrence counts as soon as it is complete; a regular expression's match counts
    once a character follows it (so ``\\bdelve\\b`` does not fire on ``delves``), or all the
    characters its lookaheads read, or generation ends. Text that could still become part of a
    match is held back: for literals the longest suffix that starts one, for regular
    expressions as many characters as their longest match and its lookaheads read.

    Args:
        phrases: ``str`` (matched literally) or ``re.Pattern`` (its own flags apply).
        ignore_case: match the literal strings regardless of case.

    Raises:
        ValueError: a phrase is empty or holds a lone surrogate (no generated text does), a
            pattern can match the empty string, or a pattern can match (or look ahead at) text
            of unbounded length (bound its repeats: ``\\w{0,20}`` instead of ``\\w*``).
        TypeError: a phrase is neither a ``str`` nor a compiled pattern.
    """

    def __init__(self, phrases: Iterable[str | re.Pattern[str]], ignore_case: bool = False) -> None:
        literals: list[str] = []
        # Each pattern with the most characters it matches and those its lookaheads read past
        # a match's end beyond the first (see _widths).
        self.patterns: list[tuple[re.Pattern[str], int, int]] = []
        for phrase in phrases:
            if isinstance(phrase, str):
                if not phrase:
                    raise ValueError("a banned phrase is empty")
                check_no_surrogate(phrase, "banned phrase")
                literals.append(phrase)
            elif isinstance(phrase, re.Pattern):
                self.patterns.append((phrase, *_widths(phrase)))
            else:
                raise TypeError(
                    f"banned phrase {phrase!r} is a {type(phrase).__name__}, "
                    "not a str or a compiled re.Pattern"
                )
        check_prefix_cost(literals, "banned phrases")
        flags = re.IGNORECASE if ignore_case else 0
        by_length = sorted(set(literals), key=len, reverse=True)
        self.literals = tuple(by_length)
        self.max_literal = len(by_length[0]) if by_length else 0
        self._literal = re.compile("|".join(map(re.escape, by_length)), flags) if literals else None
        prefixes = {p[:k] for p in by_length for k in range(1, len(p))}
        alternatives = "|".join(map(re.escape, sorted(prefixes, key=len, reverse=True)))
        self._prefix = re.compile(f"(?:{alternatives})\\Z", flags) if prefixes else None

    def __bool__(self) -> bool:
        return bool(self.literals or self.patterns)

    def find(self, text: str, start: int, finished: bool) -> int | None:
        """The start of the leftmost banned match that counts, beginning at or after ``start``."""
        best: int | None = None
        if self._literal is not None:
            match = self._literal.search(text, start)
            if match is not None:
                best = match.start()
        for pattern, _, ahead in self.patterns:
            pos = start
            while (match := pattern.search(text, pos)) is not None:
                if match.end() + ahead < len(text) or finished:
                    best = match.start() if best is None else min(best, match.start())
                    break
                pos = match.start() + 1
        return best

    def literal_at(self, text: str, start: int) -> str | None:
        """The literal phrase matched at ``start``, as the text writes it (None where only a
        regular expression matches there)."""
        match = self._literal.match(text, start) if self._literal is not None else None
        return None if match is None else match.group()

    def hold_from(self, text: str, end: int | None = None) -> int:
        """The first character that could still become part of a banned match (of the text
        cut to its first ``end`` characters, when given)."""
        n = hold = len(text) if end is None else end
        if self._prefix is not None:
            match = self._prefix.search(text, max(0, n - self.max_literal + 1), n)
            if match is not None:
                hold = match.start()
        for _, width, ahead in self.patterns:
            hold = min(hold, max(0, n - width - ahead))
        return hold


def _widths(pattern: re.Pattern[str]) -> tuple[int, int]:
    """The most characters ``pattern`` can match, and how many more than one its lookaheads
    read past a match's end (a match is decided once that many and one follow it); rejects
    empty and unbounded patterns."""
    if pattern.match(""):
        raise ValueError(f"banned pattern {pattern.pattern!r} matches the empty string")
    parsed = re._parser.parse(pattern.pattern, pattern.flags)
    high, ahead = parsed.getwidth()[1], _reads_ahead(parsed)
    if max(high, ahead) >= re._constants.MAXREPEAT:
        raise ValueError(
            f"banned pattern {pattern.pattern!r} can match (or look ahead at) text of unbounded "
            "length: bound its repeats (e.g. \\w{0,20} instead of \\w*)"
        )
    return int(high), max(ahead - 1, 0)


def _reads_ahead(items: Any) -> int:
    """The most characters a parsed pattern's lookaheads read past the position where they
    stand (at most the match's end)."""
    c = re._constants
    most = 0
    for op, av in items:
        if op in (c.ASSERT, c.ASSERT_NOT):
            direction, sub = av
            reach = sub.getwidth()[1] if direction == 1 else 0
            most = max(most, min(reach + _reads_ahead(sub), c.MAXREPEAT))
        elif op is c.BRANCH:
            most = max([most, *map(_reads_ahead, av[1])])
        elif op is c.SUBPATTERN:
            most = max(most, _reads_ahead(av[3]))
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            most = max(most, _reads_ahead(av[2]))
        elif op is c.ATOMIC_GROUP:
            most = max(most, _reads_ahead(av))
        elif op is c.GROUPREF_EXISTS:
            most = max(most, *(_reads_ahead(b) for b in av[1:] if b is not None))
    return most
