"""``Vocab``: a model's vocabulary as the layers above see it.

Token ids and text both ways, each token's bytes (one cache: a control token's piece is its
text, shown only where special tokens are), the end-of-generation tokens, the tokens whose
text is hidden, single-byte tokens, id checks, and the tokens that can heal a prompt's last
token. Built once per model; the tables over the whole vocabulary are built on first use.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import operator
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from lcgen._native.model import SPECIAL_ATTRS, ModelHandle
from lcgen._numbers import check_bool


class Vocab:
    """A model's vocabulary.

    Args:
        handle: the model whose vocabulary this is; every call raises
            :class:`~lcgen.ClosedError` once it is closed.
    """

    def __init__(self, handle: ModelHandle) -> None:
        self._handle = handle
        self.n_vocab = handle.n_vocab
        self.bos, self.eos, self.eot, self.add_bos = handle.special_tokens()
        self.fim_prefix, self.fim_suffix, self.fim_middle = handle.fim_tokens()
        self._pieces: list[bytes | None] = [None] * self.n_vocab  # special tokens shown
        self._all_pieces = False  # every entry of _pieces fetched
        self._special: list[bool | None] = [None] * self.n_vocab  # text hidden unless shown
        self._eog: dict[int, bool] = {}

    @property
    def handle(self) -> ModelHandle:
        """The native model (for the layers that call llama.cpp with this vocabulary)."""
        return self._handle

    @property
    def is_open(self) -> bool:
        return self._handle.is_open

    # text <-> tokens --------------------------------------------------------------------
    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = False
    ) -> list[int]:
        """Text to token ids.

        Args:
            text: the text.
            add_bos: prepend BOS; None follows the model's own setting.
            special: parse special-token text such as ``<|im_start|>`` into those tokens.

        Raises:
            TypeError: ``text`` is not a str.
            ValueError: it holds a lone surrogate (no UTF-8 text spells one).
        """
        if not isinstance(text, str):
            raise TypeError(f"text to tokenize must be a str, got {type(text).__name__}")
        check_bool("special", special)
        check_bool("add_bos", add_bos, none=True)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"the text holds the lone surrogate U+{ord(text[exc.start]):04X} at index "
                f"{exc.start} ({text[max(0, exc.start - 20) : exc.start + 1]!r}), which no "
                "UTF-8 text spells: a string decoded with errors='surrogateescape' holds one "
                "for each byte that was not UTF-8"
            ) from None
        tokens = self._handle.tokenize(data, False, special)
        wants_bos = self.add_bos if add_bos is None else add_bos
        if wants_bos and self.bos >= 0 and tokens[:1] != [self.bos]:
            tokens.insert(0, self.bos)
        return tokens

    @property
    def has_infill(self) -> bool:
        """Whether the model declares fill-in-the-middle markers (prefix, suffix, middle)."""
        return min(self.fim_prefix, self.fim_suffix, self.fim_middle) >= 0

    def infill(self, prefix: str, suffix: str) -> list[int]:
        """The prompt that asks for the text between ``prefix`` and ``suffix``: the model's
        markers around both, in prefix-suffix-middle order (as llama.cpp's server writes it);
        the generation that follows is the middle.

        Raises:
            ValueError: the model declares no fill-in-the-middle markers.
            TypeError: ``prefix`` or ``suffix`` is not a str.
        """
        if not self.has_infill:
            raise ValueError(
                "this model declares no fill-in-the-middle tokens (GGUF keys "
                "tokenizer.ggml.fim_pre_token_id, fim_suf_token_id, fim_mid_token_id): use a "
                "code model trained for infilling"
            )
        for name, text in (("prefix", prefix), ("suffix", suffix)):
            if not isinstance(text, str):
                raise TypeError(f"the infill {name} must be a str, got {type(text).__name__}")
        head = [self.bos] if self.add_bos and self.bos >= 0 else []
        return [
            *head,
            self.fim_prefix,
            *self.tokenize(prefix, add_bos=False),
            self.fim_suffix,
            *self.tokenize(suffix, add_bos=False),
            self.fim_middle,
        ]

    def detokenize(self, tokens: Iterable[int], *, special: bool = False) -> str:
        """Token ids to text (invalid UTF-8 becomes U+FFFD)."""
        check_bool("special", special)
        data = self._handle.detokenize(self.check_tokens(tokens), special)
        return data.decode("utf-8", "replace")

    def check_tokens(self, tokens: Iterable[int]) -> list[int]:
        """The tokens as a list, after checking each is a valid id (llama.cpp does not).

        Raises:
            ValueError: a token id is outside ``[0, n_vocab)``.
            TypeError: a token id is not an int.
        """
        if isinstance(tokens, str | bytes | bytearray) or not isinstance(tokens, Iterable):
            shown = repr(tokens)
            shown = f"{shown[:40]}..." if len(shown) > 40 else shown
            raise TypeError(f"token ids are a list of int, got {type(tokens).__name__} {shown}")
        tokens = list(tokens)
        try:
            out = [operator.index(t) for t in tokens if not isinstance(t, bool)]
        except TypeError:
            out = []
        if len(out) != len(tokens):
            raise TypeError(f"token ids must be ints, got {tokens[:8]!r}...") from None
        for tok in out:
            if not 0 <= tok < self.n_vocab:
                raise ValueError(f"token id {tok} is outside the vocabulary [0, {self.n_vocab})")
        return out

    # one token --------------------------------------------------------------------------
    def check_id(self, token: object) -> int:
        """``token`` as an int, checked to be an id of the vocabulary: llama.cpp aborts the
        process on an id out of range, and a negative one would index the caches from the end.

        Raises:
            TypeError: not an int (a bool included).
            ValueError: outside ``[0, n_vocab)``.
        """
        if type(token) is not int:
            if isinstance(token, bool) or not hasattr(token, "__index__"):
                raise TypeError(f"a token id is an int, got {token!r}")
            token = operator.index(token)
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {self.n_vocab})")
        return token

    def piece(self, token: int) -> bytes:
        """The bytes of one token as text shows it (control tokens: none); may be part of a
        UTF-8 character."""
        return b"" if self.is_special(token) else self.special_piece(token)

    def special_piece(self, token: int) -> bytes:
        """The bytes of one token with special tokens shown (what a grammar matches)."""
        token = self.check_id(token)
        piece = self._pieces[token]
        if piece is None:
            piece = self._pieces[token] = self._handle.token_to_piece(token)
        return piece

    def is_special(self, token: int) -> bool:
        """Whether the token's text is shown only where special tokens are (control tokens)."""
        token = self.check_id(token)
        flag = self._special[token]
        if flag is None:
            flag = self._special[token] = bool(self._handle.token_attr(token) & SPECIAL_ATTRS)
        return flag

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT and the like)."""
        token = self.check_id(token)
        flag = self._eog.get(token)
        if flag is None:
            flag = self._eog[token] = self._handle.is_eog(token)
        return flag

    # the whole vocabulary ---------------------------------------------------------------
    def all_pieces(self) -> list[bytes]:
        """Every token's :meth:`special_piece`, fetched in one pass."""
        if not self._all_pieces:
            self._pieces = list(self._handle.all_pieces())
            self._all_pieces = True
        return self._pieces  # type: ignore[return-value]

    @functools.cached_property
    def _tables(self) -> tuple[np.ndarray, frozenset[int], tuple[int, ...]]:
        attrs = self._handle.all_attrs()
        self._special = [bool(a & SPECIAL_ATTRS) for a in attrs]
        ends = tuple(t for t in dict.fromkeys((self.eos, self.eot)) if t >= 0)
        eog = set(ends)
        hidden = np.zeros(self.n_vocab, dtype=bool)
        for token in np.flatnonzero(np.array(self._special, dtype=bool)).tolist():
            if self.is_eog(token):
                eog.add(token)
            else:
                hidden[token] = True
        return hidden, frozenset(eog), ends

    @property
    def hidden(self) -> np.ndarray:
        """bool per token: control tokens that do not end generation (text never shows them;
        a grammar never allows them)."""
        return self._tables[0]

    @functools.cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The texts of the control tokens (end-of-generation ones too), longest first: what
        ``tokenize(special=True)`` reads as those tokens, and ``special=False`` as text."""
        pieces = self.all_pieces()
        special = np.flatnonzero(self.hidden).tolist() + sorted(self.eog_set)
        texts = {pieces[t].decode("utf-8", "replace") for t in special}
        return tuple(sorted((t for t in texts if t), key=len, reverse=True))

    @functools.cached_property
    def hidden_set(self) -> frozenset[int]:
        return frozenset(int(t) for t in np.flatnonzero(self.hidden))

    @functools.cached_property
    def visible_ids(self) -> np.ndarray:
        """int32 ids of every token that is not hidden."""
        return np.flatnonzero(~self.hidden).astype(np.int32)

    @property
    def end_tokens(self) -> tuple[int, ...]:
        """EOS and EOT (those that exist): the tokens a grammar allows where it is complete."""
        return self._tables[2]

    @property
    def eog_set(self) -> frozenset[int]:
        """The end tokens and every control token that ends generation."""
        return self._tables[1]

    @functools.cached_property
    def byte_tokens(self) -> dict[int, int]:
        """byte value -> a token whose piece is that one byte."""
        found: dict[int, int] = {}
        eog = self.eog_set
        for token in self.visible_ids.tolist():
            piece = self.special_piece(token)
            if len(piece) == 1 and token not in eog:
                found.setdefault(piece[0], token)
        return found

    def spell(self, data: bytes) -> list[int]:
        """Tokens whose pieces join to ``data``: its tokenization, else one token per byte.

        Raises:
            LookupError: neither spells it (the vocabulary lacks a single-byte token it needs).
        """
        with contextlib.suppress(UnicodeDecodeError):  # (part of a character: byte by byte)
            tokens = self.tokenize(data.decode("utf-8"), add_bos=False)
            if b"".join(self.special_piece(t) for t in tokens) == data:
                return tokens
        by_byte = self.byte_tokens
        missing = sorted({b for b in data if b not in by_byte})
        if missing:
            raise LookupError(f"the vocabulary has no tokens for bytes {bytes(missing)!r}")
        return [by_byte[b] for b in data]

    @functools.cached_property
    def _by_text(self) -> tuple[list[bytes], np.ndarray]:
        """The pieces of the tokens with text (not end-of-generation, not control), sorted,
        and their ids in that order: the tokens starting with a prefix are one range."""
        self._tables  # noqa: B018 -- fills the control-token flags in one pass
        pieces = self.all_pieces()
        keyed = sorted(
            (piece, tok)
            for tok, piece in enumerate(pieces)
            if piece and not self.is_special(tok) and not self.is_eog(tok)
        )
        return [piece for piece, _ in keyed], np.array([t for _, t in keyed], dtype=np.int64)

    def tokens_starting_with(self, prefix: bytes) -> np.ndarray:
        """Ids (ascending) of the tokens whose text starts with ``prefix``, itself included.

        End-of-generation tokens and tokens with no text are left out.
        """
        pieces, ids = self._by_text
        lo = bisect.bisect_left(pieces, prefix)
        # The range ends at the prefix with its last byte below 0xff raised (none: the end).
        head = prefix.rstrip(b"\xff")
        bound = head[:-1] + bytes([head[-1] + 1]) if head else None
        hi = len(pieces) if bound is None else bisect.bisect_left(pieces, bound)
        return np.sort(ids[lo:hi])

    def tokens_extending(self, prefix: bytes) -> np.ndarray:
        """Ids (ascending) of the tokens whose text starts with ``prefix`` or starts it (token
        healing).

        End-of-generation tokens and tokens with no text are left out.
        """
        pieces, ids = self._by_text
        found = [self.tokens_starting_with(prefix)]
        for end in range(1, len(prefix)):
            at = bisect.bisect_left(pieces, prefix[:end])
            while at < len(pieces) and pieces[at] == prefix[:end]:
                found.append(ids[at : at + 1])
                at += 1
        return np.unique(np.concatenate(found))


class HasVocab(Protocol):
    """Anything that carries a vocabulary (a :class:`~lcgen.Model`)."""

    @property
    def vocab(self) -> Vocab: ...


def vocab_of(source: Vocab | HasVocab) -> Vocab:
    """The vocabulary of ``source``: a :class:`Vocab`, or a model.

    Raises:
        TypeError: ``source`` is neither.
    """
    if isinstance(source, Vocab):
        return source
    vocab = getattr(source, "vocab", None)
    if not isinstance(vocab, Vocab):
        raise TypeError(f"expected an lcgen Model or Vocab, got {type(source).__name__}")
    return vocab
