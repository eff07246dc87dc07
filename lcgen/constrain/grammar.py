"""Grammar constraints: ``Grammar`` (what is allowed) and ``GrammarState`` (where a sequence is).

A :class:`Grammar` is GBNF text and a root rule, checked by llama.cpp's parser when it is made.
It comes from text, a file (``grammars/NAME.gbnf``), a JSON Schema, a pydantic model, a list of
choices or a regular expression. A :class:`GrammarState` is the live grammar of one sequence
over one model's vocabulary (a llama.cpp grammar sampler): check one token in microseconds
(:meth:`~GrammarState.allows`), accept it, clone it for a checkpoint, or mask the whole
vocabulary when the sampled token was rejected.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lcgen._files import read_bounded
from lcgen._native.grammar import GrammarSampler, MaskDeadlineError, check_gbnf
from lcgen._resources import resource_path
from lcgen.constrain import gbnf as _gbnf
from lcgen.constrain import regex as _regex
from lcgen.constrain.chains import check_chains
from lcgen.constrain.lark import bad_escape, redefined
from lcgen.constrain.llg import Matcher
from lcgen.constrain.llg import refusal as llg_refusal
from lcgen.constrain.pydantic_schema import pydantic_schema
from lcgen.constrain.tables import LITERALS_AND_COMMENTS, tables, traits, utf8_tail
from lcgen.constrain.unique import UniqueItems
from lcgen.errors import GrammarError, GrammarTooSlowError
from lcgen.vocab import HasVocab, Vocab, vocab_of

_RULE_NAME = re.compile(r"[a-zA-Z0-9-]+")


@dataclass(frozen=True, slots=True)
class Grammar:
    """A GBNF grammar and the name of its root rule, validated by llama.cpp's parser.

    Args:
        gbnf: the grammar text (llama.cpp's GBNF).
        root: the rule generation starts from.
        values: its sentences are values (a JSON Schema's, a choice's options): one that
            ``max_tokens`` cut where the grammar allows more is incomplete (``-1`` of
            ``-10000``, ``"yes"`` of ``"yes please"``), not only one cut before it matched.
        unique: the JSON Schema whose arrays must hold unique items (``uniqueItems``), which
            no grammar can say: generation holds them apart (see
            :mod:`lcgen.constrain.unique`), and :meth:`accepts` checks them; None: none.

    Raises:
        GrammarError: the text does not parse (the message gives llama.cpp's reason and the
            line and column), has no rule named ``root``, is left-recursive, uses a
            repetition bound that llama.cpp would silently drop (above 2000), chains rule
            references deeper than llama.cpp can recurse (see :mod:`lcgen.constrain.chains`),
            defines a rule twice (llama.cpp would keep the last definition silently), or
            escapes a value that is no character (above ``\\U0010FFFF``, or a lone
            surrogate in a literal).
        TypeError: ``gbnf`` or ``root`` is not a str.
    """

    gbnf: str
    root: str = "root"
    values: bool = field(default=False, compare=False)
    unique: UniqueItems | None = None

    def __post_init__(self) -> None:
        for name, value in (("gbnf", self.gbnf), ("root", self.root)):
            if not isinstance(value, str):
                raise TypeError(f"Grammar {name} must be a str, got {type(value).__name__}")
        if not self.gbnf.strip():
            raise GrammarError("the grammar is empty")
        if not _RULE_NAME.fullmatch(self.root):
            raise GrammarError(f"root {self.root!r} is not a rule name (letters, digits, '-')")
        if "\x00" in self.gbnf:
            raise GrammarError("the grammar contains a NUL character (write it as \\x00)")
        if (surrogate := _SURROGATE.search(self.gbnf)) is not None:
            line = self.gbnf.count("\n", 0, surrogate.start()) + 1
            raise GrammarError(
                f"the grammar contains the lone surrogate U+{ord(surrogate.group()):04X} on "
                f"line {line}, which has no UTF-8 form"
            )
        _check_repetition_bounds(self.gbnf)
        _check_nesting(self.gbnf)
        check_chains(self.gbnf)
        check_gbnf(self.gbnf, self.root)
        _check_rules_and_escapes(self.gbnf)

    @classmethod
    def from_file(cls, name_or_path: str | Path, root: str = "root") -> Grammar:
        """Load a ``.gbnf`` file: a path, or the name of a bundled grammar (``"json"``).

        Raises:
            FileNotFoundError: no such file, and no bundled grammar of that name (the
                message lists the bundled ones).
            GrammarError: the file does not parse, is not UTF-8 text, or is not a regular file
                or a pipe (a directory; a device such as ``/dev/zero`` would be read until
                memory ran out), or is over :data:`lcgen._files.MAX_FILE_BYTES`.
        """
        path = Path(name_or_path)
        if not path.is_file() and path.suffix == "" and path.name == str(name_or_path):
            try:
                return cls.bundled(path.name, root)
            except ValueError as exc:
                raise FileNotFoundError(f"no grammar file {path.name!r}, and {exc}") from None
        try:
            text = read_bounded(path).decode("utf-8")
        except IsADirectoryError:
            raise GrammarError(f"{path} is not a grammar file: it is a directory") from None
        except UnicodeDecodeError as exc:
            raise GrammarError(
                f"{path} is not a grammar file: it is not UTF-8 text (byte {exc.start})"
            ) from None
        except ValueError as exc:  # a device, or too large
            raise GrammarError(f"{path} is not a grammar file: {exc}") from None
        return cls(text, root)

    @staticmethod
    def bundled_names() -> tuple[str, ...]:
        """The names of the grammars shipped with lcgen (``grammars/*.gbnf``), sorted."""
        return tuple(sorted(p.stem for p in resource_path("grammars").glob("*.gbnf")))

    @classmethod
    def bundled(cls, name: str, root: str = "root") -> Grammar:
        """A grammar shipped with lcgen, by name (``"json"``); never reads any other file.

        Raises:
            ValueError: no bundled grammar has that name (the message lists them).
        """
        names = cls.bundled_names()
        if name not in names:
            raise ValueError(f"no bundled grammar named {name!r} (bundled: {', '.join(names)})")
        text = (resource_path("grammars") / f"{name}.gbnf").read_text(encoding="utf-8")
        return cls(text, root)

    @classmethod
    def from_json_schema(
        cls,
        schema: dict[str, Any] | bool | str,
        *,
        close_objects: bool = False,
        whitespace: Literal["flexible", "compact"] = "flexible",
        documents: Mapping[str, Any] | Callable[[str], Any] | None = None,
        uri: str = "",
    ) -> Grammar:
        """A grammar for JSON text that validates against ``schema``.

        Every output the grammar allows validates; a keyword lcgen cannot enforce exactly
        raises instead of being dropped (see :mod:`lcgen.constrain.json_schema` for the list).
        Unknown keywords are annotations (a likely misspelling warns).

        Args:
            schema: a JSON Schema, as a dict or as JSON text.
            close_objects: objects that declare ``properties`` but do not say whether others
                are allowed allow none (the specification allows any).
            whitespace: ``"flexible"`` (up to 24 spaces, tabs or newlines between JSON tokens)
                or ``"compact"`` (none: fewer tokens to generate).
            documents: the other documents the schema's references name, by absolute URI
                (a mapping, or a function of the URI giving the document or None); nothing
                is fetched. :func:`lcgen.bundle_schema` makes such a schema one document.
            uri: the URI the schema was read from (a file's ``file:`` URI): the base of its
                references where its ``$id`` is none or relative.

        Raises:
            GrammarError: an unsupported keyword or combination (named, with its location
                in the schema), an invalid schema, or one that no value satisfies.
        """
        from lcgen.constrain.bundle import read_schema
        from lcgen.constrain.json_schema import schema_to_gbnf

        gbnf, unique = schema_to_gbnf(
            read_schema(schema),
            close_objects=close_objects,
            whitespace=whitespace,
            documents=documents,
            uri=uri,
        )
        return cls(gbnf, values=True, unique=None if unique is None else UniqueItems.of(unique))

    @classmethod
    def from_pydantic(
        cls, model_cls: type[Any], *, whitespace: Literal["flexible", "compact"] = "flexible"
    ) -> Grammar:
        """A grammar for the JSON of a pydantic model (through its JSON Schema).

        Models follow their ``extra`` setting: ``"allow"`` admits other properties, the
        default (``"ignore"``, whose extra properties would be dropped anyway) and
        ``"forbid"`` do not. Where pydantic checks more than its JSON Schema says, the grammar
        keeps to what pydantic checks: a ``NaiveDatetime`` has no offset, a ``Decimal`` its
        ``max_digits``/``decimal_places`` (as a number or a string), a ``dict[int, ...]`` keys
        that read as ints (keys with a ``pattern``, keys that match it), a ``Json[...]``
        field JSON text of its type, ``UUID4`` its version, a network no host bits,
        ``Base64Str`` padded base64 of ASCII, a URL a host and the schemes its type allows, a
        ``PastDate`` a year before last year.

        Raises:
            TypeError: ``model_cls`` is not a pydantic model class.
            GrammarError: as for :meth:`from_json_schema`; and for the types no grammar can
                hold to, named with where they are: ``FutureDate``/``FutureDatetime`` (a future
                date stops being one), ``FilePath``/``DirectoryPath``/``NewPath``/``SocketPath``
                (the file system), ``PaymentCardNumber``, multi-host DSNs; a required
                ``SkipJsonSchema`` field; a type with no JSON Schema (a ``Callable``).
        """
        schema_fn = getattr(model_cls, "model_json_schema", None)
        if not isinstance(model_cls, type) or schema_fn is None:
            raise TypeError(f"expected a pydantic BaseModel subclass, got {model_cls!r}")
        return cls.from_json_schema(
            pydantic_schema(model_cls), close_objects=True, whitespace=whitespace
        )

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        """Exactly one of ``options`` (any text: quotes, backslashes, newlines, Unicode).

        Raises:
            ValueError: ``options`` is empty or contains an empty string.
            TypeError: an option is not a str.
        """
        if isinstance(options, str) or not options:
            raise ValueError(f"choice needs a non-empty list of strings, got {options!r}")
        for option in options:
            if not isinstance(option, str):
                raise TypeError(f"choice options must be str, got {option!r}")
            if not option:
                raise ValueError(
                    "a choice option is empty: it matches before any token, so the output could "
                    "end empty (give only options with text)"
                )
        # A prefix tree, not a flat alternation: llama.cpp's work per token grows with the
        # alternatives alive (see :func:`lcgen.constrain.gbnf.trie`).
        rules = _gbnf.RuleSet()
        return cls(rules.text(_gbnf.trie(options, rules)), values=True)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that ``re.fullmatch(pattern, text)`` matches, for the supported subset.

        Raises:
            GrammarError: an invalid pattern, or a construct outside the subset (named,
                with its position): backreferences, lookaround, word boundaries, flags,
                possessive quantifiers, anchors other than at the ends.
        """
        if not isinstance(pattern, str):
            raise TypeError(f"regex pattern must be a str, got {type(pattern).__name__}")
        try:
            body = _regex.regex_to_gbnf(pattern)
        except RecursionError:
            raise GrammarError(
                f"the regular expression nests too deeply to compile ({len(pattern)} characters)"
            ) from None
        return cls(f"root ::= {body}\n")

    def check(self, model: Vocab | HasVocab) -> None:
        """Check the grammar against a model's vocabulary: it parses (token names too) and
        some token, or the end of generation, is allowed at its start.

        Raises:
            GrammarError: the grammar names tokens the vocabulary lacks, or nothing can start.
        """
        with GrammarState(self, model) as state:
            if not state.is_complete:
                state.allowed()  # raises when no token is allowed

    def state(self, model: Vocab | HasVocab) -> GrammarState:
        """A fresh :class:`GrammarState` of this grammar over ``model``'s vocabulary."""
        return GrammarState(self, model)

    def accepts(self, model: Vocab | HasVocab, text: str) -> bool:
        """Whether ``text`` is a complete sentence of the grammar, with the items of
        ``uniqueItems`` arrays unique (see :meth:`GrammarState.accepts_text`)."""
        with GrammarState(self, model) as state:
            return state.accepts_text(text)


# llama.cpp parses GBNF by recursive descent and walks text through nested rules with stacks
# whose work grows with the depth: deeper than these, it could overflow the C stack (measured:
# 20,000 parentheses) or take minutes (text nested 4,000 deep in JSON: 39 s), so refuse.
MAX_GBNF_NESTING = 1000
MAX_TEXT_NESTING = 512

# The most seconds one mask of the vocabulary by llama.cpp's grammar may take (where llguidance
# has no matcher): a grammar of tens of thousands of alternatives took minutes a mask, during
# which a model, or a server's every client, waited. Such masks raise GrammarTooSlowError.
MAX_MASK_SECONDS = 2.0


def _max_depth(text: str, opening: str, closing: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif char in closing:
            depth = max(0, depth - 1)
    return deepest


def _check_nesting(gbnf: str) -> None:
    depth = _max_depth(LITERALS_AND_COMMENTS.sub(" ", gbnf), "(", ")")
    if depth > MAX_GBNF_NESTING:
        raise GrammarError(
            f"the grammar nests parentheses {depth} deep, over the bound of {MAX_GBNF_NESTING} "
            "(llama.cpp's parser recurses per level): use rules instead of deep nesting"
        )


def _check_repetition_bounds(gbnf: str) -> None:
    """llama.cpp reads ``x{m,n}`` with n above 2000 as ``x{m,}``, and with m above n it builds
    rules until memory runs out (measured: the process killed): refuse both."""
    code = LITERALS_AND_COMMENTS.sub(" ", gbnf)
    for match in re.finditer(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", code):
        low, high = match.groups()
        for bound in (low, high):
            if bound and int(bound) > _gbnf.MAX_REPEAT:
                raise GrammarError(
                    f"repetition {match.group(0)} is over llama.cpp's bound of "
                    f"{_gbnf.MAX_REPEAT} (it would silently become unbounded)"
                )
        if high and int(low) > int(high):
            raise GrammarError(
                f"repetition {match.group(0)}: its minimum {int(low)} is above its maximum "
                f"{int(high)}"
            )


_SURROGATE = re.compile("[\ud800-\udfff]")
# What llama.cpp's parser skips over whole (literals, classes, comments, token names), or a
# rule's head (group 3); groups 1 and 2 hold a literal's and a class's body.
_HEADS_AND_BODIES = re.compile(
    r'"((?:[^"\\]|\\.)*)"|\[((?:[^\]\\]|\\.)*)\]|#[^\r\n]*|!?<[^>]*>'
    r"|(?<![a-zA-Z0-9-])([a-zA-Z0-9-]+)[ \t]*::=",
    re.DOTALL,
)
_HEX_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.DOTALL)


def _check_rules_and_escapes(gbnf: str) -> None:
    """Refuse what llama.cpp's parser takes but reads in a way no one means, and other engines
    (llguidance, through :mod:`lcgen.constrain.lark`) read otherwise: a rule defined twice
    (llama.cpp keeps the last definition), an escape beyond U+10FFFF (a code point no text
    has) and a lone surrogate escaped in a literal (ditto). Run after llama.cpp's parse, which
    makes every ``name ::=`` outside literals, classes, comments and tokens a rule's head."""
    heads: dict[str, int] = {}
    for match in _HEADS_AND_BODIES.finditer(gbnf):
        literal, cls, name = match.groups()
        if name is not None:
            if name in heads:
                line = gbnf.count("\n", 0, heads[name]) + 1
                raise redefined(name, line, gbnf.count("\n", 0, match.start()) + 1)
            heads[name] = match.start()
            continue
        body = literal if literal is not None else cls
        if not body or "\\" not in body:
            continue
        start = match.start(1 if literal is not None else 2)
        for escape in _HEX_ESCAPE.finditer(body):
            digits = escape.group(1) or escape.group(2)
            if digits is None:
                continue
            error = bad_escape(
                gbnf, start + escape.start(), escape.group(), int(digits, 16), literal is not None
            )
            if error is not None:
                raise error


# A token named in GBNF (``<[id]>``, ``<text>``; group 1 is "!" where negated), found outside
# literals, classes and comments, which the alternatives before it consume.
_TOKEN_NAME = re.compile(LITERALS_AND_COMMENTS.pattern + r"|(!?)<(\[\d+\]|[^>]*)>")


def _special_token_hint(gbnf: str, vocab: Vocab) -> str:
    """Why a grammar that names an end-of-generation or control token gets stuck there (""
    where it names none): llama.cpp allows an end token only where the grammar is complete,
    and lcgen never samples control tokens."""
    if not traits(gbnf)[0]:
        return ""
    for match in _TOKEN_NAME.finditer(gbnf):
        negated, name = match.groups()
        if name is None or negated:
            continue
        if name.startswith("["):
            ids = [int(name[1:-1])]
        else:
            ids = vocab.tokenize(f"<{name}>", add_bos=False, special=True)  # as llama.cpp
        if len(ids) != 1:
            continue
        if ids[0] in vocab.eog_set:
            return (
                f"(it names <{name}>, token {ids[0]}, which ends generation: a grammar cannot "
                "ask for it, since generation ends where the grammar is complete; leave it out)"
            )
        if ids[0] in vocab.hidden_set:
            return (
                f"(it names <{name}>, token {ids[0]}, a control token: lcgen never samples "
                "control tokens, whose text is hidden)"
            )
    return ""


class GrammarState:
    """The live state of a grammar for one sequence, over one model's vocabulary.

    Not thread-safe: one state belongs to one sequence. Free it with :meth:`close` (or a
    ``with`` block); it is also freed when garbage-collected.

    Args:
        grammar: the grammar.
        model: the model (or its :class:`~lcgen.vocab.Vocab`) whose vocabulary tokens come
            from (must stay open).

    Raises:
        GrammarError: llama.cpp rejects the grammar for this vocabulary (e.g. a ``<token>``
            it does not have).
    """

    __slots__ = ("_matcher", "_matcher_at", "_pending", "_sampler", "_tokens", "_vocab", "grammar")

    def __init__(self, grammar: Grammar, model: Vocab | HasVocab) -> None:
        if not isinstance(grammar, Grammar):
            raise TypeError(f"expected a Grammar, got {type(grammar).__name__}")
        vocab = vocab_of(model)
        self.grammar = grammar
        self._vocab = vocab
        self._sampler = GrammarSampler.new(vocab.handle, grammar.gbnf, grammar.root)
        # The bytes of an unfinished UTF-8 character at the end of the accepted text.
        self._pending = b""
        # The tokens accepted, and llguidance's matcher for full masks: made on the first
        # mask, then advanced over the tokens accepted since (_matcher_at of them are in it;
        # -1: no matcher for this grammar).
        self._tokens: list[int] = []
        self._matcher: Matcher | None = None
        self._matcher_at = 0

    @property
    def n_vocab(self) -> int:
        return self._vocab.n_vocab

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next (end-of-generation tokens: only where the
        grammar is complete; control tokens, whose text is hidden, never).

        Raises:
            ValueError: ``token`` is outside the vocabulary.
            GrammarError: the state or its model was closed.
        """
        if token in self._vocab.hidden_set:
            self._sampler.allows(token)  # checks the id and that the state is open
            return False
        return self._sampler.allows(token) and self._text_ok(token)

    def _text_ok(self, token: int) -> bool:
        """llama.cpp's grammar lets through bytes that are not UTF-8 (overlong forms,
        surrogates, NUL inside a piece): the text after ``token`` must stay valid UTF-8."""
        vocab = self._vocab
        if token in vocab.eog_set:
            return not self._pending
        piece = vocab.special_piece(token)
        if not self._pending and piece.isascii():
            return b"\x00" not in piece
        return b"\x00" not in piece and utf8_tail(self._pending + piece) is not None

    def try_accept(self, token: int) -> bool:
        """Advance past ``token`` if allowed; return False (state unchanged) if not."""
        if not self.allows(token) or not self._sampler.accept(token):
            return False
        self._tokens.append(token)
        vocab = self._vocab
        if token not in vocab.eog_set and (
            self._pending or not vocab.special_piece(token).isascii()
        ):
            data = self._pending + vocab.special_piece(token)
            self._pending = data[len(data) - (utf8_tail(data) or 0) :]
        return True

    def accept(self, token: int) -> None:
        """Advance past ``token``.

        Raises:
            GrammarError: the grammar does not allow ``token`` here (the state is unchanged).
            ValueError: ``token`` is outside the vocabulary.
        """
        if not self.try_accept(token):
            raise GrammarError(f"the grammar does not allow token {token} here")

    def accept_tokens(self, tokens: list[int]) -> None:
        """Accept each token in turn.

        Raises:
            GrammarError: a token is not allowed; the tokens before it stay accepted.
        """
        for i, token in enumerate(tokens):
            if not self.try_accept(token):
                raise GrammarError(
                    f"the grammar does not allow token {token} (position {i} of {len(tokens)})"
                )

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: the tokens allowed next.

        Through llguidance where the grammar translates to it (tens of microseconds), else
        llama.cpp checks the tokens in turn (milliseconds on large vocabularies); both give
        the same mask (tested token by token over the JSON-Schema-Test-Suite).

        Raises:
            GrammarError: no token is allowed: the grammar can neither go on nor end here.
        """
        allowed = self._allowed_by_matcher()
        if allowed is None:
            allowed = self._allowed_by_llama()
        if not allowed.any():
            raise GrammarError(
                "no token of the vocabulary can continue the grammar here, and it cannot end "
                + (
                    _special_token_hint(self.grammar.gbnf, self._vocab)
                    or "(an unsatisfiable grammar, or characters no token can spell)"
                )
            )
        return allowed

    def _synced_matcher(self) -> Matcher | None:
        """llguidance's matcher, advanced over every accepted token (None: none for this
        grammar, or llguidance refused a token llama.cpp accepted)."""
        if self._matcher_at < 0:
            return None
        if self._matcher is None:
            # llama.cpp's check of a partial character is stricter than of a whole one where a
            # class negates non-ASCII characters: its masks differ from llguidance's there.
            if not traits(self.grammar.gbnf)[1]:
                self._matcher = Matcher.new(self.grammar.gbnf, self.grammar.root, self._vocab)
            self._matcher_at = 0
        if self._matcher is not None and self._matcher_at < len(self._tokens):
            if not self._matcher.consume(self._tokens[self._matcher_at :]):
                self._matcher = None
            self._matcher_at = len(self._tokens)
        if self._matcher is None:
            self._matcher_at = -1
        return self._matcher

    def _allowed_by_matcher(self) -> np.ndarray | None:
        """llguidance's mask, made to read as llama.cpp's: end tokens only where the grammar
        can end, the text valid UTF-8 after a partial character. None where it has none.
        Where the grammar forces text, llguidance's mask allows that text's own tokenization
        only, llama.cpp any split of it: then the tokens that spell a start of the text are
        allowed, and those that go past it are checked one by one (llama.cpp took seconds a
        mask where thousands of alternatives were open)."""
        matcher = self._synced_matcher()
        if matcher is None:
            return None
        forced = matcher.forced_bytes()
        if forced:
            text = forced[: next((i for i, b in enumerate(forced) if b >= 0x80), len(forced))]
            if not text:  # (a character's bytes: llama.cpp checks a partial one otherwise)
                return None
            mask = np.zeros(self.n_vocab, dtype=bool)
            longer = self._vocab.tokens_starting_with(text)
            # A token that spells a start of the forced text is allowed: no check needed.
            mask[np.setdiff1d(self._vocab.tokens_extending(text), longer)] = True
            mask[longer[matcher.valid(longer)]] = True
            return self._keep_valid_text(mask)
        allowed = matcher.allowed()
        if allowed is None:
            self._matcher, self._matcher_at = None, -1
            return None
        for token in self._vocab.eog_set:
            allowed[token] = self._sampler.allows(token)
        return self._keep_valid_text(allowed)

    def _allowed_by_llama(self) -> np.ndarray:
        """The mask by llama.cpp's grammar, which checks each candidate token in turn.

        Raises:
            GrammarTooSlowError: the check would take over :data:`MAX_MASK_SECONDS` (it
                stops as soon as its work so far projects that, a few tenths of a second).
        """
        deadline = time.monotonic() + MAX_MASK_SECONDS
        try:
            candidates = self._vocab.visible_ids if self._pending else self._candidates(deadline)
            allowed = self._sampler.allowed(candidates, deadline)
        except MaskDeadlineError as exc:
            raise self._too_slow(
                f"about {exc.per_token * exc.n_tokens:.0f} s ({exc.n_tokens} tokens to check at "
                f"{exc.per_token * 1e3:.1f} ms each)"
            ) from None
        return self._keep_valid_text(allowed)

    def _too_slow(
        self, cost: str, work: str = "one mask of the vocabulary by this grammar"
    ) -> GrammarTooSlowError:
        if traits(self.grammar.gbnf)[1]:
            why = (
                "llguidance's faster masks are not used for a grammar that negates a class "
                "with non-ASCII characters (they differ from llama.cpp's there)"
            )
        else:
            why = llg_refusal(self.grammar.gbnf, self.grammar.root, self._vocab)
        return GrammarTooSlowError(
            f"{work} would take {cost} through llama.cpp's "
            f"token-by-token check, over the bound of {MAX_MASK_SECONDS:g} s a token; "
            f"llguidance, which masks in microseconds, has none for it: {why}. Make the "
            "grammar smaller (fewer alternatives in a rule)"
        )

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise self._too_slow(f"over {MAX_MASK_SECONDS:g} s")

    def _keep_valid_text(self, allowed: np.ndarray) -> np.ndarray:
        """``allowed`` less the tokens after which the text would not be valid UTF-8 (see
        :meth:`_text_ok`): by a table at a character boundary, token by token after a
        partial character."""
        if not self._pending:
            allowed &= tables(self._vocab).boundary_ok
        else:
            for token in np.flatnonzero(allowed).tolist():
                allowed[token] = self._text_ok(token)
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (shape ``(n_vocab,)``) with every token the grammar forbids
        set to ``-inf``.

        Raises:
            ValueError: ``logits`` does not have one value per vocabulary token.
            GrammarError: no token is allowed (see :meth:`allowed`).
        """
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"logits of shape {logits.shape}, expected ({self.n_vocab},)")
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32)

    def _candidates(self, deadline: float) -> np.ndarray:
        """The tokens worth asking llama.cpp about (it checks each in turn: milliseconds for
        a large vocabulary). A token whose first character (or its first byte, a partial
        character) the grammar rejects here is rejected too, and so is one whose first two
        bytes are rejected in turn (checked after the most common first characters, such as a
        space, where the grammar is selective). Bytes of multi-byte characters stand for the
        characters they start unless the grammar negates a class with non-ASCII characters
        (llama.cpp's check of a partial character is then stricter than of a whole one)."""
        vocab = tables(self._vocab)
        uses_tokens, negates_non_ascii = traits(self.grammar.gbnf)
        if uses_tokens:  # <token> rules match by id, not by text
            return vocab.visible
        first_ok = np.ones(257, dtype=bool)  # by first byte; 256: none worth testing
        for byte, token in vocab.byte_token.items():
            if byte < 0x80 or not negates_non_ascii:
                first_ok[byte] = self.allows(token)
                self._check_deadline(deadline)
        keep = first_ok[vocab.first]
        if first_ok[:128].mean() < 0.75:
            for byte in vocab.common_first:
                if first_ok[byte]:
                    second_ok = self._second_ok(byte, negates_non_ascii, deadline)
                    keep &= (vocab.first != byte) | second_ok[vocab.second]
        keep |= vocab.eog
        candidates: np.ndarray = vocab.visible[keep[vocab.visible]]
        return candidates

    def _second_ok(self, byte: int, negates_non_ascii: bool, deadline: float) -> np.ndarray:
        """By second byte: whether the grammar allows that byte after ``byte``."""
        vocab = tables(self._vocab)
        second_ok = np.ones(257, dtype=bool)
        with self.clone() as after:
            after.accept(vocab.byte_token[byte])
            for second, token in vocab.byte_token.items():
                if second < 0x80 or not negates_non_ascii:
                    second_ok[second] = after.allows(token)
                    self._check_deadline(deadline)
        return second_ok

    def forced_text(self, limit: int) -> str:
        """The text the grammar forces next: the characters that follow, one by one, while it
        allows exactly one and cannot end there (at most ``limit``).

        Only ASCII characters are followed. A grammar that names tokens, or negates a class
        with non-ASCII characters (llama.cpp's check of a lone lead byte is stricter there than
        of the whole character), forces nothing here. Read from llguidance where it has a
        matcher for the grammar (microseconds), else from llama.cpp's check of one token per
        first byte, character by character (both give the same text: tested over the
        JSON-Schema-Test-Suite).

        Raises:
            GrammarTooSlowError: llama.cpp's check would take over :data:`MAX_MASK_SECONDS`.
        """
        uses_tokens, negates_non_ascii = traits(self.grammar.gbnf)
        if self._pending or uses_tokens or negates_non_ascii:
            return ""
        matcher = self._synced_matcher()
        if matcher is not None:
            forced = matcher.forced_bytes()[:limit]  # (empty where the grammar can end)
            return forced[
                : next((i for i, b in enumerate(forced) if b >= 0x80), len(forced))
            ].decode()
        deadline = time.monotonic() + MAX_MASK_SECONDS
        try:
            return self._forced_by_llama(limit, deadline)
        except MaskDeadlineError as exc:
            raise self._too_slow(
                f"over {MAX_MASK_SECONDS:g} s ({exc.n_tokens} tokens to check for each "
                f"character, at {exc.per_token * 1e3:.1f} ms each)",
                work="following the text this grammar forces",
            ) from None

    def _forced_by_llama(self, limit: int, deadline: float) -> str:
        vocab = tables(self._vocab)
        forced: list[str] = []
        state, probe = self, None
        try:
            while len(forced) < limit and not state.is_complete:
                allowed = state._sampler.allowed_among(vocab.probe, deadline)
                first = np.unique(vocab.probe_first[allowed])
                byte = int(first[0]) if len(first) == 1 else 0x80
                if byte >= 0x80 or byte not in vocab.byte_token:
                    break
                if probe is None:
                    probe = state = self.clone()
                probe._sampler.accept(vocab.byte_token[byte])
                forced.append(chr(byte))
        finally:
            if probe is not None:
                probe.close()
        return "".join(forced)

    @property
    def is_complete(self) -> bool:
        """Whether the grammar can end here (its end-of-generation tokens are allowed)."""
        return not self._pending and any(self._sampler.allows(t) for t in self._vocab.end_tokens)

    allows_eos = is_complete

    @property
    def end_tokens(self) -> frozenset[int]:
        """The end-of-generation tokens (allowed only where the grammar is complete)."""
        return self._vocab.eog_set

    def accepts_text(self, text: str, *, complete: bool = True) -> bool:
        """Whether ``text`` (tokenized, then walked token by token from this state) is allowed,
        with the items of ``uniqueItems`` arrays unique (see :attr:`Grammar.unique`).

        Args:
            text: the text to walk; this state is not changed.
            complete: also require that the grammar can end after it (else: a valid prefix).

        Raises:
            GrammarError: the vocabulary cannot spell ``text`` (neither its tokenization nor
                single-byte tokens reproduce it), or it nests brackets over 512 deep.
        """
        depth = _max_depth(text, "([{", ")]}")
        if depth > MAX_TEXT_NESTING:
            raise GrammarError(
                f"the text nests brackets {depth} deep, over the bound of {MAX_TEXT_NESTING} "
                "(llama.cpp's grammar check slows with the square of the depth)"
            )
        try:
            tokens = self._vocab.spell(text.encode("utf-8"))
        except LookupError as exc:
            raise GrammarError(str(exc)) from None
        with self.clone() as walker:
            if not all(walker.try_accept(t) for t in tokens):
                return False
            if not (walker.is_complete or not complete):
                return False
        unique = self.grammar.unique
        if unique is None:
            return True
        before = b"".join(self._vocab.piece(t) for t in self._tokens)
        return not unique.duplicate_in(before.decode("utf-8", "replace") + text)

    def clone(self) -> GrammarState:
        """An independent copy of this state (for a checkpoint or a fork)."""
        state = GrammarState.__new__(GrammarState)
        state.grammar, state._vocab = self.grammar, self._vocab
        state._sampler, state._pending = self._sampler.clone(), self._pending
        state._tokens = list(self._tokens)
        # A matcher is copied where one is in use (a state asked for masks), else made later.
        matcher = self._synced_matcher() if self._matcher is not None else None
        state._matcher = matcher.copy() if matcher is not None else None
        state._matcher_at = len(self._tokens) if matcher is not None else min(self._matcher_at, 0)
        return state

    def close(self) -> None:
        """Free the llama.cpp sampler (idempotent)."""
        self._sampler.close()

    def __enter__(self) -> GrammarState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
