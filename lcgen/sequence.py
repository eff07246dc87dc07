"""A live sequence: tokens that own one KV slot, reversible at every position.

The last token of a sequence is kept pending (not yet decoded) until the next step needs its
logits, so every step decodes exactly one batch and no logits have to be kept between calls.

Reversibility: each token carries a stamp (a process-wide counter value), so a checkpoint is
O(1) — a position, the stamp of the history up to it, and the RNG state — and is valid exactly
while the sequence still holds that history. The RNG state before every sampling draw is logged
by position, so ``rewind(n)`` restores the sampler as exactly as ``rewind(checkpoint)`` does.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import weakref
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, overload

import numpy as np

from lcgen import checkpoint as ckpt
from lcgen.backtrack import BACKTRACK_OPTIONS, Backtracker
from lcgen.checkpoint import Checkpoint, RngState, SequenceStats
from lcgen.context import Context, DecodeRequest
from lcgen.errors import ContextFullError, RewindError, SequenceClosedError, StateFileError
from lcgen.generator import (
    Chunk,
    GenerateOptions,
    GenerationStats,
    Generator,
    SchemaLike,
    Text,
    parse_structured,
)
from lcgen.sampling import new_rng

if TYPE_CHECKING:
    from lcgen.model import Model

_stamps = itertools.count(1)
_M = TypeVar("_M")


class Sequence:
    """Tokens of one live generation; owns a KV slot until closed.

    Created by :meth:`lcgen.Model.sequence`. Use as a context manager, or call :meth:`close`,
    to give the slot back (it is also given back when the object is garbage-collected).

    Args:
        model: the model.
        tokens: the initial tokens (the prompt).
        seed: seeds the sequence's sampler RNG (None: a fresh random seed). A ``seed`` passed
            to a generation call reseeds it.
    """

    def __init__(self, model: Model, tokens: Seq[int] = (), *, seed: int | None = None) -> None:
        self.model = model
        self._ctx: Context = model.context
        self._tokens: list[int] = list(model.check_tokens(tokens))
        self._slot = self._ctx.acquire_slot()
        self._finalizer = weakref.finalize(self, self._ctx.release_slot, self._slot)
        self._n_decoded = 0
        self._stamps = [next(_stamps) for _ in range(len(self._tokens) + 1)]
        self._uid = self._stamps[0]
        self._rng = new_rng(seed)
        self._rng_log: dict[int, RngState] = {}  # position -> RNG state before anything there
        # The prompt token last removed by token healing: (position, token, stamps around it).
        self._healed: tuple[int, int, int, int] | None = None
        self.stats = SequenceStats()

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
        self._extend(self.model.check_tokens(tokens))

    def _extend(self, tokens: Seq[int]) -> None:
        """Append checked tokens, each with a new stamp."""
        self._tokens.extend(tokens)
        self._stamps.extend(next(_stamps) for _ in tokens)

    def _keep_prefix(self, n_keep: int) -> None:
        """Cut the sequence to its first ``n_keep`` tokens, dropping their KV cells."""
        # The last token stays pending, so the next step has logits to sample from.
        kv_keep = min(self._n_decoded, max(n_keep - 1, 0))
        if kv_keep < self._n_decoded and not self._ctx.truncate(self._slot, kv_keep):
            # The memory cannot keep a partial range (sliding window, recurrent): start over.
            self._ctx.clear_slot(self._slot)
            self.stats.fallbacks += 1
            self.stats.tokens_redecoded += kv_keep
            kv_keep = 0
        self._n_decoded = kv_keep
        del self._tokens[n_keep:]
        del self._stamps[n_keep + 1 :]
        for pos in [pos for pos in self._rng_log if pos >= n_keep]:
            del self._rng_log[pos]

    def reuse(self, tokens: Seq[int]) -> int:
        """Make the sequence equal ``tokens``, keeping the KV cache of the common prefix.

        Returns:
            How many tokens were kept (need no decoding).
        """
        self._check_open()
        tokens = self.model.check_tokens(tokens)
        common = common_prefix(self._tokens, tokens)
        self._keep_prefix(common)
        self.append_tokens(tokens[common:])
        return common

    # checkpoints -----------------------------------------------------------------------
    def checkpoint(self, generator: Generator | None = None) -> Checkpoint:
        """The sequence's state now, as a value (no KV data is copied).

        Args:
            generator: the generator driving this sequence, when taken in the middle of a
                generation: its state (held text, grammar, healing) goes into the checkpoint.
        """
        self._check_open()
        cp = self._checkpoint_at(len(self._tokens))
        return cp if generator is None else dataclasses.replace(cp, generation=generator.state)

    def _checkpoint_at(self, n_tokens: int) -> Checkpoint:
        if n_tokens == len(self._tokens):  # nothing is logged past the end
            rng_state = self._rng_log.get(n_tokens) or self._rng.bit_generator.state
            return Checkpoint(n_tokens, self._stamps[n_tokens], self._uid, rng_state)
        logged = list(self._rng_log)  # positions only grow between prunes: already sorted
        at = bisect.bisect_left(logged, n_tokens)
        rng_state = self._rng_log[logged[at]] if at < len(logged) else self._rng.bit_generator.state
        return Checkpoint(n_tokens, self._stamps[n_tokens], self._uid, rng_state)

    def rewind(self, target: Checkpoint | int, generator: Generator | None = None) -> None:
        """Go back to a checkpoint, or by ``target`` tokens; then continue as if the dropped
        tokens had never been generated (KV cells, sampler RNG and tokens restored).

        Args:
            target: a checkpoint of this sequence (or of its parent, within their shared
                history), or a number of tokens.
            generator: the generator driving this sequence; it is restored too, from a
                checkpoint taken with it.

        Raises:
            RewindError: the target is not reachable: past the start, a checkpoint of another
                sequence, one beyond the current position after an earlier rewind, one whose
                history was since replaced, or the sequence is closed.
            ValueError: a generator was given but the checkpoint holds no generator state.
        """
        if self.is_closed:
            raise RewindError("cannot rewind a closed sequence")
        if generator is not None and (isinstance(target, int) or target.generation is None):
            raise ValueError(
                "to restore a generator, rewind to a checkpoint taken with it: "
                "seq.checkpoint(generator)"
            )
        if isinstance(target, int):
            if not 0 <= target <= len(self._tokens):
                raise RewindError(
                    f"cannot rewind {target} tokens: the sequence has {len(self._tokens)} tokens"
                )
            target = self._checkpoint_at(len(self._tokens) - target)
        if not self._unheal(target):
            self._check_reachable(target)
            self._keep_prefix(target.n_tokens)
        self._rng.bit_generator.state = target.rng_state
        if generator is not None and target.generation is not None:
            generator.restore(target.generation)
        self.stats.rewinds += 1

    def _unheal(self, cp: Checkpoint) -> bool:
        """Rewind to a checkpoint taken before token healing removed a prompt token: put the
        token back. Returns False when ``cp`` is not such a checkpoint."""
        if self._healed is None:
            return False
        pos, token, before, after = self._healed
        if cp.n_tokens != pos + 1 or cp.stamp != after:
            return False
        if pos > len(self._tokens) or self._stamps[pos] != before:
            return False
        self._keep_prefix(pos)
        self._tokens.append(token)
        self._stamps.append(after)
        return True

    def _check_reachable(self, cp: Checkpoint) -> None:
        n = len(self._tokens)
        if cp.n_tokens <= n and self._stamps[cp.n_tokens] == cp.stamp:
            return
        if cp.seq_uid != self._uid and cp.stamp not in self._stamps:
            raise RewindError(
                f"the checkpoint (position {cp.n_tokens}) belongs to another sequence "
                f"(#{cp.seq_uid}; this is #{self._uid}) and is not part of this one's history"
            )
        if cp.n_tokens > n:
            raise RewindError(
                f"the checkpoint at position {cp.n_tokens} lies beyond the current position {n}: "
                "the sequence was rewound past it"
            )
        raise RewindError(
            f"the sequence's history up to position {cp.n_tokens} has changed since the "
            f"checkpoint was taken (it was rewound and regenerated); current position {n}"
        )

    def fork(self, *, seed: int | None = None) -> Sequence:
        """A new sequence with the same history, sharing its KV cells (none are copied).

        Args:
            seed: reseed the fork's sampler RNG; None continues the same RNG state, so the
                fork samples exactly what this sequence would.

        Raises:
            SlotsExhaustedError: no free slot for the fork.
        """
        self._check_open()
        child = Sequence(self.model)
        if self._n_decoded:
            self._ctx.copy_slot(self._slot, child._slot, self._n_decoded)
        child._tokens = list(self._tokens)
        child._stamps = list(self._stamps)
        child._n_decoded = self._n_decoded
        child._rng.bit_generator.state = self._rng.bit_generator.state
        child._rng_log = dict(self._rng_log)
        if seed is not None:
            child._reseed(seed)
        return child

    # save / load -----------------------------------------------------------------------
    def to_bytes(self) -> bytearray:
        """The sequence as bytes: KV state, tokens, sampler state and the model's fingerprint."""
        self._check_open()
        header: dict[str, Any] = {
            "model": self.model.fingerprint,
            "tokens": self._tokens,
            "n_decoded": self._n_decoded,
            "rng": self._rng.bit_generator.state,
            "rng_log": [[pos, state] for pos, state in sorted(self._rng_log.items())],
        }
        size = self._ctx.seq_state_size(self._slot)

        def write_kv(out: bytearray, offset: int, size: int) -> int:
            return self._ctx.seq_state_into(self._slot, out, offset, size)

        return ckpt.encode(header, size, write_kv)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_bytes` to ``path`` atomically (a crash never leaves a broken file)."""
        ckpt.write_atomic(path, self.to_bytes())

    @classmethod
    def from_bytes(cls, model: Model, data: bytes | bytearray | memoryview) -> Sequence:
        """Rebuild a sequence saved with :meth:`to_bytes`, in a new slot of ``model``.

        Raises:
            StateFileError: corrupted, truncated, another format version, or another model.
        """
        header, kv = ckpt.decode(data)
        if header["model"] != model.fingerprint:
            raise StateFileError(
                f"the sequence was saved with another model (fingerprint {header['model'][:12]}, "
                f"this model is {model.fingerprint[:12]}: {model.path.name})"
            )
        if len(header["tokens"]) > model.n_ctx:
            raise StateFileError(
                f"the saved sequence has {len(header['tokens'])} tokens, more than the context "
                f"of {model.n_ctx}: load the model with a larger n_ctx"
            )
        seq = cls(model, header["tokens"])
        try:
            if header["n_decoded"]:
                seq._ctx.set_seq_state(seq._slot, kv)
        except BaseException:
            seq.close()
            raise
        seq._n_decoded = header["n_decoded"]
        seq._rng.bit_generator.state = header["rng"]
        seq._rng_log = {pos: state for pos, state in header["rng_log"]}
        return seq

    @classmethod
    def load(cls, model: Model, path: str | os.PathLike[str]) -> Sequence:
        """Load a sequence written by :meth:`save` (see :meth:`from_bytes`)."""
        return cls.from_bytes(model, ckpt.read_file(path))

    # generation ------------------------------------------------------------------------
    def stream(
        self, *, schema: SchemaLike | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[Chunk]:
        """Generate from the end of the sequence, yielding a :class:`Chunk` per token.

        Args:
            schema: constrain the output to JSON valid for this JSON Schema / pydantic model.
            **options: see :class:`lcgen.Generator` (max_tokens, stop, temperature, seed,
                grammar, choice, regex, ...). A ``seed`` reseeds the sequence's RNG; without
                one, sampling continues it.

        Yields:
            One chunk per generated token; the last has ``finish_reason`` set.

        Raises:
            ContextFullError: the sequence plus ``max_tokens`` would not fit the context.
            SequenceClosedError: the sequence was closed.
            GrammarError: the constraint cannot be built or enforced.
        """
        run = self.run(schema=schema, **options)
        while not run.is_done:
            yield step([(self, run)])[0]

    @overload
    def generate(self, *, schema: type[_M], **options: Unpack[GenerateOptions]) -> _M: ...
    @overload
    def generate(self, *, schema: Mapping[str, Any], **options: Unpack[GenerateOptions]) -> Any: ...
    @overload
    def generate(self, **options: Unpack[GenerateOptions]) -> Text: ...
    @overload
    def generate(self, *, schema: SchemaLike | None, **options: Unpack[GenerateOptions]) -> Any: ...
    def generate(
        self, *, schema: SchemaLike | None = None, **options: Unpack[GenerateOptions]
    ) -> Any:
        """Generate from the end of the sequence and return the new text (see :meth:`stream`);
        with ``schema``, the parsed value (a dict, or an instance of the pydantic model).

        Raises:
            IncompleteOutputError: with ``schema``, generation stopped before the value was
                complete (the partial text is on the exception).
        """
        text = Text.of(self.stream(schema=schema, **options))
        return text if schema is None else parse_structured(text, schema)

    def run(
        self, *, schema: SchemaLike | None = None, **options: Unpack[GenerateOptions]
    ) -> Run | Backtracker:
        """One generation on this sequence, to advance with :func:`step` (``stream`` is this
        in a loop): a plain one, or a :class:`~lcgen.backtrack.Backtracker` when hooks,
        validators or banned phrases are given."""
        settings: dict[str, Any] = dict(options)
        backtrack = {key: settings.pop(key) for key in BACKTRACK_OPTIONS & settings.keys()}
        gen = self.generator(schema=schema, **settings)
        if backtrack.get("hooks") or backtrack.get("validators") or backtrack.get("banned"):
            return Backtracker(self, gen, **backtrack)
        return Run(self, gen)

    def generator(
        self, *, schema: SchemaLike | None = None, **options: Unpack[GenerateOptions]
    ) -> Generator:
        """A :class:`Generator` set up to continue this sequence (checks the context size).

        Raises:
            ValueError: an option that needs the sequence's rewinds (hooks, validators,
                banned, ...) was given: use :meth:`run`, :meth:`stream` or :meth:`generate`.
        """
        self._check_open()
        if BACKTRACK_OPTIONS & options.keys():
            raise ValueError(
                f"{sorted(BACKTRACK_OPTIONS & options.keys())} need the sequence to rewind: "
                "use seq.run(), seq.stream() or seq.generate()"
            )
        if not self._tokens:
            raise ValueError("the sequence is empty: append a prompt before generating")
        settings: dict[str, Any] = dict(options)
        heal = self._heal_last_token() if settings.pop("token_healing", False) else b""
        gen = Generator(
            self.model, history=self._tokens, rng=self._rng, heal=heal, schema=schema, **settings
        )
        needed = len(self._tokens) + gen.max_tokens
        if needed > self._ctx.n_ctx:
            raise ContextFullError(
                f"{len(self._tokens)} tokens in the sequence + max_tokens={gen.max_tokens} = "
                f"{needed} tokens exceeds the context of {self._ctx.n_ctx} tokens: shorten the "
                "prompt, lower max_tokens or load the model with a larger n_ctx"
            )
        if gen.sampler.seed is not None:
            self._reseed(gen.sampler.seed)
        return gen

    def _heal_last_token(self) -> bytes:
        """Drop the last token and return its text, for the generator to re-create (healing)."""
        n, token = len(self._tokens), self._tokens[-1]
        piece = self.model.token_piece(token)
        if n < 2 or not piece:
            return b""
        self._healed = (n - 1, token, self._stamps[n - 1], self._stamps[n])
        self._keep_prefix(n - 1)
        return piece

    def _reseed(self, seed: int) -> None:
        self._rng_log.setdefault(len(self._tokens), self._rng.bit_generator.state)
        self._rng.bit_generator.state = new_rng(seed).bit_generator.state

    def prefill(self) -> int:
        """Decode every pending token but the last now (the last stays pending, as always), so
        forks taken next share the cells instead of each decoding the prompt.

        Returns:
            How many tokens were decoded.
        """
        self._check_open()
        pending = self._tokens[self._n_decoded : -1]
        if pending:
            self._ctx.decode([DecodeRequest(self._slot, pending, self._n_decoded, False)])
            self._n_decoded += len(pending)
            self.stats.tokens_decoded += len(pending)
        return len(pending)

    def _log_rng(self, gen: Generator, temperature: float | None = None) -> None:
        """Log the RNG state before the first draw at this position (rewinds restore it)."""
        if not gen.sampler.is_greedy or temperature:
            self._rng_log.setdefault(len(self._tokens), self._rng.bit_generator.state)

    def _sample(self, gen: Generator, row: np.ndarray) -> Chunk:
        """Sample the next token from ``row`` with ``gen`` and append it."""
        self._log_rng(gen)
        chunk = gen.step(row)
        self._extend(chunk.tokens)  # a generator only emits tokens it checked
        return chunk

    def _cost_mark(self) -> tuple[int, int]:
        """The decode counters now, for :meth:`_cost_since` at the end of a generation."""
        return self.stats.tokens_decoded, self._n_decoded

    def _cost_since(
        self, mark: tuple[int, int], n_tokens: int, rewinds: int = 0, resamples: int = 0
    ) -> GenerationStats:
        """What a generation of ``n_tokens`` kept tokens cost since ``mark``: every token
        decoded, and those beyond the growth of the cache (decoded again after rewinds)."""
        decoded = self.stats.tokens_decoded - mark[0]
        kept = self._n_decoded - mark[1]
        return GenerationStats(n_tokens, decoded, decoded - kept, rewinds, resamples)

    def _request(self) -> DecodeRequest:
        self._check_open()
        return DecodeRequest(self._slot, self._tokens[self._n_decoded :], self._n_decoded)

    def _accept(self, chunk: Chunk) -> None:
        self._n_decoded = len(self._tokens)
        self._extend(chunk.tokens)  # a generator only emits tokens it checked

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


class Run:
    """One plain generation on a sequence (see :meth:`Sequence.run`): its generator, and the
    cost put on the last chunk."""

    def __init__(self, seq: Sequence, gen: Generator) -> None:
        self.seq, self.gen = seq, gen
        self._start = seq._cost_mark()

    @property
    def is_done(self) -> bool:
        return self.gen.is_done

    def advance(self, row: np.ndarray) -> Chunk:
        chunk = self.seq._sample(self.gen, row)
        if not self.gen.is_done:
            return chunk
        stats = self.seq._cost_since(self._start, len(self.gen.tokens))
        return dataclasses.replace(chunk, stats=stats)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def decode(seqs: Seq[Sequence]) -> list[np.ndarray]:
    """Decode every sequence's pending tokens in one batch (none is sampled).

    Returns:
        The logits after each sequence's last token (views into llama.cpp's buffer when there
        is one sequence: valid until the next decode).
    """
    requests = [seq._request() for seq in seqs]
    rows = seqs[0]._ctx.decode(requests)
    out = []
    for seq, request, row in zip(seqs, requests, rows, strict=True):
        assert row is not None
        seq.stats.tokens_decoded += len(request.tokens)
        seq._n_decoded = len(seq._tokens)
        out.append(row)
    return out


def step(pairs: Seq[tuple[Sequence, Generator | Run | Backtracker]]) -> list[Chunk]:
    """Advance every sequence by one token, decoding them all in one batch.

    Each sequence's pending tokens (a prompt, appended text, or the last sampled token) are
    decoded together; each generation (a :class:`Generator`, or a run from
    :meth:`Sequence.run`) then samples from its sequence's logits.

    Returns:
        One chunk per pair, in order (a backtracking run's chunk holds the text that became
        final, possibly none).
    """
    rows = decode([seq for seq, _ in pairs])
    chunks = []
    for (seq, gen), row in zip(pairs, rows, strict=True):
        try:
            chunks.append(seq._sample(gen, row) if isinstance(gen, Generator) else gen.advance(row))
        except BaseException:
            # Sampling failed (a hook raised, an interrupt): keep the last token pending, as
            # every step expects, by dropping its cell; the next step decodes it again.
            if not seq.is_closed and seq._n_decoded == len(seq._tokens):
                seq._keep_prefix(len(seq._tokens))
            raise
    return chunks
