"""Finite automata over code points, to tell exactly which patterns an object key matches.

A regular expression (the subset :mod:`lcgen.constrain.regex` parses) becomes a Thompson NFA
with ``re.search`` semantics; a set of names becomes a literal NFA. Several NFAs run in product
and are determinized together (subset construction, one subset per automaton), so each state
of the product knows which automata accept there. The strings that reach chosen states are
written as GBNF, one rule per state, each character as the body of a JSON string writes it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from lcgen.constrain import gbnf as g
from lcgen.constrain.regex import Alt, Chars, Emitter, Node, Rep, Seq, branches
from lcgen.errors import GrammarError

MAX_NFA_STATES = 4000
MAX_STATES = 512  # of a product; beyond it callers fall back to a narrower grammar
_ANY_TEXT = Rep(Chars(((0, g.MAX_CODEPOINT),)), 0, None)
_NEWLINE = Chars(((10, 10),))


class TooLarge(GrammarError):
    """An automaton would have more states than the cap allows."""


# NFAs -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Nfa:
    """States 0..n-1; ``moves[s]`` are (characters, next state), ``eps[s]`` the empty moves."""

    start: int
    accept: int
    moves: tuple[tuple[tuple[g.Ranges, int], ...], ...]
    eps: tuple[tuple[int, ...], ...]


class _Builder:
    """Thompson's construction. Each fragment adds no move into its start state nor out of its
    end state, so alternatives may share both."""

    def __init__(self) -> None:
        self.moves: list[list[tuple[g.Ranges, int]]] = []
        self.eps: list[list[int]] = []

    def state(self) -> int:
        if len(self.moves) >= MAX_NFA_STATES:
            raise TooLarge(f"an automaton needs more than {MAX_NFA_STATES} states")
        self.moves.append([])
        self.eps.append([])
        return len(self.moves) - 1

    def build(self, node: Node, start: int, end: int) -> None:
        if isinstance(node, Chars):
            if node.ranges:
                self.moves[start].append((node.ranges, end))
        elif isinstance(node, Seq):
            self.chain(list(node.items), start, end)
        elif isinstance(node, Alt):
            for option in node.options:
                self.build(option, start, end)
        elif isinstance(node, Rep):
            self.repeat(node, start, end)
        else:
            raise AssertionError(f"an anchor inside a pattern's body: {node}")

    def chain(self, items: list[Node], start: int, end: int) -> None:
        if not items:
            self.eps[start].append(end)
            return
        for item in items[:-1]:
            mid = self.state()
            self.build(item, start, mid)
            start = mid
        self.build(items[-1], start, end)

    def repeat(self, node: Rep, start: int, end: int) -> None:
        cur = start
        for _ in range(node.low):
            nxt = self.state()
            self.build(node.item, cur, nxt)
            cur = nxt
        if node.high is None:  # a loop through fresh states, so nothing re-enters ``start``
            loop_in, loop_out = self.state(), self.state()
            self.eps[cur].append(loop_in)
            self.build(node.item, loop_in, loop_out)
            self.eps[loop_out].append(loop_in)
            self.eps[loop_in].append(end)
            return
        for _ in range(node.high - node.low):
            nxt = self.state()
            self.eps[cur].append(end)
            self.build(node.item, cur, nxt)
            cur = nxt
        self.eps[cur].append(end)

    def nfa(self, node: Node) -> Nfa:
        start, accept = self.state(), self.state()
        self.build(node, start, accept)
        return Nfa(
            start,
            accept,
            tuple(tuple(m) for m in self.moves),
            tuple(tuple(e) for e in self.eps),
        )


def search_tree(pattern: str, *, portable: bool = False, either: bool = False) -> Node:
    """A tree without anchors whose full matches are the strings in which ``re.search`` finds
    ``pattern``: any text around each top-level alternative unless anchored (``$`` also
    before a final newline). With ``portable``, those in which both Python's ``re`` and
    ECMA-262 find it, and with ``either`` too, those in which one of them does (see
    :func:`~lcgen.constrain.regex.parse`).

    Raises:
        GrammarError: an invalid pattern or a construct outside the supported subset.
    """
    options: list[Node] = []
    for body, start, end in branches(pattern, portable=portable, either=either):
        items: list[Node] = [body]
        if start is None:
            items.insert(0, _ANY_TEXT)
        if end is None:
            items.append(_ANY_TEXT)
        elif not end.strict:
            items.append(Rep(_NEWLINE, 0, 1))
        options.append(Seq(tuple(items)))
    return options[0] if len(options) == 1 else Alt(tuple(options))


def search_nfa(pattern: str, *, portable: bool = False, either: bool = False) -> Nfa:
    """An NFA accepting the strings ``s`` with ``re.search(pattern, s)`` (and the variants of
    :func:`search_tree`).

    Raises:
        GrammarError: as :func:`search_tree`; :class:`TooLarge` past :data:`MAX_NFA_STATES`.
    """
    return _Builder().nfa(search_tree(pattern, portable=portable, either=either))


def literal_nfa(names: Iterable[str]) -> Nfa:
    """An NFA accepting exactly ``names``."""
    words = [Seq(tuple(Chars(((ord(c), ord(c)),)) for c in name)) for name in names]
    return _Builder().nfa(Alt(tuple(words)))


# the product, determinized --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Product:
    """A DFA running several automata at once. State 0 is the start; ``moves[s]`` are
    (characters, next state) with disjoint characters covering every code point;
    ``accepts[s][k]`` says whether automaton ``k`` accepts the strings that reach ``s``."""

    moves: tuple[tuple[tuple[g.Ranges, int], ...], ...]
    accepts: tuple[tuple[bool, ...], ...]

    def end(self, text: str) -> int:
        """The state ``text`` leads to from the start."""
        state = 0
        for ch in text:
            state = next(t for ranges, t in self.moves[state] if _has(ranges, ord(ch)))
        return state


def alphabet(nfas: Sequence[Nfa]) -> list[g.Ranges]:
    """Disjoint classes of code points (covering them all) that no move tells apart: the
    intervals between all the moves' boundaries, grouped by which labels hold them."""
    labels = list(dict.fromkeys(r for nfa in nfas for row in nfa.moves for r, _ in row))
    events: dict[int, list[tuple[int, bool]]] = {0: [], g.MAX_CODEPOINT + 1: []}
    for i, ranges in enumerate(labels):
        for lo, hi in ranges:
            events.setdefault(lo, []).append((i, True))
            events.setdefault(hi + 1, []).append((i, False))
    cuts = sorted(events)
    active: set[int] = set()
    groups: dict[frozenset[int], list[tuple[int, int]]] = {}
    for lo, after in itertools.pairwise(cuts):
        for i, opens in sorted(events[lo], key=lambda e: e[1]):  # closings first
            if opens:
                active.add(i)
            else:
                active.discard(i)
        groups.setdefault(frozenset(active), []).append((lo, after - 1))
    return [g.ranges_of(intervals) for intervals in groups.values()]


class _Runner:
    """One NFA's moves by class of the alphabet, and its epsilon closures."""

    def __init__(self, nfa: Nfa, classes: list[g.Ranges]) -> None:
        self.nfa = nfa
        self.closures: dict[frozenset[int], frozenset[int]] = {}
        # A class lies wholly inside or outside each label: one code point of it tells which.
        points = [ranges[0][0] for ranges in classes]
        inside: dict[g.Ranges, list[int]] = {}
        self.by_class: list[dict[int, list[int]]] = []
        for row in nfa.moves:
            table: dict[int, list[int]] = {}
            for label, target in row:
                if label not in inside:
                    inside[label] = [c for c, p in enumerate(points) if _has(label, p)]
                for c in inside[label]:
                    table.setdefault(c, []).append(target)
            self.by_class.append(table)

    def closure(self, states: frozenset[int]) -> frozenset[int]:
        found = self.closures.get(states)
        if found is None:
            seen, todo = set(states), list(states)
            while todo:
                for nxt in self.nfa.eps[todo.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            found = self.closures[states] = frozenset(seen)
        return found

    def step(self, states: frozenset[int], c: int) -> frozenset[int]:
        return self.closure(frozenset(t for s in states for t in self.by_class[s].get(c, ())))


def _has(ranges: g.Ranges, point: int) -> bool:
    i = bisect.bisect_right(ranges, (point, g.MAX_CODEPOINT + 1)) - 1
    return i >= 0 and ranges[i][0] <= point <= ranges[i][1]


def product(nfas: Sequence[Nfa], max_states: int = MAX_STATES) -> Product:
    """The DFA of ``nfas`` run together (subset construction over :func:`alphabet`).

    Raises:
        TooLarge: it would have more than ``max_states`` states.
    """
    classes = alphabet(nfas)
    runners = [_Runner(nfa, classes) for nfa in nfas]
    start = tuple(r.closure(frozenset([r.nfa.start])) for r in runners)
    index = {start: 0}
    queue = [start]
    moves: list[tuple[tuple[g.Ranges, int], ...]] = []
    while len(moves) < len(queue):
        state = queue[len(moves)]
        targets: dict[int, list[g.Ranges]] = {}
        for c, ranges in enumerate(classes):
            nxt = tuple(r.step(s, c) for r, s in zip(runners, state, strict=True))
            if nxt not in index:
                if len(queue) >= max_states:
                    raise TooLarge(f"the automaton of object keys needs over {max_states} states")
                index[nxt] = len(queue)
                queue.append(nxt)
            targets.setdefault(index[nxt], []).append(ranges)
        moves.append(tuple((_union(rs), t) for t, rs in targets.items()))
    accepts = tuple(
        tuple(r.nfa.accept in s for r, s in zip(runners, state, strict=True)) for state in queue
    )
    return Product(tuple(moves), accepts)


def _union(parts: list[g.Ranges]) -> g.Ranges:
    return g.ranges_of(pair for ranges in parts for pair in ranges)


def partition(
    patterns: Sequence[str], names: Collection[str], required: Sequence[str] = ()
) -> tuple[Product, dict[frozenset[int], frozenset[int]]]:
    """Strings that are none of ``names`` and match every ``required`` pattern, split by the
    ``patterns`` they match (found by ``re.search``, JSON Schema's reading of ECMA-262
    patterns). A string that Python's ``re`` and ECMA-262 may judge apart for some pattern
    (by its ``$``, ``.``, ``\\d``, ``\\w``, ``\\s`` or their negations: ``$`` before a final
    newline, a non-ASCII ``\\w``, ...) is in no class, and the ``required`` patterns are held
    to what both match.

    Returns:
        The product DFA, and for each non-empty class (the indexes of the patterns matched)
        the DFA states where exactly its strings end.

    Raises:
        GrammarError: a pattern outside the supported subset; :class:`TooLarge` when the
            product would have more than :data:`MAX_STATES` states.
    """
    nfas = [search_nfa(p, portable=True) for p in patterns]  # matched by both
    nfas += [search_nfa(p, portable=True, either=True) for p in patterns]  # by one or both
    nfas += [literal_nfa(names)] if names else []
    nfas += [search_nfa(p, portable=True) for p in required]
    dfa = product(nfas)
    n = len(patterns)
    classes: dict[frozenset[int], set[int]] = {}
    for state, accepts in enumerate(dfa.accepts):
        is_name = bool(names) and accepts[2 * n]
        if is_name or not all(accepts[2 * n + bool(names) :]) or accepts[:n] != accepts[n : 2 * n]:
            continue
        matched = frozenset(i for i in range(n) if accepts[i])
        classes.setdefault(matched, set()).add(state)
    return dfa, {k: frozenset(v) for k, v in classes.items()}


# GBNF -----------------------------------------------------------------------------------------
def to_gbnf(dfa: Product, accepting: Collection[int], rules: g.RuleSet, name: str) -> str | None:
    """A rule for the strings (as the body of a JSON string, each character in its canonical
    JSON form) that lead ``dfa`` from its start to a state in ``accepting``; None when no such
    string can be written (surrogates cannot).

    Rules are added to ``rules``: one per state of the minimal DFA of those strings.
    """
    emitter = Emitter(json_string=True)
    moves = [
        [(kept, t) for ranges, t in row if (kept := g.subtract(ranges, g.SURROGATES))]
        for row in dfa.moves
    ]
    live = _reaching(moves, accepting)
    if 0 not in live:
        return None
    block = _blocks(moves, live, set(accepting))
    first = {b: s for s in sorted(live, reverse=True) for b in [block[s]]}  # lowest state
    rule = {b: rules.reserve(f"{name}-s{b}") for b in sorted(first)}
    for b, s in sorted(first.items()):
        options = [
            f"{_chars(emitter, ranges, rules, name)} {rule[t]}"
            for t, ranges in _by_block(moves[s], live, block).items()
        ]
        rules.define(rule[b], " | ".join(options + (['""'] if s in accepting else [])))
    return rule[block[0]]


def _reaching(moves: list[list[tuple[g.Ranges, int]]], accepting: Collection[int]) -> set[int]:
    """The states from which some state of ``accepting`` can be reached."""
    back: dict[int, set[int]] = {}
    for s, row in enumerate(moves):
        for _, t in row:
            back.setdefault(t, set()).add(s)
    live, todo = set(accepting), list(accepting)
    while todo:
        for s in back.get(todo.pop(), ()):
            if s not in live:
                live.add(s)
                todo.append(s)
    return live


def _blocks(
    moves: list[list[tuple[g.Ranges, int]]], live: set[int], accepting: set[int]
) -> dict[int, int]:
    """Moore's refinement: states of ``live`` that lead to ``accepting`` by the same strings
    share a block (numbered from 0, the start's)."""
    block = {s: int(s not in accepting) for s in live}
    while True:
        seen: dict[tuple[int, frozenset[tuple[int, g.Ranges]]], int] = {}
        refined = {}
        for s in sorted(live):
            out = frozenset(_by_block(moves[s], live, block).items())
            refined[s] = seen.setdefault((block[s], out), len(seen))
        if len(seen) == len(set(block.values())):
            return refined
        block = refined


def _by_block(
    row: list[tuple[g.Ranges, int]], live: set[int], block: dict[int, int]
) -> dict[int, g.Ranges]:
    """A state's moves to live states, their characters merged by the target's block."""
    found: dict[int, list[g.Ranges]] = {}
    for ranges, t in row:
        if t in live:
            found.setdefault(block[t], []).append(ranges)
    return {b: _union(parts) for b, parts in found.items()}


def _chars(emitter: Emitter, ranges: g.Ranges, rules: g.RuleSet, name: str) -> str:
    """A character set, named when it is several alternatives (escapes): states share it."""
    expr = emitter.chars(ranges)
    return rules.add(f"{name}-char", expr) if expr.startswith("(") else expr
