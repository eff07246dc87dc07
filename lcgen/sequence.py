"""A live sequence: a token list that owns one KV slot, and the loop that drives sequences.

The last token of a sequence is kept pending (not yet decoded) until the next step needs its
logits, so every step decodes exactly one batch and no logits have to be kept between calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Unpack

from lcgen.context import Context, DecodeRequest
from lcgen.errors import ContextFullError, SequenceClosedError
from lcgen.generator import Chunk, GenerateOptions, Generator

if TYPE_CHECKING:
    from lcgen.model import Model


class Sequence:
    """Tokens of one live generation; owns a KV slot until closed.

    Created by :meth:`lcgen.Model.sequence`. Use as a context manager, or call :meth:`close`,
    to give the slot back (it is also given back when the object is garbage-collected).
    """

    def __init__(self, model: Model, tokens: Seq[int] = ()) -> None:
        self.model = model
        self._ctx: Context = model.context
        self._slot = self._ctx.acquire_slot()
        self._tokens: list[int] = list(model.check_tokens(tokens))
        self._n_decoded = 0
        self._finalizer = weakref.finalize(self, self._ctx.release_slot, self._slot)

    # state -----------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """A copy of all tokens: prompt, appended text and generated tokens."""
        return list(self._tokens)

    @property
    def text(self) -> str:
        """The detokenized text of all tokens (special tokens not rendered)."""
        return self.model.detokenize(self._tokens)

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    @property
    def is_closed(self) -> bool:
        return not self._finalizer.alive

    def __len__(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:
        state = "closed" if self.is_closed else f"slot {self._slot}"
        return f"<lcgen.Sequence {len(self._tokens)} tokens, {state}>"

    # editing ---------------------------------------------------------------------------
    def append(self, text: str) -> list[int]:
        """Append text (tokenized without BOS); it is decoded by the next generation step.

        Returns:
            The tokens appended.
        """
        tokens = self.model.tokenize(text, add_bos=False)
        self.append_tokens(tokens)
        return tokens

    def append_tokens(self, tokens: Seq[int]) -> None:
        """Append token ids (checked against the vocabulary)."""
        self._check_open()
        self._tokens.extend(self.model.check_tokens(tokens))

    def _keep_prefix(self, n_keep: int) -> None:
        """Cut the sequence to its first ``n_keep`` tokens, dropping their KV cells."""
        n_keep = max(0, min(n_keep, len(self._tokens)))
        # The last token stays pending, so the next step has logits to sample from.
        kv_keep = min(self._n_decoded, max(n_keep - 1, 0))
        if kv_keep < self._n_decoded and not self._ctx.truncate(self._slot, kv_keep):
            # The memory cannot drop a partial range (sliding window, recurrent): start over.
            self._ctx.clear_slot(self._slot)
            kv_keep = 0
        self._n_decoded = kv_keep
        del self._tokens[n_keep:]

    def reuse(self, tokens: Seq[int]) -> int:
        """Make the sequence equal ``tokens``, keeping the KV cache of the common prefix.

        Returns:
            How many tokens were kept (need no decoding).
        """
        self._check_open()
        tokens = self.model.check_tokens(tokens)
        common = 0
        for a, b in zip(self._tokens, tokens, strict=False):
            if a != b:
                break
            common += 1
        self._keep_prefix(common)
        self._tokens.extend(tokens[common:])
        return common

    # generation ------------------------------------------------------------------------
    def stream(self, **options: Unpack[GenerateOptions]) -> Iterator[Chunk]:
        """Generate from the end of the sequence, yielding a :class:`Chunk` per token.

        Args:
            **options: see :class:`lcgen.Generator` (max_tokens, stop, temperature, seed, ...).

        Yields:
            One chunk per generated token; the last has ``finish_reason`` set.

        Raises:
            ContextFullError: the sequence plus ``max_tokens`` would not fit the context.
            SequenceClosedError: the sequence was closed.
        """
        gen = self.generator(**options)
        while not gen.is_done:
            yield step([(self, gen)])[0]

    def generate(self, **options: Unpack[GenerateOptions]) -> str:
        """Generate from the end of the sequence and return the new text (see :meth:`stream`)."""
        return "".join(chunk.text for chunk in self.stream(**options))

    def generator(self, **options: Unpack[GenerateOptions]) -> Generator:
        """A :class:`Generator` set up to continue this sequence (checks the context size)."""
        self._check_open()
        if not self._tokens:
            raise ValueError("the sequence is empty: append a prompt before generating")
        gen = Generator(self.model, history=self._tokens, **options)
        needed = len(self._tokens) + gen.max_tokens
        if needed > self._ctx.n_ctx:
            raise ContextFullError(
                f"{len(self._tokens)} tokens in the sequence + max_tokens={gen.max_tokens} = "
                f"{needed} tokens exceeds the context of {self._ctx.n_ctx} tokens: shorten the "
                "prompt, lower max_tokens or load the model with a larger n_ctx"
            )
        return gen

    def _request(self) -> DecodeRequest:
        self._check_open()
        return DecodeRequest(self._slot, self._tokens[self._n_decoded :], self._n_decoded)

    def _check_open(self) -> None:
        if self.is_closed:
            raise SequenceClosedError(
                "the sequence is closed; start a new one with model.sequence()"
            )

    # lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the KV slot. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def step(pairs: Seq[tuple[Sequence, Generator]]) -> list[Chunk]:
    """Advance every (sequence, generator) pair by one token, decoding them in one batch.

    Each sequence's pending tokens (a prompt, appended text, or the last sampled token) are
    decoded together; each generator then samples from its sequence's logits.

    Returns:
        One chunk per pair, in order.
    """
    seqs = [seq for seq, _ in pairs]
    rows = seqs[0]._ctx.decode([seq._request() for seq in seqs])
    chunks = []
    for (seq, gen), row in zip(pairs, rows, strict=True):
        assert row is not None
        seq._n_decoded = len(seq._tokens)
        chunk = gen.step(row)
        seq._tokens.extend(chunk.tokens)
        chunks.append(chunk)
    return chunks
