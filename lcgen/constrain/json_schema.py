"""JSON Schema to GBNF, exactly: every text the grammar allows is JSON that validates.

The grammar may allow less than the schema (a fixed property order, no extra properties where
the schema merely permits them, canonical string escapes, numbers without exponents where
bounded, whitespace of at most 24 characters), never more. A keyword lcgen cannot enforce
raises :class:`~lcgen.errors.GrammarError` naming it and where it is, instead of being dropped.

Enforced: ``type`` (and lists of types), ``enum``, ``const``, ``$ref`` (local, recursive too),
``anyOf``, ``oneOf`` (when its alternatives are provably disjoint: different types, different
constants, or a required property with different constants), ``allOf`` with one member;
strings: ``minLength``, ``maxLength``, ``pattern`` (Python regex subset, search semantics),
``format`` (date, time, date-time, uuid, email, ipv4); numbers: ``minimum``, ``maximum``,
``exclusiveMinimum``, ``exclusiveMaximum`` (draft 4 booleans too), ``multipleOf`` where every
integer satisfies it; objects: ``properties``, ``required``, ``additionalProperties``,
``minProperties``/``maxProperties`` when the required/declared properties settle them; arrays:
``items``, ``prefixItems``, ``additionalItems``, ``minItems``, ``maxItems``, ``uniqueItems``
where at most one item is allowed. Annotations (``title``, ``description``, ``default``, ...)
are ignored. Everything else raises.
"""

from __future__ import annotations

import contextlib
import decimal
import json
import math
import re
from decimal import Decimal
from typing import Any
from urllib.parse import unquote

import jsonschema

from lcgen.constrain import gbnf as g
from lcgen.constrain import json_rules as spec
from lcgen.constrain.regex import regex_to_gbnf
from lcgen.errors import GrammarError


def schema_to_gbnf(schema: dict[str, Any] | bool) -> str:
    """GBNF text whose root matches exactly JSON texts (a subset) valid against ``schema``.

    Raises:
        GrammarError: an unsupported keyword or combination, an invalid schema, or one that no
            value satisfies.
    """
    try:
        if isinstance(schema, dict):
            validator_cls = jsonschema.validators.validator_for(schema)
            try:
                validator_cls.check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise GrammarError(f"invalid JSON Schema: {exc.message}") from None
        with decimal.localcontext() as context:
            context.prec = 1000  # bounds such as 1e300 are whole numbers of 301 digits
            return _Compiler(schema).compile()
    except RecursionError:
        raise GrammarError(
            "the JSON Schema nests too deeply to compile (or has too many properties in one "
            "object, each compiled in turn): flatten it"
        ) from None
    except ArithmeticError as exc:
        raise GrammarError(f"a numeric bound of the JSON Schema is out of range: {exc!r}") from None


_RULE_NAME = re.compile(r"[a-zA-Z0-9-]+")


class _Compiler:
    def __init__(self, root: dict[str, Any] | bool) -> None:
        self.root = root
        self.rules = g.RuleSet()
        self.refs: dict[str, str] = {}
        base = root if isinstance(root, dict) else {}
        cls = jsonschema.validators.validator_for(base)
        self.validator = cls(base, format_checker=cls.FORMAT_CHECKER)

    def compile(self) -> str:
        return self.rules.text(self.visit(self.root, "#"))

    def named(self, name: str, expr: str) -> str:
        """``expr`` as a rule name (itself when it is one already)."""
        return expr if _RULE_NAME.fullmatch(expr) else self.rules.add(name, expr)

    def prim(self, name: str) -> str:
        if name not in self.rules.rules:
            self.rules.define(name, spec.PRIMITIVES[name])
            for dep in spec.DEPENDS.get(name, ()):
                self.prim(dep)
        return name

    # dispatch -------------------------------------------------------------------------------
    def visit(self, schema: Any, path: str) -> str:
        if schema is True or schema == {}:
            return self.prim("value")
        if schema is False:
            raise GrammarError(f"the schema at {path} is false: no value validates")
        if not isinstance(schema, dict):
            raise GrammarError(f"the schema at {path} is not an object: {schema!r}")
        self.check_keywords(schema, path)
        active = set(schema) - spec.ANNOTATIONS - {"$schema", "$id"}
        if "$ref" in schema:
            self.only(active, {"$ref"}, "$ref", path)
            return self.ref(schema["$ref"], path)
        if "allOf" in schema:
            self.only(active, {"allOf"}, "allOf", path)
            if len(schema["allOf"]) != 1:
                raise GrammarError(f"allOf with several schemas (at {path}) is not supported")
            return self.visit(schema["allOf"][0], f"{path}/allOf/0")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                self.only(active, {key}, key, path)
                options = schema[key]
                if key == "oneOf":
                    self.check_disjoint(options, path)
                return g.alternatives(
                    self.visit(s, f"{path}/{key}/{i}") for i, s in enumerate(options)
                )
        if "const" in schema or "enum" in schema:
            return self.enum(schema, path)
        return g.alternatives(self.visit_type(t, schema, path) for t in self.types(schema, path))

    def check_keywords(self, schema: dict[str, Any], path: str) -> None:
        for key in schema:
            if key in spec.UNSUPPORTED:
                raise GrammarError(f"unsupported JSON Schema keyword {key!r} at {path}")
            if key in ("$schema", "$id") and path != "#":
                raise GrammarError(f"{key!r} inside a subschema (at {path}) is not supported")
            known = key in spec.ANNOTATIONS or key in spec.GENERIC or key in ("$schema", "$id")
            known = known or key.startswith("x-") or any(key in k for k in spec.BY_TYPE.values())
            if not known:
                raise GrammarError(f"unknown JSON Schema keyword {key!r} at {path}")

    @staticmethod
    def only(active: set[str], allowed: set[str], what: str, path: str) -> None:
        extra = sorted(active - allowed)
        if extra:
            raise GrammarError(
                f"{what} together with {', '.join(extra)} (at {path}) is not supported"
            )

    def types(self, schema: dict[str, Any], path: str) -> list[str]:
        declared = schema.get("type")
        if declared is None:
            found = [t for t, kws in spec.BY_TYPE.items() if kws & set(schema)]
            return found or ["any"]
        names = declared if isinstance(declared, list) else [declared]
        if "number" in names and "integer" in names:
            names = [n for n in names if n != "integer"]
        return list(dict.fromkeys(names))

    def visit_type(self, kind: str, schema: dict[str, Any], path: str) -> str:
        if kind == "any":
            return self.prim("value")
        if kind == "null":
            return '"null"'
        if kind == "boolean":
            return '("true" | "false")'
        if kind in ("integer", "number"):
            return self.number(schema, path, integer=kind == "integer")
        return {"string": self.string, "array": self.array, "object": self.object}[kind](
            schema, path
        )

    def ref(self, ref: str, path: str) -> str:
        if ref in self.refs:
            return self.refs[ref]
        if not ref.startswith("#"):
            raise GrammarError(f"$ref {ref!r} (at {path}): only local references are supported")
        target: Any = self.root
        for part in filter(None, unquote(ref[1:]).split("/")):
            key = part.replace("~1", "/").replace("~0", "~")
            try:
                target = target[int(key)] if isinstance(target, list) else target[key]
            except (KeyError, IndexError, ValueError, TypeError):
                raise GrammarError(f"$ref {ref!r} (at {path}) does not resolve") from None
        name = self.rules.reserve(ref.rsplit("/", 1)[-1] or "root-ref")
        self.refs[ref] = name
        self.rules.define(name, self.visit(target, ref))
        return name

    # values ---------------------------------------------------------------------------------
    def enum(self, schema: dict[str, Any], path: str) -> str:
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        check = self.validator.evolve(schema=schema)
        kept = [v for v in values if check.is_valid(v)]
        if not kept:
            raise GrammarError(f"no value of enum/const at {path} satisfies the other keywords")
        return g.alternatives(self.const(v, path) for v in kept)

    def const(self, value: Any, path: str) -> str:
        if isinstance(value, dict):
            members = [
                f'{self.const(k, path)} ws ":" ws {self.const(v, path)} ws'
                for k, v in value.items()
            ]
            self.prim("ws")
            return '"{" ws ' + ' "," ws '.join(members) + ' "}"' if members else '"{" ws "}"'
        if isinstance(value, list):
            self.prim("ws")
            items = [f"{self.const(v, path)} ws" for v in value]
            return '"[" ws ' + ' "," ws '.join(items) + ' "]"' if items else '"[" ws "]"'
        if isinstance(value, float) and not math.isfinite(value):
            raise GrammarError(f"the constant {value!r} at {path} is not JSON")
        return g.literal(json.dumps(value, ensure_ascii=False))

    def string(self, schema: dict[str, Any], path: str) -> str:
        fmt, pattern = schema.get("format"), schema.get("pattern")
        lengths = {"minLength", "maxLength"} & set(schema)
        if (fmt is not None) + (pattern is not None) + bool(lengths) > 1:
            used = [k for k in ("format", "pattern", *sorted(lengths)) if k in schema]
            raise GrammarError(f"{' with '.join(used)} on one string (at {path}) is not supported")
        if fmt is not None:
            if fmt not in spec.FORMATS:
                supported = ", ".join(spec.FORMATS)
                raise GrammarError(
                    f"unsupported string format {fmt!r} at {path} (supported: {supported})"
                )
            return f'"\\"" {self.prim(fmt)} "\\""'
        if pattern is not None:
            try:
                body = regex_to_gbnf(pattern, json_string=True, search=True)
            except GrammarError as exc:
                raise GrammarError(f"pattern at {path}: {exc}") from None
            return f'"\\"" {body} "\\""'
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if (low, high) == (0, None):
            return self.prim("string")
        try:
            chars = g.repeat(self.prim("char"), low, high)
        except GrammarError as exc:
            raise GrammarError(f"minLength/maxLength at {path}: {exc}") from None
        return f'"\\"" {chars} "\\""'

    def number(self, schema: dict[str, Any], path: str, integer: bool) -> str:
        lo, hi = (
            spec.bound(schema, "minimum", "exclusiveMinimum"),
            spec.bound(schema, "maximum", "exclusiveMaximum"),
        )
        step = schema.get("multipleOf")
        if step is not None and not (integer and (1 / Decimal(str(step))) % 1 == 0):
            raise GrammarError(f"multipleOf {step} at {path} is not supported")
        options = []
        lo_int = None if lo is None else math.floor(lo[0]) + 1 if lo[1] or lo[0] % 1 else int(lo[0])
        hi_int = None if hi is None else math.ceil(hi[0]) - 1 if hi[1] or hi[0] % 1 else int(hi[0])
        if lo_int is None or hi_int is None or lo_int <= hi_int:
            options.append(g.integer_range(lo_int, hi_int))
        if not integer:
            if lo is None and hi is None:
                return self.prim("number")
            with contextlib.suppress(GrammarError):  # no fraction fits: integers only
                options.append(
                    g.decimal_range(
                        self.rules,
                        spec.as_float(lo, False),
                        spec.as_float(hi, True),
                        need_fraction=True,
                    )
                )
        if not options:
            raise GrammarError(
                f"no {'integer' if integer else 'number'} satisfies the bounds at {path}"
            )
        return g.alternatives(options)

    # containers -----------------------------------------------------------------------------
    def array(self, schema: dict[str, Any], path: str) -> str:
        items, prefix = schema.get("items"), schema.get("prefixItems", [])
        rest: Any = True if items is None else items
        if isinstance(items, list):  # draft 2019 and before: tuple form
            prefix, rest = items, schema.get("additionalItems", True)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if rest is False:
            high = len(prefix) if high is None else min(high, len(prefix))
        if schema.get("uniqueItems") and (high is None or high > 1):
            raise GrammarError(f"uniqueItems at {path} is not supported (unless maxItems <= 1)")
        if max(low, high or 0) > g.MAX_REPEAT:
            raise GrammarError(f"minItems/maxItems at {path} are over {g.MAX_REPEAT}")
        if high is not None and low > high:
            raise GrammarError(f"no array satisfies minItems {low} / maxItems {high} at {path}")
        self.prim("ws")
        elems = [self.visit(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix[:high])]
        rest_rule = None
        if rest is not False:
            # A named rule: the chain below writes the item twice, and inlined in nested
            # arrays that would double the grammar at every level.
            rest_rule = self.named("item", self.visit(rest, f"{path}/items"))
        return '"[" ws ' + self.item_chain(elems, rest_rule, low, high, 0) + ' "]"'

    def item_chain(
        self, elems: list[str], rest: str | None, low: int, high: int | None, i: int
    ) -> str:
        """Items i.. of an array (each followed by ws; commas between)."""
        comma = '"," ws ' if i else ""
        if high is not None and i >= high:
            return '""'
        if i >= len(elems):
            if rest is None:
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

    def object(self, schema: dict[str, Any], path: str) -> str:
        props: dict[str, Any] = dict(schema.get("properties", {}))
        required = list(dict.fromkeys(schema.get("required", [])))
        extra = schema.get("additionalProperties", True)
        for name in required:
            if name not in props:
                if extra is False:
                    raise GrammarError(f"required property {name!r} at {path} is not allowed")
                props[name] = extra
        if not props and extra is True:
            self.settle_counts(schema, 0, None, path)
            return self.prim("object")
        self.prim("ws")
        members = [(n, s) for n, s in props.items() if s is not False or n in required]
        free = extra not in (False, True) and "additionalProperties" in schema
        self.settle_counts(schema, len(required), None if free else len(members), path)
        kvs = [(n in required, self.member(n, s, f"{path}/properties/{n}")) for n, s in members]
        extra_kv = None
        if free:
            key = self.key_not_in(list(props))
            extra_kv = f'{key} ws ":" ws {self.visit(extra, f"{path}/additionalProperties")} ws'
        return '"{" ws ' + self.member_chain(kvs, extra_kv, 0, True, {}) + ' "}"'

    def settle_counts(
        self, schema: dict[str, Any], least: int, most: int | None, path: str
    ) -> None:
        low, high = schema.get("minProperties"), schema.get("maxProperties")
        if low is not None and low > least:
            raise GrammarError(
                f"minProperties {low} at {path} is not supported (above the {least} required)"
            )
        if high is not None and (most is None or high < most):
            raise GrammarError(
                f"maxProperties {high} at {path} is not supported (below the properties allowed)"
            )

    def member(self, name: str, schema: Any, path: str) -> str:
        self.prim("ws")
        return f'{self.const(name, path)} ws ":" ws {self.visit(schema, path)} ws'

    def member_chain(
        self,
        kvs: list[tuple[bool, str]],
        extra: str | None,
        i: int,
        first: bool,
        memo: dict[tuple[int, bool], str],
    ) -> str:
        """Members i.. of an object in order: required ones always, optional ones maybe."""
        if (i, first) in memo:
            return memo[(i, first)]
        comma = "" if first else '"," ws '
        if i == len(kvs):
            if extra is None:
                return '""'
            tail = g.repeat(f'("," ws {extra})', 0, None)
            body = f"({comma}{extra} {tail})?"
        else:
            taken = f"{comma}{kvs[i][1]} {self.member_chain(kvs, extra, i + 1, False, memo)}"
            if kvs[i][0]:
                body = taken
            else:
                skipped = self.member_chain(kvs, extra, i + 1, first, memo)
                body = f"({taken} | {skipped})" if skipped != '""' else f"({taken})?"
        memo[(i, first)] = self.rules.add("members", body)
        return memo[(i, first)]

    def key_not_in(self, names: list[str]) -> str:
        """A JSON string of raw characters (no escapes) that is none of ``names``."""
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

    # oneOf ------------------------------------------------------------------------------------
    def check_disjoint(self, options: list[Any], path: str) -> None:
        resolved = [self.resolve(o) for o in options]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not self.disjoint(resolved[i], resolved[j]):
                    raise GrammarError(
                        f"oneOf at {path}: alternatives {i} and {j} may both match a value, and "
                        "lcgen cannot exclude that (use anyOf, or tell them apart by type or by a "
                        "required property with different constants)"
                    )

    def resolve(self, schema: Any) -> Any:
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and seen < 32:
            ref = schema["$ref"]
            self.ref(ref, "#")
            target: Any = self.root
            for part in filter(None, unquote(ref[1:]).split("/")):
                key = part.replace("~1", "/").replace("~0", "~")
                target = target[int(key)] if isinstance(target, list) else target[key]
            schema, seen = target, seen + 1
        return schema

    def json_types(self, schema: Any) -> set[str]:
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return set() if schema is False else set(spec.TYPES)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return {spec.type_of(v) for v in values}
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return set().union(*(self.json_types(s) for s in schema[key]))
        declared = schema.get("type")
        if declared is None:
            return set(spec.TYPES)
        names = set(declared if isinstance(declared, list) else [declared])
        return names | ({"integer"} if "number" in names else set())

    def disjoint(self, a: Any, b: Any) -> bool:
        if not self.json_types(a) & self.json_types(b):
            return True
        va, vb = spec.constants(a), spec.constants(b)
        if va is not None and vb is not None:
            return not va & vb
        if isinstance(a, dict) and isinstance(b, dict):
            both = set(a.get("required", [])) & set(b.get("required", []))
            for name in both:
                pa = spec.constants(self.resolve(a.get("properties", {}).get(name, True)))
                pb = spec.constants(self.resolve(b.get("properties", {}).get(name, True)))
                if pa is not None and pb is not None and not pa & pb:
                    return True
        return False
