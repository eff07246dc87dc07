"""``\\uXXXX`` escapes of non-ASCII characters inside JSON strings, as GBNF.

JSON may write any character as ``\\u`` and four hex digits (either case), and one beyond
U+FFFF as a UTF-16 surrogate pair; Python's ``json.dumps`` does so for every non-ASCII
character and DEL (U+007F) by default. Where a grammar writes specific characters (a pattern's
classes, a constant, a property name), these let the escaped form through as well as the raw
one.
"""

from __future__ import annotations

import functools

from lcgen.constrain import gbnf as g

_BMP = ((0x7F, 0xD7FF), (0xE000, 0xFFFF))  # DEL and non-ASCII, no surrogates
_ASTRAL = ((0x10000, g.MAX_CODEPOINT),)
_U = g.literal("\\u")
_ANY_HEX = "[0-9a-fA-F]"


@functools.lru_cache(maxsize=4096)  # the same classes recur across states and schemas
def escapes(ranges: g.Ranges) -> str | None:
    """GBNF for the JSON escapes of DEL and the non-ASCII code points in ``ranges`` (None when
    there are none)."""
    options = [f"{_U} {_hex_range(lo, hi, 4)}" for lo, hi in g.intersect(ranges, _BMP)]
    for lo, hi in g.intersect(ranges, _ASTRAL):
        options += _pairs(lo, hi)
    return g.alternatives(options) if options else None


def _pairs(lo: int, hi: int) -> list[str]:
    """Surrogate-pair escapes of the code points ``lo..hi`` (all above U+FFFF)."""
    (h_lo, l_lo), (h_hi, l_hi) = _surrogates(lo), _surrogates(hi)

    def pair(h0: int, h1: int, l0: int, l1: int) -> str:
        return f"{_U} {_hex_range(h0, h1, 4)} {_U} {_hex_range(l0, l1, 4)}"

    if h_lo == h_hi:
        return [pair(h_lo, h_lo, l_lo, l_hi)]
    out = [pair(h_lo, h_lo, l_lo, 0xDFFF)]
    if h_lo + 1 <= h_hi - 1:
        out.append(pair(h_lo + 1, h_hi - 1, 0xDC00, 0xDFFF))
    out.append(pair(h_hi, h_hi, 0xDC00, l_hi))
    return out


def _surrogates(cp: int) -> tuple[int, int]:
    offset = cp - 0x10000
    return 0xD800 + (offset >> 10), 0xDC00 + (offset & 0x3FF)


def _digits(lo: int, hi: int) -> str:
    """One hex digit from ``lo`` to ``hi`` (values), in either case."""
    if lo == hi < 10:
        return g.literal(str(lo))
    ranges = []
    for v in range(lo, hi + 1):
        if v < 10:
            ranges.append((ord("0") + v, ord("0") + v))
        else:
            ranges += [(ord("a") + v - 10,) * 2, (ord("A") + v - 10,) * 2]
    return g.char_class(g.ranges_of(ranges))


def _hex_range(lo: int, hi: int, width: int) -> str:
    """``width`` hex digits whose value lies in ``lo..hi``, most significant first."""
    if width == 0:
        return '""'
    unit = 16 ** (width - 1)
    (d_lo, r_lo), (d_hi, r_hi) = divmod(lo, unit), divmod(hi, unit)
    if d_lo == d_hi:
        return _join(_digits(d_lo, d_lo), _hex_range(r_lo, r_hi, width - 1))
    full = unit - 1
    options = []
    first = d_lo if r_lo == 0 else d_lo + 1
    last = d_hi if r_hi == full else d_hi - 1
    if first > d_lo:
        options.append(_join(_digits(d_lo, d_lo), _hex_range(r_lo, full, width - 1)))
    if first <= last:
        options.append(_join(_digits(first, last), g.repeat(_ANY_HEX, width - 1, width - 1)))
    if last < d_hi:
        options.append(_join(_digits(d_hi, d_hi), _hex_range(0, r_hi, width - 1)))
    return g.alternatives(options)


def _join(head: str, tail: str) -> str:
    return head if tail == '""' else f"{head} {tail}"
