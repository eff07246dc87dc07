"""The ``Run`` protocol (a generation in progress, as the scheduler drives it), the one batched
step, and the plain run: one sequence sampled token by token.

Every step decodes the pending tokens of every run's sequences together, in one
``llama_decode`` batch, then hands each run the logits after its sequences' last tokens. A plain
run samples one token; a :class:`~lcgen.runtime.backtrack.Backtracker` may also rewind; a beam
search forks. The scheduler knows nothing else about them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence as Seq
from typing import Protocol

import numpy as np

from lcgen.constrain import GrammarState
from lcgen.decoding import Chunk, GenerationStats, Generator
from lcgen.decoding.results import TokenLogprob
from lcgen.decoding.speculation import Drafter
from lcgen.errors import ContextFullError, DecodeError, RewindError
from lcgen.runtime.checkpoint import Checkpoint
from lcgen.runtime.tokens import TokenSequence


class Run(Protocol):
    """A generation in progress: what a step may call on it."""

    @property
    def is_done(self) -> bool:
        """Whether it is finished (no more steps)."""
        ...

    def sequences(self) -> Seq[TokenSequence]:
        """The sequences to decode in this step (their pending tokens)."""
        ...

    def advance(self, rows: Seq[np.ndarray]) -> Chunk | None:
        """Take the logits after each sequence's last token (one row per sequence, in order,
        the step's own copy; for a sequence that drafted, one row per draft token
        more) and move on; the text that became final, if any."""
        ...


def decode(seqs: Seq[TokenSequence]) -> list[np.ndarray]:
    """Decode every sequence's pending tokens in one batch (none is sampled). A sequence whose
    logits the KV store kept (opened on a prompt it knew the end of) decodes nothing; one that
    asked to keep its logits (a generation's first step: its prompt's end) has them kept.
    Where the KV cache has no room for the drafts too, the batch is decoded without them.

    Returns:
        The logits after each sequence's last token (copies: another thread's decode cannot
        change them).
    """
    if not seqs:
        return []
    for seq in seqs:
        seq.claim()
    drafted = any(seq.n_pending > len(seq) - seq.n_decoded for seq in seqs)
    try:
        return _decode(seqs)
    except ContextFullError:
        if not drafted:
            raise
        for seq in seqs:  # drafts only save time: the step goes on without them
            seq.drop_draft()
        return _decode(seqs)


def _decode(seqs: Seq[TokenSequence]) -> list[np.ndarray]:
    """:func:`decode`, drafts and all."""
    kept = [seq.kept_logits() for seq in seqs]
    requests = [seq.pending_request() for seq, row in zip(seqs, kept, strict=True) if row is None]
    try:
        rows = iter(seqs[0].model.context.decode(requests) if requests else ())
    except BaseException:
        for seq in seqs:  # a chunked prefill may have stopped half-way
            seq.resync()
        raise
    out = []
    decoded = iter(requests)
    for seq, row in zip(seqs, kept, strict=True):
        if row is None:
            request, row = next(decoded), next(rows)
            if row is None:  # its pending token was decoded elsewhere since it was asked for
                raise RewindError(
                    "the sequence changed while this step decoded it: drive a sequence from "
                    "one thread at a time"
                )
            seq.mark_decoded(request)
            if seq.keep_next:
                seq.keep_logits(row)
        seq.keep_next = False
        out.append(row)
    return out


def step(runs: Seq[Run]) -> list[Chunk | None]:
    """Advance every run by one step, all their sequences decoded in one batch.

    Returns:
        Per run, in order, the chunk its step produced (None: no text this step).

    Raises:
        ValueError: a sequence is in the step twice (see :func:`_check_distinct`).
        Whatever a run raises; every sequence is left as before the step (its last token
        pending), so the runs can go on or be dropped.
    """
    groups = [run.sequences() for run in runs]
    seqs = [seq for group in groups for seq in group]
    _check_distinct(seqs)
    if not seqs:
        return [run.advance([]) for run in runs]
    chunks: list[Chunk | None] = []
    with seqs[0].model.context.in_use():  # the model stays open while the runs advance
        rows = decode(seqs)
        at, group = 0, groups[0]
        try:
            for run, group in zip(runs, groups, strict=True):
                chunks.append(run.advance(rows[at : at + len(group)]))
                at += len(group)
        except BaseException as exc:
            if isinstance(exc, DecodeError):  # NaN logits: that run's cells are broken
                for seq in group:
                    seq.mark_broken()
            for seq in seqs:
                seq.resync()
            raise
    for group in groups:
        for seq in group:
            # It ended without a new token (retries): keep the last pending, unless the store
            # kept the logits after it (a rewind to the prompt's end: the next step samples
            # from them, as the first did).
            if seq.n_decoded == len(seq) and not seq.is_closed and seq.kept_logits() is None:
                seq.resync()
    return chunks


def _check_distinct(seqs: Seq[TokenSequence]) -> None:
    """Refuse a step that holds one sequence twice (llama.cpp would refuse the batch).

    Raises:
        ValueError: one run was submitted twice, or two runs on one sequence are stepped
            together.
    """
    seen: set[int] = set()
    for seq in seqs:
        if id(seq) in seen:
            raise ValueError(
                f"a sequence (slot {seq.slot}) is in one step twice: the same run submitted "
                "twice, or two runs on one sequence; a sequence takes one run at a time"
            )
        seen.add(id(seq))


class SequenceRun:
    """A generation on one sequence with one generator: what plain and backtracking runs
    share (the public step API, and the cost of the generation so far).

    Args:
        seq: the sequence generated on.
        gen: its generator (made by ``seq.run``).
        drafter: with speculation, what drafts the tokens each step verifies.
    """

    def __init__(self, seq: TokenSequence, gen: Generator, drafter: Drafter | None = None) -> None:
        self.sequence, self.generator = seq, gen
        self._heal_mark = seq.heal_mark if gen.heal else None  # (see __del__)
        self._start = (seq.stats.tokens_decoded, seq.n_decoded)
        self._base = len(seq) - len(gen.tokens)  # where the generated tokens start
        # With ``logprobs``: each generated token's entry (its log-probability, alternatives).
        self.token_entries: list[TokenLogprob] = []
        self.drafter = drafter
        self._steps = self._drafted = self._accepted = self._forced = 0
        plan = gen.plan
        self.fast_forward = (
            plan.fast_forward and gen.grammar is not None and not self.sees_every_token
        )
        # Text forced before the first step (decoded with the prompt), given with its chunk.
        self._held: Chunk | None = None
        if self.fast_forward and not (gen.is_done or plan.stops.strings or plan.stop_tokens):
            self._held = self._fast_forward(Chunk("", ()), reserve=1)

    @property
    def sees_every_token(self) -> bool:
        """Whether every token is sampled (a backtracking run's hooks, validators and
        banned-phrase checks see each one): no forced token is appended unsampled."""
        return False

    def __del__(self) -> None:
        # Dropped before a step re-created the text token healing removed (a stream closed
        # before its first chunk, a run never stepped): the sequence spells its prompt again.
        if self._heal_mark is not None and not self.sequence.is_closed:
            self.sequence.restore_heal(self._heal_mark)

    @property
    def token_logprobs(self) -> list[float]:
        """With ``logprobs``: each generated token's log-probability."""
        return [entry.logprob for entry in self.token_entries]

    @property
    def is_done(self) -> bool:
        return self.generator.is_done

    def sequences(self) -> tuple[TokenSequence]:
        self._check_in_step()
        return (self.sequence,)

    @property
    def ends_sequence(self) -> bool:
        """Whether the sequence still ends with this generation's tokens."""
        seq, gen = self.sequence, self.generator
        end = self._base + len(gen.tokens)
        return len(seq) == end and seq.tokens_from(self._base) == gen.tokens

    def _check_in_step(self) -> None:
        """Refuse to go on when the sequence no longer ends with this generation's tokens: it
        was rewound, appended to or generated on by another run behind this one's back (going
        on would sample from the wrong tokens, past its grammar).

        Raises:
            RewindError: the sequence was changed outside this generation.
        """
        seq, gen = self.sequence, self.generator
        end = self._base + len(gen.tokens)
        if not self.ends_sequence:
            raise RewindError(
                f"the sequence changed outside this generation ({len(seq)} tokens, where the "
                f"generation left {end}): rewind it with run.rewind(cp) or "
                "seq.rewind(cp, run.generator), or start a new run"
            )

    def advance(self, rows: Seq[np.ndarray]) -> Chunk:
        """Sample from the logits after the sequence's last token; after a draft, walk its
        rows: each position is sampled as without a draft, and the walk goes on while the
        sampled token equals the draft token decoded there. Then draft for the next step."""
        (row,) = rows
        chunk = self._advance_one(row) if row.ndim == 1 else self._verify(row)
        # (A step that raised took no token: see _verify for one that did. Nor did one that
        # ran out of retries: its draft tokens taken before count as accepted.)
        if self.generator.finish_reason != "retries":
            self._steps += 1
        if self._held is not None:
            chunk, self._held = join_chunks([self._held, chunk]), None
        if self.fast_forward and not self.is_done:
            chunk = self._fast_forward(chunk)
        if self.drafter is not None:
            if self.is_done:
                self.drafter.close()
            else:
                self._draft(self.drafter)
        if chunk.finish_reason is not None:
            chunk = dataclasses.replace(chunk, stats=self.stats())
        return chunk

    def _advance_one(self, row: np.ndarray) -> Chunk:
        """Sample one token from ``row`` and take it (each kind of run its own way)."""
        raise NotImplementedError

    def _verify(self, rows: np.ndarray) -> Chunk:
        seq = self.sequence
        chunks: list[Chunk] = []
        accepted = 0
        try:
            for i, row in enumerate(rows):
                chunks.append(self._advance_one(row))
                if self.is_done or i + 1 == len(rows) or not seq.confirm_draft():
                    break
                accepted += 1
        except BaseException:
            # The tokens taken before the failure stay (a hook raised on a later one): their
            # text comes with the next chunk, and they count as a step of their own.
            if chunks:
                held = [self._held] if self._held is not None else []
                self._held = join_chunks([*held, *chunks])
                self._steps += 1
            raise
        finally:
            seq.drop_draft()
            self._drafted += len(rows) - 1
            # The draft tokens taken (a hook may have raised on a confirmed one: not taken).
            self._accepted += max(len(chunks) - 1, 0)
            assert self.drafter is not None
            self.drafter.feedback(len(rows) - 1, accepted)
        return join_chunks(chunks)

    def _fast_forward(self, chunk: Chunk, reserve: int = 0) -> Chunk:
        """Append the tokens the constraint forces after the last one (the sampled one, or the
        prompt's): they are decoded with it in the next step. ``reserve``: tokens of
        ``max_tokens`` to leave for sampling. Returns ``chunk`` with their text."""
        chunks = [chunk]
        for token in self._forced_tokens(reserve):
            chunks.append(self._take_forced(token))
            if self.generator.is_done:
                break
        return join_chunks(chunks)

    def _forced_tokens(self, reserve: int) -> list[int]:
        """The tokens the constraint forces after the last one, leaving ``reserve`` tokens of
        ``max_tokens`` and one of the context."""
        seq, gen = self.sequence, self.generator
        room = min(
            gen.max_tokens - len(gen.tokens) - reserve, seq.model.context.n_ctx - len(seq) - 1
        )
        return gen.forced_tokens(seq.vocab.special_piece(seq.tokens[-1]), room)

    def _take_forced(self, token: int) -> Chunk:
        """Append a forced token, unsampled; its text."""
        gen = self.generator
        chunk = gen.accept(token)
        self.sequence.append_tokens((token,))
        if gen.logprobs is not None:  # a plan that asked for both: certain, given the rest
            self.token_entries.append(TokenLogprob(token, chunk.text, 0.0, ()))
        self._forced += 1
        return chunk

    def _draft(self, drafter: Drafter) -> None:
        """Give the sequence a draft for the next step: the drafter's guess, cut where the
        grammar forbids a token (it could never be sampled there) and to what may still be
        generated."""
        seq, gen = self.sequence, self.generator
        if gen.heal:
            return  # the first token must re-create healed text: nothing to look up
        room = min(gen.max_tokens - len(gen.tokens), seq.model.context.n_ctx - len(seq)) - 1
        draft = drafter.propose(seq.tokens, room)
        if draft and gen.grammar is not None:
            with gen.grammar.clone() as probe:
                draft = self._allowed_draft(probe, draft)
        if draft:
            seq.draft(draft)

    def _allowed_draft(self, probe: GrammarState, draft: list[int]) -> list[int]:
        """The start of ``draft`` the grammar allows, cut before a token after which it forces
        text with fast-forward on: a step without a draft appends forced tokens unsampled, so
        the walk must end at the token before them (walking on would sample there, drawing
        from the RNG, and take the model's split of the text rather than the tokenizer's)."""
        allowed: list[int] = []
        for token in draft:
            if not probe.try_accept(token):
                break
            if self.fast_forward and probe.forced_text(1):
                break
            allowed.append(token)
        return allowed

    def stats(self) -> GenerationStats:
        """What the generation has cost so far."""
        return self.cost()

    def step(self) -> Chunk:
        """Decode the sequence's pending tokens and sample the next token.

        Returns:
            The chunk of text that became final (its ``finish_reason`` is set on the last).

        Raises:
            ValueError: the generation is finished.
        """
        if self.is_done:
            raise ValueError("the generation is finished; start a new one with seq.run()")
        chunk = step([self])[0]
        assert chunk is not None
        return chunk

    def checkpoint(self) -> Checkpoint:
        """The sequence's and the generator's state now (``seq.checkpoint(run.generator)``),
        for :meth:`rewind`."""
        return self.sequence.checkpoint(self.generator)

    def cost(self, rewinds: int = 0, resamples: int = 0) -> GenerationStats:
        """What the generation has cost so far: every token decoded, those beyond the growth
        of the cache (decoded again after rewinds), and the drafts."""
        decoded = self.sequence.stats.tokens_decoded - self._start[0]
        kept = self.sequence.n_decoded - self._start[1]
        redecoded = decoded - kept - (self._drafted - self._accepted)
        n_tokens = len(self.generator.tokens)
        return GenerationStats(
            n_tokens,
            decoded,
            redecoded,
            rewinds,
            resamples,
            steps=self._steps,
            drafted=self._drafted,
            accepted=self._accepted,
            forced=self._forced,
        )


class PlainRun(SequenceRun):
    """A generation that samples one token per step (see :meth:`lcgen.Sequence.run`).

    Drive it with :meth:`step` (``seq.stream`` is that in a loop); take
    :meth:`checkpoint` at any step and :meth:`rewind` to it: the KV cache, the sampler and the
    generator's state (held text, grammar, healing) go back together.
    """

    def __init__(self, seq: TokenSequence, gen: Generator, drafter: Drafter | None = None) -> None:
        super().__init__(seq, gen, drafter)
        self._rewinds = 0
        # The text forced before the first step and the tokens then: a rewind to there gives
        # it with the next step again (it was given with the first, then lost).
        self._opening = (self._held, len(gen.tokens))

    def _advance_one(self, row: np.ndarray) -> Chunk:
        seq, gen = self.sequence, self.generator
        if not gen.sampler.is_greedy:
            seq.note_draw()
        chunk = gen.step(row)
        seq.append_tokens(chunk.tokens)
        self.token_entries.extend(chunk.logprobs)
        return chunk

    def stats(self) -> GenerationStats:
        return self.cost(self._rewinds)

    def rewind(self, checkpoint: Checkpoint) -> None:
        """Go back to a checkpoint taken with :meth:`checkpoint` (the generation may have
        finished since: it goes on from there).

        Raises:
            RewindError: the checkpoint is not reachable (see :meth:`lcgen.Sequence.rewind`).
            ValueError: the checkpoint was taken without the generator's state.
        """
        self.sequence.rewind(checkpoint, self.generator)
        del self.token_entries[len(self.generator.tokens) :]
        self._rewinds += 1
        opening, n_tokens = self._opening
        if opening is not None and len(self.generator.tokens) == n_tokens:
            self._held = opening


def join_chunks(chunks: list[Chunk]) -> Chunk:
    """One chunk for the tokens one step took (accepted draft tokens, forced ones): texts and
    tokens joined, the log-probabilities summed (each token's on ``logprobs``), the finish of
    the last."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    entries = tuple(e for c in chunks for e in c.logprobs)
    logprob = None
    if entries:  # (a chunk that released no token has none, and no logprob)
        logprob = math.fsum(e.logprob for e in entries)
    elif all(c.logprob is not None for c in chunks):
        logprob = math.fsum(c.logprob for c in chunks if c.logprob is not None)
    return Chunk(
        "".join(c.text for c in chunks),
        tuple(t for c in chunks for t in c.tokens),
        last.finish_reason,
        last.stop,
        logprob,
        entries[0].top if len(entries) == 1 else (),  # (several: each entry's own)
        logprobs=entries,
    )
