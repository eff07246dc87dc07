"""Building blocks for writing GBNF: literals, character sets, rule sets and number ranges.

Shared by the regex and JSON Schema compilers in :mod:`lcgen.grammar`. Everything here is
pure text manipulation; nothing knows about llama.cpp.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal

from lcgen.errors import GrammarError


class Unsupported(GrammarError):
    """What lcgen cannot compile, valid as it is: a regex construct, a bound past llama.cpp's
    (a schema's pattern or length raising it is an UnsupportedSchemaError, not invalid)."""


MAX_CODEPOINT = 0x10FFFF
SURROGATES = ((0xD800, 0xDFFF),)
# llama.cpp turns a bounded repetition above this into an unbounded one, silently.
MAX_REPEAT = 2000
# An unbounded number is written with at most this many digits before the point and after it:
# every 64-bit integer, and every double as Python writes it without an exponent (17
# significant digits from 1e-4 up: 20 places). A small model that starts repeating a digit
# has to end the number instead of filling max_tokens (llama.cpp's own converter allows 16).
MAX_DIGITS = 20
MAX_PLACES = 20

Ranges = tuple[tuple[int, int], ...]


# character sets (sorted, disjoint, inclusive code point ranges) ------------------------------
def ranges_of(items: Iterable[tuple[int, int]]) -> Ranges:
    """Sort and merge code point ranges."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(items):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def complement(ranges: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    start = 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODEPOINT:
        out.append((start, MAX_CODEPOINT))
    return tuple(out)


def subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    return intersect(ranges, complement(removed))


def intersect(a: Ranges, b: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _class_char(cp: int) -> str:
    if cp in (0x5C, 0x5D, 0x5B, 0x2D, 0x5E, 0x22):  # \ ] [ - ^ "
        return "\\" + chr(cp) if cp != 0x5E else "\\x5E"
    if 0x20 < cp < 0x7F:
        return chr(cp)
    if cp <= 0xFF:
        return f"\\x{cp:02X}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def char_class(ranges: Ranges) -> str:
    """A GBNF character class matching exactly the code points in ``ranges``.

    Raises:
        GrammarError: the set is empty (no character matches).
    """
    if not ranges:
        raise GrammarError("a character class matches no character")
    negated = complement(ranges)
    # llama.cpp rejects a token that ends inside a multi-byte character when a negated class
    # excludes any character that token could still become: negate only ASCII characters.
    ascii_only = not negated or negated[-1][1] < 0x80
    use, prefix = (negated, "^") if ascii_only and len(negated) < len(ranges) else (ranges, "")
    if not use:  # every code point
        return "[\\x00-\\U0010FFFF]"
    parts = [
        _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in use
    ]
    return "[" + prefix + "".join(parts) + "]"


def literal(text: str) -> str:
    """A GBNF string literal matching exactly ``text``."""
    out = ['"']
    for ch in text:
        cp = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif cp < 0x20 or cp == 0x7F:
            out.append(f"\\x{cp:02X}")
        elif 0xD800 <= cp <= 0xDFFF:
            raise GrammarError(f"a literal contains the lone surrogate U+{cp:04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def alternatives(options: Iterable[str]) -> str:
    """``( a | b | ... )``; a single option is returned as it is."""
    unique = list(dict.fromkeys(options))
    if not unique:
        raise GrammarError("no alternative matches")
    return unique[0] if len(unique) == 1 else "(" + " | ".join(unique) + ")"


# alternatives of literal texts, as a prefix tree -------------------------------------------------
@dataclass(frozen=True, slots=True)
class Expr:
    """A piece of an option already written as GBNF (a character's escapes, a number's optional
    zeros): options that start with the same pieces share them; nothing looks inside."""

    gbnf: str


Piece = str | Expr  # a str is one character of text, written as :func:`literal` writes it

# Levels of parentheses a prefix tree nests in one rule before a deeper node gets a rule of its
# own: llama.cpp parses a group by recursion, so a long option that branches at every
# character (``a``, ``aa``, ``aaa``, ...) must not nest its whole length; and llguidance's Lark
# parser refuses a rule nested about 50 deep, which :mod:`lcgen.constrain.lark` writes 3 or 4
# per level here (measured: 12 levels pass, 14 fail; 8 leaves room for the pieces' own).
MAX_TRIE_NESTING = 8


@dataclass(slots=True)
class _Node:
    children: dict[Piece, _Node] = field(default_factory=dict)
    end: bool = False


def trie(options: Iterable[Sequence[Piece]], rules: RuleSet, name: str = "option") -> str:
    """Exactly one of ``options`` (each a sequence of pieces), written as a prefix tree:
    ``"v10" | "v11" | "v2"`` becomes ``"v" ("1" ("0" | "1") | "2")``.

    Why: llama.cpp's grammar keeps one stack per alternative still alive, and every token it
    checks or accepts walks them all, so a flat alternation of n options costs n per step (a
    20,000-option choice took seconds a token). In the tree only the children of one node are
    alive. The language is the same (a concatenation distributes over alternatives); an option
    that is a prefix of another ends with an empty alternative. Nodes nested deeper than
    :data:`MAX_TRIE_NESTING` become rules named after ``name`` in ``rules``.

    Raises:
        GrammarError: there is no option.
    """
    root = _Node()
    for option in options:
        node = root
        for piece in option:
            child = node.children.get(piece)
            if child is None:  # not setdefault: a node made per piece doubled the time
                child = node.children[piece] = _Node()
            node = child
        node.end = True
    if not root.children and not root.end:
        raise GrammarError("no alternative matches")
    deferred: list[tuple[str, _Node]] = []

    def body(node: _Node, depth: int) -> list[str]:
        """The alternatives of the language from ``node`` on."""
        out = []
        for piece, child in node.children.items():
            parts, text = [], ""
            while True:  # a run of single-child nodes is one sequence, no nesting
                if isinstance(piece, Expr):
                    parts += [literal(text), piece.gbnf] if text else [piece.gbnf]
                    text = ""
                else:
                    text += piece
                if child.end or len(child.children) != 1:
                    break
                ((piece, child),) = child.children.items()
            if text:
                parts.append(literal(text))
            if child.children:
                parts.append(group(child, depth + 1))
            out.append(" ".join(parts))
        return out + (['""'] if node.end else [])

    def group(node: _Node, depth: int) -> str:
        if depth >= MAX_TRIE_NESTING:
            rule = rules.reserve(name)
            deferred.append((rule, node))
            return rule
        return "(" + " | ".join(body(node, depth)) + ")"

    top = body(root, 0)
    while deferred:  # a worklist, not recursion: any depth of tree
        rule, node = deferred.pop()
        rules.define(rule, " | ".join(body(node, 0)))
    return top[0] if len(top) == 1 else "(" + " | ".join(top) + ")"


def repeat(item: str, low: int, high: int | None) -> str:
    """``item`` repeated ``low`` to ``high`` times (None: no upper bound)."""
    for bound in (low, high):
        if bound is not None and bound > MAX_REPEAT:
            raise Unsupported(
                f"a repetition bound of {bound} is over llama.cpp's limit of {MAX_REPEAT}"
            )
    if high is not None and high < low:
        raise GrammarError(f"repetition {{{low},{high}}} has its maximum below its minimum")
    if high == 0:
        return '""'
    if (low, high) == (0, None):
        return f"{item}*"
    if (low, high) == (1, None):
        return f"{item}+"
    if (low, high) == (0, 1):
        return f"{item}?"
    if high == low:
        return f"{item}{{{low}}}" if low != 1 else item
    return f"{item}{{{low},{'' if high is None else high}}}"


class RuleSet:
    """Named GBNF rules, added in order; identical bodies share one name."""

    def __init__(self, reserved: Iterable[str] = ("root",)) -> None:
        self.rules: dict[str, str] = {}
        self._by_body: dict[str, str] = {}
        self._reserved = set(reserved)  # names :meth:`define` gives: never made up

    def add(self, name: str, body: str) -> str:
        existing = self._by_body.get(body)
        if existing is not None:
            return existing
        name = self.reserve(name)
        self.rules[name] = body
        self._by_body[body] = name
        return name

    def reserve(self, name: str) -> str:
        """A fresh name (made of what GBNF allows) whose body is given later with
        :meth:`define` (for recursion)."""
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", name).strip("-") or "r"
        n, fresh = 1, base
        while fresh in self.rules or fresh in self._reserved:
            n += 1
            fresh = f"{base}-{n}"
        self.rules[fresh] = ""
        return fresh

    def define(self, name: str, body: str) -> None:
        self.rules[name] = body

    def text(self, root_body: str) -> str:
        """The grammar: root and the rules it reaches. A visit that failed (a property or an
        alternative no value satisfies) leaves rules nothing refers to, one of them reserved
        and never defined, which llama.cpp would refuse."""
        used: set[str] = set()
        todo = [root_body]
        while todo:
            for word in _WORDS.findall(todo.pop()):
                if word in self.rules and word not in used:
                    used.add(word)
                    todo.append(self.rules[word])
        lines = [f"root ::= {root_body}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items() if name in used]
        return "\n".join(lines) + "\n"


# A rule body's literals, character classes and names (a name is a word outside the others).
_WORDS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[a-zA-Z0-9-]+')


# integer ranges -------------------------------------------------------------------------------
def _digit_class(lo: int, hi: int) -> str:
    return f"[{lo}]" if lo == hi else f"[{lo}-{hi}]"


def _same_length(a: str, b: str) -> str:
    """Digit strings of len(a) == len(b) between a and b (inclusive, a <= b)."""
    if a == b:
        return literal(a)
    k = len(a) - 1
    if k == 0:
        return _digit_class(int(a), int(b))
    common = 0
    while a[common] == b[common]:
        common += 1
    if common:
        return f"{literal(a[:common])} {_same_length(a[common:], b[common:])}"
    tail = f" [0-9]{{{k}}}" if k > 1 else " [0-9]"
    lo0, hi0 = int(a[0]), int(b[0])
    options: list[str] = []
    if a[1:] != "0" * k:
        options.append(f"{literal(a[0])} {_group(_same_length(a[1:], '9' * k))}")
        lo0 += 1
    last = None
    if b[1:] != "9" * k:
        last = f"{literal(b[0])} {_group(_same_length('0' * k, b[1:]))}"
        hi0 -= 1
    if lo0 <= hi0:
        options.append(_digit_class(lo0, hi0) + tail)
    if last:
        options.append(last)
    return alternatives(options)


def _group(expr: str) -> str:
    return f"({expr})" if " " in expr or "|" in expr else expr


def natural_range(lo: int, hi: int | None) -> str | None:
    """Canonical decimal naturals (no leading zeros) in [lo, hi]; None when empty."""
    if hi is not None and lo > hi:
        return None
    options = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for n_digits in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (n_digits - 1) if n_digits > 1 else 0)
        b = 10**n_digits - 1 if hi is None else min(hi, 10**n_digits - 1)
        options.append(_same_length(str(a), str(b)))
    if hi is None:
        longest = max(len(str(lo)), MAX_DIGITS - 1)
        options.append(f"[1-9] {repeat('[0-9]', len(str(lo)), longest)}")
    return alternatives(options)


def integer_range(lo: int | None, hi: int | None) -> str:
    """Canonical decimal integers in [lo, hi] (None: unbounded on that side).

    Raises:
        GrammarError: the range is empty.
    """
    options = []
    if hi is None or hi >= 0:
        positive = natural_range(max(lo, 0) if lo is not None else 0, hi)
        if positive:
            options.append(positive)
    if lo is None or lo < 0:
        magnitude = natural_range(max(1, -hi) if hi is not None else 1, None if lo is None else -lo)
        if magnitude:
            options.append(f'"-" {_group(magnitude)}')
    if not options:
        raise GrammarError(f"no integer lies in [{lo}, {hi}]")
    return alternatives(options)


# decimal ranges (numbers written without an exponent) -----------------------------------------
Bound = tuple[Decimal, bool]  # (value, exclusive)
_Side = tuple[str, str] | None  # (fraction digits still tied with the bound, "ge"|"gt"|"le"|"lt")


def _zero_ok(side: _Side) -> bool:
    """Whether a fraction that ends here (all further digits 0) satisfies ``side``."""
    if side is None:
        return True
    digits, op = side
    if not digits:
        return op in ("ge", "le")
    return op in ("le", "lt")


def _norm(side: _Side) -> _Side | Literal[False]:
    """None when every fraction satisfies ``side``, False when none does."""
    if side is not None and not side[0]:
        if side[1] == "ge":
            return None
        if side[1] == "lt":
            return False
    return side


def _next_side(side: _Side, digit: int) -> _Side | Literal[False]:
    """The side after one more fraction digit: None when satisfied, False when violated."""
    if side is None:
        return None
    digits, op = side
    c = int(digits[0]) if digits else 0
    if digit == c:
        return _norm((digits[1:], op))
    if (digit > c) == (op in ("ge", "gt")):
        return None
    return False


def _digits(n: int, nonzero_end: bool) -> str:
    """1 to ``n`` digits (the last not 0 when ``nonzero_end``)."""
    return f"({repeat('[0-9]', 0, n - 1)} [1-9])" if nonzero_end else repeat("[0-9]", 1, n)


class _Fractions:
    """Named rules for fraction digit strings d1 d2 ... such that 0.d1d2... meets two bounds,
    at most ``places`` digits long (``nonzero_end``: the last digit is not 0, so that the
    number is no integer)."""

    def __init__(self, rules: RuleSet, need_fraction: bool, places: int, nonzero_end: bool) -> None:
        self.rules = rules
        self.need_fraction = need_fraction or nonzero_end
        self.places = places
        self.nonzero_end = nonzero_end
        self.names: dict[tuple[_Side, _Side, int], str | None] = {}

    def part(self, lo: _Side, hi: _Side) -> str | None:
        """The optional ``"." digits`` part of a number; None when no fraction fits."""
        nlo, nhi = _norm(lo), _norm(hi)
        if nlo is False or nhi is False:
            return None
        lo, hi = nlo, nhi
        digits = self.nonempty(lo, hi, self.places)
        if _zero_ok(lo) and _zero_ok(hi) and not self.need_fraction:
            return f'("." {digits})?' if digits else '""'
        return f'"." {digits}' if digits else None

    def nonempty(self, lo: _Side, hi: _Side, left: int) -> str | None:
        if left == 0:
            return None
        key = (lo, hi, left)
        if key in self.names:
            return self.names[key]
        if lo is None and hi is None:
            return _digits(left, self.nonzero_end)
        name = self.rules.reserve("frac")
        self.names[key] = name
        by_next: dict[tuple[_Side, _Side], list[int]] = {}
        for digit in range(10):
            nlo, nhi = _next_side(lo, digit), _next_side(hi, digit)
            if nlo is not False and nhi is not False:
                by_next.setdefault((nlo, nhi), []).append(digit)
        options = []
        for (nlo, nhi), digits in by_next.items():
            rest = self.nonempty(nlo, nhi, left - 1)
            if _zero_ok(nlo) and _zero_ok(nhi):
                # (may end after these digits: after a 0 not where the end must not be 0)
                ending = [d for d in digits if d or not self.nonzero_end]
                if ending and not rest:
                    options.append(_class(ending))
                elif ending and nlo is None and nhi is None and not self.nonzero_end:
                    options.append(f"{_class(ending)} {repeat('[0-9]', 0, left - 1)}")
                elif ending:
                    options.append(f"{_class(ending)} {rest}?")
                if len(ending) < len(digits) and rest:
                    options.append(f'"0" {rest}')
            elif rest:
                options.append(f"{_class(digits)} {rest}")
        if not options:
            self.names[key] = None
            del self.rules.rules[name]
            return None
        self.rules.define(name, " | ".join(options))
        return name


def _class(digits: list[int]) -> str:
    return "[" + "".join(str(d) for d in digits) + "]"


def _split(value: Decimal) -> tuple[int, str]:
    """(integer part, fraction digits without trailing zeros) of a non-negative decimal."""
    whole = int(value)
    text = format(value - whole, "f")
    fraction = text.split(".", 1)[1].rstrip("0") if "." in text else ""
    return whole, fraction


def _nonneg_decimal(
    rules: RuleSet,
    lo: Bound,
    hi: Bound | None,
    need_fraction: bool,
    places: int,
    nonzero_end: bool = False,
) -> str | None:
    """Decimal texts (``int`` or ``int.digits``) of values in the range, lo >= 0."""
    fr = _Fractions(rules, need_fraction, places, nonzero_end)
    a, fa = _split(lo[0])
    lo_side: _Side = (fa, "gt" if lo[1] else "ge")
    digits = _digits(places, nonzero_end)
    any_fraction = f'"." {digits}' if fr.need_fraction else f'("." {digits})?'
    if hi is None:
        options = [f"{literal(str(a))} {fr.part(lo_side, None)}"]
        options.append(f"{_group(natural_range(a + 1, None) or '')} {any_fraction}")
        return alternatives(options)
    b, fb = _split(hi[0])
    hi_side: _Side = (fb, "lt" if hi[1] else "le")
    if lo[0] > hi[0] or (lo[0] == hi[0] and (lo[1] or hi[1])):
        return None
    options = []
    if a == b:
        part = fr.part(lo_side, hi_side)
        if part:
            options.append(f"{literal(str(a))} {part}")
    else:
        low_part, high_part = fr.part(lo_side, None), fr.part(None, hi_side)
        if low_part:
            options.append(f"{literal(str(a))} {low_part}")
        middle = natural_range(a + 1, b - 1)
        if middle:
            options.append(f"{_group(middle)} {any_fraction}")
        if high_part:
            options.append(f"{literal(str(b))} {high_part}")
    return alternatives(options) if options else None


def decimal_range(
    rules: RuleSet,
    lo: Bound | None,
    hi: Bound | None,
    need_fraction: bool = False,
    places: int = MAX_PLACES,
    nonzero_end: bool = False,
) -> str:
    """Numbers written ``-?int(.digits)?`` (``-?int.digits`` when ``need_fraction``; at most
    ``places`` digits after the point; ``nonzero_end``: with digits, the last not 0, so that
    no integer is written) whose value lies between the bounds.

    Raises:
        GrammarError: no number lies between the bounds.
    """
    zero = Decimal(0)
    options = []
    if hi is None or hi[0] > 0 or (hi[0] == 0 and not hi[1]):
        low = lo if lo is not None and lo[0] >= 0 else (zero, False)
        positive = _nonneg_decimal(rules, low, hi, need_fraction, places, nonzero_end)
        if positive:
            options.append(positive)
    if lo is None or lo[0] < 0:
        m_lo = (-hi[0], hi[1]) if hi is not None and hi[0] < 0 else (zero, True)
        m_hi = (-lo[0], lo[1]) if lo is not None else None
        negative = _nonneg_decimal(rules, m_lo, m_hi, need_fraction, places, nonzero_end)
        if negative:
            options.append(f'"-" {_group(negative)}')
    if not options:
        raise GrammarError(f"no number lies between {lo} and {hi}")
    return alternatives(options)
