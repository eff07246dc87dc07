"""``uniqueItems``: arrays whose items must all differ, held to while the JSON is generated.

No grammar can say that the items of an array differ (a ``set[str]`` holds any strings), so a
JSON Schema's grammar lets such arrays be what the rest of the schema says, and generation
keeps their items apart: :class:`UniqueScan` reads the JSON text as it is generated, knows from
the schema which arrays must hold unique items (walking it along the text's keys and indices),
and reports the character at which an item becomes equal to an earlier item of its array (JSON
equality: ``1`` is ``1.0``, ``true`` is not ``1``, objects whatever their key order). The
backtracking run then takes the item back (:class:`lcgen.runtime.backtrack.Backtracker`): it
draws another token where a string became a repeat, takes a repeated number back whole and a
repeated array or object from its last value, and closes an array where every item tried
repeated one.

Where the schema branches (``anyOf``, ``oneOf``, ``if``/``then``/``else``), an array is held
unique when any branch that could apply to it says so: that only narrows what is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from lcgen.constrain.json_rules import item_key
from lcgen.errors import GrammarError

__all__ = ["SCALAR", "UniqueItems", "UniqueScan"]

Schemas = tuple[Any, ...]  # the subschemas that may apply at one place of the text
SCALAR = frozenset("0123456789+-.eEtruefalsn")  # the characters of numbers and literals
_LITERALS = ("true", "false", "null")


@dataclass(frozen=True)
class UniqueItems:
    """The schema of a grammar that holds arrays' items unique, as canonical JSON text (what
    makes two grammars equal)."""

    schema: str

    @staticmethod
    def of(schema: dict[str, Any] | bool) -> UniqueItems:
        text = json.dumps(_plain(schema), sort_keys=True, separators=(",", ":"))
        return UniqueItems(text)

    @property
    def walker(self) -> _Walker:
        return _walker(self.schema)

    def scan(self, text: str = "") -> UniqueScan:
        """A scan that has read ``text``."""
        return UniqueScan(self.walker).reread(text)

    def duplicate_in(self, text: str) -> bool:
        """Whether ``text`` (JSON, or the start of it) has an item equal to an earlier one in
        an array that must hold unique items."""
        return UniqueScan(self.walker).feed(text) is not None


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: keys as text, a value JSON has no form for (a date, a
    Decimal in an annotation) as its text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


@functools.lru_cache(maxsize=32)
def _walker(schema: str) -> _Walker:
    """The walker of a schema (kept out of :class:`UniqueItems`, which stays a plain value:
    a grammar pickles, and equal schemas share one)."""
    return _Walker(json.loads(schema))


class _Walker:
    """Which subschemas apply where in a JSON value, and which arrays must be unique."""

    def __init__(self, root: dict[str, Any] | bool) -> None:
        from lcgen.constrain.json_schema import _Compiler

        self.root = root
        self._refs = _Compiler(root, False, False)  # (its $ref resolution)
        self._expanded: dict[tuple[int, ...], Schemas] = {}

    def expand(self, schemas: Schemas) -> Schemas:
        """``schemas`` and every subschema that applies to the same value beside them."""
        key = tuple(id(s) for s in schemas)
        found = self._expanded.get(key)
        if found is not None:
            return found
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        todo = list(schemas)
        while todo:
            schema = todo.pop()
            if not isinstance(schema, dict) or id(schema) in seen:
                continue
            seen.add(id(schema))
            out.append(schema)
            ref = schema.get("$ref")
            if isinstance(ref, str):
                with contextlib.suppress(GrammarError):  # (compiled: its references resolve)
                    todo.append(self._refs.resolve_ref(ref, "#"))
            for name in ("allOf", "anyOf", "oneOf"):
                if isinstance(schema.get(name), list):
                    todo.extend(schema[name])
            todo.extend(schema.get(name) for name in ("if", "then", "else"))
            for name in ("dependentSchemas", "dependencies"):
                if isinstance(schema.get(name), dict):
                    todo.extend(schema[name].values())
        self._expanded[key] = found = tuple(out)
        return found

    def unique(self, schemas: Schemas) -> bool:
        return any(s.get("uniqueItems") is True for s in self.expand(schemas))

    def child(self, schemas: Schemas, step: str | int) -> Schemas:
        """The subschemas that apply to the value at key ``step`` (a str) or index ``step``.
        (Not cached: keys and indices are the text's, without bound, and the walker is kept
        per schema across generations.)"""
        expanded = self.expand(schemas)
        if isinstance(step, str):
            return tuple(sub for schema in expanded for sub in self._member(schema, step))
        return tuple(sub for schema in expanded for sub in self._item(schema, step))

    @staticmethod
    def _member(schema: dict[str, Any], key: str) -> tuple[Any, ...]:
        """The subschemas ``schema`` applies to the value of ``key`` (with its
        ``unevaluatedProperties`` where it does not name the key itself: that may be more,
        which only narrows)."""
        found: list[Any] = []
        properties = schema.get("properties")
        if isinstance(properties, dict) and key in properties:
            found.append(properties[key])
        patterns = schema.get("patternProperties")
        for pattern, sub in patterns.items() if isinstance(patterns, dict) else ():
            try:
                matched = re.search(pattern, key) is not None
            except re.error:
                matched = True
            if matched:
                found.append(sub)
        if not found and "additionalProperties" in schema:
            found.append(schema["additionalProperties"])
        if not found and "unevaluatedProperties" in schema:
            found.append(schema["unevaluatedProperties"])
        return tuple(found)

    def _item(self, schema: dict[str, Any], index: int) -> tuple[Any, ...]:
        """The subschemas ``schema`` applies to item ``index`` (as :meth:`_member`)."""
        items, prefix = schema.get("items"), schema.get("prefixItems")
        if not self._refs.draft2020:  # (no keyword before 2020-12)
            prefix = None
        found: list[Any] = []
        if isinstance(items, list):  # draft 2019 and before: the tuple form
            found.append(items[index] if index < len(items) else schema.get("additionalItems"))
        elif isinstance(prefix, list) and index < len(prefix):
            found.append(prefix[index])
        else:
            found.append(items)
        if all(s is None for s in found) and "unevaluatedItems" in schema:
            found.append(schema["unevaluatedItems"])
        found.append(schema.get("contains"))
        return tuple(s for s in found if s is not None)


@dataclass(slots=True)
class _Frame:
    """An open array or object of the text."""

    is_array: bool
    schemas: Schemas
    unique: bool
    opened: int  # where its "[" or "{" is
    # (arrays) the items so far, canonical: those read before the scan was copied, shared
    # with the copies, and those read since, its own (see UniqueScan.keep)
    seen: set[Any] = field(default_factory=set)
    added: set[Any] = field(default_factory=set)
    index: int = 0  # (arrays) items so far
    start: int = -1  # (arrays) where the open item began, or -1
    after: int = -1  # (arrays) where the last item ended, or -1
    key: str | None = None  # (objects) the key whose value comes next


@dataclass(slots=True)
class UniqueScan:
    """JSON text read so far, with which of its arrays must hold unique items; :meth:`feed`
    reads more. Text that is not JSON (a tool call's grammar allows plain text) is read as
    one value that ends at once: nothing in it is held."""

    walker: _Walker
    text: str = ""
    _stack: list[_Frame] = field(default_factory=list)
    _expect: str = "value"  # "value", "key", "colon", "next" (after a value) or "done"
    _string: int = -1  # where the open string began, or -1
    _is_key: bool = False
    _escape: bool = False
    _scalar: int = -1  # where the open number or literal began, or -1

    repeated: int = -1  # where the item that repeated another began (set by feed)
    # The arrays (by where they open) that can take no more items: every item tried after the
    # last one repeated another. A "," there counts as a repeat. (Shared by copies: the run
    # that found them keeps it.)
    full: dict[int, int] = field(default_factory=dict)  # (each with where its last item ended)
    # Starts of items that every continuation tried turned into a repeat, by array (where it
    # opens), each with where the item it was found in began: no later item of the array may
    # begin so either (its earlier items are still there), and spelled in other tokens the
    # same text would use the retries up. (Shared by copies, as full.)
    dead: dict[int, dict[str, int]] = field(default_factory=dict)

    def close_last(self) -> int | None:
        """Where an item of a unique array is to begin after another (the innermost array
        open): mark the array full (every item tried repeated one) and return where its last
        item ended; elsewhere None."""
        frame = self._stack[-1] if self._stack else None
        if frame is None or not frame.unique or self._expect != "value" or frame.index == 0:
            return None
        if frame.start >= 0 or self._string >= 0 or self._scalar >= 0 or frame.after < 0:
            return None
        self.full[frame.opened] = frame.after
        return frame.after

    def give_up_item(self) -> bool:
        """Where an item of a unique array is open, mark the text it has so far as one no item
        may start with (every token that could follow it led to a repeat); whether one was.
        The outermost such item: inside it, an inner array's items may have repeated an
        outer item, which a later inner item would not."""
        frame = next((f for f in self._stack if f.unique and f.start >= 0), None)
        if frame is None:
            return False
        self.dead.setdefault(frame.opened, {})[self.text[frame.start :]] = frame.start
        return True

    def copy(self) -> UniqueScan:
        """A scan that reads on from here on its own (the items read so far are shared: keep
        only the copy once it is kept)."""
        frames = [dataclasses.replace(f, added=set(f.added)) for f in self._stack]
        scan = UniqueScan(
            self.walker, self.text, frames, self._expect, full=self.full, dead=self.dead
        )
        scan._string, scan._is_key, scan._escape = self._string, self._is_key, self._escape
        scan._scalar = self._scalar
        return scan

    def keep(self) -> UniqueScan:
        """This scan, to read on from (the scan it was copied from is given up): the items it
        read join those it shares."""
        for frame in self._stack:
            frame.seen |= frame.added
            frame.added = set()
        return self

    def reread(self, text: str = "") -> UniqueScan:
        """A scan of the same schema that has read ``text`` instead (its full arrays and the
        item starts it gave up kept, where they begin in ``text``)."""
        for opened, after in list(self.full.items()):  # (kept while their last item is)
            if after > len(text):
                del self.full[opened]
        for opened, given_up in list(self.dead.items()):  # (kept while their items are)
            kept = {item: start for item, start in given_up.items() if start <= len(text)}
            if kept:
                self.dead[opened] = kept
            else:
                del self.dead[opened]
        scan = UniqueScan(self.walker, full=self.full, dead=self.dead)
        if scan.feed(text) is not None:  # (kept text the marks refuse: read it without them)
            scan = UniqueScan(self.walker)
            scan.feed(text)
        return scan.keep()

    def outside(self, more: str) -> int:
        """How much of ``more`` reads on outside the items of arrays that must hold unique
        items (text a rewind never has to take back: up to a unique array's ``[`` and the
        whitespace after it, from its ``]`` on): its length. Reads nothing."""
        trial = self.copy()
        for i, char in enumerate(more):
            if trial.feed(char) is not None or any(
                f.unique and (f.index or f.start >= 0) for f in trial._stack
            ):
                return i
        return len(more)

    @property
    def held_from(self) -> int | None:
        """Where the text a rewind may still have to take back begins, or None: in a unique
        array, from the end of its last item (the separator after it, where no item can
        follow that does not repeat one, is taken back too)."""
        ends = [f.after for f in self._stack if f.unique and f.after >= 0]
        return min(ends) if ends else None

    def feed(self, more: str) -> int | None:
        """Read ``more``; the offset in :attr:`text` of the character that made an item equal
        to an earlier one of a unique array (the scan stops there), or None."""
        at = len(self.text)
        self.text += more
        text = self.text
        for i in range(at, len(text)):
            if self.dead and self._gives_up(i):
                return i - 1
            if self._expect == "done":
                break
            char = text[i]
            if self._string >= 0:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    start, self._string = self._string, -1
                    if self._is_key:
                        try:
                            self._stack[-1].key = json.loads(text[start : i + 1])
                        except ValueError:  # (not JSON: a grammar that is not a schema's)
                            self._expect = "done"
                            break
                        self._expect = "colon"
                    elif self._ended(start, i + 1):
                        return i
                continue
            if self._scalar >= 0:
                if char in SCALAR and text[self._scalar : i + 1] not in _LITERALS:
                    continue
                start, self._scalar = self._scalar, -1
                if char in SCALAR:  # the literal's last letter
                    if self._ended(start, i + 1):
                        return i
                    continue
                if self._ended(start, i):  # a number ends at the character after it
                    return i
            if char in " \t\n\r":
                continue
            if self._expect in ("value", "key") and char in "]}" and self._stack:
                frame = self._stack.pop()  # (empty: "[]", "{}")
                if self._ended(frame.opened, i + 1):
                    return i
            elif self._expect == "value":
                self._begin(char, i)
            elif self._expect == "key" and char == '"':
                self._string, self._is_key = i, True
            elif self._expect == "colon":
                self._expect = "value"
            elif self._expect == "next" and self._stack:
                frame = self._stack[-1]
                if char == ",":
                    if self.full.get(frame.opened, i + 1) <= i:  # (after the last item then:
                        # no item can follow it that repeats none)
                        self.repeated = i
                        return i
                    self._expect = "value" if frame.is_array else "key"
                else:  # "]" or "}"
                    self._stack.pop()
                    if self._ended(frame.opened, i + 1):
                        return i
            else:  # not JSON as this scan reads it: nothing more is held
                self._expect = "done"
        if self.dead and self._gives_up(len(text)):
            return len(text) - 1
        return None

    def _gives_up(self, end: int) -> bool:
        """Whether an open item's text up to ``end`` is one given up (see give_up_item)."""
        for frame in self._stack:
            if frame.unique and frame.start >= 0:
                given_up = self.dead.get(frame.opened)
                found = given_up.get(self.text[frame.start : end]) if given_up else None
                if found is not None and found <= frame.start:  # (that item or a later one)
                    self.repeated = frame.start
                    return True
        return False

    def _begin(self, char: str, at: int) -> None:
        schemas: Schemas = (self.walker.root,)
        if self._stack:
            frame = self._stack[-1]
            if frame.is_array:
                frame.start = at
                schemas = self.walker.child(frame.schemas, frame.index)
            else:
                schemas = self.walker.child(frame.schemas, frame.key or "")
        if char in "[{":
            is_array = char == "["
            unique = is_array and self.walker.unique(schemas)
            self._stack.append(_Frame(is_array, schemas, unique, at))
            self._expect = "value" if is_array else "key"
        elif char == '"':
            self._string, self._is_key = at, False
        else:
            self._scalar = at

    def _ended(self, start: int, end: int) -> bool:
        """A value ended (``text[start:end]``): whether it repeats an item of its unique array."""
        self._expect = "next" if self._stack else "done"
        if not self._stack or not self._stack[-1].is_array:
            return False
        frame = self._stack[-1]
        frame.index += 1
        frame.start, frame.after = -1, end
        if not frame.unique:
            return False
        try:
            item = item_key(json.loads(self.text[start:end]))
        except ValueError:  # (not JSON: a grammar that is not a schema's)
            return False
        if item in frame.seen or item in frame.added:
            self.repeated = start
            return True
        frame.added.add(item)
        return False
