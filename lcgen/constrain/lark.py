"""GBNF in llguidance's Lark dialect, with the language kept exactly (the first step of moving
masks to llguidance; see the constraints section of the README).

llguidance splits a grammar into lexemes (matched by regular expressions, longest match first)
and rules over them (an Earley parser). Longest match is where a plain translation of GBNF goes
wrong: with ``"\\"fxo\\""`` and a ``"\\""`` both possible after ``{``, the lexer that has read
``"f`` keeps to the longer lexeme and loses the other path, so valid text is refused. Here every
lexeme is a single character, except a span that reads as one JSON string: it opens with ``"``,
closes with the first ``"`` no backslash escapes, and its language is regular (no recursive
rule inside). Such spans are prefix-free, so the longest match never has a choice; and a grammar
that could match ``"`` anywhere outside such spans (where a one-character ``"`` lexeme would be
a prefix of a span) gets no spans at all. Inside a JSON string a mask is then the lexer's work
alone, which is what makes llguidance fast there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from lcgen.errors import GrammarError

_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_ESCAPES = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_QUOTE, _BACKSLASH = 0x22, 0x5C
_MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)


@dataclass(frozen=True, slots=True)
class Lit:
    text: str


@dataclass(frozen=True, slots=True)
class Cls:
    negated: bool
    ranges: tuple[tuple[int, int], ...]

    def has(self, cp: int) -> bool:
        return any(lo <= cp <= hi for lo, hi in self.ranges) != self.negated


@dataclass(frozen=True, slots=True)
class Ref:
    name: str


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Rep:
    item: Node
    low: int
    high: int | None


Node = Lit | Cls | Ref | Seq | Alt | Rep


def parse(gbnf: str) -> dict[str, Node]:
    """The rules of a GBNF text, by name (llama.cpp's syntax: a newline ends a rule outside
    parentheses). Surrogates in a character class are left out: no UTF-8 text holds one.

    Raises:
        GrammarError: a construct this translation does not take (``<token>`` references,
            unknown escapes), a syntax error, with its position; a rule defined twice, or an
            escape that is no character (see :func:`redefined`, :func:`bad_escape`).
    """
    return _Parser(gbnf).rules()


def redefined(name: str, first_line: int, second_line: int) -> GrammarError:
    """The error for a rule defined twice. llama.cpp keeps the last definition silently (and
    other engines merge both), so a grammar that does it is refused rather than guessed at."""
    return GrammarError(
        f"rule {name!r} is defined twice (lines {first_line} and {second_line}): write its "
        f"alternatives in one definition ({name} ::= a | b)"
    )


def bad_escape(
    text: str, pos: int, escape: str, value: int, in_literal: bool
) -> GrammarError | None:
    """The error for the escape at offset ``pos`` of ``text``, in a literal (``in_literal``) or
    a character class, where it is no character, or None: a value beyond U+10FFFF anywhere; a
    surrogate (U+D800-U+DFFF) in a literal, which no UTF-8 text holds (in a class it simply
    matches nothing)."""
    if value > _MAX_CODEPOINT:
        problem = "is beyond Unicode (the last code point is U+10FFFF, \\U0010FFFF)"
    elif in_literal and _SURROGATES[0] <= value <= _SURROGATES[1]:
        problem = (
            f"is a lone surrogate (U+{value:04X}), which no UTF-8 text holds: write a "
            "character above U+FFFF as one \\U escape, not as a surrogate pair"
        )
    else:
        return None
    line = text.count("\n", 0, pos) + 1
    where = "a literal" if in_literal else "a character class"
    return GrammarError(f"the escape {escape} in {where} on line {line} {problem}")


def _without_surrogates(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if lo > hi or hi < _SURROGATES[0] or lo > _SURROGATES[1]:
            out.append((lo, hi))
            continue
        if lo < _SURROGATES[0]:
            out.append((lo, _SURROGATES[0] - 1))
        if hi > _SURROGATES[1]:
            out.append((_SURROGATES[1] + 1, hi))
    return tuple(out)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def fail(self, what: str) -> GrammarError:
        return GrammarError(f"cannot translate the grammar to Lark: {what} at offset {self.pos}")

    def line(self, pos: int) -> int:
        return self.text.count("\n", 0, pos) + 1

    def rules(self) -> dict[str, Node]:
        rules: dict[str, Node] = {}
        starts: dict[str, int] = {}
        while True:
            self.space(newlines=True)
            if self.pos >= len(self.text):
                return rules
            start = self.pos
            name = self.name()
            if name in starts:
                raise redefined(name, self.line(starts[name]), self.line(start))
            starts[name] = start
            self.space(newlines=False)
            if not self.text.startswith("::=", self.pos):
                raise self.fail("expected '::='")
            self.pos += 3
            self.space(newlines=True)
            rules[name] = self.alternatives(nested=False)

    def space(self, newlines: bool) -> None:
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            if c == "#":
                while self.pos < len(text) and text[self.pos] not in "\r\n":
                    self.pos += 1
            elif c in " \t" or (newlines and c in "\r\n"):
                self.pos += 1
            else:
                return

    def name(self) -> str:
        m = _NAME.match(self.text, self.pos)
        if m is None:
            raise self.fail("expected a rule name")
        self.pos = m.end()
        return m.group(0)

    def char(self, in_literal: bool) -> int:
        text = self.text
        if self.pos >= len(text):
            raise self.fail("unexpected end")
        c = text[self.pos]
        if c != "\\":
            if in_literal and _SURROGATES[0] <= ord(c) <= _SURROGATES[1]:
                raise self.fail(f"a lone surrogate U+{ord(c):04X} in a literal")
            self.pos += 1
            return ord(c)
        e = text[self.pos + 1 : self.pos + 2]
        if e in _HEX_DIGITS:
            n = _HEX_DIGITS[e]
            digits = text[self.pos + 2 : self.pos + 2 + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"a bad \\{e} escape")
            value = int(digits, 16)
            error = bad_escape(text, self.pos, f"\\{e}{digits}", value, in_literal)
            if error is not None:
                raise error
            self.pos += 2 + n
            return value
        if e not in _ESCAPES:
            raise self.fail(f"an unknown escape \\{e}")
        self.pos += 2
        return _ESCAPES[e]

    def alternatives(self, nested: bool) -> Node:
        options = [self.sequence(nested)]
        while self.text.startswith("|", self.pos):
            self.pos += 1
            self.space(newlines=True)
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        text = self.text
        while self.pos < len(text) and text[self.pos] not in "|)\r\n":
            items.append(self.repeated(self.atom()))
            self.space(newlines=nested)
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def atom(self) -> Node:
        text, c = self.text, self.text[self.pos]
        if c == '"':
            self.pos += 1
            chars = []
            while self.pos < len(text) and text[self.pos] != '"':
                chars.append(chr(self.char(in_literal=True)))
            if self.pos >= len(text):
                raise self.fail("an unterminated string")
            self.pos += 1
            return Lit("".join(chars))
        if c == "[":
            self.pos += 1
            negated = text.startswith("^", self.pos)
            self.pos += negated
            ranges = []
            while self.pos < len(text) and text[self.pos] != "]":
                lo = hi = self.char(in_literal=False)
                if text.startswith("-", self.pos) and not text.startswith("-]", self.pos):
                    self.pos += 1
                    hi = self.char(in_literal=False)
                ranges.append((lo, hi))
            if self.pos >= len(text):
                raise self.fail("an unterminated character class")
            self.pos += 1
            return Cls(negated, _without_surrogates(ranges))
        if c == "(":
            self.pos += 1
            self.space(newlines=True)
            node = self.alternatives(nested=True)
            if not text.startswith(")", self.pos):
                raise self.fail("expected ')'")
            self.pos += 1
            return node
        if c == ".":
            self.pos += 1
            return Cls(True, ())
        if not _NAME.match(text, self.pos):
            raise self.fail(f"unexpected {c!r}")
        return Ref(self.name())

    def repeated(self, node: Node) -> Node:
        text = self.text
        while self.pos < len(text) and text[self.pos] in "*+?{":
            c = text[self.pos]
            if c != "{":
                self.pos += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                node = Rep(node, low, high)
                continue
            end = text.find("}", self.pos)
            m = re.fullmatch(r"\s*(\d+)\s*(,\s*(\d*)\s*)?", text[self.pos + 1 : end])
            if end < 0 or m is None:
                raise self.fail("a bad repetition")
            low = int(m.group(1))
            high = low if m.group(2) is None else int(m.group(3)) if m.group(3) else None
            self.pos = end + 1
            node = Rep(node, low, high)
        return node


# Where a span stands in a JSON string: before its opening quote, inside, inside after a
# backslash, after the closing quote. A character no state takes kills the span.
_BEFORE, _INSIDE, _ESCAPED, _CLOSED = range(4)
_DEAD = -1


def _step(state: int, kind: int) -> int:
    """The state after one character: ``kind`` is the quote, the backslash, or -1 (another)."""
    if state == _BEFORE:
        return _INSIDE if kind == _QUOTE else _DEAD
    if state == _INSIDE:
        return _CLOSED if kind == _QUOTE else _ESCAPED if kind == _BACKSLASH else _INSIDE
    if state == _ESCAPED:
        return _INSIDE
    return _DEAD


class _Spans:
    """Which sequences of nodes read as exactly one JSON string (see the module doc)."""

    def __init__(self, rules: dict[str, Node]) -> None:
        self.rules = rules
        self._rule_ends: dict[tuple[str, frozenset[int]], frozenset[int]] = {}
        self._open: set[str] = set()

    def longest(self, items: Sequence[Node], start: int) -> int | None:
        """The largest ``end`` where ``items[start:end]`` reads as one JSON string, or None:
        one walk forward (a path that died stays dead, so the walk stops there)."""
        states, end = frozenset({_BEFORE}), None
        for j in range(start, len(items)):
            states = self.ends(items[j], states)
            if _DEAD in states:
                break
            if states == {_CLOSED}:
                end = j + 1
        return end

    def ends(self, node: Node, states: frozenset[int]) -> frozenset[int]:
        """The states ``node`` can end in from ``states`` (with ``_DEAD`` if any path dies)."""
        if isinstance(node, Lit):
            out = set()
            for state in states:
                for ch in node.text:
                    state = _step(state, ord(ch))
                    if state == _DEAD:
                        return frozenset({_DEAD})
                out.add(state)
            return frozenset(out)
        if isinstance(node, Cls):
            kinds = [k for k in (_QUOTE, _BACKSLASH) if node.has(k)]
            if node.negated or sum(hi - lo + 1 for lo, hi in node.ranges) > len(kinds):
                kinds.append(-1)
            return frozenset(_step(s, k) for s in states for k in kinds)
        if isinstance(node, Ref):
            return self._ref(node.name, states)
        if isinstance(node, Seq):
            for item in node.items:
                states = self.ends(item, states)
                if _DEAD in states:
                    break
            return states
        if isinstance(node, Alt):
            return frozenset().union(*(self.ends(o, states) for o in node.options))
        for _ in range(node.low):
            states = self.ends(node.item, states)
        seen, frontier, n = set(states), states, node.low
        while (node.high is None or n < node.high) and _DEAD not in seen:
            frontier = self.ends(node.item, frontier) - seen
            if not frontier:
                break
            seen |= frontier
            n += 1
        return frozenset(seen)

    def _ref(self, name: str, states: frozenset[int]) -> frozenset[int]:
        if name in self._open or name not in self.rules:  # recursive: not regular
            return frozenset({_DEAD})
        key = (name, states)
        if key not in self._rule_ends:
            self._open.add(name)
            try:
                self._rule_ends[key] = self.ends(self.rules[name], states)
            finally:
                self._open.discard(name)
        return self._rule_ends[key]


def _char_regex(cp: int) -> str:
    return f"\\x{{{cp:x}}}"


def _class_regex(node: Cls) -> str:
    if not node.ranges:
        return "/[\\s\\S]/" if node.negated else "/[^\\s\\S]/"
    body = "".join(
        _char_regex(lo) if lo == hi else f"{_char_regex(lo)}-{_char_regex(hi)}"
        for lo, hi in node.ranges
    )
    return f"/[{'^' if node.negated else ''}{body}]/"


def _repeat(item: str, low: int, high: int | None) -> str:
    if high is None:
        return f"{item}*" if low == 0 else f"{item}+" if low == 1 else f"{item}{{{low},}}"
    return f"{item}?" if (low, high) == (0, 1) else f"{item}{{{low},{high}}}"


class _Emitter:
    def __init__(self, rules: dict[str, Node], spans: bool) -> None:
        self.rules = rules
        self.spans = _Spans(rules) if spans else None
        self.quote_outside = False  # a one-character lexeme that can be a quote
        self._rule_names: dict[str, str] = {}
        self._term_names: dict[str, str] = {}
        self.terminals: list[str] = []

    def rule(self, name: str) -> str:
        if name not in self.rules:
            raise GrammarError(f"cannot translate the grammar to Lark: no rule {name!r}")
        return self._rule_names.setdefault(name, f"r{len(self._rule_names)}")

    def terminal(self, body: str) -> str:
        name = f"T{len(self.terminals)}"
        self.terminals.append(f"{name}: {body}")
        return name

    def term(self, node: Node) -> str:
        """``node`` inside a terminal (a regular language: no recursion reaches here)."""
        if isinstance(node, Lit):
            return f"/{''.join(_char_regex(ord(c)) for c in node.text)}/" if node.text else '""'
        if isinstance(node, Cls):
            return _class_regex(node)
        if isinstance(node, Ref):
            if node.name not in self._term_names:
                self._term_names[node.name] = self.terminal(self.term(self.rules[node.name]))
            return self._term_names[node.name]
        if isinstance(node, Seq):
            return "(" + " ".join(self.term(i) for i in node.items) + ")"
        if isinstance(node, Alt):
            return "(" + " | ".join(self.term(o) for o in node.options) + ")"
        return _repeat(self.term(node.item), node.low, node.high)

    def expr(self, node: Node) -> str:
        """``node`` in a rule: one-character lexemes, or a JSON-string span as a terminal."""
        if isinstance(node, Seq):
            return "(" + " ".join(self._items(node.items)) + ")"
        if self._span(node):
            return self.terminal(self.term(node))
        if isinstance(node, Lit):
            self.quote_outside |= '"' in node.text
            chars = " ".join(f"/{_char_regex(ord(c))}/" for c in node.text)
            return f"({chars})" if chars else '""'
        if isinstance(node, Cls):
            self.quote_outside |= node.has(_QUOTE)
            return _class_regex(node)
        if isinstance(node, Ref):
            return self.rule(node.name)
        if isinstance(node, Alt):
            return "(" + " | ".join(self.expr(o) for o in node.options) + ")"
        return _repeat(self.expr(node.item), node.low, node.high)

    def _span(self, node: Node) -> bool:
        return self.spans is not None and self.spans.longest((node,), 0) == 1

    def _items(self, items: tuple[Node, ...]) -> list[str]:
        out, i = [], 0
        while i < len(items):
            end = None if self.spans is None else self.spans.longest(items, i)
            if end is None:
                out.append(self.expr(items[i]))
                i += 1
            else:
                out.append(self.terminal(" ".join(self.term(x) for x in items[i:end])))
                i = end
        return out

    def grammar(self, root: str) -> str:
        start = self.rule(root)
        done: set[str] = set()
        lines = [f"start: {start}"]
        while len(done) < len(self._rule_names):
            for name, lark_name in list(self._rule_names.items()):
                if name not in done:
                    done.add(name)
                    lines.append(f"{lark_name}: {self.expr(self.rules[name])}")
        return "\n".join(lines + self.terminals)


def to_lark(gbnf: str, root: str = "root") -> str:
    """The grammar in llguidance's Lark dialect, matching exactly the same texts.

    Raises:
        GrammarError: the GBNF uses what this translation does not take (``<token>``
            references, unknown escapes), or has no rule ``root``.
    """
    rules = parse(gbnf)
    emitter = _Emitter(rules, spans=True)
    lark = emitter.grammar(root)
    if emitter.quote_outside and emitter.terminals:
        lark = _Emitter(rules, spans=False).grammar(root)
    return lark
