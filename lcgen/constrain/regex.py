"""Compile a practical subset of Python regular expressions to GBNF, exactly.

Supported: literals, escapes (``\\n \\t \\xhh \\uhhhh \\Uhhhhhhhh \\N{name}``, octal, escaped
punctuation), character classes with ranges and negation, ``.``, ``\\d \\w \\s`` and their
negations (with Python's Unicode meaning), groups (``(...)``, ``(?:...)``, ``(?P<name>...)``,
ECMA-262's ``(?<name>...)``),
alternation, ``? * + {m} {m,} {,n} {m,n}`` (lazy forms too: same language), and anchors
(``^ $ \\A \\Z``) at the ends of the top-level alternatives. Anything else (backreferences,
lookaround, word boundaries, flags, possessive quantifiers, atomic groups, conditionals) raises
:class:`~lcgen.errors.GrammarError` naming it.

Two encodings of the matched characters: plain text, or the body of a JSON string (for JSON
Schema ``pattern``), where each character is written in its canonical JSON form, or as a
``\\uXXXX`` escape when it is not ASCII (as ``json.dumps`` writes it).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import unicodedata
import warnings
from dataclasses import dataclass

from lcgen.constrain import gbnf as g
from lcgen.constrain import lark
from lcgen.constrain.escapes import escapes
from lcgen.errors import GrammarError

# NUL ends a token piece inside llama.cpp's grammar (a C string): it can never be generated raw.
_UNWRITABLE = g.ranges_of([(0, 0), (0xD800, 0xDFFF)])
_JSON_ESCAPED = g.ranges_of([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
_ANY = ((0, g.MAX_CODEPOINT),)
_DOT = g.complement(((0x0A, 0x0A),))
# ECMA-262's "." stops at every line terminator, Python's only at "\n".
_PORTABLE_DOT = g.complement(g.ranges_of([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))
_ECMA_SPACE = "\t\n\v\f\r \xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
_ECMA_SPACE += "\u2028\u2029\u202f\u205f\u3000\ufeff"
# What ECMA-262 (JSON Schema's regex dialect) reads as \d, \w, \s.
_ECMA_CLASSES = {
    "d": g.ranges_of([(0x30, 0x39)]),
    "w": g.ranges_of([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]),
    "s": g.ranges_of((ord(c), ord(c)) for c in _ECMA_SPACE),
}
_NEVER = "[^\\x00-\\U0010FFFF]"  # a character class no character matches
_SIMPLE_ESCAPES = {"a": 7, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}


@dataclass(frozen=True)
class Chars:
    ranges: g.Ranges


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Rep:
    item: Node
    low: int
    high: int | None


@dataclass(frozen=True)
class Anchor:
    end: bool  # False: ^ or \A; True: $ or \Z
    strict: bool  # \Z (end only) rather than $ (end, or before a final newline)


Node = Chars | Seq | Alt | Rep | Anchor
EMPTY = Seq(())


@functools.cache
def python_class(letter: str) -> g.Ranges:
    """The code points Python's ``\\d``, ``\\w`` or ``\\s`` match (str patterns, Unicode)."""
    everything = "".join(map(chr, range(g.MAX_CODEPOINT + 1)))
    found = re.finditer(f"\\{letter.lower()}+", everything)
    ranges = g.ranges_of((m.start(), m.end() - 1) for m in found)
    return g.complement(ranges) if letter.isupper() else ranges


@functools.cache
def portable_class(letter: str, *, widest: bool = False) -> g.Ranges:
    """What ``\\d``, ``\\w``, ``\\s`` (or a negation) may stand for where Python's ``re``
    (Unicode) and ECMA-262 must both agree: the characters both match, or with ``widest``
    those either matches (a negated class's items, whose complement must stay narrow)."""
    base = letter.lower()
    python, ecma = python_class(base), _ECMA_CLASSES[base]
    if letter.isupper():  # the complement of the other side's set
        return g.complement(portable_class(base, widest=not widest))
    if widest:
        return g.ranges_of([*python, *ecma])
    return g.complement(g.ranges_of([*g.complement(python), *g.complement(ecma)]))


class _Parser:
    def __init__(self, pattern: str, portable: bool = False, either: bool = False) -> None:
        self.p = pattern
        self.i = 0
        # JSON Schema's patterns are ECMA-262: match only what it and Python's re agree on
        # (ASCII \d and \w, "." before any line terminator, "$" at the very end); with
        # ``either``, what either of them matches.
        self.portable = portable
        self.either = either
        self.negated = False  # inside a negated character class

    def fail(self, what: str, at: int | None = None) -> GrammarError:
        pos = self.i if at is None else at
        return g.Unsupported(f"unsupported in regex /{self.p}/ at position {pos}: {what}")

    def peek(self, n: int = 1) -> str:
        return self.p[self.i : self.i + n]

    def take(self) -> str:
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self) -> Node:
        node = self.alternation()
        if self.i != len(self.p):
            raise self.fail("unbalanced ')'")
        return node

    def alternation(self) -> Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self) -> Node:
        items: list[Node] = []
        while self.i < len(self.p) and self.peek() not in "|)":
            start = self.i
            atom = self.atom()
            atom = self.quantifiers(atom, start)
            items.append(atom)
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantifiers(self, atom: Node, start: int) -> Node:
        bounds = self.quantifier()
        if bounds is None:
            return atom
        if isinstance(atom, Anchor):
            raise self.fail("a quantified anchor", start)
        if self.peek() == "+":
            raise self.fail("possessive quantifier")
        if self.peek() == "?":
            self.i += 1  # lazy: the same set of full matches
        return Rep(atom, *bounds)

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        m = re.compile(r"\{(\d*)(?:(,)(\d*))?\}").match(self.p, self.i)
        if c != "{" or m is None or m.group(0) == "{}":
            return None  # Python reads such a brace literally
        self.i = m.end()
        low = int(m.group(1)) if m.group(1) else 0
        high_text = m.group(3) if m.group(2) else m.group(1)
        return low, int(high_text) if high_text else None

    def atom(self) -> Node:
        start = self.i
        c = self.take()
        if c == "(":
            return self.group(start)
        if c == "[":
            return Chars(self.char_class())
        if c == ".":
            return Chars(_PORTABLE_DOT if self.portable and not self.either else _DOT)
        if c in "^$":
            return Anchor(end=c == "$", strict=self.portable and not self.either)
        if c == "\\":
            return self.escape(in_class=False)
        return Chars(((ord(c), ord(c)),))

    def group(self, start: int) -> Node:
        if self.peek() == "?":
            if self.peek(3) == "?P<":
                self.i = self.p.index(">", self.i) + 1
            elif self.peek(2) == "?:":
                self.i += 2
            elif self.peek(2) == "?#":
                self.i = self.p.index(")", self.i) + 1
                return EMPTY
            else:
                kinds = {"?=": "lookahead", "?!": "negative lookahead", "?<=": "lookbehind",
                         "?<!": "negative lookbehind", "?P=": "backreference",
                         "?>": "atomic group", "?(": "conditional"}  # fmt: skip
                for prefix, kind in sorted(kinds.items(), key=lambda kv: -len(kv[0])):
                    if self.p.startswith(prefix, self.i):
                        raise self.fail(kind, start)
                raise self.fail("inline flags", start)
        inner = self.alternation()
        if self.peek() != ")":
            raise self.fail("unbalanced '('", start)
        self.i += 1
        return inner

    def char_class(self) -> g.Ranges:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        self.negated = negate
        items: list[tuple[int, int]] = []
        first = True
        while first or self.peek() != "]":
            first = False
            lo = self.class_item()
            if self.peek() == "-" and self.peek(2) != "-]" and self.peek(2)[1:] != "]":
                self.i += 1
                hi = self.class_item()
                if isinstance(lo, tuple) or isinstance(hi, tuple):
                    raise self.fail("a class escape as a range end")
                items.append((lo, hi))
            elif isinstance(lo, tuple):
                items.extend(lo)
            else:
                items.append((lo, lo))
        self.i += 1
        self.negated = False
        ranges = g.ranges_of(items)
        return g.complement(ranges) if negate else ranges

    def class_item(self) -> int | g.Ranges:
        c = self.take()
        if c != "\\":
            return ord(c)
        is_set = self.peek() in tuple("dwsDWS")
        node = self.escape(in_class=True)
        assert isinstance(node, Chars)
        return node.ranges if is_set else node.ranges[0][0]

    def escape(self, in_class: bool) -> Node:
        start = self.i - 1
        c = self.take()
        if c in "dwsDWS":
            if self.portable:  # (a negated class's items: the other way round)
                return Chars(portable_class(c, widest=(in_class and self.negated) != self.either))
            return Chars(python_class(c))
        if c in "AZ" and not in_class:
            return Anchor(end=c == "Z", strict=True)
        if c == "b" and in_class:
            return _char(8)
        if c in "bB":
            raise self.fail("word boundary \\" + c, start)
        if c in _SIMPLE_ESCAPES:
            return _char(_SIMPLE_ESCAPES[c])
        if c in "xuU":
            size = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + size]
            self.i += size
            return _char(int(digits, 16))
        if c == "N":
            name_end = self.p.index("}", self.i)
            name = self.p[self.i + 1 : name_end]
            self.i = name_end + 1
            return _char(ord(unicodedata.lookup(name)))
        if c.isdigit():
            return self.octal_or_backreference(c, in_class, start)
        return _char(ord(c))

    def octal_or_backreference(self, c: str, in_class: bool, start: int) -> Node:
        octal = re.compile(r"[0-7]{0,2}" if c == "0" or in_class else r"[0-7]{2}")
        m = octal.match(self.p, self.i)
        if m is None or c in "89":
            raise self.fail("backreference", start)
        self.i = m.end()
        return _char(int(c + m.group(0), 8))


def _char(cp: int) -> Chars:
    return Chars(((cp, cp),))


_ECMA_NAMED = re.compile(
    r"\\k<(?P<ref>[A-Za-z_]\w*)>|\\.|\[\^?\]?(?:\\.|[^\]\\])*\]|\(\?<(?P<group>[A-Za-z_]\w*)>"
)


def python_spelling(pattern: str) -> str:
    """``pattern`` with ECMA-262's named groups ``(?<name>...)`` and references ``\\k<name>``
    spelled as Python's ``(?P<name>...)`` and ``(?P=name)`` (outside classes and escapes)."""

    def spelled(m: re.Match[str]) -> str:
        if m["group"] is not None:
            return f"(?P<{m['group']}>"
        return f"(?P={m['ref']})" if m["ref"] is not None else m[0]

    return _ECMA_NAMED.sub(spelled, pattern) if "<" in pattern else pattern


def parse(pattern: str, *, portable: bool = False, either: bool = False) -> Node:
    """Parse ``pattern`` (checked with Python's ``re`` first) into a syntax tree; with
    ``portable``, one that matches only strings Python's ``re`` and ECMA-262 both match (and
    with ``either`` too, every string one of them matches).

    Raises:
        GrammarError: the pattern is invalid, or uses a construct outside the subset.
    """
    try:
        pattern = python_spelling(pattern)
        # re warns (FutureWarning) of a class its future versions will read otherwise ("[[",
        # "--", "&&" in a class): that is refused. The warning filters are the process's:
        # threads take turns (interleaved, one thread's restore kept another's filter for good).
        with _WARNINGS, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FutureWarning)
            re.compile(pattern)
        future = [w for w in caught if issubclass(w.category, FutureWarning)]
        if future:
            re.purge()  # (re cached it: compiled again, it would not warn)
            raise GrammarError(f"invalid regex /{pattern:.200}/: {future[0].message}")
    except (re.error, OverflowError, RecursionError) as exc:
        # OverflowError: a repetition count beyond re's (a{99999999999999999999});
        # RecursionError: groups nested deeper than re's parser goes
        raise GrammarError(f"invalid regex /{pattern:.200}/: {exc}") from None
    return _Parser(pattern, portable, either).parse()


_WARNINGS = threading.Lock()  # (see parse)


def nullable(node: Node) -> bool:
    if isinstance(node, Chars):
        return False
    if isinstance(node, Seq):
        return all(nullable(item) for item in node.items)
    if isinstance(node, Alt):
        return any(nullable(option) for option in node.options)
    if isinstance(node, Rep):
        return node.low == 0 or nullable(node.item)
    return True


def without_empty(node: Node) -> Node | None:
    """A node matching the same strings as ``node`` except the empty one (None: nothing left)."""
    if not nullable(node):
        return node
    if isinstance(node, Seq):
        if not node.items:
            return None
        head, rest = node.items[0], Seq(node.items[1:])
        options: list[Node] = []
        head_ne = without_empty(head)
        if head_ne is not None:
            options.append(Seq((head_ne, rest)))
        rest_ne = without_empty(rest)
        if rest_ne is not None:
            options.append(rest_ne)
        return Alt(tuple(options)) if len(options) > 1 else (options[0] if options else None)
    if isinstance(node, Alt):
        kept = [k for k in (without_empty(o) for o in node.options) if k is not None]
        return Alt(tuple(kept)) if len(kept) > 1 else (kept[0] if kept else None)
    if isinstance(node, Rep):
        item = without_empty(node.item)
        return None if item is None or node.high == 0 else Rep(item, 1, node.high)
    return None


def branches(
    pattern: str, *, portable: bool = False, either: bool = False
) -> list[tuple[Node, Anchor | None, Anchor | None]]:
    """The top-level alternatives of ``pattern`` (see :func:`parse`), each as (body without
    anchors, its start anchor, its end anchor).

    Raises:
        GrammarError: an invalid pattern, a construct outside the subset, or an anchor that is
            not at an end of a top-level alternative.
    """
    tree = parse(pattern, portable=portable, either=either)
    options = tree.options if isinstance(tree, Alt) else (tree,)
    return [_strip_anchors(option, pattern) for option in options]


def _strip_anchors(branch: Node, pattern: str) -> tuple[Node, Anchor | None, Anchor | None]:
    items = list(branch.items) if isinstance(branch, Seq) else [branch]
    start = end = None
    while items and isinstance(items[0], Anchor) and not items[0].end:
        start = items.pop(0)
    while items and isinstance(items[-1], Anchor) and items[-1].end:
        end = items.pop()
    assert start is None or isinstance(start, Anchor)
    assert end is None or isinstance(end, Anchor)
    body = Seq(tuple(items))
    if _has_anchor(body):
        raise g.Unsupported(
            f"unsupported in regex /{pattern}/: an anchor (^ $ \\A \\Z) other than at the start "
            "or end of the pattern or of a top-level alternative"
        )
    return body, start, end


def _has_anchor(node: Node) -> bool:
    if isinstance(node, Anchor):
        return True
    if isinstance(node, Seq):
        return any(_has_anchor(i) for i in node.items)
    if isinstance(node, Alt):
        return any(_has_anchor(o) for o in node.options)
    if isinstance(node, Rep):
        return _has_anchor(node.item)
    return False


_ONE_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
_ONE_CLASS = re.compile(r"\[(?:[^\]\\]|\\.)*\]")


class Emitter:
    """Writes a syntax tree as a GBNF expression, in plain or JSON-string-body encoding."""

    def __init__(self, json_string: bool) -> None:
        self.json_string = json_string

    def chars(self, ranges: g.Ranges) -> str:
        writable = g.subtract(ranges, _UNWRITABLE if not self.json_string else g.SURROGATES)
        if not writable:  # e.g. only NUL: this branch can never be generated
            return _NEVER
        if not self.json_string:
            if len(writable) == 1 and writable[0][0] == writable[0][1]:
                return g.literal(chr(writable[0][0]))
            return g.char_class(writable)
        options = []
        raw = g.subtract(writable, _JSON_ESCAPED)
        if raw:
            single = len(raw) == 1 and raw[0][0] == raw[0][1]
            options.append(g.literal(chr(raw[0][0])) if single else g.char_class(raw))
            escaped = escapes(raw)  # DEL, non-ASCII also as \uXXXX (json.dumps' way)
            if escaped is not None:
                options.append(escaped)
        for lo, hi in g.intersect(writable, _JSON_ESCAPED):
            options += [g.literal(json.dumps(chr(cp))[1:-1]) for cp in range(lo, hi + 1)]
        return g.alternatives(options)

    def emit(self, node: Node) -> str:
        if isinstance(node, Chars):
            return self.chars(node.ranges)
        if isinstance(node, Seq):
            parts = [self.emit(item) for item in node.items]
            return " ".join(_merge_literals(parts)) if parts else '""'
        if isinstance(node, Alt):
            return g.alternatives(self.emit(option) for option in node.options)
        assert isinstance(node, Rep)
        item, low, high = node.item, node.low, node.high
        if nullable(item):
            stripped = without_empty(item)
            if stripped is None:
                return '""'
            item, low = stripped, 0
        if high == 0:
            return '""'
        inner = self.emit(item)
        atomic = _ONE_LITERAL.fullmatch(inner) or _ONE_CLASS.fullmatch(inner) or _is_group(inner)
        return g.repeat(inner if atomic else f"({inner})", low, high)

    def any_text(self) -> str:
        return g.repeat(f"({self.chars(_ANY)})", 0, None)


def _is_group(expr: str) -> bool:
    """Whether ``expr`` is one parenthesized group, ``( ... )``."""
    if not expr.startswith("("):
        return False
    depth = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[()]', expr):
        depth += {"(": 1, ")": -1}.get(m.group(0), 0)
        if depth == 0:
            return m.end() == len(expr)
    return False


def _merge_literals(parts: list[str]) -> list[str]:
    merged: list[str] = []
    for part in parts:
        if merged and _ONE_LITERAL.fullmatch(part) and _ONE_LITERAL.fullmatch(merged[-1]):
            merged[-1] = merged[-1][:-1] + part[1:]
        else:
            merged.append(part)
    return merged


def json_string_literal(text: str) -> str:
    """A GBNF expression for the body of a JSON string holding exactly ``text``, each character
    written as :class:`Emitter` writes it there (canonical, non-ASCII ones raw or escaped).

    Raises:
        GrammarError: ``text`` holds a lone surrogate (no JSON string spells one raw).
    """
    for ch in text:
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise GrammarError(f"a literal contains the lone surrogate U+{ord(ch):04X}")
    return Emitter(json_string=True).emit(Seq(tuple(_char(ord(ch)) for ch in text)))


def json_string_rules(rules: dict[str, lark.Node], out: g.RuleSet, done: dict[str, str]) -> str:
    """The body of a JSON string whose text is one of rule ``root`` of ``rules`` (parsed GBNF):
    each rule it reaches again in ``out`` (``done``: the copies made so far, by name), each
    character written as :class:`Emitter` writes it in a JSON string."""
    emitter = Emitter(json_string=True)

    def expr(node: lark.Node) -> str:
        if isinstance(node, lark.Lit):
            return json_string_literal(node.text) if node.text else '""'
        if isinstance(node, lark.Cls):
            ranges = g.ranges_of(node.ranges)
            return emitter.chars(g.complement(ranges) if node.negated else ranges)
        if isinstance(node, lark.Ref):
            if node.name not in done:
                done[node.name] = out.reserve(f"{node.name}-in-string")
                out.define(done[node.name], expr(rules[node.name]))
            return done[node.name]
        if isinstance(node, lark.Rep):
            return g.repeat(f"({expr(node.item)})", node.low, node.high)
        parts = [expr(n) for n in (node.items if isinstance(node, lark.Seq) else node.options)]
        joined = (" " if isinstance(node, lark.Seq) else " | ").join(parts)
        return f"({joined})" if parts else '""'

    return expr(rules["root"])


def span(node: Node) -> tuple[int, int | None]:
    """The fewest and the most characters ``node`` matches (None: no most)."""
    if isinstance(node, Chars):
        return 1, 1
    if isinstance(node, Anchor):
        return 0, 0
    if isinstance(node, Seq | Alt):
        spans = [span(n) for n in (node.items if isinstance(node, Seq) else node.options)]
        highs = [x for _, x in spans]
        if isinstance(node, Seq):
            return sum(m for m, _ in spans), None if None in highs else sum(highs)  # type: ignore[arg-type]
        return min(m for m, _ in spans), None if None in highs else max(highs)  # type: ignore[type-var]
    low, high = span(node.item)
    if high == 0 or node.high == 0:
        return 0, 0
    return node.low * low, None if high is None or node.high is None else node.high * high


def within_lengths(node: Node, low: int, high: int | None) -> Node | None:
    """A node matching only strings ``node`` matches whose length is in [low, high] (None: no
    most): all of them where the bounds cut nothing off, else a part (repetitions given fewer
    or more copies, each part of a sequence its share of the lengths); None when no part is
    found. Never a string outside both."""
    least, most = span(node)
    if least >= low and (high is None or (most is not None and most <= high)):
        return node
    if high is not None and least > high:
        return None
    if isinstance(node, Alt):
        kept = [b for o in node.options if (b := within_lengths(o, low, high)) is not None]
        return None if not kept else kept[0] if len(kept) == 1 else Alt(tuple(kept))
    if isinstance(node, Seq):
        return _seq_within(node, low, high)
    if isinstance(node, Rep):
        return _rep_within(node, low, high)
    return None  # one character, or an anchor, outside the lengths


def _seq_within(node: Seq, low: int, high: int | None) -> Node | None:
    """Share the lengths among the items: each its least, more for those that can grow until
    ``low`` is reached, then what ``high`` leaves to the bounded ones, the rest evenly to the
    unbounded ones."""
    spans = [span(item) for item in node.items]
    lows = [m for m, _ in spans]
    need = low - sum(lows)
    for i, (m, x) in enumerate(spans):
        if need <= 0:
            break
        grow = need if x is None else min(x - m, need)
        lows[i] += grow
        need -= grow
    if need > 0:
        return None
    if high is None:  # the least raised; each as long as it likes
        highs: list[int | None] = [x for _, x in spans]
    else:
        fixed, budget = list(lows), high - sum(lows)
        for i, (_, x) in enumerate(spans):
            if x is not None:
                grow = min(x - fixed[i], budget)
                fixed[i] += grow
                budget -= grow
        unbounded = [i for i, (_, x) in enumerate(spans) if x is None]
        for k, i in enumerate(unbounded):  # the first ones one more where it does not divide
            fixed[i] += budget // len(unbounded) + (k < budget % len(unbounded))
        highs = list(fixed)
    items = [within_lengths(n, a, b) for n, a, b in zip(node.items, lows, highs, strict=True)]
    return None if None in items else Seq(tuple(i for i in items if i is not None))


def _rep_within(node: Rep, low: int, high: int | None) -> Node | None:
    """Fewer or more copies. Under a most, copies of varied length are held to lengths that
    keep every count in bounds: a copy of bounded length to its shortest (``%XX`` or a
    character: characters), an unbounded one to what the most leaves each required copy
    (one label of a domain rather than several of one character)."""
    item = without_empty(node.item)
    if item is None:
        return node if low == 0 else None
    least, most = span(item)
    copies_low = max(node.low, -(-low // least))
    size = least
    if least != most and high is not None:
        size = least if most is not None else max(least, high // max(copies_low, 1))
        held = within_lengths(item, least, size)
        if held is None:
            return None
        item = held
    copies_high = node.high if high is None else high // size
    if node.high is not None and copies_high is not None:
        copies_high = min(node.high, copies_high)
    if copies_high is not None and copies_low > copies_high:
        return None
    return Rep(item, copies_low, copies_high)


def regex_to_gbnf(
    pattern: str,
    *,
    json_string: bool = False,
    search: bool = False,
    lengths: tuple[int, int | None] | None = None,
) -> str:
    """A GBNF expression for the strings ``pattern`` matches.

    Args:
        pattern: a Python regular expression in the supported subset.
        json_string: write each character as the body of a JSON string would.
        search: JSON Schema ``pattern`` semantics: the text need only contain a match,
            unless anchors pin it, and only what Python's ``re.search`` and ECMA-262 both
            match (see :func:`parse`); otherwise ``re.fullmatch`` semantics.
        lengths: with ``search``, only texts of these many characters (minLength and
            maxLength beside the pattern): all of them or a part (:func:`within_lengths`).

    Raises:
        GrammarError: an invalid pattern, or a construct outside the subset.
    """
    emitter = Emitter(json_string)
    if lengths is not None:
        assert search
        anything = Rep(Chars(_ANY), 0, None)
        found = [
            within_lengths(
                Seq((anything,) * (start is None) + (body,) + (anything,) * (end is None)), *lengths
            )
            for body, start, end in branches(pattern, portable=True)
        ]
        kept = [emitter.emit(node) for node in found if node is not None]
        if not kept:
            raise GrammarError(f"no text of {lengths[0]} to {lengths[1]} characters matches")
        return g.alternatives(kept)
    options = []
    for body, start, end in branches(pattern, portable=search):
        parts = [emitter.emit(body)]
        if search and start is None:
            parts.insert(0, emitter.any_text())
        if search and end is None:
            parts.append(emitter.any_text())
        elif search and end is not None and not end.strict:
            parts.append(f"{emitter.chars(((10, 10),))}?")
        options.append(" ".join(parts))
    return g.alternatives(options)
