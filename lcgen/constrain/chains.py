"""How deep llama.cpp recurses into a GBNF grammar's rules, found before it does.

llama.cpp expands the rule references a grammar can meet before its next character one C call
deeper each: when it sets the grammar up, when it checks it for left recursion, and after every
character it accepts. A long enough chain of such references (``a ::= b``, ``b ::= c``, ...;
also through groups, repetitions and rules that can match nothing) overflows the C stack and
kills the process: measured, a chain of 80,000 rules on a thread's 8 MiB stack and of 2,000 on
a 256 KiB one. So the longest chain is measured here, without recursion, and a grammar whose
chain is over :data:`MAX_GBNF_CHAIN` is refused.

The grammar is read as llama.cpp reads it: each group and each repetition becomes a rule of its
own, so a rule is a list of alternatives, each a list of items (a terminal, or a reference with
its repetition bounds).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lcgen.errors import GrammarError

# The deepest chain of rule references before a character (each group and repetition counts
# as the rule llama.cpp makes of it): a thousand times what real grammars need, and far from
# the depth that overflowed a 256 KiB thread stack (2,000).
MAX_GBNF_CHAIN = 1000

_TOKEN = re.compile(
    r'(?P<lit>"(?:[^"\\]|\\.)*")'
    r"|(?P<term>\[(?:[^\]\\]|\\.)*\]|!?<[^>]*>|\.)"
    r"|#[^\r\n]*"
    r"|(?P<head>[a-zA-Z0-9_-]+)[ \t]*::="
    r"|(?P<ref>[a-zA-Z0-9_-]+)"
    r"|(?P<rep>\{\s*(?P<low>\d+)\s*(?P<comma>,)?\s*(?P<high>\d*)\s*\})"
    r"|(?P<op>[()|?*+])"
    r"|\s+|.",
    re.DOTALL,
)

Key = str | int  # a rule's name, or the number of a rule made for a group or repetition


@dataclass(slots=True)
class _Item:
    """A terminal (``target`` None; ``empty``: the literal ``""``) or a reference, repeated
    ``low`` to ``high`` times (None: no bound)."""

    target: Key | None
    empty: bool = False
    low: int = 1
    high: int | None = 1


@dataclass(slots=True)
class _Rules:
    alternatives: dict[Key, list[list[_Item]]] = field(default_factory=dict)
    n_made: int = 0

    def make(self) -> int:
        self.n_made += 1
        self.alternatives[self.n_made] = [[]]
        return self.n_made


def _read(gbnf: str) -> _Rules:
    """The grammar's rules, read leniently: a syntax error is llama.cpp's to report."""
    rules = _Rules()
    open_groups: list[Key] = []  # the rule being read, then each open group's rule
    for m in _TOKEN.finditer(gbnf):
        kind = m.lastgroup
        if kind == "head":
            name = m.group("head")
            rules.alternatives[name] = [[]]
            open_groups = [name]
            continue
        if not open_groups or kind is None:
            continue
        current = rules.alternatives[open_groups[-1]][-1]
        if kind == "lit":
            current.append(_Item(None, empty=m.group("lit") == '""'))
        elif kind == "term":
            current.append(_Item(None))
        elif kind == "ref":
            current.append(_Item(m.group("ref")))
        elif kind == "rep":
            low, high = int(m.group("low")), m.group("high")
            upper = low if not m.group("comma") else int(high) if high else None
            _repeat(rules, current, low, upper)
        else:
            op = m.group("op")
            if op == "(":
                group = rules.make()
                current.append(_Item(group))
                open_groups.append(group)
            elif op == ")" and len(open_groups) > 1:
                open_groups.pop()
            elif op == "|":
                rules.alternatives[open_groups[-1]].append([])
            elif op in ("?", "*", "+"):
                _repeat(rules, current, int(op == "+"), 1 if op == "?" else None)
    return rules


def _repeat(rules: _Rules, items: list[_Item], low: int, high: int | None) -> None:
    """Repeat the last item, in a rule of its own (as llama.cpp does)."""
    if not items:
        return
    made = rules.make()
    rules.alternatives[made] = [[items[-1]]]
    items[-1] = _Item(made, low=low, high=high)


def _nullable(rules: _Rules) -> set[Key]:
    """The rules that can match the empty text (each alternative counts its items not yet
    known to: linear in the grammar's size)."""
    pending: list[int] = []  # per alternative: its items not yet known to match nothing
    owner: list[Key] = []
    watchers: dict[Key, list[int]] = {}
    found: set[Key] = set()
    queue: list[Key] = []
    for key, alternatives in rules.alternatives.items():
        for items in alternatives:
            index, left = len(pending), 0
            for item in items:
                if item.low == 0 or item.empty:
                    continue
                if item.target is None:
                    left = -1  # a character: never empty
                    break
                left += 1
                watchers.setdefault(item.target, []).append(index)
            pending.append(left)
            owner.append(key)
            if left == 0 and key not in found:
                found.add(key)
                queue.append(key)
    while queue:
        for index in watchers.get(queue.pop(), ()):
            pending[index] -= 1
            if pending[index] == 0 and owner[index] not in found:
                found.add(owner[index])
                queue.append(owner[index])
    return found


def _edges(rules: _Rules, nullable: set[Key]) -> dict[Key, list[tuple[Key, int]]]:
    """Each rule's references that it can meet before a character, with how many calls deep
    each goes: one, or for a repetition of a rule that can match nothing, one per copy."""
    edges: dict[Key, list[tuple[Key, int]]] = {}
    for key, alternatives in rules.alternatives.items():
        out = edges.setdefault(key, [])
        for items in alternatives:
            for item in items:
                if item.target is not None and item.target in rules.alternatives:
                    copies = 1
                    if item.target in nullable and item.high != 1:
                        copies = item.high if item.high is not None else item.low + 1
                    out.append((item.target, copies))
                empty = item.empty or item.low == 0 or item.target in nullable
                if not empty:
                    break
    return edges


def longest_chain(gbnf: str) -> tuple[int, Key | None]:
    """The deepest chain of rule references llama.cpp can meet before a character, and the
    rule it starts from (a cycle, which is left recursion, is llama.cpp's to report)."""
    rules = _read(gbnf)
    edges = _edges(rules, _nullable(rules))
    depth: dict[Key, int] = {}
    on_path: set[Key] = set()
    for start in edges:
        if start in depth:
            continue
        stack: list[tuple[Key, int]] = [(start, 0)]
        on_path.add(start)
        while stack:
            key, i = stack[-1]
            out = edges[key]
            if i < len(out):
                stack[-1] = (key, i + 1)
                target = out[i][0]
                if target not in depth and target not in on_path:
                    stack.append((target, 0))
                    on_path.add(target)
                continue
            stack.pop()
            on_path.discard(key)
            depth[key] = max((w + depth.get(t, 0) for t, w in out), default=0)
    deepest = max(depth, key=depth.__getitem__, default=None)
    return (0, None) if deepest is None else (depth[deepest], deepest)


def check_chains(gbnf: str) -> None:
    """Refuse a grammar whose rule references chain deeper than :data:`MAX_GBNF_CHAIN`
    before a character (llama.cpp would recurse that deep in C; see the module doc)."""
    n, start = longest_chain(gbnf)
    if n > MAX_GBNF_CHAIN:
        where = f"rule {start!r}" if isinstance(start, str) else "a group or repetition"
        raise GrammarError(
            f"{where} starts a chain of {n} rule references before any character, over the "
            f"bound of {MAX_GBNF_CHAIN} (llama.cpp recurses once per reference): put "
            "characters between the references, or use fewer rules"
        )
