"""Full-vocabulary masks through llguidance: the one module that touches it.

llama.cpp's grammar checks a vocabulary token by token (tens of milliseconds inside a JSON
string on a 262k vocabulary); llguidance walks a token trie against its lexer and parser
(tens of microseconds). A grammar gets llguidance's masks where :mod:`lcgen.constrain.lark`
translates it with its language kept exactly (a grammar naming ``<token>``s does not
translate); llama.cpp's grammar stays the authority for every token accepted, so a mask from
here only ever narrows what sampling draws from, never what the grammar allows.

llguidance is a dependency (abi3 wheels for Linux x86_64, macOS and Windows); where it cannot
be imported, :meth:`Matcher.new` returns None and masks come from llama.cpp.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from lcgen._native.model import tokenize_address
from lcgen.constrain.lark import to_lark
from lcgen.errors import GrammarError
from lcgen.vocab import Vocab

_llg: Any
try:
    import llguidance
    import llguidance.numpy

    _llg = llguidance
except ImportError:  # pragma: no cover - a dependency; a platform without its wheel may lack it
    _llg = None

# Compiled matchers kept per vocabulary, by grammar: a new state copies one (tens of
# microseconds) instead of compiling the grammar again (a millisecond or a few); where a
# grammar has no matcher, why (a str), so it is not translated again for each state.
_MAX_TEMPLATES = 32
_UNCOMPILED = object()
_tokenizers: weakref.WeakKeyDictionary[Vocab, Any] = weakref.WeakKeyDictionary()
_templates: weakref.WeakKeyDictionary[Vocab, dict[tuple[str, str], Any]] = (
    weakref.WeakKeyDictionary()
)


def available() -> bool:
    """Whether llguidance is installed."""
    return _llg is not None


def tokenizer(vocab: Vocab) -> Any:
    """llguidance's tokenizer of ``vocab``, built once per vocabulary (about a second on a
    262k vocabulary). Tokens are given as lcgen's grammar sees them: a token with text by its
    text (user-defined ones such as ``<table>`` too, as llama.cpp's grammar matches them),
    control and end-of-generation tokens marked special (no text matches them)."""
    built = _tokenizers.get(vocab)
    if built is None:
        pieces = vocab.all_pieces()
        hidden, eog = vocab.hidden, vocab.eog_set
        tokens = [
            b"\xff" + piece if hidden[t] or t in eog else piece for t, piece in enumerate(pieces)
        ]
        ends = list(vocab.end_tokens) or [0]
        built = _llg.LLTokenizer.from_llamacpp(
            tokens=tokens,
            vocab_ptr=vocab.handle.vocab(),
            tokenize_fptr=tokenize_address(),
            eos_token=ends,
            slices=None,
        )
        _tokenizers[vocab] = built
    return built


def compile_matcher(gbnf: str, root: str, vocab: Vocab) -> Any | None:
    """llguidance's matcher at the start of the grammar over ``vocab``, compiled now (a
    millisecond or a few; :meth:`Matcher.new` keeps the result), or None: llguidance is not
    installed, the grammar does not translate, or llguidance refuses it (a limit of its own)."""
    compiled = _compile(gbnf, root, vocab)
    return None if isinstance(compiled, str) else compiled


def _compile(gbnf: str, root: str, vocab: Vocab) -> Any:
    """llguidance's matcher, or (a str) why there is none."""
    if _llg is None:
        return "llguidance is not installed"
    try:
        spec = _llg.LLMatcher.grammar_from_lark(to_lark(gbnf, root))
    except GrammarError as exc:
        return f"the grammar does not translate to llguidance's ({exc})"
    except RecursionError:  # nested deeper than lark.parse goes
        return "the grammar nests too deeply to translate to llguidance's"
    matcher = _llg.LLMatcher(tokenizer(vocab), spec, log_level=0, limits=_limits())
    if matcher.is_error():
        reason = matcher.get_error().strip().split("\n", 1)[0][:200]
        return f"llguidance refused it ({reason})"
    return matcher


def _limits() -> Any:
    """llguidance's parser limits, with a rule's open alternatives raised from 2,000 to 100,000
    (and the items a step may make with them): past 2,000 it refused the grammar, and llama.cpp
    masked in seconds (a rule of 9,800 words: 4 s a mask there, 10 ms here)."""
    return _llg.LLParserLimits(max_items_in_row=100_000, step_max_items=500_000)


def refusal(gbnf: str, root: str, vocab: Vocab) -> str:
    """Why the grammar has no llguidance matcher over ``vocab`` (empty: it has one)."""
    if _llg is None:
        return "llguidance is not installed"
    compiled = _template(gbnf, root, vocab)
    return compiled if isinstance(compiled, str) else ""


def _template(gbnf: str, root: str, vocab: Vocab) -> Any:
    """The grammar's compiled matcher (or why none), kept per vocabulary (the last 32)."""
    templates = _templates.setdefault(vocab, {})
    key = (gbnf, root)
    template = templates.get(key, _UNCOMPILED)  # one lookup: another thread may clear it
    if template is _UNCOMPILED:
        template = _compile(gbnf, root, vocab)
        if len(templates) >= _MAX_TEMPLATES:
            templates.clear()
        templates[key] = template
    return template


class Matcher:
    """One grammar's llguidance matcher over one vocabulary.

    Not thread-safe; one belongs to one :class:`~lcgen.GrammarState`.
    """

    __slots__ = ("_matcher", "_n_vocab")

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab

    @classmethod
    def new(cls, gbnf: str, root: str, vocab: Vocab) -> Matcher | None:
        """A matcher at the start of the grammar, or None where :func:`compile_matcher` gives none;
        compiled once per vocabulary and grammar (the last 32 kept), copied for each call."""
        if _llg is None:
            return None
        template = _template(gbnf, root, vocab)
        return None if isinstance(template, str) else cls(template.deep_copy(), vocab.n_vocab)

    def consume(self, tokens: list[int]) -> bool:
        """Advance past ``tokens``; False when llguidance refuses one (the matcher is then
        of no further use)."""
        return bool(self._matcher.consume_tokens(tokens))

    def copy(self) -> Matcher:
        return Matcher(self._matcher.deep_copy(), self._n_vocab)

    def forced_bytes(self) -> bytes:
        """The text the grammar allows next and nothing else (empty: none): llguidance's mask
        then holds that text's own tokenization alone, narrower than the grammar allows."""
        return bytes(self._matcher.compute_ff_bytes())

    def valid(self, tokens: np.ndarray) -> np.ndarray:
        """A bool per token of ``tokens``: whether it may come next (by its text, however the
        tokenizer would split that text)."""
        check = self._matcher.validate_tokens
        return np.fromiter((check([t]) == 1 for t in tokens.tolist()), bool, len(tokens))

    def allowed(self) -> np.ndarray | None:
        """A bool per token: what llguidance allows next (None in an error state)."""
        bits = _llg.numpy.allocate_token_bitmask(1, self._n_vocab)
        _llg.numpy.fill_next_token_bitmask(self._matcher, bits, 0)
        if self._matcher.is_error():
            return None
        flags = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self._n_vocab]
        return flags.astype(bool)
