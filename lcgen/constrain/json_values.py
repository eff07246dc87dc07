"""GBNF for the values of one conjunction of plain JSON Schemas, type by type (the second half
of :mod:`lcgen.constrain.json_schema`): what the members say about strings, numbers, arrays and
objects is gathered, and keywords of one type constrain only values of that type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import math
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import jsonschema

from lcgen.constrain import automaton, lark
from lcgen.constrain import gbnf as g
from lcgen.constrain import json_rules as spec
from lcgen.constrain.json_numbers import NumberRules
from lcgen.constrain.json_rules import Conj, NoValue, Unsatisfiable, item_key
from lcgen.constrain.regex import json_string_literal, json_string_rules, regex_to_gbnf
from lcgen.errors import GrammarError, UnsupportedSchemaError

FALSE: dict[str, Any] = {"not": {}}  # "no value", in every draft
# Keys of the plain schemas lcgen writes itself (validators ignore unknown keys): strings
# that are none of a list; properties named only to constrain them (they close no object).
NOT_IN, SYNTHETIC = "$lcgen-not-in", "$lcgen-synthetic"
# The keyword a member stands for, where it is not its own key (unevaluatedProperties...).
SOURCE = "$lcgen-source"
_RULE_NAME = re.compile(r"[a-zA-Z0-9-]+")


def count(schema: dict[str, Any], key: str, default: int = 0) -> int:
    """A count keyword (``minItems``...), which may be written as a float such as 2.0."""
    return int(schema.get(key, default))


def first_satisfiable(options: list[Callable[[], str]], path: str) -> str:
    """The alternatives of the options that some value satisfies (raising when none is)."""
    found, reasons, proven = [], [], True
    for option in options:
        try:
            found.append(option())
        except Unsatisfiable as exc:
            reasons.append(str(exc))
            proven &= isinstance(exc, NoValue)
    if found:
        return g.alternatives(found)
    unique = list(dict.fromkeys(reasons))
    kind = NoValue if proven else Unsatisfiable
    if len(unique) == 1:
        raise kind(unique[0])
    shown = "; ".join(unique[:3]) + "; ..." * (len(unique) > 3)
    raise kind(f"no value satisfies the schema at {path}" + f" ({shown})" * bool(shown))


@dataclasses.dataclass
class _Members:
    """What :meth:`ValueCompiler.member_chain` writes an object's members from."""

    kvs: list[tuple[bool, str]]  # (required, member) of each declared property, in order
    extra: str | None  # one extra member; its key may repeat another (and then counts once)
    repeats: bool  # an extra key may repeat a declared one
    numbered: Callable[[int], list[str]] | None  # n extra members whose keys are all distinct
    bounds: tuple[int, int | None]  # minProperties, maxProperties
    # (i, first, count) -> the rule, or why no members from there meet the bounds (a failure
    # is kept too: else each of the 2**n ways to reach it would try again)
    memo: dict[tuple[int, bool, int], str | Unsatisfiable] = dataclasses.field(default_factory=dict)
    undistinct: bool = False  # a way needed distinct extra keys, and numbered was None


_OLD_DRAFTS = ("Draft3Validator", "Draft4Validator", "Draft6Validator", "Draft7Validator")


@functools.lru_cache(maxsize=2)
def format_checker(today: datetime.date) -> jsonschema.FormatChecker:
    """jsonschema's format checks, with lcgen's formats checked by the very language their
    rules spell (an ``enum`` or ``const`` beside ``format`` keeps the values its rule would
    write): jsonschema checks date-time, time, duration, hostname and uri only where optional
    packages are installed, and kept ``"tomorrow"`` for a date-time without them."""
    checker = jsonschema.FormatChecker()
    for name in spec.FORMATS:
        pattern = re.compile(format_regex(name, today))
        checker.checks(name)(
            lambda value, p=pattern: not isinstance(value, str) or p.fullmatch(value) is not None
        )
    return checker


def primitive_rules(name: str, today: datetime.date) -> dict[str, str]:
    """The GBNF of primitive ``name`` and of the primitives it refers to, by name (a dated
    one's as of ``today``)."""
    rules: dict[str, str] = {}
    todo = [name]
    while todo:
        rule = todo.pop()
        if rule not in rules:
            dated = spec.DATED.get(rule)
            rules[rule] = dated(today) if dated else spec.PRIMITIVES[rule]
            todo.extend(spec.DEPENDS.get(rule, ()))
    return rules


def format_regex(name: str, today: datetime.date) -> str:
    """The Python regular expression of the texts format ``name``'s rule allows."""
    rules = primitive_rules(name, today)
    parsed = lark.parse("".join(f"{k} ::= {v}\n" for k, v in rules.items()))
    return _node_regex(parsed[name], parsed)


def _node_regex(node: lark.Node, rules: dict[str, lark.Node]) -> str:
    if isinstance(node, lark.Lit):
        return re.escape(node.text)
    if isinstance(node, lark.Cls):
        ranges = "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in node.ranges)
        if not ranges:
            return "[\\s\\S]" if node.negated else "(?!)"
        return f"[{'^' * node.negated}{ranges}]"
    if isinstance(node, lark.Ref):
        return f"(?:{_node_regex(rules[node.name], rules)})"
    if isinstance(node, lark.Seq):
        return "".join(_node_regex(item, rules) for item in node.items)
    if isinstance(node, lark.Alt):
        return "(?:" + "|".join(_node_regex(o, rules) for o in node.options) + ")"
    high = "" if node.high is None else str(node.high)
    return f"(?:{_node_regex(node.item, rules)}){{{node.low},{high}}}"


class ValueCompiler:
    """The GBNF of values, per JSON type, of conjunctions of plain schemas; subschemas (items,
    properties) go back through :meth:`visit`, which the schema compiler defines.

    Args:
        root: the whole schema (enum values are checked against its validator, whose
            references resolve within it).
        close_objects: objects that declare properties allow no others unless they say so.
        compact: no whitespace between JSON tokens.
    """

    def __init__(self, root: dict[str, Any] | bool, close_objects: bool, compact: bool) -> None:
        self.root = root
        self.close_objects = close_objects
        self.rules = g.RuleSet(reserved=[*spec.PRIMITIVES, "root"])
        self.numbers = NumberRules(self.rules)
        self.in_string: dict[str, str] = {}  # rules, and their copies inside a JSON string
        self.unique_items = False  # an array must hold unique items: no grammar says that
        self.nots: dict[int, tuple[Any, dict[str, Any]]] = {}  # see not_of
        if compact:
            self.rules.define("ws", '""')
        base = root if isinstance(root, dict) else {}
        cls = jsonschema.validators.validator_for(base)
        # (one day for the whole schema: the dated rules and the format checks)
        self.today = datetime.datetime.now(datetime.UTC).date()
        self.validator = cls(base, format_checker=format_checker(self.today))

    def visit(self, schema: Any, path: str) -> str:
        """The GBNF expression of the values ``schema`` allows."""
        raise NotImplementedError

    def n_narrowed(self) -> int:
        """How many parts of the schema were written in part so far (a value a failed visit
        found none of may then still exist)."""
        return 0

    def narrow(self, what: str) -> bool:
        """Note that ``what`` is written in part (fewer values, never more); whether to write
        it whole instead, wider (the second pass that tells an unsatisfiable schema from one
        lcgen cannot write: see :meth:`lcgen.constrain.json_schema._Compiler.compile`)."""
        return False

    def not_of(self, schema: Any) -> dict[str, Any]:
        """``{"not": schema}``, one dict for one ``schema``: a visit that comes back to it (a
        recursion) is then told by its identity, as for the schema's own subschemas."""
        found = self.nots.get(id(schema))
        if found is None:
            found = self.nots[id(schema)] = (schema, {"not": schema})  # (schema kept alive)
        return found[1]

    def named(self, name: str, expr: str) -> str:
        """``expr`` as a rule name (itself when it is one already)."""
        return expr if _RULE_NAME.fullmatch(expr) else self.rules.add(name, expr)

    def prim(self, name: str) -> str:
        if name not in self.rules.rules:
            for rule, text in primitive_rules(name, self.today).items():
                if rule not in self.rules.rules:
                    self.rules.define(rule, text)
        return name

    # one conjunction, per type ------------------------------------------------------------------
    def conjunction(self, conj: Conj, path: str) -> str:
        if any(member == FALSE for member in conj):
            raise NoValue(f"no value satisfies the schema at {path}")
        if not any(set(m) & spec.CONSTRAINING for m in conj):
            return self.prim("value")
        consts = [m for m in conj if "const" in m or "enum" in m]
        if consts:
            return self.enum(conj, consts, path)
        types = list(spec.TYPES)
        for member in conj:
            allowed = self.types_of(member)
            if allowed is not None:
                types = [t for t in types if t in allowed]
        if not types:
            declared = " and ".join(json.dumps(m["type"]) for m in conj if "type" in m)
            raise NoValue(
                f"no value satisfies the schema at {path}: the types {declared} (joined by "
                "allOf or $ref) have none in common"
            )
        if "number" in types and "integer" in types:
            types.remove("integer")
        return first_satisfiable(
            [functools.partial(self.visit_type, kind, conj, path) for kind in types], path
        )

    @staticmethod
    def types_of(member: dict[str, Any]) -> set[str] | None:
        declared = member.get("type")
        if declared is None:
            return None
        names = set(declared if isinstance(declared, list) else [declared])
        return names | ({"integer"} if "number" in names else set())

    def visit_type(self, kind: str, conj: Conj, path: str) -> str:
        if kind == "null":
            return '"null"'
        if kind == "boolean":
            return '("true" | "false")'
        if kind in ("integer", "number"):
            return self.number(conj, path, integer=kind == "integer")
        return {"string": self.string, "array": self.array, "object": self.object}[kind](conj, path)

    def all_of(self, schemas: list[Any]) -> Any:
        """One schema for the conjunction of ``schemas`` (visited later)."""
        kept = [s for s in schemas if s is not True and s != {}]
        if any(s is False or s == FALSE for s in kept):
            return False
        unique = list({json.dumps(s, sort_keys=True, default=str): s for s in kept}.values())
        return True if not unique else unique[0] if len(unique) == 1 else {"allOf": unique}

    # values -----------------------------------------------------------------------------------
    def enum(self, conj: Conj, consts: Conj, path: str) -> str:
        first = consts[0]
        values = [first["const"]] if "const" in first else list(first["enum"])
        # Each value against the other keywords: not against its own list (a linear scan per
        # value, quadratic in a long enum), and one validator per schema.
        others = [
            {k: v for k, v in m.items() if k != ("const" if "const" in m else "enum")}
            if m is first
            else m
            for m in conj
        ]
        checks = [self.validator.evolve(schema=_checkable(m)).is_valid for m in others if m != {}]
        kept = [
            value
            for value in values
            if all(check(value) for check in checks)
            and all(value not in m.get(NOT_IN, ()) for m in conj)
            and not (spec.type_of(value) == "integer" and any(spec.NOT_INTEGER in m for m in conj))
            and not (isinstance(value, str) and _matches_any(value, conj))
        ]
        if not values:
            raise NoValue(f"enum at {path} is empty: no value satisfies it")
        if not kept:
            raise NoValue(f"no value of enum/const at {path} satisfies the other keywords")
        return g.trie((self.const_pieces(v, path) for v in kept), self.rules, "enum")

    def const_pieces(self, value: Any, path: str) -> list[g.Piece]:
        """:meth:`const` as pieces for :func:`~lcgen.constrain.gbnf.trie`, so that a long enum
        is a prefix tree rather than an alternation llama.cpp walks whole every token: the
        characters of the JSON text (a non-ASCII one in a string with its escapes, a number
        with its optional zeros); an object or array is one piece."""
        if isinstance(value, dict | list):
            return [g.Expr(self.const(value, path))]
        value = _number(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            text, zeros = self.number_const(value, path)
            return [*text, g.Expr(zeros)]
        text = json.dumps(value, ensure_ascii=False)
        if isinstance(value, str) and _escaped_too(value):
            return [g.Expr(json_string_literal(c)) if _escaped_too(c) else c for c in text]
        return list(text)

    def const(self, value: Any, path: str) -> str:
        if isinstance(value, dict):
            self.prim("ws")
            orders = itertools.permutations(value.items()) if len(value) <= 4 else [value.items()]
            options = []
            for order in orders:
                members = [
                    f'{self.const(k, path)} ws ":" ws {self.const(v, path)} ws' for k, v in order
                ]
                options.append(
                    '"{" ws ' + ' "," ws '.join(members) + ' "}"' if members else '"{" ws "}"'
                )
            return g.alternatives(options)
        if isinstance(value, list):
            self.prim("ws")
            items = [f"{self.const(v, path)} ws" for v in value]
            return '"[" ws ' + ' "," ws '.join(items) + ' "]"' if items else '"[" ws "]"'
        value = _number(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            text, zeros = self.number_const(value, path)
            return f"{g.literal(text)} {zeros}"
        if isinstance(value, str) and _escaped_too(value):
            return f'"\\"" {json_string_literal(value)} "\\""'
        return g.literal(json.dumps(value, ensure_ascii=False))

    @staticmethod
    def number_const(value: float, path: str) -> tuple[str, str]:
        """A constant number: its shortest text and the GBNF of the zeros that may follow it
        (equal numbers are equal values: 1, 1.0 and 1.00 all match the constant 1), up to the
        places any number has (a small model wrote ``1.000…`` until max_tokens)."""
        if isinstance(value, float) and not math.isfinite(value):
            raise GrammarError(f"the constant {value!r} at {path} is not JSON")
        number = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
        whole = number == number.to_integral_value()
        text = str(int(number)) if whole else format(number.normalize(), "f")
        if whole and abs(number) > 2**53:
            # Past 2**53 a float and an int of one text are unequal numbers once read (JSON
            # readers make "…0.0" a float): an int constant is written as an integer only, a
            # float one with a fraction (12345678901234567890.0 came back as 1.2345…e+19).
            point = f'"." {g.repeat(_ZERO, 1, g.MAX_PLACES)}'
            return (text, point) if isinstance(value, float) else (text, '""')
        if whole:
            return text, f'("." {g.repeat(_ZERO, 1, g.MAX_PLACES)})?'
        places = len(text) - text.index(".") - 1
        return text, g.repeat(_ZERO, 0, max(0, g.MAX_PLACES - places))

    def string(self, conj: Conj, path: str) -> str:
        for member in conj:
            why = spec.REFUSED_FORMATS.get(member.get("format", ""))
            if why is not None:
                raise UnsupportedSchemaError(
                    f"format {member['format']!r} at {path} is not supported: {why}"
                )
        content = [m.get("contentSchema", True) for m in conj if spec.holds_json(m)]
        low = max((count(m, "minLength") for m in conj), default=0)
        highs = [count(m, "maxLength") for m in conj if "maxLength" in m]
        high = min(highs) if highs else None
        formats = {m["format"] for m in conj if m.get("format") in spec.FORMATS}
        patterns = {m["pattern"] for m in conj if "pattern" in m}
        excluded = [v for m in conj for v in m.get(NOT_IN, ())]
        lengths = low > 0 or high is not None
        others = bool(excluded) + bool(content)
        unmatched = sorted({p for m in conj for p in m.get(spec.NOT_MATCHING, ())})
        if unmatched and not (formats or content or lengths):
            return self.not_matching(unmatched, sorted(patterns), excluded, path)
        if unmatched:
            used = [*sorted(formats), "minLength/maxLength"] if lengths else sorted(formats)
            used += ["contentSchema"] * bool(content)
            raise UnsupportedSchemaError(
                f"not of pattern with {' and '.join(used)} on one string (at {path}) is not "
                "supported"
            )
        if len(formats) + len(patterns) + others > 1 or (others and lengths):
            used = [*sorted(formats), *sorted(patterns)]
            used += ["minLength/maxLength"] * lengths + ["not enum"] * bool(excluded)
            used += ["contentSchema"] * bool(content)
            raise UnsupportedSchemaError(
                f"{' with '.join(used)} on one string (at {path}) is not supported"
            )
        if high is not None and low > high:
            raise NoValue(f"no string satisfies minLength {low} / maxLength {high} at {path}")
        if high is not None and high > g.MAX_REPEAT >= low:
            high = g.MAX_REPEAT  # longer strings are never written (the grammar's size)
        fmt = formats.pop() if formats else None
        if fmt is not None and lengths and fmt in spec.FORMAT_PATTERNS:
            patterns, fmt = {spec.FORMAT_PATTERNS[fmt]}, None
        if fmt is not None:
            least, most = spec.FORMAT_LENGTHS.get(fmt, (0, None))
            if low > least or (high is not None and (most is None or most > high)):
                raise UnsupportedSchemaError(
                    f"{fmt} with minLength/maxLength on one string (at {path}) is not "
                    f"supported (its texts have {least} to {most} characters)"
                )
            return f'"\\"" {self.prim(fmt)} "\\""'
        if patterns:
            try:
                body = regex_to_gbnf(
                    patterns.pop(),
                    json_string=True,
                    search=True,
                    lengths=(low, high) if lengths else None,
                )
            except GrammarError as exc:
                raise _kind_of(exc)(f"pattern at {path}: {exc}") from None
            return f'"\\"" {body} "\\""'
        if excluded:
            return self.key_not_in(excluded)
        if content:
            return self.json_content(self.all_of(content), path)
        if not lengths:
            return self.prim("string")
        try:
            chars = g.repeat(self.prim("char"), low, high)
        except GrammarError as exc:
            raise _kind_of(exc)(f"minLength/maxLength at {path}: {exc}") from None
        return f'"\\"" {chars} "\\""'

    def not_matching(
        self, unmatched: list[str], required: list[str], excluded: list[str], path: str
    ) -> str:
        """A JSON string that none of ``unmatched`` and every ``required`` pattern matches (as
        both Python's ``re`` and ECMA-262 read them: a string they may judge apart is left
        out) and that is none of ``excluded``, through an automaton of them all."""
        try:
            dfa, classes = automaton.partition(unmatched, excluded, required)
        except automaton.TooLarge as exc:
            raise UnsupportedSchemaError(f"not of pattern at {path}: {exc}") from None
        except GrammarError as exc:
            raise _kind_of(exc)(f"pattern at {path}: {exc}") from None
        states = classes.get(frozenset(), frozenset())
        body = automaton.to_gbnf(dfa, states, self.rules, "unmatched") if states else None
        if body is None:
            raise Unsatisfiable(
                f"no string at {path} matches {' and '.join(map(repr, required)) or 'nothing'} "
                f"and none of {', '.join(map(repr, unmatched))} (that lcgen writes)"
            )
        return f'"\\"" {body} "\\""'

    def json_content(self, schema: Any, path: str) -> str:
        """A JSON string whose text is JSON valid against ``schema`` (``contentMediaType``
        application/json: pydantic's Json), its characters escaped as JSON writes them."""
        inner = self.visit(schema, f"{path}/contentSchema")
        # (rules still being compiled, whose bodies are empty yet, are left out: a content
        # that reaches one holds its own JSON text, escaped again at every level)
        defined = "".join(f"{name} ::= {body}\n" for name, body in self.rules.rules.items() if body)
        try:
            body = json_string_rules(
                lark.parse(f"root ::= {inner}\n{defined}"), self.rules, self.in_string
            )
        except KeyError:
            raise UnsupportedSchemaError(
                f"contentSchema at {path} is not supported: its JSON refers back to the schema "
                "around it (a Json field of its own model)"
            ) from None
        return f'"\\"" {body} "\\""'

    def number(self, conj: Conj, path: str, integer: bool) -> str:
        return self.numbers.number(conj, path, integer) or self.prim("number")

    # arrays -----------------------------------------------------------------------------------
    def array(self, conj: Conj, path: str) -> str:
        if not any(set(m) & spec.BY_TYPE["array"] for m in conj):
            return self.prim("array")
        prefixes, rests = [], []
        for m in conj:
            items, prefix = m.get("items"), m.get("prefixItems", [])
            rest: Any = True if items is None else items
            if isinstance(items, list):  # draft 2019 and before: tuple form
                prefix, rest = items, m.get("additionalItems", True)
            prefixes.append(prefix)
            rests.append(rest)
        length = max((len(p) for p in prefixes), default=0)
        elems = [
            self.all_of([p[i] if i < len(p) else r for p, r in zip(prefixes, rests, strict=True)])
            for i in range(length)
        ]
        rest_all = self.all_of(rests)
        low = max((count(m, "minItems") for m in conj), default=0)
        highs = [count(m, "maxItems") for m in conj if "maxItems" in m]
        high = min(highs) if highs else None
        for i, elem in enumerate(elems):
            if elem is False:
                high = i if high is None else min(high, i)
                break
        if rest_all is False:
            high = length if high is None else min(high, length)
        unique = any(m.get("uniqueItems") for m in conj)
        if unique and length == 0 and (values := self.item_values(rest_all)) is not None:
            if low > values:  # (as many unique items as the items have values, at most)
                raise NoValue(
                    f"no array satisfies uniqueItems with minItems {low} at {path}: its items "
                    f"take {values} value{'s' * (values != 1)}"
                )
            high = values if high is None else min(high, values)
        if unique and (high is None or high > 1):
            self.unique_items = True  # held to as the text is generated (lcgen.constrain.unique)
        if max(low, high or 0) > g.MAX_REPEAT:
            raise UnsupportedSchemaError(f"minItems/maxItems at {path} are over {g.MAX_REPEAT}")
        if high is not None and low > high:
            raise NoValue(f"no array satisfies minItems {low} / maxItems {high} at {path}")
        self.prim("ws")
        contains = [
            m
            for m in conj
            if "contains" in m and (count(m, "minContains", 1) > 0 or "maxContains" in m)
        ]
        if contains:
            return self.contains(contains, elems, rest_all, low, high, path)
        # An item no value satisfies ends the arrays before it, as false does.
        names: list[str] = []
        unmet: NoValue | None = None
        for i, elem in enumerate(elems[:high]):
            narrowed = self.n_narrowed()
            try:
                names.append(self.visit(elem, f"{path}/prefixItems/{i}"))
            except NoValue as exc:
                if self.n_narrowed() != narrowed:  # (values lcgen does not write may exist)
                    raise
                high, unmet = i, exc
                break
        rest_rule = None
        if rest_all is not False and (high is None or high > length):
            narrowed = self.n_narrowed()
            try:
                # A named rule: the chain below writes the item twice, and inlined in nested
                # arrays that would double the grammar at every level.
                where = f"{path}/{_said_by(conj, 'items')}"
                rest_rule = self.named("item", self.visit(rest_all, where))
            except NoValue as exc:
                if self.n_narrowed() != narrowed:
                    raise
                high, unmet = length, exc
        if high is not None and low > high:
            raise NoValue(f"minItems {low} at {path} needs item {high}: {unmet}")
        return '"[" ws ' + self.item_chain(names, rest_rule, low, high, 0) + ' "]"'

    def item_values(self, schema: Any, depth: int = 0) -> int | None:
        """How many values at most ``schema`` has where it says so plainly, through ``$ref``
        (pydantic's enums) and ``allOf`` (see :func:`_values`); None: more."""
        found = [_values(schema)]
        if isinstance(schema, dict) and depth < 16:
            ref = schema.get("$ref")
            resolve = getattr(self, "resolve_ref", None)
            if isinstance(ref, str) and resolve is not None:
                with contextlib.suppress(GrammarError):
                    found.append(self.item_values(resolve(ref, "#"), depth + 1))
            for member in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
                found.append(self.item_values(member, depth + 1))
            for name in ("anyOf", "oneOf"):  # (pydantic's Optional: the branches add up)
                if isinstance(schema.get(name), list):
                    branches = [self.item_values(b, depth + 1) for b in schema[name]]
                    if all(n is not None for n in branches):
                        found.append(sum(n for n in branches if n is not None))
        bounds = [n for n in found if n is not None]
        return min(bounds) if bounds else None

    def contains(
        self, members: Conj, elems: list[Any], rest: Any, low: int, high: int | None, path: str
    ) -> str:
        """Arrays of ``minItems`` to ``maxItems`` items (the first ones ``prefixItems``) with
        at least ``minContains`` and at most ``maxContains`` of them matching ``contains``:
        item by item, counting the matches so far (beside ``maxContains`` the other items
        must not match) and the items, as far as the bounds and the prefix tell them apart."""
        if len(members) > 1:
            raise UnsupportedSchemaError(
                f"two contains at {path} (joined by allOf or $ref) are not supported"
            )
        member, wanted = members[0], members[0]["contains"]
        need = count(member, "minContains", 1)
        most = count(member, "maxContains") if "maxContains" in member else None
        if most is not None and most < need:
            raise NoValue(f"no array satisfies minContains {need} / maxContains {most} at {path}")
        if high is not None and need > high:
            raise NoValue(f"no array satisfies minContains {need} / maxItems {high} at {path}")
        top = need if most is None else most  # (matches are counted up to this)
        # Items are counted up to this (when unbounded: then any more; past the first, which
        # no comma comes before)
        cap = max(low, len(elems), 1) if high is None else high
        if max(need, cap) > _MAX_CONTAINS_ITEMS or (top + 1) * (cap + 1) > _MAX_CONTAINS_STATES:
            raise UnsupportedSchemaError(
                f"contains at {path} with minContains/maxContains {need}/{most} and "
                f"minItems/maxItems {low}/{high} is not supported (over "
                f"{_MAX_CONTAINS_STATES} counting states)"
            )
        kinds: dict[int, tuple[str | None, str | None]] = {}

        def kind(n: int) -> tuple[str | None, str | None]:
            """The item at ``n`` as a match of ``contains``, and as another item (None: no
            value is one)."""
            at = min(n, len(elems))
            if at not in kinds:
                schema = elems[at] if at < len(elems) else rest
                said = f"prefixItems/{at}" if at < len(elems) else _said_by(members, "items")
                where = f"{path}/{said}"
                pair = []
                for option, name in (
                    (self.all_of([schema, wanted]), "match"),
                    (
                        schema if most is None else self.all_of([schema, self.not_of(wanted)]),
                        "item",
                    ),
                ):
                    try:
                        pair.append(
                            None if option is False else self.named(name, self.visit(option, where))
                        )
                    except NoValue:
                        pair.append(None)
                kinds[at] = (pair[0], pair[1])
            return kinds[at]

        if most is None and not elems and high is None and low <= need:
            match, other = kind(0)  # (no count of items needed: the matches, and any)
            if match is None:
                raise NoValue(f"no item satisfies contains at {path}")
            gap = f'("," ws {other} ws)*' if other else '""'
            head = f'({other} ws "," ws)*' if other else '""'
            body = f"{head} {match} ws {gap}" + f' ("," ws {match} ws {gap})' * (need - 1)
            return f'"[" ws {body} "]"'

        def steps(found: int, n: int) -> list[tuple[str, int, int]]:
            """(item, matches, items) after one more item."""
            if high is not None and n >= high:
                return []
            match, other = kind(n)
            after = n + 1 if high is not None else min(n + 1, cap)
            out = []
            if match is not None and (most is None or found < most):
                out.append((match, min(found + 1, top), after))
            if other is not None:
                out.append((other, found, after))
            return out

        @functools.cache
        def live(found: int, n: int) -> bool:
            """Whether an array can end from here (over a self-loop only by more matches)."""
            if found >= need and n >= low:
                return True
            return any((f, m) != (found, n) and live(f, m) for _, f, m in steps(found, n))

        rules: dict[tuple[int, int], str] = {}

        def items(found: int, n: int) -> str:
            """The items after ``n`` items of which ``found`` matched (a live state)."""
            if (found, n) in rules:
                return rules[(found, n)]
            rules[(found, n)] = name = self.rules.reserve("contains")
            comma = '"," ws ' if n else ""
            options = ['""'] if found >= need and n >= low else []
            for item, f, m in steps(found, n):
                if live(f, m):
                    options.append(f"{comma}{item} ws {items(f, m)}")
            self.rules.define(name, g.alternatives(options))
            return name

        if not live(0, 0):
            raise NoValue(f"no array satisfies contains with minItems/maxItems at {path}")
        return f'"[" ws {items(0, 0)} "]"'

    def item_chain(
        self, elems: list[str], rest: str | None, low: int, high: int | None, i: int
    ) -> str:
        """Items i.. of an array (each followed by ws; commas between)."""
        comma = '"," ws ' if i else ""
        if high is not None and i >= high:
            return '""'
        if i >= len(elems):
            if rest is None:
                if i < low:
                    raise Unsatisfiable(f"minItems {low} needs more items than allowed")
                return '""'
            need, more = max(low - i, 0), None if high is None else high - i
            item = f"({comma}{rest} ws)" if i else f"{rest} ws"
            if i == 0:  # the first has no comma: split it off
                tail = f'("," ws {rest} ws)'
                head_need = max(need - 1, 0)
                body = f"{item} {g.repeat(tail, head_need, None if more is None else more - 1)}"
                return body if need else f"({body})?"
            return g.repeat(f'("," ws {rest} ws)', need, more)
        head = f"{comma}{elems[i]} ws {self.item_chain(elems, rest, low, high, i + 1)}"
        return head if i < low else f"({head})?"

    # objects ----------------------------------------------------------------------------------
    def object(self, conj: Conj, path: str) -> str:
        required = list(dict.fromkeys(n for m in conj for n in m.get("required", ())))
        names = list(
            dict.fromkeys([*(n for m in conj for n in m.get("properties", {})), *required])
        )
        low = max((count(m, "minProperties") for m in conj), default=0)
        highs = [count(m, "maxProperties") for m in conj if "maxProperties" in m]
        high = min(highs) if highs else None
        if high is not None and low > high:
            raise NoValue(
                f"no object satisfies minProperties {low} / maxProperties {high} at {path}"
            )
        key_rules = [m["propertyNames"] for m in conj if "propertyNames" in m]
        allowed: list[tuple[str, Any]] = []
        for name in names:
            schema = self.all_of([self.member_schema(m, name) for m in conj])
            if any(not self.validator.evolve(schema=k).is_valid(name) for k in key_rules):
                schema = False
            if schema is False:
                if name in required:
                    raise NoValue(f"required property {name!r} at {path} is not allowed")
                continue
            allowed.append((name, schema))
        extras = self.extras(conj, names, allowed, key_rules, path)
        if not names and extras == [(None, True, False)] and (low, high) == (0, None):
            return self.prim("object")
        self.prim("ws")
        kvs = []
        for name, schema in allowed:
            narrowed = self.n_narrowed()
            try:
                kvs.append(
                    (name in required, self.member(name, schema, f"{path}/properties/{name}"))
                )
            except NoValue:
                if name in required or self.n_narrowed() != narrowed:
                    raise
                # No value satisfies an optional property's schema: objects go without it.
        extra_kvs, numbered, repeats = [], None, False
        for key, value, repeating in extras:
            with contextlib.suppress(Unsatisfiable):  # no such key then
                where = f"{path}/{_said_by(conj, 'additionalProperties')}"
                value_expr = self.visit(value, where)
                key_expr = self.key_not_in(names) if key is None else key
                extra_kvs.append(f'{key_expr} ws ":" ws {value_expr} ws')
                repeats |= repeating
                if key is None:  # any key: n distinct ones can be spelled
                    numbered = functools.partial(self.numbered_extras, names, value_expr, path)
        extra = self.named("extra", g.alternatives(extra_kvs)) if extra_kvs else None
        n_required = sum(r for r, _ in kvs)
        if n_required > (high if high is not None else math.inf):
            raise NoValue(
                f"{n_required} properties are required at {path}, more than maxProperties {high}"
            )
        members = _Members(kvs, extra, repeats, numbered, (low, high))
        try:
            chain = self.member_chain(members, 0, True, 0)
        except Unsatisfiable:
            if members.undistinct:
                raise UnsupportedSchemaError(
                    f"minProperties {low} on extra properties (at {path}) is not supported where "
                    "patternProperties or propertyNames spell their keys: the grammar cannot keep "
                    "those keys distinct"
                ) from None
            raise Unsatisfiable(
                f"no object satisfies minProperties {low}"
                + f" / maxProperties {high}" * (high is not None)
                + f" at {path} with the properties it allows"
            ) from None
        return '"{" ws ' + chain + ' "}"'

    def member_schema(self, member: dict[str, Any], name: str) -> Any:
        """What ``member`` says about the value of property ``name``."""
        declared = [member["properties"][name]] if name in member.get("properties", {}) else []
        matching = [s for p, s in member.get("patternProperties", {}).items() if re.search(p, name)]
        if declared or matching:
            return self.all_of(declared + matching)
        return self.additional(member)

    def additional(self, member: dict[str, Any]) -> Any:
        if "additionalProperties" in member:
            return member["additionalProperties"]
        declares = "properties" in member and SYNTHETIC not in member
        return not (self.close_objects and declares and "patternProperties" not in member)

    def extras(
        self,
        conj: Conj,
        names: list[str],
        allowed: list[tuple[str, Any]],
        key_rules: list[Any],
        path: str,
    ) -> list[tuple[str | None, Any, bool]]:
        """(key expression, or None for "any key but the declared ones"; value schema; whether
        the key may spell a declared one) of the properties beyond the declared ones."""
        with_patterns = [m for m in conj if m.get("patternProperties")]
        if not with_patterns and not key_rules:
            value = self.all_of([self.additional(m) for m in conj])
            return [] if value is False else [(None, value, False)]
        if with_patterns:  # (keys other than the declared ones)
            exact = self.pattern_extras(conj, names, key_rules)
            if exact is not None:
                return [(key, value, False) for key, value in exact]
        # Keys that propertyNames spells, or patterns no automaton split exactly: what follows
        # may leave some keys or values out (never writes more).
        if self.narrow(f"the extra properties at {path}"):
            return [(None, True, False)]
        if len(with_patterns) + len(key_rules) > 1:
            return []  # keys that several rules judge: only the declared ones
        if key_rules:  # keys spelled by propertyNames, their values as any extra's
            keys, rule = [key_rules[0]], None
        else:
            rule = with_patterns[0]
            keys = [{"type": "string", "pattern": p} for p in rule["patternProperties"]]
            if self.additional(rule) is not False:  # other keys: any but the declared ones
                keys.append({"type": "string", NOT_IN: names})
        base = [self.additional(m) for m in conj if m is not rule]
        if rule is not None:
            base += list(rule["patternProperties"].values())
        schemas = dict(allowed)
        out: list[tuple[str | None, Any, bool]] = []
        for key in keys:
            check = self.validator.evolve(schema=key)
            spelled = [n for n in names if check.is_valid(n) and n not in key.get(NOT_IN, ())]
            own = [self.additional(rule)] if rule is not None and NOT_IN in key else []
            if spelled:  # keys but the declared ones, where the key's schema can say so
                with contextlib.suppress(GrammarError):
                    other = self.all_of([key, {"type": "string", NOT_IN: spelled}])
                    key_expr = self.visit(other, path)
                    value = self.all_of([*base, *own])
                    if value is not False:
                        out.append((key_expr, value, False))
                    continue
            if any(n not in schemas for n in spelled):
                continue  # it could spell a property that is not allowed
            # A key may repeat a declared one (the last value wins): its value satisfies both.
            value = self.all_of([*base, *own, *(schemas[n] for n in spelled)])
            if value is not False:
                with contextlib.suppress(Unsatisfiable):
                    key_expr = self.visit(self.all_of([key, {"type": "string"}]), path)
                    out.append((key_expr, value, bool(spelled)))
        return out

    def pattern_extras(
        self, conj: Conj, names: list[str], key_rules: list[Any]
    ) -> list[tuple[str | None, Any]] | None:
        """The extra keys split by the patterns they match, each class's values satisfying the
        schemas of exactly those patterns (or ``additionalProperties`` where none matches).
        None where that cannot be built exactly (too many automaton states, propertyNames
        saying more than patterns): the caller then narrows."""
        required = _key_patterns(key_rules)
        if required is None:
            return None
        patterns = list(dict.fromkeys(p for m in conj for p in m.get("patternProperties", {})))
        try:
            dfa, classes = automaton.partition(patterns, names, required)
        except GrammarError:
            return None
        by_value: dict[str, tuple[Any, set[int]]] = {}  # classes whose values agree share a key
        for matched, states in sorted(classes.items(), key=lambda kv: sorted(kv[0])):
            value = self.all_of(
                [s for m in conj for s in self.extra_schemas(m, {patterns[i] for i in matched})]
            )
            if value is not False:
                text = json.dumps(value, sort_keys=True, default=str)
                by_value.setdefault(text, (value, set()))[1].update(states)
        out: list[tuple[str | None, Any]] = []
        for value, ends in by_value.values():
            body = automaton.to_gbnf(dfa, ends, self.rules, "pkey")
            if body is not None:
                out.append((f'"\\"" {body} "\\""', value))
        return out

    def extra_schemas(self, member: dict[str, Any], matched: set[str]) -> list[Any]:
        """What ``member`` says about the value of a key that is none of the declared
        properties and matches exactly the patterns ``matched``."""
        own = [s for p, s in member.get("patternProperties", {}).items() if p in matched]
        return own or [self.additional(member)]

    def member(self, name: str, schema: Any, path: str) -> str:
        self.prim("ws")
        return f'{self.const(name, path)} ws ":" ws {self.visit(schema, path)} ws'

    def member_chain(self, m: _Members, i: int, first: bool, count: int) -> str:
        """Members i.. of an object in order (``count`` taken so far): required ones always,
        optional ones maybe, then extra ones, within min/maxProperties."""
        key = (i, first, count)
        found = m.memo.get(key)
        if isinstance(found, Unsatisfiable):
            raise found
        if found is not None:
            return found
        try:
            rule = self._member_chain(m, i, first, count)
        except Unsatisfiable as exc:
            m.memo[key] = exc
            raise
        m.memo[key] = rule
        return rule

    def _member_chain(self, m: _Members, i: int, first: bool, count: int) -> str:
        comma = "" if first else '"," ws '
        if i == len(m.kvs):
            body = self.extra_members(m, comma, count)
            if body == '""':
                return body
        else:
            options = []
            required = m.kvs[i][0]
            with contextlib.suppress(Unsatisfiable):
                counted = count + (m.bounds != (0, None))
                rest = self.member_chain(m, i + 1, False, counted)
                options.append(f"{comma}{m.kvs[i][1]} {rest}")
            if not required:
                with contextlib.suppress(Unsatisfiable):
                    options.append(self.member_chain(m, i + 1, first, count))
            if not options:
                raise Unsatisfiable("minProperties/maxProperties cannot be met")
            body = g.alternatives(options)
        return self.rules.add("members", body)

    def extra_members(self, m: _Members, comma: str, count: int) -> str:
        """The extra members after ``count`` declared ones. An extra key may repeat another
        (a repeat counts once), so beyond one, those that count toward minProperties have
        keys distinct by construction; and one counts only where it cannot repeat a declared
        key written before it."""
        low, high = m.bounds
        need = max(low - count, 0)
        room = None if high is None else high - count
        if (room is not None and room < need) or (need and m.extra is None):
            raise Unsatisfiable("minProperties/maxProperties cannot be met")  # object() says where
        if need and count and m.repeats:
            m.undistinct = True
            raise Unsatisfiable("an extra key could repeat a declared one")
        if m.extra is None or room == 0:
            return '""'
        if need <= 1:
            tail = g.repeat(f'("," ws {m.extra})', 0, None if room is None else room - 1)
            body = f"{comma}{m.extra} {tail}"
            return body if need else f"({body})?"
        if m.numbered is None:
            m.undistinct = True
            raise Unsatisfiable("extra keys cannot be kept distinct")
        tail = g.repeat(f'("," ws {m.extra})', 0, None if room is None else room - need)
        return comma + ' "," ws '.join(m.numbered(need)) + f" {tail}"

    def numbered_extras(self, names: list[str], value: str, path: str, n: int) -> list[str]:
        """``n`` extra members whose keys differ from each other and from ``names``: the k-th
        key is any text that does not end in a digit, then the k-th number (its trailing digits
        tell it apart) that is no name's trailing digits."""
        if n > g.MAX_REPEAT:
            raise UnsupportedSchemaError(f"minProperties at {path} is over {g.MAX_REPEAT}")
        taken = {name[len(name.rstrip("0123456789")) :] for name in names}
        numbers = itertools.islice((str(k) for k in itertools.count(1) if str(k) not in taken), n)
        non_digit = g.char_class(g.subtract(spec.RAW_RANGES, ((0x30, 0x39),)))
        prefix = self.rules.add("nkey-prefix", f"({spec.RAW_CHAR})* {non_digit}")
        value = self.named("extra-value", value)
        return [f'"\\"" {prefix}? "{k}\\"" ws ":" ws {value} ws' for k in numbers]

    def key_not_in(self, names: list[str]) -> str:
        """A JSON string that is none of ``names``: of raw characters (no escapes, which could
        spell a name in another form), or with none given, any JSON string."""
        if not names:
            return self.prim("string")
        raw = spec.RAW_CHAR
        trie: dict[str, Any] = {}
        for name in names:
            node = trie
            for ch in name:
                node = node.setdefault(ch, {})
            node[""] = {}
        return f'"\\"" {self.trie_rule(trie, raw)} "\\""'

    def trie_rule(self, node: dict[str, Any], raw: str) -> str:
        children = {c: n for c, n in node.items() if c}
        options = [] if "" in node else ['""']
        for ch, child in children.items():
            options.append(f"{g.literal(ch)} {self.trie_rule(child, raw)}")
        others = g.subtract(
            ((0x20, g.MAX_CODEPOINT),),
            g.ranges_of((ord(c), ord(c)) for c in [*children, '"', "\\"]),
        )
        others = g.subtract(others, g.SURROGATES)
        options.append(f"{g.char_class(others)} ({raw})*")
        return self.rules.add("key", " | ".join(options))


# The most (matches so far, items so far) states a contains with item counts is written with.
_MAX_CONTAINS_STATES = 4096
_MAX_CONTAINS_ITEMS = 500  # items counted beside contains (one rule, and a call, each)


def _number(value: Any) -> Any:
    """A ``Decimal`` (a schema read with ``parse_float=Decimal``) as the int or float JSON
    reads its text as; any other value as it is."""
    if isinstance(value, Decimal):
        return int(value) if value % 1 == 0 else float(value)
    return value


def _matches_any(text: str, conj: Conj) -> bool:
    """Whether a pattern some member says no string matches matches ``text`` (or cannot be
    read: then it is left out too)."""
    for pattern in (p for m in conj for p in m.get(spec.NOT_MATCHING, ())):
        try:
            if re.search(pattern, text):
                return True
        except re.error:
            return True
    return False


def _checkable(member: dict[str, Any]) -> dict[str, Any]:
    """``member`` as jsonschema can check it: without an ``additionalItems`` that ``items``
    (not a list) makes moot (jsonschema takes the length of a boolean ``items`` there)."""
    if "additionalItems" in member and not isinstance(member.get("items"), list):
        return {k: v for k, v in member.items() if k != "additionalItems"}
    return member


def _said_by(conj: Conj, key: str) -> str:
    """The keyword ``key`` stands for in ``conj`` (for paths): ``unevaluatedProperties``
    where only the member made for it says ``additionalProperties``."""
    saying = [m for m in conj if key in m]
    sources = {m.get(SOURCE, key) for m in saying}
    return sources.pop() if len(sources) == 1 else key


def _escaped_too(text: str) -> bool:
    """Whether ``text`` has a character JSON text may hold raw or as a ``\\u`` escape (which
    ``json.dumps`` writes by default): DEL and the non-ASCII ones."""
    return any(c >= "\x7f" for c in text)


def _values(schema: Any) -> int | None:
    """How many values at most a schema has, where it says so plainly (``enum``, ``const``,
    the types ``boolean`` and ``null``); None: more than it says plainly."""
    if schema is False:
        return 0
    if not isinstance(schema, dict):
        return None
    found: list[int] = []
    if isinstance(schema.get("enum"), list):
        found.append(len({item_key(v) for v in schema["enum"]}))
    if "const" in schema:
        found.append(1)
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if isinstance(types, list) and types and set(types) <= {"boolean", "null"}:
        found.append(2 * ("boolean" in types) + ("null" in types))
    if types == ["integer"]:  # a range of integers
        low = _bound(schema, "minimum", "exclusiveMinimum")
        high = _bound(schema, "maximum", "exclusiveMaximum")
        if low is not None and high is not None:
            first = math.ceil(low[0]) + (low[1] and low[0] == math.ceil(low[0]))
            last = math.floor(high[0]) - (high[1] and high[0] == math.floor(high[0]))
            found.append(max(0, last - first + 1))
    return min(found) if found else None


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str) -> tuple[Any, bool] | None:
    """A number bound of ``schema`` (the value, whether it is exclusive), where one is plainly a
    number (draft 4's boolean exclusives leave it out)."""
    for name, strict in ((exclusive, True), (inclusive, False)):
        value = schema.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return value, strict
    return None


def _key_patterns(rules: list[Any]) -> list[str] | None:
    """The patterns of ``propertyNames`` schemas that say nothing else about a key (None when
    one says more)."""
    patterns = []
    for rule in rules:
        if rule is True:
            continue
        if not isinstance(rule, dict) or rule.get("type", "string") != "string":
            return None
        if set(rule) & spec.CONSTRAINING - {"type", "pattern"}:
            return None
        if "pattern" in rule:
            patterns.append(rule["pattern"])
    return patterns


_ZERO = '"0"'


def _kind_of(exc: GrammarError) -> type[GrammarError]:
    """The error a pattern's or a length's ``exc`` is in a schema: unsupported where it names
    a regex construct or a bound past llama.cpp's, else invalid or unsatisfiable."""
    return UnsupportedSchemaError if isinstance(exc, g.Unsupported) else GrammarError
