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
# microseconds) instead of compiling the grammar again (a millisecond or a few); None where a
# grammar has no matcher, so it is not translated again for each state.
_MAX_TEMPLATES = 32
_UNCOMPILED = object()
_tokenizers: weakref.WeakKeyDictionary[Vocab, Any] = weakref.WeakKeyDictionary()
_templates: weakref.WeakKeyDictionary[Vocab, dict[tuple[str, str], Any | None]] = (
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
    if _llg is None:
        return None
    try:
        spec = _llg.LLMatcher.grammar_from_lark(to_lark(gbnf, root))
    except (GrammarError, RecursionError):  # RecursionError: nested deeper than lark.parse goes
        return None
    matcher = _llg.LLMatcher(tokenizer(vocab), spec, log_level=0)
    return None if matcher.is_error() else matcher


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
        templates = _templates.setdefault(vocab, {})
        key = (gbnf, root)
        template = templates.get(key, _UNCOMPILED)  # one lookup: another thread may clear it
        if template is _UNCOMPILED:
            template = compile_matcher(gbnf, root, vocab)
            if len(templates) >= _MAX_TEMPLATES:
                templates.clear()
            templates[key] = template
        return None if template is None else cls(template.deep_copy(), vocab.n_vocab)

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
