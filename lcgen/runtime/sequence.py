"""``Sequence``: a live sequence — its tokens own one KV slot; it generates, forks, saves and
loads, and is reversible at every position (see :mod:`lcgen.runtime.tokens`)."""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar, Unpack, overload

import numpy as np

from lcgen.decoding import Chunk, GenerateOptions, Generator, Plan, Text, make_plan
from lcgen.decoding.results import SchemaLike, check_parsed, parse_structured
from lcgen.decoding.sampling import check_seed
from lcgen.decoding.speculation import Drafter
from lcgen.errors import ContextFullError, RewindError, StateFileError
from lcgen.runtime import statefile
from lcgen.runtime.backtrack import Backtracker
from lcgen.runtime.checkpoint import RngState
from lcgen.runtime.context import check_fits
from lcgen.runtime.drafts import drafter_for
from lcgen.runtime.run import PlainRun
from lcgen.runtime.tokens import ModelLike, TokenSequence, check_model

_M = TypeVar("_M")


_LOAD_INTO = (
    "Sequence.load/from_bytes(model, ...) expects the lcgen.Model to load into as its first "
    "argument"
)


class Sequence(TokenSequence):
    """Tokens of one live generation; owns a KV slot until closed.

    Created by :meth:`lcgen.Model.sequence`. Use as a context manager, or call :meth:`close`,
    to give the slot back (it is also given back when the object is garbage-collected).

    Args:
        model: the model.
        tokens: the initial tokens (the prompt).
        seed: seeds the sequence's sampler RNG (None: a fresh random seed). A ``seed`` passed
            to a generation call reseeds it.

    Raises:
        SlotsExhaustedError: every slot is held by a live sequence.
    """

    # Drafters of runs on this sequence (weakly: a dropped run's goes with it), closed with it
    # so that a draft model's slot is not held by a sequence nobody generates on.
    _drafters: weakref.WeakSet[Drafter] | None = None

    # forks -----------------------------------------------------------------------------
    def fork(self, *, seed: int | None = None) -> Sequence:
        """A new sequence with the same history, sharing its KV cells (none are copied).

        Args:
            seed: reseed the fork's sampler RNG; None continues the same RNG state, so the
                fork samples exactly what this sequence would.

        Raises:
            SlotsExhaustedError: no free slot for the fork.
            ValueError: ``seed`` is not an int >= 0 or None.
        """
        self._check_open()
        check_seed(seed)  # before a slot is taken
        child = Sequence.__new__(Sequence)
        try:  # (as in TokenSequence.__init__)
            entry = self.model.cache.fork(self._entry)
            child._adopt(self.model, entry, self._n_decoded, None, list(self._stamps))
        except BaseException:
            self.model.cache.abandon_opened()
            raise
        child._rng.bit_generator.state = self._rng.bit_generator.state
        child._rng_log = dict(self._rng_log)
        if seed is not None:
            child.reseed(seed)
        return child

    def prefill(self) -> int:
        """Decode the pending tokens now, keeping the logits after the last one in the store,
        so that forks taken next, and sequences opened on these tokens, share the cells and
        sample their first token from those logits instead of each decoding the end again.
        Where only the last token is pending, nothing is decoded: the next step decodes it
        in one batch with the other sequences'.

        Returns:
            How many tokens were decoded.
        """
        self._check_open()
        check_fits(len(self._tokens), self._ctx.n_ctx)
        if len(self._tokens) - self._n_decoded < 2:
            return 0
        self._draft = []  # (a guess at the next tokens: the next step may make another)
        request = self.pending_request()
        try:
            (row,) = self._ctx.decode([request])
        except BaseException:
            self.resync()
            raise
        assert row is not None
        self.mark_decoded(request)
        self.keep_logits(row)
        return len(request.tokens)

    # save / load -----------------------------------------------------------------------
    def to_bytes(self) -> bytearray:
        """The sequence as bytes: KV state, tokens, sampler state and the model's fingerprint."""
        self._check_open()
        # No decode runs meanwhile; one another thread made but has not counted yet shows as
        # cells past the decoded tokens (the file would not load back): refused.
        with self._ctx.lock:
            tokens = self._whole_tokens()
            # Every token decoded: with the logits after them kept, those are saved too (the
            # sequence stays as it is); else the last token's cell goes, kept pending.
            kept = self.kept_logits() if len(tokens) == len(self._tokens) else None
            if kept is None and 0 < self._n_decoded == len(self._tokens):
                self._trim_kv(self._n_decoded - 1)
            n_decoded = self._n_decoded
            held = self._ctx.ledger.held(self._slot)
            if held != n_decoded or not n_decoded < max(1, len(tokens)) + (kept is not None):
                raise RewindError(
                    "the sequence changed while it was saved: drive a sequence (saving it too) "
                    "from one thread at a time"
                )
            header: dict[str, Any] = {
                "model": self.model.fingerprint,
                "kv": list(self._ctx.kv_types),
                "tokens": tokens,
                "n_decoded": n_decoded,
                "rng": self._rng.bit_generator.state,
                "rng_log": [[pos, state] for pos, state in sorted(self._rng_log.items())],
            }
            row = b"" if kept is None else statefile.logits_bytes(kept)
            if row:
                header["logits"] = True  # a row of them after the KV state
            size = self._ctx.seq_state_size(self._slot)

            def write_kv(out: bytearray, offset: int, size: int) -> int:
                n = self._ctx.seq_state_into(self._slot, out, offset, size - len(row))
                out[offset + n : offset + n + len(row)] = row
                return n + len(row)

            return statefile.encode(header, size + len(row), write_kv)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_bytes` to ``path`` atomically (a crash never leaves a broken file).

        Raises:
            StateFileError: ``path`` cannot be written (a directory, a missing folder...).
        """
        statefile.write_atomic(path, self.to_bytes())

    @classmethod
    def from_bytes(cls, model: ModelLike, data: bytes | bytearray | memoryview) -> Sequence:
        """Rebuild a sequence saved with :meth:`to_bytes`, in a new slot of ``model``.

        Raises:
            TypeError: ``model`` is not a model (an :class:`lcgen.Model`).
            StateFileError: corrupted, truncated, another format version, or another model.
        """
        check_model(model, _LOAD_INTO)
        header, kv = statefile.decode(data)
        tokens, n_decoded, logits = _checked_header(header, model)
        row = None
        if logits:  # the logits after every token, after the KV state
            n_row = model.vocab.n_vocab * statefile.LOGITS.itemsize
            if len(kv) < n_row:
                raise StateFileError(f"the saved sequence's logits are cut short ({len(kv)} bytes)")
            kv, row = kv[:-n_row], statefile.read_logits(kv[-n_row:], "the saved sequence's")
        with model.cache.uncounted():  # (it looks for no cached prefix: no hit, no miss)
            seq = cls(model)
        try:
            n_cells = seq._ctx.set_seq_state(seq._slot, kv) if n_decoded else 0
            if n_cells != n_decoded:
                raise StateFileError(
                    f"the saved sequence says {n_decoded} tokens have KV cells, its state "
                    f"holds {n_cells}"
                )
            seq._rng.bit_generator.state = header["rng"]
            seq._rng_log = _checked_rng_log(header["rng_log"], len(tokens), seq._rng)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            seq.close()
            raise StateFileError(f"the saved sequence's header is malformed: {exc!r}") from None
        except BaseException:
            seq.close()
            raise
        seq.append_tokens(tokens)
        seq._n_decoded = n_decoded
        if row is not None:
            seq.keep_logits(row)
        return seq

    @classmethod
    def load(cls, model: ModelLike, path: str | os.PathLike[str]) -> Sequence:
        """Load a sequence written by :meth:`save` into a new slot of ``model``
        (see :meth:`from_bytes`).

        Raises:
            TypeError: ``model`` is not a model (an :class:`lcgen.Model`).
            StateFileError: the file cannot be read, or see :meth:`from_bytes`.
        """
        check_model(model, _LOAD_INTO)  # before the file is read
        return cls.from_bytes(model, statefile.read_file(path))

    # generation ------------------------------------------------------------------------
    def run(
        self, *, schema: SchemaLike | None = None, **options: Unpack[GenerateOptions]
    ) -> PlainRun | Backtracker:
        """Start a generation from the end of the sequence, to drive step by step.

        ``run.step()`` decodes and samples one token and returns its :class:`Chunk`;
        ``run.is_done`` says when to stop. On a plain run, ``run.checkpoint()`` takes the
        sequence's and the generator's state at any step and ``run.rewind(cp)`` goes back to
        it (``run.generator`` is the :class:`~lcgen.Generator`). With hooks, validators or
        banned phrases the run is a :class:`~lcgen.runtime.backtrack.Backtracker`, which
        rewinds by itself.

        Args:
            schema: constrain the output to JSON valid for this JSON Schema / pydantic model.
            **options: see :meth:`stream`.

        Raises:
            ContextFullError: the sequence plus ``max_tokens`` would not fit the context.
            ClosedError: the sequence was closed.
            ValueError, TypeError: an option is out of range or unknown (named).
        """
        return self.run_plan(make_plan(schema=schema, **options))

    def run_plan(self, plan: Plan) -> PlainRun | Backtracker:
        """:meth:`run` with the options already made into a plan."""
        epoch = self.run_epoch = self.run_epoch + 1  # first: older runs lose the end
        try:
            return self._new_run(plan)
        except BaseException:  # refused: an older run keeps it
            if self.run_epoch == epoch:
                self.run_epoch = epoch - 1
            raise

    def _new_run(self, plan: Plan) -> PlainRun | Backtracker:
        self._check_open()
        self.restore_heal()  # what a run that never stepped took away (it can go on no more)
        if not self._tokens:
            raise ValueError("the sequence is empty: append a prompt before generating")
        limit = plan.max_tokens
        if limit is None:  # up to the end of the context
            if len(self._tokens) >= self._ctx.n_ctx:
                raise ContextFullError(
                    f"the sequence's {len(self._tokens)} tokens fill the context of "
                    f"{self._ctx.n_ctx} tokens: no room to generate (shorten the prompt or load "
                    "the model with a larger n_ctx)"
                )
            # (the plan takes the room left after healing, below)
        elif len(self._tokens) + limit > self._ctx.n_ctx:
            raise ContextFullError(
                f"{len(self._tokens)} tokens in the sequence + max_tokens={limit} = "
                f"{len(self._tokens) + limit} tokens exceeds the context of {self._ctx.n_ctx} "
                "tokens: shorten the prompt, lower max_tokens or load the model with a larger n_ctx"
            )
        # Checked before anything changes.
        drafter = drafter_for(plan.speculation, self.model, plan.sampler.logit_bias)
        self.drop_draft()  # one an abandoned speculative run left for its next step
        for old in list(self._drafters or ()):  # a run held by its caller keeps no draft slot
            old.close()  # (it takes one again if it goes on)
        if drafter is not None:
            if self._drafters is None:
                self._drafters = weakref.WeakSet()
            self._drafters.add(drafter)
        before = self.checkpoint() if plan.token_healing else None
        heal = self.heal_last_token() if plan.token_healing else b""
        if plan.max_tokens is None:  # the room left, with the token healing took away
            plan = dataclasses.replace(plan, max_tokens=self._ctx.n_ctx - len(self._tokens))
        try:  # (it checks the plan's token ids against the vocabulary)
            gen = Generator(self.vocab, plan, history=self._tokens, rng=self._rng, heal=heal)
        except BaseException:
            if before is not None:
                self._unheal(before)  # the healed token back: a refused call changes nothing
            raise
        if gen.is_done:  # max_tokens=0: nothing re-creates the healed text
            self.end_heal(gen.heal)
        if plan.sampler.seed is not None:
            self.reseed(plan.sampler.seed)
        self.keep_next = True  # the logits after the prompt, for a later run on the same one
        if plan.backtracking is not None:
            return Backtracker(self, gen, plan.backtracking, drafter)
        return PlainRun(self, gen, drafter)

    def stream(
        self, *, schema: SchemaLike | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[Chunk]:
        """Generate from the end of the sequence, yielding a :class:`Chunk` per token.

        Args:
            schema: constrain the output to JSON valid for this JSON Schema / pydantic model.
            **options: max_tokens (256; None: to the context's end), stop, include_stop,
                stop_tokens, sampler, temperature (0: greedy), top_k, top_p, min_p, repeat_penalty,
                frequency_penalty, presence_penalty, repeat_last_n,
                seed, logit_bias, logprobs, token_healing, grammar, choice, regex, hooks,
                validators, banned, banned_ignore_case, max_retries, lookback (see
                :func:`lcgen.decoding.make_plan`). A ``seed`` reseeds the sequence's RNG;
                without one, sampling continues it.

        Yields:
            One chunk per generated token; the last has ``finish_reason`` set.

        Raises:
            ContextFullError: the sequence plus ``max_tokens`` would not fit the context.
            ClosedError: the sequence was closed.
            GrammarError: the constraint cannot be built or enforced.
        """
        return chunks_of(self.run(schema=schema, **options))

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
            IncompleteOutputError: with a constraint (schema, grammar, choice, regex),
                generation stopped before the output matched it (the partial text is on the
                exception).
            SchemaValidationError: with a pydantic ``schema``, the output matched its JSON
                Schema but the model's own validation refused it.
            ValueError: ``logprobs`` with ``schema`` (the parsed value has no place for them).
        """
        plan = make_plan(schema=schema, **options)
        check_parsed(schema, plan.logprobs)
        run = self.run_plan(plan)
        text = Text.of(chunks_of(run), plan.logprobs is not None)
        healed = run.generator.healed
        plan.check_complete(text, self.vocab, healed)
        return text if schema is None else parse_structured(text, schema, healed)

    # lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Give the slot back, and a draft model's slot that a run on this sequence holds;
        its cells stay in the model's KV store for later sequences that start the same way.
        Idempotent."""
        for drafter in list(self._drafters or ()):
            drafter.close()
        super().close()


def chunks_of(run: PlainRun | Backtracker) -> Iterator[Chunk]:
    """The chunks of ``run`` to its end, each step's as it is taken (what ``seq.stream``
    yields)."""
    if run.is_done:  # max_tokens=0: still a last chunk, with the finish reason and stats
        yield Chunk("", (), run.generator.finish_reason, stats=run.stats())
    try:
        while not run.is_done:
            yield run.step()
    except GeneratorExit:  # closed early: tokens held back for a rewind were never streamed
        if isinstance(run, Backtracker):
            run.drop_unreleased()
        raise
    finally:  # (ended, closed or failed: the sequence spells the prompt whole again)
        seq = run.sequence
        if run.generator.heal and not seq.is_closed and run.ends_sequence:
            seq.end_heal(run.generator.heal)


def _checked_rng_log(log: object, n_tokens: int, rng: np.random.Generator) -> dict[int, RngState]:
    """A saved sequence's RNG states by position, each checked now (a rewind would restore
    them far from the file).

    Raises:
        TypeError, ValueError: a position or a state that ``rng``'s bit generator refuses.
    """
    if not isinstance(log, list):
        raise TypeError(f"rng_log is not a list: {log!r:.60}")
    scratch = type(rng.bit_generator)()
    out: dict[int, RngState] = {}
    for item in log:
        pos, state = item
        if type(pos) is not int or not 0 <= pos <= n_tokens:
            raise ValueError(f"rng_log position {pos!r} is not one of the sequence's")
        scratch.state = state
        out[pos] = state
    return out


def _checked_header(header: dict[str, Any], model: ModelLike) -> tuple[list[int], int, bool]:
    """The tokens, decoded count and whether the logits after them follow the KV state, of a
    saved sequence's header, checked.

    Raises:
        StateFileError: another model, more tokens than the context, or fields of the wrong
            type or out of range (a forged file whose checksum was recomputed).
    """
    fingerprint = header.get("model")
    if fingerprint != model.fingerprint:
        raise StateFileError(
            f"the sequence was saved with another model (fingerprint {str(fingerprint)[:12]}, "
            f"this model is {model.fingerprint[:12]}: {model.path.name})"
        )
    statefile.check_kv_types(header, model.context.kv_types, "the sequence")
    tokens, n_decoded = header.get("tokens"), header.get("n_decoded")
    if not isinstance(tokens, list) or not all(
        type(t) is int and 0 <= t < model.vocab.n_vocab
        for t in tokens  # (not a bool)
    ):
        raise StateFileError("the saved sequence's tokens are not token ids of this model")
    if len(tokens) > model.context.n_ctx:
        raise StateFileError(
            f"the saved sequence has {len(tokens)} tokens, more than the context of "
            f"{model.context.n_ctx}: load the model with a larger n_ctx"
        )
    logits = header.get("logits", False)
    if type(logits) is not bool or (logits and not tokens):
        raise StateFileError(f"the saved sequence's 'logits' field is malformed: {logits!r:.20}")
    last = len(tokens) if logits else max(0, len(tokens) - 1)
    if type(n_decoded) is not int or not 0 <= n_decoded <= last or (logits and n_decoded < last):
        why = "all have" if logits else "the last one never has"
        raise StateFileError(
            f"the saved sequence says {n_decoded!r} of its {len(tokens)} tokens have KV cells "
            f"({why}, {'with' if logits else 'without'} the logits after them)"
        )
    return tokens, n_decoded, logits
