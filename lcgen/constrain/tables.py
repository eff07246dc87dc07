"""Per-vocabulary tables and text checks behind :class:`lcgen.GrammarState`.

llama.cpp's grammar sampler checks tokens by their text. Two things it does not do are done
here: keep the accepted text valid UTF-8 (it lets overlong forms and surrogates through), and
narrow the full-vocabulary check to the tokens that can still be allowed (it checks every
token it is given, in turn: milliseconds for a large vocabulary).
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass

import numpy as np

from lcgen.vocab import Vocab

LITERALS_AND_COMMENTS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')


@functools.lru_cache(maxsize=256)
def traits(gbnf: str) -> tuple[bool, bool]:
    """(names tokens with ``<...>``, has a negated class excluding a non-ASCII character):
    what decides how far the slow path may trust single-byte tokens to stand for others."""
    uses_tokens = "<" in LITERALS_AND_COMMENTS.sub(" ", gbnf)
    negates_non_ascii = False
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|\[\^((?:[^\]\\]|\\.)*)\]', gbnf):
        body = m.group(1)
        if body and (not body.isascii() or re.search(r"\\(x[89a-fA-F]|u|U)", body)):
            negates_non_ascii = True
    return uses_tokens, negates_non_ascii


def utf8_tail(data: bytes) -> int | None:
    """How many bytes at the end of ``data`` start an unfinished UTF-8 character (0-3), or
    None when ``data`` is not a prefix of valid UTF-8 (RFC 3629: no overlong forms, no
    surrogates, nothing above U+10FFFF)."""
    i, n = 0, len(data)
    while i < n:
        lead = data[i]
        if lead < 0x80:
            i += 1
            continue
        if not 0xC2 <= lead <= 0xF4:
            return None
        need = 1 if lead < 0xE0 else 2 if lead < 0xF0 else 3
        low, high = _SECOND_BYTE.get(lead, (0x80, 0xBF))
        for k in range(1, need + 1):
            if i + k >= n:
                return n - i
            byte = data[i + k]
            if not (low <= byte <= high if k == 1 else 0x80 <= byte <= 0xBF):
                return None
        i += need + 1
    return 0


_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


@dataclass(frozen=True)
class Tables:
    """Per-vocabulary tables for the slow path, built once from every token's piece."""

    boundary_ok: np.ndarray  # bool: the piece may follow a character boundary
    first: np.ndarray  # int: the piece's first byte (256: none, or an EOG token)
    second: np.ndarray  # int: the piece's second byte (256: none)
    byte_token: dict[int, int]  # byte -> the token that is just that byte (ASCII, lead bytes)
    common_first: tuple[int, ...]  # ASCII bytes that start an eighth of the vocabulary
    eog: np.ndarray  # bool: end-of-generation tokens
    visible: np.ndarray  # int32: tokens that are not hidden control tokens
    # Tokens that tell which bytes may come next: each byte's one-byte token, or, for a byte
    # without one, every token it starts (the grammar allows a byte where one of them fits).
    probe: np.ndarray  # int32
    probe_first: np.ndarray  # the first byte of each


_TABLES: weakref.WeakKeyDictionary[Vocab, Tables] = weakref.WeakKeyDictionary()


def tables(vocab: Vocab) -> Tables:
    """The tables of ``vocab``, built on first use (a pass over every token's piece)."""
    cached = _TABLES.get(vocab)
    if cached is not None:
        return cached
    pieces = vocab.all_pieces()
    n = vocab.n_vocab
    boundary_ok = np.ones(n, dtype=bool)
    first, second = np.full(n, 256, dtype=np.int16), np.full(n, 256, dtype=np.int16)
    for token, piece in enumerate(pieces):
        if piece.isascii():
            boundary_ok[token] = b"\x00" not in piece
        else:
            try:
                piece.decode("utf-8")
                boundary_ok[token] = b"\x00" not in piece
            except UnicodeDecodeError:
                boundary_ok[token] = b"\x00" not in piece and utf8_tail(piece) is not None
        if piece and token not in vocab.eog_set:
            first[token] = piece[0]
            if len(piece) > 1:
                second[token] = piece[1]
    byte_token = {b: t for b, t in vocab.byte_tokens.items() if 0 < b < 0x80 or b >= 0xC2}
    counts = np.bincount(first, minlength=257)
    common = tuple(int(b) for b in np.flatnonzero(counts[:128] > n // 8) if b in byte_token)
    eog = np.zeros(n, dtype=bool)
    eog[list(vocab.eog_set)] = True
    probe = set(byte_token.values())
    visible = np.zeros(n, dtype=bool)
    visible[vocab.visible_ids] = True
    for byte in [*range(1, 0x80), *range(0xC2, 0xF5)]:
        if byte not in byte_token:
            probe.update(np.flatnonzero((first == byte) & visible).tolist())
    probe_ids = np.array(sorted(probe), dtype=np.int32)
    built = Tables(
        boundary_ok,
        first,
        second,
        byte_token,
        common,
        eog,
        vocab.visible_ids,
        probe_ids,
        first[probe_ids].astype(np.int32),
    )
    _TABLES[vocab] = built
    return built
