"""JSON Schema to GBNF, exactly: every text the grammar allows is JSON that validates, but
for ``uniqueItems``, which no grammar can say (generation holds to it: see
:mod:`lcgen.constrain.unique`).

The grammar may allow less than the schema (a fixed property order, canonical escapes of ASCII,
numbers without exponents where bounded, whitespace of at most 24 characters, durations of at
most 6 digits a field, fewer extra keys where ``patternProperties`` meets a ``propertyNames``
that says more than a pattern or where telling keys apart by their patterns would take an
automaton of over 512 states, and where ``minProperties`` needs two or more extra properties,
keys that each end in their own number, so that no repeat can make up the count), never more.
A keyword lcgen cannot enforce raises :class:`~lcgen.errors.GrammarError` naming it and
where it is, instead of being dropped; unknown keywords are annotations, ignored as the
specification says (a likely misspelling of a keyword warns).

How: every schema is first *flattened* into alternatives, each a conjunction of plain schemas
without applicators: ``allOf`` joins conjunctions, ``anyOf``/``oneOf`` (each option joined with
the ``not`` of the others it may overlap) and ``if``/``then``/``else`` and the dependency
keywords branch, ``not`` is pushed inward (each keyword negated on
its own: a conjunction fails when one of its keywords fails), and a ``$ref`` beside other
keywords is expanded in place. ``unevaluatedProperties``/``unevaluatedItems`` add a member to
each alternative of their schema: what the properties and items its other members do not
evaluate must be. Each conjunction then becomes GBNF per JSON type, gathering
what its members say about that type: keywords of one type constrain only values of that
type, as the specification says.
"""

from __future__ import annotations

import decimal
import difflib
import functools
import itertools
import json
import math
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import unquote

import jsonschema

from lcgen.constrain import json_rules as spec
from lcgen.constrain import lark
from lcgen.constrain.bundle import Documents, bundle, draft_of, schema_error, unresolved_ref
from lcgen.constrain.json_rules import Conj, NoValue, Unsatisfiable, not_finite
from lcgen.constrain.json_values import (
    FALSE,
    NOT_IN,
    SOURCE,
    SYNTHETIC,
    ValueCompiler,
    count,
    first_satisfiable,
)
from lcgen.errors import GrammarError, UnsupportedSchemaError, warn

MAX_ALTERNATIVES = 256
# $refs expanded in place (beside other keywords, in allOf) per schema: a chain of allOfs of two
# $refs each doubles the expansions at every level.
MAX_EXPANSIONS = 20_000
# Marks a schema made by negating a plain schema in part (its value: what was left out).
PARTIAL = "$lcgen-partial-negation"
# Marks a member whose properties and items do not count as evaluated (unevaluated*).
UNCOUNTED = "$lcgen-evaluates-nothing"
# The keywords :meth:`_Compiler.negate_plain` negates exactly.
NEGATED = frozenset(
    ["type", "const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
     "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
     "required", "properties", "pattern", NOT_IN]
)  # fmt: skip


_TOO_DEEP = (
    "the JSON Schema nests too deeply to compile (or has too many properties in one object, "
    "each compiled in turn): flatten it"
)


def schema_to_gbnf(
    schema: dict[str, Any] | bool,
    *,
    close_objects: bool = False,
    whitespace: Literal["flexible", "compact"] = "flexible",
    documents: Documents | None = None,
    uri: str = "",
) -> tuple[str, Any]:
    """GBNF text whose root matches exactly JSON texts (a subset) valid against ``schema``,
    but for ``uniqueItems``, which no grammar can say; and where the schema has arrays that
    must hold unique items, the schema as one document (:func:`bundle_schema`) for
    :mod:`lcgen.constrain.unique` to hold generation to them (else None).

    Args:
        schema: the JSON Schema.
        documents: the other documents its references name (:func:`bundle_schema`).
        uri: the URI the schema was read from (:func:`bundle_schema`).
        close_objects: objects that do not say whether they allow other properties allow
            none (the specification allows any).
        whitespace: ``"flexible"``: up to 24 spaces, tabs or newlines between tokens of JSON;
            ``"compact"``: none (fewer tokens to generate).

    Raises:
        GrammarError: an unsupported keyword or combination, an invalid schema, or one that no
            value satisfies.
    """
    if whitespace not in ("flexible", "compact"):
        raise ValueError(f"whitespace must be 'flexible' or 'compact', got {whitespace!r}")
    if isinstance(schema, dict):
        try:
            draft_of(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise schema_error(exc) from None
        except RecursionError:
            raise UnsupportedSchemaError(_TOO_DEEP) from None
    one = bundle(schema, documents, uri)  # (outside: a documents function raises what it raises)
    try:
        with decimal.localcontext() as context:
            context.prec = 1000  # bounds such as 1e300 are whole numbers of 301 digits
            compiler = _Compiler(one.schema, close_objects, whitespace == "compact", one.errors)
            compiler.where = one.where
            return compiler.compile(), one.schema if compiler.unique_items else None
    except Unsatisfiable as exc:  # internal: users see a plain GrammarError
        raise one.located(GrammarError(str(exc))) from None
    except GrammarError as exc:
        raise one.located(exc) from None
    except RecursionError:
        raise UnsupportedSchemaError(_TOO_DEEP) from None
    except ArithmeticError as exc:
        raise UnsupportedSchemaError(
            f"a numeric bound of the JSON Schema is out of range: {exc!r}"
        ) from None


def _shape(schema: dict[str, Any]) -> tuple[Any, ...]:
    """A key two schemas share only when they are the same schema: the subschemas by identity
    (a list made afresh, as the allOf that merges members is, by what it holds)."""
    return tuple((key, _atom(value)) for key, value in schema.items())


def _content(schema: dict[str, Any]) -> str | None:
    """Text two schemas share when they are equal (None: one JSON cannot write)."""
    try:
        return json.dumps(schema, default=repr)  # (in order: properties are written so)
    except (TypeError, ValueError):
        return None


def _atom(value: Any) -> Any:
    if isinstance(value, dict):
        return ("dict", id(value))
    if isinstance(value, list | tuple):
        return ("list", *map(_atom, value))
    return (type(value).__name__, value)


def _refs(node: lark.Node) -> list[str]:
    """The rules ``node`` refers to."""
    if isinstance(node, lark.Ref):
        return [node.name]
    if isinstance(node, lark.Seq):
        return [name for item in node.items for name in _refs(item)]
    if isinstance(node, lark.Alt):
        return [name for option in node.options for name in _refs(option)]
    if isinstance(node, lark.Rep):
        return _refs(node.item)
    return []


def _impossible(conj: Conj) -> bool:
    """Whether no value satisfies ``conj`` for a plain reason (its types have none in common,
    or it holds only numbers and their bounds cross): an alternative not worth keeping (a
    oneOf's options joined with the negations of the others make many)."""
    types = set(spec.TYPES)
    for member in conj:
        allowed = ValueCompiler.types_of(member)
        if allowed is not None:
            types &= allowed
    if not types:
        return True
    if not types <= {"integer", "number"}:
        return False
    lows = [b for m in conj if (b := spec.bound(m, "minimum", "exclusiveMinimum"))]
    highs = [b for m in conj if (b := spec.bound(m, "maximum", "exclusiveMaximum"))]
    if not lows or not highs:
        return False
    (lo, lo_open), (hi, hi_open) = max(lows), min(highs, key=lambda b: (b[0], not b[1]))
    return lo > hi or (lo == hi and (lo_open or hi_open))


def _holds(key: str, value: Any) -> bool:
    """Whether keyword ``key`` with ``value`` holds for every value (no count, no name)."""
    if key in ("minLength", "minItems", "minProperties", "minContains"):
        return bool(value == 0)
    return key in ("required", "properties", "patternProperties", "dependentRequired") and not value


def _evaluates(member: dict[str, Any]) -> bool:
    """Whether ``member``'s properties and items count as evaluated (a negation's do not)."""
    return SYNTHETIC not in member and UNCOUNTED not in member


def _annotating(alts: list[Conj]) -> bool:
    """Whether a member of ``alts`` evaluates properties or items."""
    return any(_evaluates(m) and set(m) & spec.ANNOTATING for c in alts for m in c)


def _prefix(member: dict[str, Any]) -> list[Any]:
    """The items ``member`` says one by one (prefixItems; items as a list before 2020-12)."""
    items = member.get("items")
    return items if isinstance(items, list) else member.get("prefixItems", [])


def _all_items(member: dict[str, Any]) -> bool:
    """Whether ``member`` evaluates every item of an array (items beyond its prefix)."""
    items = member.get("items")
    return (items is not None and not isinstance(items, list)) or (
        isinstance(items, list) and "additionalItems" in member
    )


# The keywords whose value is an object keyed by property names (or patterns of them).
_BY_PROPERTY_NAME = frozenset(
    ["properties", "patternProperties", "dependentRequired", "dependentSchemas", "dependencies"]
)
_OLD_DRAFTS = ("Draft3Validator", "Draft4Validator", "Draft6Validator", "Draft7Validator")


class _Compiler(ValueCompiler):
    """Schemas to alternatives of conjunctions (the per-type GBNF is :class:`ValueCompiler`'s)."""

    def __init__(
        self,
        root: dict[str, Any] | bool,
        close_objects: bool,
        compact: bool,
        unresolved: dict[str, GrammarError] | None = None,
        widen: bool = False,
    ) -> None:
        super().__init__(root, close_objects, compact)
        # (root: one document, from bundle(), which says why the references it left as
        # written do not resolve)
        self.options = (close_objects, compact, unresolved)
        self.unresolved = unresolved or {}
        self.where: Callable[[str], str] = str  # (places in given documents by URI: Bundle's)
        # A not lcgen can negate only in part counts as true: what it leaves out comes back.
        self.widen = widen
        self.refs: dict[str, str] = {}
        self.expanding: list[str] = []
        # Recursion through anything but a plain {"$ref": ...} (a $ref in anyOf, oneOf, beside
        # a type list...) comes back to a subschema still being visited: that visit becomes a
        # rule, and the inner one refers to it. (shape: [schema, its rule once one is needed])
        self.visiting: dict[tuple[Any, ...], list[Any]] = {}
        self.recursive: dict[tuple[Any, ...], tuple[Any, str]] = {}  # shape: (schema, rule)
        self.memo: dict[str, str] = {}  # a schema's JSON text: its expression
        self.cycles: dict[str, str] = {}  # rules a recursion came back to: which $ref, where
        self.followed: list[str] = []  # every $ref followed, in order ("$ref '#' at #/...")
        self.expansions = 0  # $refs expanded in place (bounded: MAX_EXPANSIONS)
        self.narrowed: list[str] = []  # parts written in part ("the not at #/not, whose ...")
        # How many schemas with unevaluated* the flatten under way is inside: there, which
        # properties and items a location's subschemas evaluated matters.
        self.scopes = 0
        self.negating = 0  # how many negations the flatten under way is inside
        # The keywords of the draft (jsonschema's, and those it reads beside them)
        self.vocabulary = set(type(self.validator).VALIDATORS) | {
            "then", "else", "exclusiveMinimum", "exclusiveMaximum"
        }  # fmt: skip
        if "dependentSchemas" in self.vocabulary:  # (2019-09 on: read by contains)
            self.vocabulary |= {"minContains", "maxContains"}
        name = type(self.validator).__name__
        self.old_draft = name in _OLD_DRAFTS  # $ref ignores its siblings
        self.draft2020 = not self.old_draft and name != "Draft201909Validator"  # prefixItems
        self.draft4 = name in _OLD_DRAFTS[:2]  # boolean exclusiveMinimum/Maximum

    def compile(self) -> str:
        try:
            text = self.rules.text(self.visit(self.root, "#"))
        except Unsatisfiable as exc:
            if not self.narrowed:
                raise
            # The values a negation left out may have been the valid ones: where the schema
            # without those negations (wider) has values, lcgen cannot write it; else no value
            # validates it at all.
            try:
                _Compiler(self.root, *self.options, widen=True).visit(self.root, "#")
            except Unsatisfiable:
                raise exc from None
            parts = "; ".join(dict.fromkeys(self.narrowed))
            raise UnsupportedSchemaError(
                f"lcgen writes only in part {parts}: what it can write of the schema has "
                f"no value, but the values left out may be valid ({exc})"
            ) from None
        if self.cycles:
            self.check_finite(text)
        return text

    def check_finite(self, text: str) -> None:
        """Raise where a recursion never ends: a rule the root reaches that derives no finite
        text (every value of it holds another, as a required property that refers back does),
        which would leave generation no way to finish."""
        rules = lark.parse(text)
        finite: set[str] = set()

        def ends(node: lark.Node) -> bool:
            if isinstance(node, lark.Ref):
                return node.name in finite
            if isinstance(node, lark.Seq):
                return all(ends(item) for item in node.items)
            if isinstance(node, lark.Alt):
                return any(ends(option) for option in node.options)
            if isinstance(node, lark.Rep):
                return node.low == 0 or ends(node.item)
            return True

        pending = dict(rules)
        while True:
            done = [name for name, node in pending.items() if ends(node)]
            if not done:
                break
            finite.update(done)
            for name in done:
                del pending[name]
        reached, stack = set(), ["root"]
        while stack:
            name = stack.pop()
            if name in reached or name not in rules:
                continue
            reached.add(name)
            stack += _refs(rules[name])
        for name in self.cycles:
            if name in reached and name not in finite:
                raise Unsatisfiable(
                    f"{self.cycles[name]} never ends: every value holds "
                    "another (a required property or minItems that refers back), so no finite "
                    "value validates; make the recursion optional"
                )

    # schemas to alternatives of conjunctions -------------------------------------------------
    def n_narrowed(self) -> int:
        return len(self.narrowed)

    def narrow(self, what: str) -> bool:
        if not self.widen:
            self.narrowed.append(what)
        return self.widen

    def visit(self, schema: Any, path: str) -> str:
        """The GBNF expression of the values ``schema`` allows; a rule that refers to itself
        where the schema's values hold values of the same schema (a visit of it comes back
        to it, through properties or items)."""
        if not isinstance(schema, dict):
            return self.visit_once(schema, path)
        key = _shape(schema)
        done = self.recursive.get(key)
        if done is not None:
            return done[1]
        entry = self.visiting.get(key)
        if entry is not None:
            if entry[1] is None:
                rule = entry[1] = self.rules.reserve("rec-" + path.rsplit("/", 1)[-1])
                via = self.followed[entry[3] : entry[3] + 1] or [f"the schema at {path}"]
                # (the first $ref followed since that visit began: the one it went through)
                self.cycles[rule] = f"the recursion of {via[0]} (back to {entry[2]})"
            return str(entry[1])
        content = _content(schema)
        if content is not None and content in self.memo:
            # An equal schema elsewhere: written once (a rule where long, referred to).
            if len(self.memo[content]) > 40:
                self.memo[content] = self.named("value", self.memo[content])
            return self.memo[content]
        entry = self.visiting[key] = [schema, None, path, len(self.followed)]
        marks = (len(self.refs), len(self.recursive), len(self.memo))
        try:
            body = self.visit_once(schema, path)
        except BaseException:
            if entry[1] is not None:  # what was made since may refer to its rule: never made
                self.forget(marks)
            raise
        finally:
            del self.visiting[key]
        name = entry[1]
        if name is None:
            if content is not None:
                self.memo[content] = body
            return body
        if self.loops(name, body):
            raise GrammarError(
                f"{self.cycles[name]} refers only to itself, with no property or item in "
                "between: no value validates"
            )
        self.rules.define(name, body)
        self.recursive[key] = (schema, name)
        return str(name)

    def forget(self, marks: tuple[int, int, int]) -> None:
        """Drop the rules of references and recursions, and the visits, made since ``marks``
        (a failed visit's, which may refer to a rule that is never defined)."""
        made: tuple[dict[Any, Any], ...] = (self.refs, self.recursive, self.memo)
        for found, mark in zip(made, marks, strict=True):
            while len(found) > mark:
                found.popitem()

    def loops(self, name: str, body: str) -> bool:
        """Whether ``body`` is ``name``, or a rule that is only another such rule, and so on
        back to ``name`` (a loop that no text ends: llama.cpp calls it left recursion)."""
        seen: set[str] = set()
        while body not in seen and body in self.rules.rules:
            if body == name:
                return True
            seen.add(body)
            body = self.rules.rules[body]
        return body == name

    def visit_once(self, schema: Any, path: str) -> str:
        if schema is False:
            raise NoValue(f"the schema at {path} is false: no value validates")
        if isinstance(schema, dict) and "$ref" in schema and self.only_ref(schema):
            self.check_keywords(schema, path)
            return self.ref(schema["$ref"], path)
        if schema is True or (isinstance(schema, dict) and not set(schema) & spec.CONSTRAINING):
            if isinstance(schema, dict):
                self.check_keywords(schema, path)
            return self.prim("value")
        return first_satisfiable(
            [functools.partial(self.conjunction, c, path) for c in self.flatten(schema, path)],
            path,
        )

    def only_ref(self, schema: dict[str, Any]) -> bool:
        return self.old_draft or not (set(schema) - spec.ANNOTATIONS - {"$ref", "$schema", "$id"})

    def flatten(self, schema: Any, path: str) -> list[Conj]:
        """``schema`` as alternatives, each a conjunction of plain schemas."""
        if schema is True:
            return [[]]
        if schema is False:
            return []
        if not isinstance(schema, dict):
            raise GrammarError(f"the schema at {path} is not an object: {schema!r}")
        self.check_keywords(schema, path)
        if "$ref" in schema and self.old_draft:
            schema = {"$ref": schema["$ref"]}
        if not set(schema) & spec.UNEVALUATED or self.old_draft:  # (no keywords before 2019)
            return self.applied(schema, path)
        self.scopes += 1
        try:
            alts = self.applied(schema, path)
        finally:
            self.scopes -= 1
        return [self.unevaluated(schema, conj, path) for conj in alts]

    def applied(self, schema: dict[str, Any], path: str) -> list[Conj]:
        """:meth:`flatten` of a schema without ``unevaluated*`` (or with it, not yet held to)."""
        if self.negating:
            # A keyword the draft lacks is held to where it narrows (as a user meant it) but
            # is true under a not, as the draft reads it: negated it would widen.
            schema = {
                k: v
                for k, v in schema.items()
                if k in self.vocabulary or k not in spec.CONSTRAINING
            }
        plain = {k: v for k, v in schema.items() if k not in spec.APPLICATORS}
        if not self.draft2020:  # (an unknown keyword before 2020-12: items take them all)
            plain.pop("prefixItems", None)
        if self.old_draft:  # (unknown before 2019-09: contains asks for one match)
            plain.pop("minContains", None)
            plain.pop("maxContains", None)
        alts: list[Conj] = [[plain]]
        if "$ref" in schema:
            alts = self.join(alts, self.expand_ref(schema["$ref"], path))
        for i, sub in enumerate(schema.get("allOf", ())):
            alts = self.join(alts, self.flatten(sub, f"{path}/allOf/{i}"))
        if "anyOf" in schema:
            alts = self.join(alts, self.any_of(schema["anyOf"], f"{path}/anyOf"))
        if "oneOf" in schema:
            # OpenAPI's (and pydantic's) discriminator: its property is in every value (pydantic
            # refuses one without it, even where its field has a default) and tells them apart.
            found = schema.get("discriminator")
            tag = found.get("propertyName") if isinstance(found, dict) else None
            # (not under a not: there the property it requires would be negated too)
            tag = tag if isinstance(tag, str) and not self.negating else None
            if tag is not None:
                alts = self.join(alts, [[{"required": [tag]}]])
            alts = self.join(alts, self.one_of(schema["oneOf"], path, tag))
        if "not" in schema:
            alts = self.join(alts, self.negate(schema["not"], f"{path}/not"))
        if "if" in schema and ("then" in schema or "else" in schema):
            test = schema["if"]
            yes = self.join(
                self.flatten(test, f"{path}/if"),
                self.flatten(schema.get("then", True), f"{path}/then"),
            )
            no = self.join(
                self.negate(test, f"{path}/if"),
                self.flatten(schema.get("else", True), f"{path}/else"),
            )
            alts = self.join(alts, yes + no)
        elif "if" in schema and self.scopes:
            # An if alone asserts nothing, but where it validates, what it evaluated counts.
            test = self.flatten(schema["if"], f"{path}/if")
            if _annotating(test):
                alts = self.join(alts, [[], *test])
        for key, name, then in self.dependencies(schema):
            absent: Conj = [{"properties": {name: FALSE}, SYNTHETIC: True}]  # (or no object)
            flat = self.flatten(then, f"{path}/{key}/{name}")
            if key == "dependencies" and not self.old_draft:
                # Held to in every draft, but no keyword since 2019-09 (it was split in two):
                # what it says evaluates nothing there.
                flat = [[{**m, UNCOUNTED: True} for m in conj] for conj in flat]
            present = self.join([[{"type": "object", "required": [name]}]], flat)
            alts = self.join(alts, [absent, *present])
        return alts

    @staticmethod
    def dependencies(schema: dict[str, Any]) -> list[tuple[str, str, Any]]:
        """(keyword, property, schema that applies when it is present) of every dependency."""
        found: list[tuple[str, str, Any]] = []
        for key in ("dependencies", "dependentRequired", "dependentSchemas"):
            for name, then in schema.get(key, {}).items():
                found.append((key, name, {"required": then} if isinstance(then, list) else then))
        return found

    def join(
        self, left: list[Conj], right: list[Conj], where: str = "the schema", prune: bool = False
    ) -> list[Conj]:
        """Each alternative of ``left`` with each of ``right`` (``prune``: without those
        :func:`_impossible`, which would say why when compiled)."""
        joined = [a + b for a in left for b in right]
        if prune:
            joined = [c for c in joined if not _impossible(c)]
        if len(joined) > MAX_ALTERNATIVES:
            raise UnsupportedSchemaError(
                f"{where} branches into over {MAX_ALTERNATIVES} alternatives (anyOf, oneOf and "
                "the not of each option of a oneOf lcgen cannot prove disjoint from another, "
                "if/then/else and dependencies multiply): simplify it"
            )
        return joined

    def any_of(self, schemas: list[Any], path: str) -> list[Conj]:
        """The alternatives of an ``anyOf``: one per branch; where ``unevaluated*`` reads this
        location, one per set of the branches that evaluate properties or items, since every
        branch that validates counts (a value that two branches validate may need the
        properties of both)."""
        flats = [self.flatten(s, f"{path}/{i}") for i, s in enumerate(schemas)]
        if not self.scopes:
            return [c for f in flats for c in f]
        telling = [f for f in flats if _annotating(f)]
        rest = [c for f in flats if not _annotating(f) for c in f]
        if math.prod(len(f) + 1 for f in telling) - 1 + len(rest) > MAX_ALTERNATIVES:
            raise UnsupportedSchemaError(
                f"the anyOf at {path} has too many branches beside unevaluatedProperties or "
                f"unevaluatedItems: each set of them that may validate together is an "
                f"alternative, over {MAX_ALTERNATIVES}"
            )
        sets = [
            [m for conj in chosen if conj is not None for m in conj]
            for chosen in itertools.product(*([None, *f] for f in telling))
            if any(c is not None for c in chosen)
        ]
        return [*sets, *rest]

    def unevaluated(self, schema: dict[str, Any], conj: Conj, path: str) -> Conj:
        """``conj``, an alternative of ``schema`` made of it and its in-place subschemas,
        with what its ``unevaluatedProperties`` / ``unevaluatedItems`` say of the properties
        and items none of them evaluated (a negation's keywords evaluate nothing)."""
        seen = [m for m in conj if _evaluates(m)]
        out = list(conj)
        rest = schema.get("unevaluatedProperties", True)
        if "unevaluatedProperties" in schema and not any("additionalProperties" in m for m in seen):
            # (a member with additionalProperties evaluates every property: this one too, for
            # an unevaluatedProperties around this location)
            member: dict[str, Any] = {"additionalProperties": rest, SOURCE: "unevaluatedProperties"}
            for key in ("properties", "patternProperties"):
                if named := {n: True for m in seen for n in m.get(key, {})}:
                    member[key] = named
            out.append(member)
        rest = schema.get("unevaluatedItems", True)
        if "unevaluatedItems" in schema and not any(_all_items(m) for m in seen):
            if any("contains" in m for m in seen):
                raise UnsupportedSchemaError(
                    f"unevaluatedItems at {path} beside contains is not supported (which items "
                    "contains evaluates depends on their values)"
                )
            n = max((len(_prefix(m)) for m in seen), default=0)
            out.append({"prefixItems": [True] * n, "items": rest, SOURCE: "unevaluatedItems"})
        return out

    def expand_ref(self, ref: str, path: str) -> list[Conj]:
        if ref in self.expanding:
            raise UnsupportedSchemaError(
                f"$ref {ref!r} at {path} is not supported: it refers to itself with no property "
                "or item in between (through $ref beside other keywords, allOf, anyOf, oneOf, "
                "not, if/then/else or dependencies), a recursion that never ends (validating "
                "it never ends either); recur through properties or items"
            )
        self.expansions += 1
        if self.expansions > MAX_EXPANSIONS:
            raise UnsupportedSchemaError(
                f"the schema expands $refs beside other keywords or in allOf over "
                f"{MAX_EXPANSIONS} times (at $ref {ref!r} at {path}: a subschema met on many "
                "paths is expanded on each): simplify it"
            )
        self.expanding.append(ref)
        self.followed.append(f"$ref {ref!r} at {path}")
        try:
            return self.flatten(self.resolve_ref(ref, path), ref)
        finally:
            self.expanding.pop()

    def resolve_ref(self, ref: str, path: str) -> Any:
        """The subschema a ``$ref`` names: a JSON pointer, as :func:`bundle_schema` writes
        every reference it reads (one in a keyword it does not read stays as written)."""
        if ref in self.unresolved:
            error = self.unresolved[ref]
            raise type(error)(str(error))
        written = unresolved_ref(ref)
        if written is not None:
            raise GrammarError(
                f"$ref {written!r} (at {path}) does not resolve (a bundle of the schema left it "
                "unresolved)"
            )
        if not ref.startswith("#"):
            raise UnsupportedSchemaError(
                f"$ref {ref!r} (at {path}) is inside a keyword lcgen does not read as a schema: "
                "it resolves only JSON pointers ('#/...') there"
            )
        fragment = unquote(ref[1:])
        if fragment and not fragment.startswith("/"):
            raise GrammarError(f"$ref {ref!r} (at {path}): no anchor {fragment!r} is defined")
        target: Any = self.root
        for part in fragment.split("/")[1:]:
            key = part.replace("~1", "/").replace("~0", "~")
            try:
                target = target[int(key)] if isinstance(target, list) else target[key]
            except (KeyError, IndexError, ValueError, TypeError):
                raise GrammarError(f"$ref {ref!r} (at {path}) does not resolve") from None
        return target

    def ref(self, ref: str, path: str) -> str:
        if ref in self.refs:
            name = self.refs[ref]
            if not self.rules.rules.get(name):  # still being compiled: a recursion
                self.cycles.setdefault(name, f"the recursion of $ref {ref!r} at {path}")
            return name
        target = self.resolve_ref(ref, path)
        name = self.rules.reserve("ref-" + (ref.rsplit("/", 1)[-1] or "root"))
        marks = (len(self.refs), len(self.recursive), len(self.memo))
        self.refs[ref] = name
        self.followed.append(f"$ref {ref!r} at {path}")
        try:
            body = self.visit(target, ref)
        except BaseException:
            self.forget(marks)  # (its rule is never defined)
            raise
        if self.loops(name, body):
            raise GrammarError(f"$ref {ref!r} (at {path}) refers only to itself")
        self.rules.define(name, body)
        return name

    def check_keywords(self, schema: dict[str, Any], path: str) -> None:
        for key in schema:
            # A schema given as a Python dict may have keys JSON cannot: named, not a TypeError
            # from inside.
            if not isinstance(key, str):
                raise GrammarError(
                    f"the JSON Schema at {path} has the key {key!r:.80}, a "
                    f"{type(key).__name__}: its keys are strings"
                )
            value = schema[key]
            if key in _BY_PROPERTY_NAME and isinstance(value, dict):
                for name in value:
                    if not isinstance(name, str):
                        raise GrammarError(
                            f"{key} at {path} has the key {name!r:.80}, a "
                            f"{type(name).__name__}: property names are strings"
                        )
            if key in spec.UNSUPPORTED:
                error = self.unresolved.get(f"{key} {schema[key]}")  # (the bundle's reason)
                if error is not None:
                    raise type(error)(str(error))
                raise UnsupportedSchemaError(f"unsupported JSON Schema keyword {key!r} at {path}")
            self.check_number(key, schema[key], path)
            if key not in spec.KNOWN and key not in spec.QUIET and not key.startswith("x-"):
                close = difflib.get_close_matches(key, spec.KNOWN, n=1, cutoff=0.85)
                if close:
                    said = f"unknown JSON Schema keyword {key!r} at {path} is ignored"
                    warn(self.where(f"{said} (did you mean {close[0]!r}?)"))

    @staticmethod
    def check_number(key: str, value: Any, path: str) -> None:
        """Refuse a number JSON cannot write (NaN, infinities) where the keyword reads numbers,
        and a count that is not a whole number (the meta-schema refuses most: not all drafts)."""
        if key in spec.NUMBERS or key in spec.COUNTS or key in ("const", "enum"):
            bad = not_finite(value)
            if bad is not None:
                held = "is" if bad is value else "holds"
                raise GrammarError(
                    f"invalid JSON Schema: {key} at {path} {held} {bad!r}, a number that is not "
                    "finite (JSON has no NaN or Infinity)"
                )
        if key in spec.COUNTS and not (
            isinstance(value, int | float) and not isinstance(value, bool) and value % 1 == 0
        ):
            raise GrammarError(
                f"invalid JSON Schema: {key} at {path} must be a whole number, got {value!r:.80}"
            )

    # not --------------------------------------------------------------------------------------
    def negate(self, schema: Any, path: str) -> list[Conj]:
        """Alternatives whose values all fail ``schema`` (perhaps not every such value: a
        keyword whose negation lcgen cannot write is left out, which only narrows)."""
        alts: list[Conj] = [[]]
        scopes, self.scopes = self.scopes, 0  # (what a negation evaluates never counts)
        self.negating += 1
        try:
            flat = self.flatten(schema, path)
        finally:
            self.scopes = scopes
            self.negating -= 1
        for conj in flat:
            negations = [n for member in conj for n in self.negate_plain(member, path)]
            alts = self.join(alts, [[n] for n in negations])
        return alts

    def negate_plain(self, member: dict[str, Any], path: str) -> list[dict[str, Any]]:
        """Plain schemas, each failing one keyword of ``member`` (so failing ``member``).

        What cannot be negated is left out, which only narrows, and the schemas made say so
        (:data:`PARTIAL`): negating them again would widen, so that raises.

        Raises:
            GrammarError: ``member`` is such a partial negation (a ``not`` inside a ``not``,
                or inside an ``if``, whose ``else`` is its negation).
        """
        if PARTIAL in member:
            raise UnsupportedSchemaError(
                f"not at {path} negates a not of {member[PARTIAL]}, which lcgen negates only "
                "in part (the values it leaves out would come back negated twice, allowing "
                "invalid ones): a not inside a not or inside an if is not supported there"
            )
        out: list[dict[str, Any]] = []
        left_out = sorted(set(member) & (spec.CONSTRAINING | {NOT_IN}) - NEGATED)
        types = self.types_of(member)
        if types is not None and "integer" in types and "number" not in types:
            out.append({"type": "number", spec.NOT_INTEGER: True})
        if spec.NOT_INTEGER in member:  # (no number that is not an integer: an integer)
            out.append({"type": "integer"})
        if types is not None:
            others = [t for t in spec.NON_NUMERIC if t not in types]
            others += [] if types & {"integer", "number"} else ["number"]
            if others:
                out.append({"type": others})
        if "const" in member or "enum" in member:
            values = [member["const"]] if "const" in member else member["enum"]
            kinds = {spec.type_of(v) for v in values}
            others = [t for t in spec.NON_NUMERIC if t not in kinds]
            others += [] if kinds & {"integer", "number"} else ["number"]
            if others:
                out.append({"type": others})
            if "boolean" in kinds:
                out += [{"const": b} for b in (True, False) if not any(v is b for v in values)]
            if "string" in kinds:
                out.append({"type": "string", NOT_IN: [v for v in values if isinstance(v, str)]})
            out += self.numbers_between(values)
            if kinds & {"array", "object"}:
                left_out.append("enum (the arrays and objects it does not list)")
        if NOT_IN in member:  # strings but these (a string enum negated): these strings
            out.append({"enum": list(member[NOT_IN])})
        if "pattern" in member:
            out.append({"type": "string", spec.NOT_MATCHING: [member["pattern"]]})
        for pattern in member.get(spec.NOT_MATCHING, ()):  # (strings matching none: one)
            out.append({"type": "string", "pattern": pattern})
        for key, flip in (("minimum", "maximum"), ("maximum", "minimum")):
            b = spec.bound(member, key, "exclusive" + key.capitalize())
            if b is not None:
                out.append({"type": "number", **self.bound_schema(flip, b[0], not b[1])})
        for low, high, kind in (
            ("minLength", "maxLength", "string"),
            ("minItems", "maxItems", "array"),
            ("minProperties", "maxProperties", "object"),
        ):
            if member.get(low, 0) > 0:
                out.append({"type": kind, high: count(member, low) - 1})
            if high in member:
                out.append({"type": kind, low: count(member, high) + 1})
        for name in member.get("required", ()):
            out.append({"type": "object", "properties": {name: FALSE}, SYNTHETIC: True})
        for name, sub in member.get("properties", {}).items():
            out.append(
                {
                    "type": "object",
                    "required": [name],
                    "properties": {name: self.not_of(sub)},
                    SYNTHETIC: True,
                }
            )
        if not out and all(_holds(k, member[k]) for k in set(member) & spec.CONSTRAINING):
            return []  # (what every value satisfies: its not, none)
        if not out and set(member) & spec.CONSTRAINING:
            keys = ", ".join(sorted(set(member) & spec.CONSTRAINING))
            raise UnsupportedSchemaError(f"not of {keys} (at {path}) is not supported")
        if left_out and self.widen:
            return [{}]  # any value: the not as true
        if left_out:
            self.narrowed.append(f"the not at {path}, whose {', '.join(left_out)} it cannot negate")
            return [{**n, PARTIAL: ", ".join(left_out)} for n in out]
        return out

    def numbers_between(self, values: list[Any]) -> list[dict[str, Any]]:
        """Number schemas that together hold every number but the numbers among ``values``:
        the open intervals around and between them."""
        points = sorted({v for v in values if spec.type_of(v) in ("integer", "number")})
        if not points:
            return []
        ends = [None, *points, None]
        return [
            {
                "type": "number",
                **({} if low is None else self.bound_schema("minimum", low, True)),
                **({} if high is None else self.bound_schema("maximum", high, True)),
            }
            for low, high in itertools.pairwise(ends)
        ]

    def bound_schema(self, key: str, value: Any, exclusive: bool) -> dict[str, Any]:
        if not exclusive:
            return {key: value}
        if self.draft4:
            return {key: value, "exclusive" + key.capitalize(): True}
        return {"exclusive" + key.capitalize(): value}

    # oneOf ------------------------------------------------------------------------------------
    def one_of(self, options: list[Any], path: str, tag: str | None) -> list[Conj]:
        """The alternatives of a ``oneOf``: each option with the negation of every other one
        that may match a value with it (``tag``: a property every value has, whose constants
        may tell options apart); none is needed where lcgen proves two disjoint."""
        resolved = [self.resolve(o) for o in options]
        # (draft 4 has no const: its disjointness would rest on a keyword the draft ignores)
        proves = "const" in self.vocabulary
        negated: dict[int, list[Conj]] = {}  # (each option negated once, where first needed)
        out: list[Conj] = []
        for i, option in enumerate(options):
            alts = self.flatten(option, f"{path}/oneOf/{i}")
            for j, other in enumerate(options):
                if j == i or (proves and self.disjoint(resolved[i], resolved[j], tag)):
                    continue
                try:
                    if j not in negated:
                        negated[j] = self.negate(other, f"{path}/oneOf/{j}")
                except UnsupportedSchemaError as exc:
                    raise UnsupportedSchemaError(
                        f"oneOf at {path}: alternatives {i} and {j} may both match a value, and "
                        f"lcgen cannot exclude {j} where {i} matches ({exc}); use anyOf, or tell "
                        "them apart by type or by a required property with different constants"
                    ) from None
                alts = self.join(alts, negated[j], f"the oneOf at {path}", prune=True)
            out += alts
        return out

    def resolve(self, schema: Any) -> Any:
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and self.only_ref(schema) and seen < 32:
            schema, seen = self.resolve_ref(schema["$ref"], "#"), seen + 1
        return schema

    def json_types(self, schema: Any, seen: frozenset[int] = frozenset()) -> set[str]:
        """The JSON types ``schema`` may allow (more, never fewer; all where it comes back to
        itself through a $ref)."""
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return set() if schema is False else set(spec.TYPES)
        if id(schema) in seen:
            return set(spec.TYPES)
        seen = seen | {id(schema)}
        found = set(spec.TYPES)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            found = {spec.type_of(v) for v in values}
            found |= {"number"} if "integer" in found else set()
        for key in ("anyOf", "oneOf"):
            if key in schema:
                found &= set().union(*(self.json_types(s, seen) for s in schema[key]))
        for sub in schema.get("allOf", ()):
            found &= self.json_types(sub, seen)
        declared = self.types_of(schema)
        return found if declared is None else found & declared

    def disjoint(self, a: Any, b: Any, tag: str | None = None) -> bool:
        if not self.json_types(a) & self.json_types(b):
            return True
        va, vb = spec.constants(a), spec.constants(b)
        if va is not None and vb is not None:
            return not va & vb
        if isinstance(a, dict) and isinstance(b, dict):
            both = set(a.get("required", [])) & set(b.get("required", []))
            both |= {tag} if tag is not None else set()
            for name in both:
                pa = spec.constants(self.resolve(a.get("properties", {}).get(name, True)))
                pb = spec.constants(self.resolve(b.get("properties", {}).get(name, True)))
                if pa is not None and pb is not None and not pa & pb:
                    return True
        return False
