"""The core of a live sequence: tokens whose KV cells live in one slot, reversible at every
position. Runs drive it; :class:`~lcgen.Sequence` adds generation, forks and persistence.

The last token of a sequence is kept pending (not yet decoded) until the next step needs its
logits, so every step decodes exactly one batch. One exception: a sequence opened on a prompt
whose end the KV store kept the logits of (see :mod:`lcgen.runtime.kvstore`) starts with every
token decoded, and its first step samples from those logits without decoding.

Reversibility: each token carries a stamp (a process-wide counter value), so a checkpoint is
O(1) — a position, the stamp of the history up to it, and the RNG state — and is valid exactly
while the sequence still holds that history. The RNG state before every sampling draw is logged
by position, so ``rewind(n)`` restores the sampler as exactly as ``rewind(checkpoint)`` does.

Speculation: a run may :meth:`~TokenSequence.draft` tokens after the pending one. The next step
decodes them too, with the logits after each; they are not part of the sequence. As the run
samples, :meth:`~TokenSequence.confirm_draft` keeps the cell of each sampled token that equals
the next draft token, and :meth:`~TokenSequence.drop_draft` removes the cells of the rest.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import secrets
import weakref
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import ClassVar, Protocol, Self, cast

import numpy as np

from lcgen._numbers import plain
from lcgen._unshared import Unshared
from lcgen.decoding import Generator
from lcgen.decoding.sampling import new_rng
from lcgen.errors import ClosedError, RewindError
from lcgen.runtime.checkpoint import Checkpoint, RngState, SequenceStats
from lcgen.runtime.context import Context, DecodeRequest, finished
from lcgen.runtime.kvstore import Entry, KVStore, common_prefix, this_thread
from lcgen.vocab import Vocab

# Starting at random: a checkpoint pickled in another process (whose counter made the same
# stamps) is refused by the sequences here instead of taken for one of theirs.
_stamps = itertools.count(secrets.randbits(62) + 1)


class ModelLike(Protocol):
    """What a sequence needs of its model (a :class:`~lcgen.Model`)."""

    @property
    def vocab(self) -> Vocab: ...
    @property
    def context(self) -> Context: ...
    @property
    def cache(self) -> KVStore: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def path(self) -> Path: ...


def check_model(value: object, expected: str) -> None:
    """Raise ``TypeError("{expected}, got TYPE")`` unless ``value`` has what a sequence needs
    of its model (:class:`ModelLike`)."""
    if not all(hasattr(value, a) for a in ("vocab", "context", "cache", "fingerprint", "path")):
        raise TypeError(f"{expected}, got {type(value).__name__}")


def _check_generator(generator: object) -> None:
    if generator is not None and not isinstance(generator, Generator):
        raise TypeError(
            f"generator must be the Generator driving the sequence (run.generator) or None, "
            f"got {generator!r:.60}"
        )


class TokenSequence(Unshared):
    """Tokens of one live generation in a KV slot, with O(1) checkpoints and rewinds.

    The slot comes from the model's KV store, starting from the longest prefix of ``tokens``
    it holds (only the rest is decoded); closing the sequence parks its cells there for the
    next sequence that starts the same way.

    Args:
        model: the model.
        tokens: the initial tokens (the prompt).
        seed: seeds the sequence's sampler RNG (None: a fresh random seed).

    Raises:
        SlotsExhaustedError: every slot is held by a live sequence of this thread (with other
            threads holding some, it waits for one).
    """

    instead: ClassVar[str] = (
        "fork it (seq.fork(): a copy that shares its cells), or save it (seq.to_bytes(), "
        "seq.save(path)) and load that"
    )

    def __init__(self, model: ModelLike, tokens: Seq[int] = (), *, seed: int | None = None) -> None:
        checked = model.vocab.check_tokens(tokens)
        try:
            entry, n_reused = model.cache.open(checked)
            self._adopt(model, entry, n_reused, seed)
        except BaseException:  # (Ctrl-C) an entry made live but not adopted is parked
            model.cache.abandon_opened()
            raise
        self.stats.tokens_reused = n_reused

    def _adopt(
        self,
        model: ModelLike,
        entry: Entry,
        n_decoded: int,
        seed: int | None,
        stamps: list[int] | None = None,
    ) -> None:
        """Take ``entry`` (a live slot whose first ``n_decoded`` tokens have cells; ``stamps``:
        its positions' stamps, a fork's parent's; new ones where None)."""
        entry.holder = weakref.ref(self)
        self.model = model
        self.vocab = model.vocab
        self._ctx: Context = model.context
        self._entry = entry
        self._tokens = entry.tokens  # the same list: the store sees what this sequence holds
        self._slot = entry.slot
        self._finalizer = weakref.finalize(self, model.cache.park, entry)
        # Not at exit: a daemon thread may still generate on it then (parked, its next step
        # raised ClosedError), and the cells go with the process.
        self._finalizer.atexit = False
        self._n_decoded = n_decoded
        self._draft: list[int] = []  # to decode after the pending tokens in the next step
        self._ahead: list[int] = []  # draft tokens decoded past the sequence's end
        self._uid = next(_stamps)
        if stamps is None:
            stamps = list(itertools.islice(_stamps, len(self._tokens)))
            stamps.insert(0, self._uid)
        self._stamps = stamps
        self._rng = new_rng(seed)
        self._rng_log: dict[int, RngState] = {}  # position -> RNG state before anything there
        # The prompt token last removed by token healing: (position, token, stamps around it).
        self._healed: tuple[int, int, int, int] | None = None
        # Whether nothing has been appended since: the sequence is its prompt cut short (a
        # rewind by count to the same position after a generation leaves it cut on purpose).
        self._heal_open = False
        # Keep the logits of the next decode in the store (set when a generation starts: they
        # follow its prompt).
        self.keep_next = False
        self.stats = SequenceStats()
        self.run_epoch = 0  # runs started on it (a stream of an older one no longer drops)

    def mark_broken(self) -> None:
        """Its cells gave NaN logits: drop them when it closes, rather than park them for other
        sequences to reuse."""
        self._entry.broken = True

    def claim(self) -> None:
        """Count the sequence as the calling thread's: the one that drives it, and so will
        give its slot back (the store's deadlock check asks; a sequence handed to another
        thread is that thread's from its first step there)."""
        self._entry.owner = this_thread()

    # state -----------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """A copy of all tokens: prompt, appended text and generated tokens."""
        return list(self._tokens)

    def tokens_from(self, start: int) -> list[int]:
        """A copy of the tokens from position ``start`` on (cheaper than all of them)."""
        return self._tokens[start:]

    @property
    def text(self) -> str:
        """The detokenized text of all tokens (special tokens not rendered)."""
        return self.vocab.detokenize(self._tokens)

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    @property
    def n_decoded(self) -> int:
        """How many tokens have KV cells (all but the pending ones)."""
        return self._n_decoded

    @property
    def n_pending(self) -> int:
        """Tokens the next step decodes (new cells): the pending ones and the draft."""
        return len(self._tokens) - self._n_decoded + len(self._draft)

    @property
    def slot(self) -> int:
        """The llama.cpp sequence id that holds this sequence's KV cells."""
        return self._slot

    @property
    def rng(self) -> np.random.Generator:
        """The sampler's random generator (its state is part of every checkpoint)."""
        return self._rng

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
        tokens = self.vocab.tokenize(text, add_bos=False)
        self.append_tokens(tokens)
        return tokens

    def append_tokens(self, tokens: Seq[int]) -> None:
        """Append token ids (checked against the vocabulary); each gets a new stamp."""
        self._check_open()
        checked = self.vocab.check_tokens(tokens)
        self._tokens.extend(checked)
        self._stamps.extend(next(_stamps) for _ in checked)
        if checked:
            self._heal_open = False

    def _keep_prefix(self, n_keep: int) -> None:
        """Cut the sequence to its first ``n_keep`` tokens, dropping their KV cells."""
        # The last token stays pending, so the next step has logits to sample from; unless
        # the store kept the logits after exactly these tokens (a rewind to the end of the
        # prompt): the next step samples from them, as the first did (the last token decoded
        # alone would give logits a batch's rounding did not, and could flip a near-tie).
        kept = self._entry.end_logits
        if kept is not None and kept[0] == n_keep <= self._n_decoded:
            kv_keep = n_keep
        else:
            kv_keep = min(self._n_decoded, max(n_keep - 1, 0))
        if kv_keep < self._n_decoded or self._ahead or self._draft:
            self._trim_kv(kv_keep)
        del self._tokens[n_keep:]
        del self._stamps[n_keep + 1 :]
        for pos in [pos for pos in self._rng_log if pos >= n_keep]:
            del self._rng_log[pos]

    def _trim_kv(self, kv_keep: int) -> None:
        """Keep the KV cells of the first ``kv_keep`` tokens only."""
        self._draft, self._ahead = [], []
        self._entry.cut(kv_keep)
        # Finished where Ctrl-C interrupts it: the count of decoded tokens must stay the
        # cells' (the next decode would start past them, and llama.cpp refuse it).
        if not finished(lambda: self._cut_cells(kv_keep)):
            self.stats.fallbacks += 1
            self.stats.tokens_redecoded += kv_keep

    def _cut_cells(self, kv_keep: int) -> bool:
        """Keep the cells of the first ``kv_keep`` tokens, or none where the memory cannot
        keep a partial range (sliding window, recurrent: False). Idempotent."""
        kept = self._ctx.truncate(self._slot, kv_keep)
        if not kept:
            self._ctx.clear_slot(self._slot)
        self._n_decoded = kv_keep if kept else 0
        return kept

    def reuse(self, tokens: Seq[int]) -> int:
        """Make the sequence equal ``tokens``, keeping the KV cache of the common prefix.

        Returns:
            How many tokens were kept (need no decoding).
        """
        self._check_open()
        tokens = self.vocab.check_tokens(tokens)
        common = common_prefix(self._tokens, tokens)
        self._keep_prefix(common)
        self.append_tokens(tokens[common:])
        return common

    # checkpoints -----------------------------------------------------------------------
    def checkpoint(self, generator: Generator | None = None) -> Checkpoint:
        """The sequence's state now, as a value (no KV data is copied).

        Args:
            generator: the generator driving this sequence, when taken in the middle of a
                generation (``run.generator``): its state (held text, grammar, healing) goes
                into the checkpoint.
        """
        self._check_open()
        _check_generator(generator)
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
                sequence, one beyond the current position after an earlier rewind, or one whose
                history was since replaced.
                Also a checkpoint whose generator state is another generator's (nothing changes).
            ClosedError: the sequence is closed.
            ValueError: a generator was given but the checkpoint holds no generator state.
        """
        self._check_open()
        _check_generator(generator)
        target = cast(Checkpoint | int, plain(target))
        if generator is not None and (isinstance(target, int) or target.generation is None):
            raise ValueError(
                "to restore a generator, rewind to a checkpoint taken with it: "
                "seq.checkpoint(generator)"
            )
        if isinstance(target, bool) or not isinstance(target, int | Checkpoint):
            raise TypeError(f"rewind takes a Checkpoint or a number of tokens, got {target!r}")
        if (
            generator is not None
            and isinstance(target, Checkpoint)
            and target.generation is not None
        ):
            try:  # checked before anything changes
                generator.check_restorable(target.generation)
            except ValueError as exc:
                raise RewindError(f"the checkpoint cannot restore this generator: {exc}") from None
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
            # Back where healing took the token away, with the text to re-create again: the
            # sequence is its prompt cut short once more (a rewind by count is not).
            if generator.heal:
                self._heal_open = self._at_healed_token()
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
        self._heal_open = False
        return True

    def end_heal(self, rest: bytes) -> int:
        """A generation ended before its tokens re-created the text token healing removed:
        put the rest back, so the sequence still spells its prompt and the output (where no
        token was generated, the removed token itself, else the rest's tokens after them).

        Args:
            rest: the healed text's bytes no generated token re-created (the generator's
                ``heal``); nothing happens when it is empty.

        Returns:
            How many tokens now follow the generated ones (0 where the removed token itself
            is back).
        """
        if not rest or self._healed is None:
            return 0
        if self._at_healed_token():
            self._put_healed_back()
            return 0
        # (a rewind to a checkpoint from before the heal still puts the token back)
        tokens = self.vocab.spell(rest)
        self.append_tokens(tokens)
        return len(tokens)

    @property
    def heal_mark(self) -> object:
        """Which token healing removed the token now missing (None: none did)."""
        return self._healed

    def restore_heal(self, mark: object = None) -> None:
        """Put back the token healing removed where nothing has replaced it: the run that
        removed it was dropped or superseded before a step re-created its text. ``mark``
        (a :attr:`heal_mark`): only if that healing removed it."""
        if mark is not None and mark is not self._healed:
            return  # another run's healing (the dropped run's own was undone or done)
        if self._healed is not None and self._heal_open and self._at_healed_token():
            self._put_healed_back()

    def _put_healed_back(self) -> None:
        assert self._healed is not None
        _, token, _, after = self._healed
        self._tokens.append(token)  # as before the heal (its checkpoints reach it again)
        self._stamps.append(after)
        self._healed, self._heal_open = None, False

    def _whole_tokens(self) -> list[int]:
        """The tokens, with the one token healing removed put back while nothing has replaced
        it yet (a sequence saved then is its prompt, not the prompt cut short)."""
        if self._healed is not None and self._heal_open and self._at_healed_token():
            return [*self._tokens, self._healed[1]]
        return list(self._tokens)

    def _at_healed_token(self) -> bool:
        """Whether the sequence ends where token healing took its token away, with the
        history before it unchanged."""
        if self._healed is None:
            return False
        pos, _, before, _ = self._healed
        return pos == len(self._tokens) and self._stamps[pos] == before

    def _check_reachable(self, cp: Checkpoint) -> None:
        n = len(self._tokens)
        if not isinstance(cp.n_tokens, int) or cp.n_tokens < 0:
            raise RewindError(f"a checkpoint's position must be an int >= 0, got {cp.n_tokens!r}")
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

    # sampling --------------------------------------------------------------------------
    def heal_last_token(self) -> bytes:
        """Drop the last token and return its text, for a generator to re-create (token
        healing); ``b""`` when there is nothing to heal. A checkpoint taken before puts the
        token back."""
        n, token = len(self._tokens), self._tokens[-1]
        piece = self.vocab.piece(token)
        if n < 2 or not piece:
            return b""
        self._healed = (n - 1, token, self._stamps[n - 1], self._stamps[n])
        self._keep_prefix(n - 1)
        self._heal_open = True
        return piece

    def reseed(self, seed: int) -> None:
        """Seed the sampler RNG. A checkpoint taken before restores the old state; one taken
        after, or a rewind to this position later, the new one (the state before the first
        draw here)."""
        self._check_open()
        rng = new_rng(seed)
        self._rng_log.pop(len(self._tokens), None)
        self._rng.bit_generator.state = rng.bit_generator.state

    def note_draw(self) -> None:
        """Log the RNG state before the first random draw at the next position (a rewind to it
        restores that state)."""
        self._rng_log.setdefault(len(self._tokens), self._rng.bit_generator.state)

    # decoding --------------------------------------------------------------------------
    def kept_logits(self) -> np.ndarray | None:
        """The logits after the last token when every token is decoded and the store kept
        them (the sequence was opened on a prompt whose end it knew): the next step samples
        from them instead of decoding. None otherwise."""
        kept = self._entry.end_logits
        n = len(self._tokens)
        if kept is None or kept[0] != n or self._n_decoded != n or self._draft:
            return None
        return kept[1]

    def pending_request(self) -> DecodeRequest:
        """The tokens not decoded yet, and the draft after them, as a request for
        :meth:`Context.decode` (the logits after the last pending token and after each draft
        token)."""
        self._check_open()
        pending = self._tokens[self._n_decoded :]
        if not self._draft:
            return DecodeRequest(self._slot, pending, self._n_decoded)
        return DecodeRequest(
            self._slot, pending + self._draft, self._n_decoded, n_outputs=1 + len(self._draft)
        )

    def mark_decoded(self, request: DecodeRequest) -> None:
        """Record that ``request`` (from :meth:`pending_request`) was decoded: its draft
        tokens (all but the first of its outputs) are decoded ahead of the sequence's end."""
        n_draft = request.n_outputs - 1
        end = len(request.tokens) - n_draft
        self._n_decoded = request.pos + end
        self._ahead, self._draft = list(request.tokens[end:]), []
        self.stats.tokens_decoded += len(request.tokens)

    def keep_logits(self, row: np.ndarray) -> None:
        """Keep ``row``, the logits after every token, in the store (a prompt's end: a later
        sequence opened on the same tokens starts from them)."""
        if self._n_decoded == len(self._tokens) and row.ndim == 1:
            self._entry.keep_logits(self._n_decoded, row)

    def draft(self, tokens: Seq[int]) -> None:
        """Decode ``tokens`` after the pending ones in the next step, as a guess at what will
        be sampled (they do not join the sequence; see :meth:`confirm_draft`).

        Raises:
            ValueError: a token is outside the vocabulary, or the draft would not fit the
                context.
        """
        self._check_open()
        checked = self.vocab.check_tokens(tokens)
        if len(self._tokens) + len(checked) > self._ctx.n_ctx:
            raise ValueError(
                f"a draft of {len(checked)} tokens after {len(self._tokens)} would not fit the "
                f"context of {self._ctx.n_ctx} tokens"
            )
        self._draft = checked

    def confirm_draft(self) -> bool:
        """Whether the token just appended equals the next draft token decoded ahead: then its
        cell is kept (it counts as decoded, and the logits after it are the draft's next row).
        """
        ahead = self._ahead
        if ahead and self._n_decoded == len(self._tokens) - 1 and self._tokens[-1] == ahead[0]:
            del ahead[0]
            self._n_decoded += 1
            return True
        return False

    def drop_draft(self) -> int:
        """Remove the cells of the draft tokens not confirmed; returns how many."""
        n = len(self._ahead)
        if n:
            self._trim_kv(self._n_decoded)
        self._draft = []
        return n

    def drop_cells(self) -> int:
        """Drop the KV cells only this sequence holds (those of a prefix shared with another
        sequence or a cached entry stay: dropping them would free nothing), keeping its
        tokens: its next step decodes them again (how a scheduler short of cells pauses a
        generation). Returns how many tokens lost their cells."""
        self._check_open()
        n, counted = self._n_decoded, self.stats.tokens_redecoded
        with self._ctx.lock:  # the ledger, which other threads' decodes change
            self._trim_kv(min(n, self._ctx.ledger.shared_prefix(self._slot)))
        # Every token that lost its cells, once (a fallback in the trim counted the shared
        # prefix it could not keep already).
        self.stats.tokens_redecoded = counted + n - self._n_decoded
        return n - self._n_decoded

    def resync(self) -> None:
        """After an interrupted step (an error, a hook that raised, Ctrl-C): make the KV memory
        hold exactly the tokens counted as decoded, and keep the last token pending."""
        if self.is_closed:
            return
        self._trim_kv(min(self._n_decoded, max(len(self._tokens) - 1, 0)))

    def _check_open(self) -> None:
        if self.is_closed:
            raise ClosedError("the sequence is closed; start a new one with model.sequence()")
        self._ctx.check_open()  # its model may have been closed

    # lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Give the slot back; its cells stay in the model's KV store for later sequences
        that start the same way. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
