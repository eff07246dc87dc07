"""Compound JSON Schemas made one document (:func:`bundle_schema`): every ``$ref`` a JSON
pointer into the schema itself, so lcgen's compiler, jsonschema's validator and the
uniqueItems walker read references one plain way.

A ``$ref`` resolves as the specification says: against the base URI where it is written. An
``$id`` sets that base for its subschema (``id`` in draft 4; drafts up to 7 ignore the siblings
of a ``$ref``, its ``$id`` too, and write an anchor as an ``$id`` that is a bare fragment).
A ``$ref`` may name the root, a subschema with an ``$id`` (an embedded resource), an anchor
(``$anchor``, ``$dynamicAnchor``), or another document: one given in ``documents``, or the
meta-schema of drafts 4, 6 and 7. Nothing is fetched.

Only the subschemas of the draft's own applicator keywords count: an ``$id`` inside ``enum``,
``const``, an unknown keyword or one the draft lacks names nothing.

A ``$dynamicRef`` (``$recursiveRef`` in 2019-09) becomes a ``$ref`` where its target is the
same wherever it is met (:meth:`_Bundler.dynamic_target`); another is left as written.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

import jsonschema

from lcgen.constrain import json_rules as spec
from lcgen.constrain.json_rules import not_finite
from lcgen.constrain.regex import python_spelling
from lcgen.errors import GrammarError, UnsupportedSchemaError

# The keywords whose value is a subschema, a list of them, or an object of them (all drafts).
_ONE = frozenset(
    [
        "additionalItems",
        "additionalProperties",
        "contains",
        "contentSchema",
        "else",
        "if",
        "items",
        "not",
        "propertyNames",
        "then",
        "unevaluatedItems",
        "unevaluatedProperties",
    ]
)
_LIST = frozenset(["allOf", "anyOf", "oneOf", "prefixItems", "items", "$lcgen-documents"])
# (the keywords whose value is an object of subschemas by name)
BY_NAME = frozenset(
    ["$defs", "definitions", "properties", "patternProperties", "dependentSchemas", "dependencies"]
)
_OLD = (
    jsonschema.Draft3Validator,
    jsonschema.Draft4Validator,
    jsonschema.Draft6Validator,
    jsonschema.Draft7Validator,
)
# Where the documents given by URI go in the bundle (a key no draft reads)
DOCUMENTS = "$lcgen-documents"
# The meta-schemas that are one document each (2019-09's and 2020-12's are several, whose
# $dynamicRef or $recursiveRef depends on the path to it)
_META = {
    urldefrag(cls.META_SCHEMA["$schema"])[0]: cls.META_SCHEMA
    for cls in (jsonschema.Draft4Validator, jsonschema.Draft6Validator, jsonschema.Draft7Validator)
}

Documents = Mapping[str, Any] | Callable[[str], Any]
Location = tuple[Any, ...]  # keys from the bundle's root
# The meta-schemas no document given can stand for (several documents, see above)
_SEVERAL = (
    "https://json-schema.org/draft/2020-12/schema",
    "https://json-schema.org/draft/2019-09/schema",
)


@dataclass
class Bundle:
    """A schema made one document, why the references it left unresolved do not resolve (by
    the reference as the bundle writes it: its absolute URI), and the URIs of the documents
    at ``#/$lcgen-documents/0``, ``/1``..."""

    schema: Any
    errors: dict[str, GrammarError] = field(default_factory=dict)
    uris: list[str | None] = field(default_factory=list)  # (None: one a bundle held)
    dynamic: bool = False  # whether it has a $dynamicRef or $recursiveRef left as written

    def located(self, error: GrammarError) -> GrammarError:
        """``error`` with the places inside given documents written by their URIs."""
        text = self.where(str(error))
        return error if text == str(error) else type(error)(text)

    def where(self, text: str) -> str:
        """``text`` with the places inside given documents written by their URIs."""
        uris = self.uris

        def uri(match: re.Match[str]) -> str:
            i = int(match.group(1))
            named = uris[i] if i < len(uris) else None
            return match.group(0) if named is None else named + "#"

        return _IN_DOCUMENT.sub(uri, text)


_IN_DOCUMENT = re.compile(r"#/\$lcgen-documents/(\d+)")
# How a bundle writes a reference that does not resolve: a pointer to nowhere naming it.
UNRESOLVED = "#/$lcgen-unresolved/"


def unresolved_mark(ref: str) -> str:
    """How a bundle writes ``ref``, which does not resolve: a pointer to nowhere naming it
    (:func:`unresolved_ref` reads it back)."""
    return UNRESOLVED + ref.replace("~", "~0").replace("/", "~1").replace("%", "%25")


def unresolved_ref(ref: str) -> str | None:
    """The reference a bundle left unresolved (its absolute URI), or None."""
    if not ref.startswith(UNRESOLVED):
        return None
    return unquote(ref[len(UNRESOLVED) :]).replace("~1", "/").replace("~0", "~")


class _NotGiven(GrammarError):
    """A reference names a document lcgen was not given (it may come with another)."""


def bundle_schema(schema: Any, documents: Documents | None = None, *, uri: str = "") -> Any:
    """``schema`` as one document whose references are JSON pointers (``#/...``); the schema
    itself where it already is one. A reference that does not resolve is written as its
    absolute URI: :meth:`lcgen.Grammar.from_json_schema` says why where the schema uses it.

    Args:
        schema: a JSON Schema: a dict, a bool, or its JSON text.
        documents: the other documents its references name, by absolute URI: a mapping, or
            a function of the URI that gives the document, or None where it has none (or
            raises :class:`GrammarError` saying why). References resolve against the root's
            ``$id``; where it has none, a relative one such as ``"address.json"`` names the
            URI ``"address.json"`` (or one relative to ``uri``).
        uri: the URI the schema was read from (a file's ``file:`` URI): the base of its
            references where its ``$id`` is none or relative.

    Raises:
        GrammarError: the schema is not JSON, nests too deeply to read, or has a ``$schema``
            or an ``$id`` that is no URI.
        TypeError: ``schema`` or ``documents`` of another type.
    """
    one = bundle(read_schema(schema), documents, uri)
    if one.dynamic and one.schema is not schema:
        for said, error in one.errors.items():  # (why one is left as written)
            if said.startswith(("$dynamicRef ", "$recursiveRef ")):
                raise type(error)(f"{error} (a bundle drops the $ids it resolves by)")
        raise UnsupportedSchemaError(
            "a $dynamicRef or $recursiveRef whose target depends on the path to it is not "
            "supported where a schema is made one document (it resolves by the $ids that drops)"
        )
    return one.schema


def read_schema(schema: Any) -> dict[str, Any] | bool:
    """A JSON Schema given as a dict, a bool or JSON text, as a dict or a bool.

    Raises:
        GrammarError: text that is not JSON.
        TypeError: another type (a pydantic model: named, with what to call).
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON Schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        hint = ""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            hint = f" (for the pydantic model {schema.__name__}: Grammar.from_pydantic)"
        raise TypeError(
            f"a JSON Schema is a dict, a bool or JSON text, got {type(schema).__name__}{hint}"
        )
    return schema


def draft_of(schema: Any, named: str = "the JSON Schema") -> type[jsonschema.Validator]:
    """The validator class of the draft ``schema`` names (the newest where it names none)."""
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):
        raise GrammarError(
            f"invalid JSON Schema: $schema of {named} is {schema['$schema']!r:.80}: a URI (a "
            "string)"
        )
    return jsonschema.validators.validator_for(schema)  # type: ignore[no-any-return]


def bundle(schema: Any, documents: Documents | None, uri: str = "") -> Bundle:
    """:func:`bundle_schema`, with the reasons and URIs the compiler reports by."""
    if documents is not None and not callable(documents) and not isinstance(documents, Mapping):
        raise TypeError(
            "documents is a mapping of URI to JSON Schema or a function of the URI, got "
            f"{type(documents).__name__}"
        )
    if not isinstance(schema, dict):
        return Bundle(schema)
    try:
        return _Bundler(schema, documents).bundle(uri)
    except RecursionError:
        raise UnsupportedSchemaError(
            "the JSON Schema nests too deeply to read: flatten it"
        ) from None


def schema_error(exc: jsonschema.SchemaError) -> GrammarError:
    """The error for a schema its draft's meta-schema refuses, naming the keyword and where."""
    parts = list(exc.absolute_path)
    if parts and parts[-1] in spec.KNOWN:
        where = f"{parts[-1]} at {pointer(parts[:-1])}"
    else:
        where = f"the schema at {pointer(parts)}"
    if exc.validator == "format" and exc.validator_value == "regex":
        # (jsonschema reads patterns with Python's re: ECMA-262's (?<name>...) is no error)
        with contextlib.suppress(re.error):
            re.compile(python_spelling(exc.instance))
            return UnsupportedSchemaError(
                f"{where}: the ECMA-262 named group in {exc.instance!r:.80} is not supported: "
                "write (?:...)"
            )
        escape = _ECMA_ONLY.search(exc.instance) if isinstance(exc.instance, str) else None
        if escape is not None:
            return UnsupportedSchemaError(
                f"{where}: the ECMA-262 escape {escape.group(1)!r} in {exc.instance!r:.80} (a "
                "Unicode property class or code point) is not supported: write the characters "
                "as a class such as [a-zA-Z\u00c0-\u024f]"
            )
    if not_finite(exc.instance) is not None:
        return GrammarError(
            f"invalid JSON Schema: {where} is {exc.instance!r:.80}, a number that is not finite "
            "(JSON has no NaN or Infinity)"
        )
    return GrammarError(f"invalid JSON Schema: {where}: {exc.message}")


# ECMA-262 escapes Python's re lacks, which JSON Schema's patterns may use (zod writes
# \p{Extended_Pictographic}): after an even number of backslashes.
_ECMA_ONLY = re.compile(r"(?<!\\)(?:\\\\)*(\\[pP]\{[^}]*\}?|\\u\{[0-9a-fA-F]*\}?)")


def _join(base: str, ref: str) -> str:
    """``ref`` made absolute against ``base`` (a fragment also against a URN, which urljoin
    leaves alone)."""
    if ref.startswith("#"):
        return urldefrag(base)[0] + ref
    return urljoin(base, ref)


def _absolute(base: str, ref: str) -> str:
    """``ref``'s absolute URI (a bundle's mark: the URI it names)."""
    return unresolved_ref(ref) or _join(base, ref)


def pointer(parts: Iterable[Any]) -> str:
    """A location in the schema as lcgen's messages write it (``#/items/0``); with ``%``
    written ``%25``, the fragment of a ``$ref`` to it."""
    return "/".join(["#", *(str(p).replace("~", "~0").replace("/", "~1") for p in parts)])


def _children(node: dict[str, Any]) -> Iterator[tuple[Location, Any]]:
    """The subschemas of ``node``, by where they are (the keyword first)."""
    for key, value in node.items():
        if key in BY_NAME and isinstance(value, dict):
            for name, sub in value.items():
                yield (key, name), sub
        elif key in _LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                yield (key, i), sub
        elif key in _ONE:
            yield (key,), value


class _Bundler:
    def __init__(self, root: dict[str, Any], documents: Documents | None) -> None:
        self.root = root
        self.draft = draft_of(root)
        self.old = issubclass(self.draft, _OLD)
        self.id_key = "id" if self.draft in _OLD[:2] else "$id"
        # The keywords whose subschemas an $id or an anchor in names a resource: the draft's
        # (references are read in every keyword lcgen reads)
        self.keywords = set(self.draft.VALIDATORS) | {"definitions", DOCUMENTS}
        self.keywords |= {"then", "else"} if "if" in self.keywords else set()
        self.keywords |= set() if self.old else {"$defs", "contentSchema"}
        self.dynamic = False  # whether it has a $dynamicRef or $recursiveRef left as written
        # ($dynamicAnchor is a keyword where $dynamicRef is: 2020-12)
        dynamic = "$dynamicRef" in self.draft.VALIDATORS
        self.anchor_keys = ("$anchor", "$dynamicAnchor") if dynamic else ("$anchor",)
        self.references = [
            k
            for k in ("$ref", "$dynamicRef", "$recursiveRef")
            if k == "$ref" or k in self.draft.VALIDATORS
        ]
        self.given: dict[str, Any] = {}  # the mapping given, by URI without a fragment
        self.lookup: Callable[[str], Any] | None = None
        if callable(documents):
            self.lookup = documents
        elif documents is not None:
            for uri in documents:
                if not isinstance(uri, str):
                    raise TypeError(f"documents are keyed by URI (a str), got {uri!r:.80}")
            self.given = {urldefrag(uri)[0]: doc for uri, doc in documents.items()}
            self.lookup = self.given.get
        # The documents referred to, in order: at DOCUMENTS (after those of a bundle given)
        held = root.get(DOCUMENTS)
        self.docs: list[Any] = list(held) if isinstance(held, list) else []
        self.held = len(self.docs)
        self.out = Bundle(root, uris=[None] * self.held)
        self.resources: dict[str, Location] = {}  # absolute URI (no fragment): where
        self.anchors: dict[tuple[str, str], Location] = {}  # (URI, name): where
        # The references: where, the keyword ($ref, $dynamicRef, $recursiveRef), as written, its
        # base URI
        self.refs: list[tuple[Location, str, str, str]] = []
        self.dynamic_anchors: dict[tuple[str, str], Location] = {}  # ("" for $recursiveAnchor)
        self.root_base = ""
        self.ids: list[Location] = []  # the $ids of embedded resources (dropped)
        # The anchors outside the root resource: where, the keyword (dropped: a bundle's
        # references are pointers, and an anchor kept could catch one left unresolved)
        self.foreign: list[tuple[Location, str]] = []
        self.missing: dict[str, GrammarError] = {}  # documents asked for in vain
        self.failures: list[tuple[Location, str, GrammarError]] = []  # where, URI, why
        self.scans: dict[str, set[str]] = {}  # a given document's resources, by its URI

    def bundle(self, uri: str = "") -> Bundle:
        """The bundle (``uri``: the root's base URI before its $id)."""
        self.index(self.root, urldefrag(uri)[0], (), top=True)
        changed: list[tuple[Location, str, str]] = []  # where, keyword, the new reference
        dynamic: list[tuple[Location, str, str, str]] = []  # where, keyword, URI, first target
        # Rounds: a document a function gives may hold the resource a reference before it
        # named in vain (tried again while documents come in).
        failed: list[int] = []
        start = 0
        while True:
            n_docs = len(self.docs)
            batch = [*failed, *range(start, len(self.refs))]
            start, failed = len(self.refs), []
            self.missing.clear()
            for i in batch:
                if not self.resolve(i, changed, dynamic):
                    failed.append(i)
            if start == len(self.refs) and (not failed or len(self.docs) == n_docs):
                break
        for i in failed:
            where, key, written, base = self.refs[i]
            absolute = _absolute(base, written)
            written = unresolved_ref(written) or written
            said = f"{key} {written!r} (at {pointer(where)})"
            uri = urldefrag(absolute)[0]
            reason = self.not_given(uri, urldefrag(written)[0], said)
            self.unresolved(where, key, absolute, GrammarError(reason))
        for where, key, absolute, found in dynamic:  # (once every document is in)
            final = self.dynamic_target(key, absolute, found)
            if final is None:
                said = f"{key} {self.at(self.root, where)[key]!r} (at {pointer(where)})"
                anchor = "$recursiveAnchor" if key == "$recursiveRef" else "$dynamicAnchor"
                self.unresolved(
                    where,
                    key,
                    absolute,
                    UnsupportedSchemaError(
                        f"{said}: its target depends on the path to it (several resources have "
                        f"its {anchor} and the root has none), which lcgen does not support"
                    ),
                )
            else:
                changed.append((where, key, final))
        if not changed and not self.ids and len(self.docs) == self.held:
            for where, _, error in self.failures:  # (each as written: it means what it did)
                self.out.errors.setdefault(self.at(self.root, where)["$ref"], error)
            return self.out
        for where, absolute, error in self.failures:
            # A pointer to nowhere that names it: no anchor or $id the bundle keeps catches it.
            mark = unresolved_mark(absolute)
            self.out.errors.setdefault(mark, error)
            changed.append((where, "$ref", mark))
        if len(self.docs) > self.held and DOCUMENTS in self.root and not self.held:
            raise UnsupportedSchemaError(f"the JSON Schema has the key {DOCUMENTS!r}: lcgen's own")
        out = copy.deepcopy(self.root)
        if self.docs:
            out[DOCUMENTS] = docs = copy.deepcopy(self.docs)
            for doc in docs:  # (named by the URI they were given as)
                if isinstance(doc, dict):
                    doc.pop(self.id_key, None)
        for where in self.ids:
            self.at(out, where).pop(self.id_key, None)
        for where, key in self.foreign:
            self.at(out, where).pop(key, None)
        for where, key, found in changed:
            node = self.at(out, where)
            if key == "$ref":
                node["$ref"] = found
                continue
            del node[key]  # (a dynamic reference whose target is one: a $ref, beside any)
            if "$ref" in node:
                node["allOf"] = [*node.get("allOf", []), {"$ref": found}]
            else:
                node["$ref"] = found
        self.out.schema = out
        self.out.dynamic = self.dynamic
        return self.out

    def resolve(
        self,
        i: int,
        changed: list[tuple[Location, str, str]],
        dynamic: list[tuple[Location, str, str, str]],
    ) -> bool:
        """Resolve reference ``i``: False where it names a document not given (yet)."""
        where, key, written, base = self.refs[i]
        said = f"{key} {unresolved_ref(written) or written!r} (at {pointer(where)})"
        if (
            unresolved_ref(written) is not None
            and not urlsplit(unresolved_ref(written) or "").scheme
        ):
            return True  # (a bundle's, relative: it stays, and the compiler says so)
        if key == "$recursiveRef" and written != "#":
            only = f"{said}: a $recursiveRef is '#' (draft 2019-09)"
            self.unresolved(where, key, written, UnsupportedSchemaError(only))
            return True
        try:  # (one a bundle left unresolved: its URI, which documents given now may hold)
            absolute = _absolute(base, written)
            urldefrag(absolute)
        except ValueError as exc:
            error = GrammarError(f"{said} is no URI: {exc}")
            self.unresolved(where, key, written, error)
            return True
        try:
            found = self.target(absolute, written, said)
        except _NotGiven:
            return False
        except GrammarError as exc:
            self.unresolved(where, key, absolute, exc)
            return True
        if key != "$ref":
            dynamic.append((where, key, absolute, found))
        elif found != written:
            changed.append((where, key, found))
        return True

    def unresolved(self, where: Location, key: str, absolute: str, error: GrammarError) -> None:
        """Note a reference that does not resolve, and why."""
        if key != "$ref":  # (left as written: the compiler raises why where it meets it)
            self.dynamic = True
            written = self.at(self.root, where)[key]
            self.out.errors.setdefault(f"{key} {written}", error)
        else:
            self.failures.append((where, absolute, error))

    def dynamic_target(self, key: str, absolute: str, found: str) -> str | None:
        """The JSON pointer a ``$dynamicRef`` or ``$recursiveRef`` (``absolute``: its URI;
        ``found``: where it resolves first) names wherever it is met, or None where that
        depends on the path to it. The outermost resource of the dynamic scope with the anchor
        wins, and the root is the outermost of every scope: where the root has it, it; where
        only one resource has it, the first target (where no other resource is in the scope);
        a first target without the anchor, a JSON pointer: that target, as a $ref."""
        fragment = urldefrag(absolute)[1]
        name = "" if key == "$recursiveRef" else unquote(fragment)
        if key == "$dynamicRef" and (not name or name.startswith("/")):
            return found
        named = [at for (_, n), at in self.dynamic_anchors.items() if n == name]
        if all(pointer(at).replace("%", "%25") != found for at in named):
            return found  # (by location: a document given by another URI than its $id too)
        outer = self.dynamic_anchors.get((self.root_base, name))
        if outer is not None:
            return pointer(outer).replace("%", "%25")
        if len(named) == 1:
            return found
        return None

    def index(
        self, node: Any, base: str, where: Location, top: bool = False, named: bool = True
    ) -> None:
        """Note the resources, anchors and references in ``node`` (at ``where``, whose base
        URI is ``base``; ``named``: whether an $id or an anchor there names it)."""
        if not isinstance(node, dict):
            return
        if top:
            self.resources.setdefault(base, where)
        ident = node.get(self.id_key) if named else None
        if isinstance(ident, str) and self.old and "$ref" in node:
            if not top:
                self.ids.append(where)  # (ignored beside a $ref)
        elif isinstance(ident, str):
            if self.old and ident.startswith("#"):
                self.anchors.setdefault((base, ident[1:]), where)
                if base != self.root_base or where[:1] == (DOCUMENTS,):
                    self.foreign.append((where, self.id_key))
            else:
                try:
                    base, fragment = urldefrag(_join(base, ident))
                except ValueError as exc:
                    raise GrammarError(
                        f"invalid JSON Schema: {self.id_key} at {pointer(where)} is no URI: {exc}"
                    ) from None
                self.resources.setdefault(base, where)
                if not top:
                    self.ids.append(where)
                if named and node.get("$recursiveAnchor") is True:
                    self.dynamic_anchors.setdefault((base, ""), where)
                if fragment and self.old:
                    self.anchors.setdefault((base, fragment), where)
        if where == ():
            self.root_base = base
        if top and node.get("$recursiveAnchor") is True:
            self.dynamic_anchors.setdefault((base, ""), where)
        if named and not self.old:
            for key in self.anchor_keys:
                if isinstance(node.get(key), str):
                    self.anchors.setdefault((base, node[key]), where)
                    if base != self.root_base or where[:1] == (DOCUMENTS,):
                        self.foreign.append((where, key))
            if "$dynamicAnchor" in self.anchor_keys and isinstance(node.get("$dynamicAnchor"), str):
                self.dynamic_anchors.setdefault((base, node["$dynamicAnchor"]), where)
        for key in self.references:
            if isinstance(node.get(key), str):
                self.refs.append((where, key, node[key], base))
        for step, sub in _children(node):
            self.index(sub, base, where + step, named=named and step[0] in self.keywords)

    def target(self, absolute: str, written: str, said: str) -> str:
        """The JSON pointer of what the ``$ref`` ``written`` names (``absolute``: its URI;
        ``said``: it and where it is, for messages)."""
        uri, fragment = urldefrag(absolute)
        if uri not in self.resources:
            self.fetch(uri, urldefrag(written)[0], said)
        fragment = unquote(fragment)
        if fragment and not fragment.startswith("/"):
            found = self.anchors.get((uri, fragment))
            if found is None:
                inside = f" in {uri!r}" if uri else ""
                raise GrammarError(f"{said}: no anchor {fragment!r} is defined{inside}")
            return pointer(found).replace("%", "%25")
        location = self.resources[uri]
        node = self.at(self.root, location)
        for part in fragment.split("/")[1:]:
            key: Any = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list):
                key = int(key) if key.isascii() and key.isdigit() else len(node)
            if not isinstance(node, dict | list) or key not in (
                node if isinstance(node, dict) else range(len(node))
            ):
                raise GrammarError(f"{said} does not resolve")
            node, location = node[key], (*location, key)
        return pointer(location).replace("%", "%25")

    def fetch(self, uri: str, written: str, said: str) -> None:
        """Add the document ``uri`` names (given, holding it as an embedded resource, or a
        meta-schema), or raise (:class:`_NotGiven` where none has it)."""
        if uri in self.missing:
            raise self.missing[uri]
        try:
            try:
                found = None if self.lookup is None else self.lookup(uri)
            except GrammarError as exc:  # (the function's reason; a meta-schema needs none)
                if uri not in _META:
                    raise type(exc)(f"{said}: {exc}") from None
                found = None
            if found is None:
                found = _META.get(uri)
            if found is not None:
                self.add(uri, found, said)
                return
            for other, doc in self.given.items():
                if other not in self.resources and uri in self.scan(other, doc):
                    self.add(other, doc, said)
                    return
            raise _NotGiven(self.not_given(uri, written, said))
        except GrammarError as exc:
            self.missing[uri] = exc
            raise

    def scan(self, uri: str, doc: Any) -> set[str]:
        """The resources of a given document (none where one of its $ids is no URI)."""
        if uri not in self.scans:
            try:
                self.scans[uri] = set(self.resource_ids(doc, uri))
            except GrammarError:
                self.scans[uri] = set()
        return self.scans[uri]

    def resource_ids(self, node: Any, base: str, named: bool = True) -> Iterator[str]:
        """The URIs of the resources in ``node`` (whose base URI is ``base``), as
        :meth:`index` reads them; raising for an $id that is no URI."""
        if not isinstance(node, dict):
            return
        ident = node.get(self.id_key) if named else None
        if isinstance(ident, str) and not (self.old and ("$ref" in node or ident[:1] == "#")):
            try:
                base = urldefrag(_join(base, ident))[0]
            except ValueError as exc:
                raise GrammarError(
                    f"invalid JSON Schema: {self.id_key} {ident!r:.80} is no URI: {exc}"
                ) from None
            yield base
        for step, sub in _children(node):
            yield from self.resource_ids(sub, base, named and step[0] in self.keywords)

    def not_given(self, uri: str, written: str, said: str) -> str:
        if uri in _SEVERAL:
            return (
                f"{said} refers to the meta-schema {uri!r}: it is several documents, whose "
                "dynamic references depend on the path to them, which lcgen does not support"
            )
        hint = ""
        if written in self.given and written != uri:
            hint = (
                f" (documents has {written!r}: references resolve against the $id of the "
                "schema they are in, so give it by its absolute URI)"
            )
        return (
            f"{said} refers to the document {uri!r}, which lcgen was not given: it fetches "
            "nothing (Grammar.from_json_schema and lcgen.bundle_schema take documents by URI: "
            f"documents={{{uri!r}: ...}}){hint}"
        )

    def add(self, uri: str, found: Any, said: str) -> None:
        """Put ``found``, the document ``uri`` names, in the bundle (checked first)."""
        named = f"the document {uri!r}, named by {said}"
        if not isinstance(found, dict | bool):
            raise GrammarError(
                f"{named} is {type(found).__name__} {found!r:.80}: a JSON Schema is an object or "
                "a boolean"
            )
        draft = draft_of(found, named)
        if isinstance(found, dict) and "$schema" in found and draft is not self.draft:
            root = self.root.get("$schema")
            hint = (
                f'; give the root the same "$schema": {found["$schema"]!r}' if root is None else ""
            )
            raise UnsupportedSchemaError(
                f"{said} refers to {uri!r}, a schema of another draft ({found['$schema']!r}) "
                f"than the root's ({root or 'none named: the newest'}): lcgen reads one draft "
                f"per schema{hint}"
            )
        try:
            self.draft.check_schema(found)
        except jsonschema.SchemaError as exc:
            error = schema_error(exc)
            raise type(error)(f"{error} (in {named})") from None
        try:  # (before anything of it is kept)
            list(self.resource_ids(found, uri))
        except GrammarError as exc:
            raise GrammarError(f"{exc} (in {named})") from None
        location = (DOCUMENTS, len(self.docs))
        self.docs.append(found)
        self.out.uris.append(uri)
        self.resources[uri] = location
        self.index(found, uri, location, top=True)
        ident = found.get(self.id_key) if isinstance(found, dict) else None
        if isinstance(ident, str):  # (its anchors by the URI it was given as too)
            with contextlib.suppress(ValueError):
                own = urldefrag(_join(uri, ident))[0]
                for (base, name), at in list(self.anchors.items()):
                    if base == own:
                        self.anchors.setdefault((uri, name), at)

    def at(self, root: dict[str, Any], location: Location) -> Any:
        """The node at ``location`` in ``root`` (the given schema, or its bundled copy)."""
        node: Any = root
        if root is self.root and location[:1] == (DOCUMENTS,):
            node, location = self.docs, location[1:]
        for key in location:
            node = node[key]
        return node
