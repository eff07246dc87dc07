"""The text side of generation: incremental UTF-8 decoding and stop strings, without a model.

Every transition is pure: it takes the held state as a value and returns the new one, so a
checkpoint captures it by keeping the value and a rewind restores it by reassignment.

- ``decode_step`` turns token pieces (bytes that may split a character) into text. A valid but
  incomplete trailing sequence is held; invalid bytes become U+FFFD exactly as
  ``bytes.decode("utf-8", "replace")`` would, so the joined output never depends on the split.
- ``stop_step`` holds back the longest suffix that could still grow into a stop string and
  reports a stop as soon as one is complete. The stop that ends first in the text wins; among
  stops ending at the same character the longest wins (it starts earliest). This equals "the
  earliest start" except when a stop lies strictly inside a longer one (``"bc"`` in
  ``"abcd"``): waiting for the longer one would mean generating past a completed stop.
- ``text_step`` chains both over one ``TextState``.
"""

from __future__ import annotations

import re
from codecs import utf_8_decode
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "MAX_PREFIX_COST",
    "NO_STOPS",
    "Stops",
    "TextState",
    "check_prefix_cost",
    "decode_flush",
    "decode_step",
    "stop_flush",
    "stop_step",
    "text_flush",
    "text_step",
]


def decode_step(held: bytes, piece: bytes) -> tuple[bytes, str]:
    """Decode one token piece, holding back a character that is not complete yet.

    Args:
        held: bytes held by the previous step (``b""`` at the start).
        piece: the token's bytes; it may start or end inside a multi-byte character.

    Returns:
        ``(held, text)``: the bytes to pass to the next step (at most 3, always a valid but
        unfinished UTF-8 sequence) and the text that is complete now. Invalid bytes give one
        U+FFFD per maximal invalid subpart, as ``bytes.decode("utf-8", "replace")`` does.
    """
    data = held + piece if held else piece
    # The C decoder behind codecs' incremental UTF-8 decoder: with final=False it leaves a
    # valid but unfinished trailing sequence unconsumed and replaces everything invalid.
    text, consumed = utf_8_decode(data, "replace", False)
    return data[consumed:], text


def decode_flush(held: bytes) -> str:
    """Release held bytes at the end of generation.

    Args:
        held: bytes held by the last ``decode_step``.

    Returns:
        ``""`` when nothing is held, else U+FFFD for the unfinished character.
    """
    return held.decode("utf-8", "replace")


# Holding back text that could still become a stop (or a banned phrase) tables every prefix of
# every string: the cost grows with each length squared. This bound (about 0.8 s to prepare)
# refuses what would otherwise take minutes.
MAX_PREFIX_COST = 2_000_000


def check_prefix_cost(strings: Iterable[str], what: str) -> None:
    """Refuse strings whose prefix tables would take too long to build.

    Raises:
        ValueError: the lengths squared sum past :data:`MAX_PREFIX_COST` (both named).
    """
    lengths = [len(s) for s in strings]
    cost = sum(n * n for n in lengths)
    if cost > MAX_PREFIX_COST:
        raise ValueError(
            f"{what} of {sum(lengths)} characters (the longest {max(lengths)}) are too long to "
            f"match as they stream: the sum of their lengths squared, {cost}, is over "
            f"{MAX_PREFIX_COST}; keep each under about 1,000 characters"
        )


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_no_surrogate(text: str, what: str) -> None:
    """Check that a string to find in generated text holds no lone surrogate: generated text
    is decoded UTF-8, which never holds one, so such a string could never match.

    Raises:
        ValueError: it does (the string and the code point named), as a constraint's literal
            with one is refused.
    """
    bad = _SURROGATE.search(text)
    if bad:
        raise ValueError(
            f"{what} {text!r} contains the lone surrogate U+{ord(bad[0]):04X}, which no "
            "generated text holds"
        )


@dataclass(frozen=True, slots=True)
class Stops:
    """Stop strings and how a hit is emitted; immutable, precomputes its lookup tables.

    Attributes:
        strings: the stop strings; each non-empty. Empty means generation never stops on text.
        include_stop: whether the emitted text ends with the stop string that was hit.
        max_len: length of the longest stop string (0 without stops).

    Raises:
        TypeError: ``strings`` is a single ``str`` or holds a non-``str``.
        ValueError: a stop string is empty or holds a lone surrogate (it could never match).
    """

    strings: tuple[str, ...] = ()
    include_stop: bool = False
    max_len: int = field(init=False, repr=False, compare=False)
    _any_stop: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _prefix_ends: frozenset[str] = field(init=False, repr=False, compare=False)
    _held_suffix: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Validate the strings and build the prefix tables.

        Raises:
            TypeError: ``strings`` is a single ``str`` or holds a non-``str``.
            ValueError: a stop string is empty or holds a lone surrogate.
        """
        if isinstance(self.strings, str):
            raise TypeError(f"stop strings must be a tuple of str, not the str {self.strings!r}")
        strings = tuple(self.strings)
        for stop in strings:
            if not isinstance(stop, str):
                raise TypeError(f"stop string {stop!r} is a {type(stop).__name__}, not a str")
            if not stop:
                raise ValueError(f"stop string {stop!r} is empty; stops are {strings!r}")
            check_no_surrogate(stop, "stop string")
        check_prefix_cost(strings, "stop strings")
        prefixes = {stop[:k] for stop in strings for k in range(1, len(stop))}
        # Anchored at the end, searched left to right: the first match is the longest suffix.
        alternatives = "|".join(map(re.escape, sorted(prefixes, key=len, reverse=True)))
        object.__setattr__(self, "strings", strings)
        object.__setattr__(self, "max_len", max(map(len, strings), default=0))
        object.__setattr__(self, "_any_stop", re.compile("|".join(map(re.escape, strings))))
        object.__setattr__(self, "_prefix_ends", frozenset(prefix[-1] for prefix in prefixes))
        object.__setattr__(self, "_held_suffix", re.compile(f"(?:{alternatives or '(?!)'})\\Z"))


NO_STOPS = Stops()


def _first_hit(buffer: str, stops: Stops) -> tuple[int, str] | None:
    """The stop that ends first in ``buffer`` (longest on a tie) as ``(start, stop)``."""
    if stops._any_stop.search(buffer) is None:
        return None
    best: str | None = None
    best_end = len(buffer) + 1
    for stop in stops.strings:
        start = buffer.find(stop)
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or end < best_end or (end == best_end and len(stop) > len(best)):
            best, best_end = stop, end
    return None if best is None else (best_end - len(best), best)


def _hold_length(buffer: str, stops: Stops) -> int:
    """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
    if not buffer or buffer[-1] not in stops._prefix_ends:
        return 0
    match = stops._held_suffix.search(buffer, max(0, len(buffer) - stops.max_len + 1))
    return 0 if match is None else len(buffer) - match.start()


def stop_step(held: str, text: str, stops: Stops) -> tuple[str, str, str | None]:
    """Append ``text`` and emit what can no longer become part of a stop string.

    Args:
        held: text held by the previous step (``""`` at the start).
        text: new text, of any length.
        stops: the stop strings.

    Returns:
        ``(held, emit, hit)``. Without a hit, ``emit`` is everything but the longest suffix that
        is a proper prefix of some stop, which is held. On a hit, ``hit`` is the stop that ends
        first (longest on a tie), ``emit`` is the text before it (through it with
        ``include_stop``), ``held`` is ``""`` and the rest of the text is discarded.
    """
    if not stops.strings:
        return "", held + text if held else text, None
    buffer = held + text
    found = _first_hit(buffer, stops)
    if found is not None:
        start, stop = found
        end = start + len(stop) if stops.include_stop else start
        return "", buffer[:end], stop
    keep = _hold_length(buffer, stops)
    return buffer[len(buffer) - keep :], buffer[: len(buffer) - keep], None


def stop_flush(held: str) -> str:
    """Release the held text at the end of generation (length limit or end of sequence).

    Args:
        held: text held by the last ``stop_step``; it never contains a whole stop string.

    Returns:
        The held text, unchanged.
    """
    return held


@dataclass(frozen=True, slots=True)
class TextState:
    """Everything the text side holds between tokens; a checkpoint keeps it as is.

    Attributes:
        held_bytes: bytes of a character not finished yet (at most 3).
        held_text: text that may still be the start of a stop string.
    """

    held_bytes: bytes = b""
    held_text: str = ""


_EMPTY = TextState()


def text_step(state: TextState, piece: bytes, stops: Stops) -> tuple[TextState, str, str | None]:
    """Decode one token piece and pass its text through the stop matcher.

    Args:
        state: the state after the previous token (``TextState()`` at the start).
        piece: the token's bytes.
        stops: the stop strings.

    Returns:
        ``(state, emit, hit)``: the next state, the text to stream now, and the stop string hit
        (``None`` when generation goes on). After a hit the state is empty and generation ends.
    """
    held_bytes, text = decode_step(state.held_bytes, piece)
    if not text:
        return TextState(held_bytes, state.held_text), "", None
    held_text, emit, hit = stop_step(state.held_text, text, stops)
    if hit is not None:
        return _EMPTY, emit, hit
    if not held_bytes and not held_text:
        return _EMPTY, emit, None  # the common case; building a frozen dataclass costs ~0.5 µs
    return TextState(held_bytes, held_text), emit, None


def text_flush(state: TextState, stops: Stops) -> tuple[str, str | None]:
    """Release everything held at the end of generation.

    The unfinished character (if any) becomes U+FFFD, which still goes through the stop
    matcher, so a stop string containing U+FFFD can hit here.

    Args:
        state: the state after the last token.
        stops: the stop strings.

    Returns:
        ``(emit, hit)``: the remaining text and the stop string hit by it, or ``None``.
    """
    held_text, emit, hit = stop_step(state.held_text, decode_flush(state.held_bytes), stops)
    return (emit, hit) if hit is not None else (emit + stop_flush(held_text), None)
