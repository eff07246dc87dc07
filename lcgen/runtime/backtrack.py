"""Backtracking generation: hooks, validators, banned phrases and a schema's ``uniqueItems``,
paid for with rewinds.

A :class:`Backtracker` drives one (sequence, generator) pair. Each step it samples a candidate,
lets the hooks accept, replace, redraw or reject it, appends it, runs the validators and the
banned-phrase matcher on the text, and rewinds through the sequence's checkpoints when any of
them asks to (or an item of a unique array repeats an earlier one). Nothing is decoded again
except the tokens a rewind dropped (plus the last kept token, whose logits the next step
needs): the prompt is decoded once.

Streaming holds text back only as far as a rewind could still reach: the part that could become
a banned phrase and, when hooks or validators are given, the last ``lookback`` tokens.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
from collections.abc import Set
from dataclasses import dataclass, replace

import numpy as np

from lcgen.constrain.unique import SCALAR, UniqueScan
from lcgen.decoding import Chunk, GenerationStats, Generator, Override, Resample, Rewind, Step
from lcgen.decoding.options import Backtracking
from lcgen.decoding.results import FinishReason
from lcgen.decoding.speculation import Drafter
from lcgen.decoding.text import decode_flush
from lcgen.errors import ClosedError, NoCandidatesError, RewindError
from lcgen.runtime.checkpoint import Checkpoint
from lcgen.runtime.run import SequenceRun, join_chunks
from lcgen.runtime.tokens import TokenSequence


@dataclass(slots=True)
class _Mark:
    """What the backtracker knows about the state before one generated token."""

    checkpoint: Checkpoint | None  # None once no rewind can reach it (frees the grammar clone)
    out_len: int  # characters of the generator's output before the token
    visible: int  # characters of the text so far (output + text held for stop strings)
    held_bytes: bool  # whether part of a character was held (it started in an earlier token)


@dataclass(frozen=True, slots=True)
class _TakeBack:
    """Take the text back from character ``char`` on (a repeated item), as a rewind."""

    char: int


class Backtracker(SequenceRun):
    """Runs hooks, validators and banned phrases over one sequence's generation.

    Args:
        seq: the sequence generated on.
        gen: its generator (made by ``seq.run``).
        settings: the plan's backtracking settings:

            - hooks, called with a :class:`~lcgen.Step` for each sampled candidate, in order;
              each returns None (accept), ``Override(token)`` (the next hooks see the new
              token), ``Resample(exclude, temperature)`` or ``Rewind(n, ban)`` (the hooks
              then start over on the next candidate);
            - validators, called with the generated text after each token; they return None
              or ``Rewind(n, ban)``;
            - banned phrases: the sequence is rewound to the token where one starts, that
              token is banned at that position, and generation goes on;
            - max_retries: the most resamples and rewinds in the whole generation; one more
              ends it with finish reason ``"retries"`` (what was rejected is still removed);
            - lookback: the most tokens a hook's or validator's ``Rewind`` can drop; streams
              hold back the text of that many tokens when hooks or validators are given.
        drafter: with speculation, what drafts the tokens each step verifies.
    """

    def __init__(
        self,
        seq: TokenSequence,
        gen: Generator,
        settings: Backtracking,
        drafter: Drafter | None = None,
    ) -> None:
        # (Set before the run's own start, which may append the tokens a constraint forces.)
        self._epoch = seq.run_epoch  # (see drop_unreleased)
        self.hooks, self.validators = settings.hooks, settings.validators
        self.banned = settings.banned
        self.max_retries, self.lookback = settings.max_retries, settings.lookback
        self.finish_reason: FinishReason | None = gen.finish_reason  # set when max_tokens=0
        self._marks: list[_Mark] = []
        self._visible_at: list[int] = []  # _marks[i].visible, for bisecting
        self._out = ""  # the generator's output so far
        self._emitted = 0  # characters of it streamed
        self._emitted_tokens = 0
        self._scan_from = 0  # banned matches cannot start before this character
        self._bans: dict[int, set[int]] = {}  # generated index -> tokens banned there
        self._rewinds = self._resamples = 0
        self._user_rewinds = 0  # asked for by the caller: they do not count as retries
        # Arrays whose items must be unique (uniqueItems): the JSON text read so far, and the
        # read of it with the candidate, kept once the candidate is.
        unique = gen.grammar.grammar.unique if gen.grammar is not None else None
        text = gen.healed + gen.text_state.held_text  # (what _json_text reads at the start)
        self._unique = None if unique is None else unique.scan(text)
        self._unique_next: UniqueScan | None = None
        super().__init__(seq, gen, drafter)

    @property
    def sees_every_token(self) -> bool:
        """Whether hooks, validators or banned phrases see every token. Without them (a
        schema's ``uniqueItems`` alone), forced text outside the arrays that must hold unique
        items is appended unsampled, as in a plain run (see :meth:`_forced_tokens`)."""
        return bool(self.hooks or self.validators or self.banned)

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    # one step ----------------------------------------------------------------------------
    def _advance_one(self, row: np.ndarray) -> Chunk:
        """Sample, check and append the next token from the logits after the sequence's last
        token; rewind when asked. Returns the text that became final."""
        seq, gen = self.sequence, self.generator
        index = len(gen.tokens)
        if len(self._marks) == index:
            mark = self._mark()
            self._marks.append(mark)
            self._visible_at.append(mark.visible)
        before = self._marks[index].checkpoint
        assert before is not None and before.generation is not None
        exclude = set(self._bans.get(index, ()))
        temperature: float | None = None
        while True:
            if not gen.sampler.is_greedy or temperature:
                seq.note_draw()
            try:
                chunk = gen.step(row, exclude=exclude, temperature=temperature)
            except NoCandidatesError:
                if index == 0 and not exclude:  # (nothing this run ruled out: the constraint's)
                    raise
                return self._exhausted(index)
            try:
                chunk, action = self._run_hooks(chunk, row, before)
            except BaseException:
                gen.restore(before.generation)
                raise
            if not isinstance(action, Resample):
                break
            self._undo_candidate(before)
            if not self._retry():
                return self._end("retries")
            self._resamples += 1
            exclude.update(action.exclude)
            temperature = action.temperature if action.temperature is not None else temperature
        seq.append_tokens(chunk.tokens)
        self._out += chunk.text
        if self._unique_next is not None:
            self._unique, self._unique_next = self._unique_next.keep(), None
        if gen.logprobs is not None:
            (entry,) = chunk.logprobs
            self.token_entries.append(entry)
        if isinstance(action, Rewind):
            return self._rewind(action, "a hook")
        if isinstance(action, _TakeBack):
            return self._take_back(action.char)
        text = self._visible()
        for validator in self.validators:
            try:
                verdict = validator(text)
            except BaseException:
                self._rewind_quietly(index)  # back to the last good state: before the token
                raise
            if verdict is not None:
                if not isinstance(verdict, Rewind):
                    raise TypeError(
                        f"validator {validator!r} returned {verdict!r}; expected None or Rewind"
                    )
                return self._rewind(verdict, "a validator")
        if self.banned:
            # Banned phrases are looked for in the text a stop string can no longer cut (text
            # held as the start of one is seen once released: "city of" is no match in
            # "city of New" that the stop "of New" ends). A constraint may force the text that
            # follows: a phrase it completes is written whatever is sampled next, so the token
            # that led there is taken back now (it would be final, out of reach, by the time
            # the phrase is).
            text = self._out
            ahead = text if gen.text_state.held_text else text + gen.forced_text()
            start = self.banned.find(ahead, self._scan_from, gen.is_done)
            if start is not None and start >= len(text):
                return self._rewind_to(index, ban=True)
            if start is not None:
                at = self._match_token(start)
                own = at == self._token_of(start)  # (else: the first token a rewind reaches)
                also = self._spellings(at, ahead, start) if own else frozenset()
                return self._rewind_to(at, ban=True, also=also)
            self._scan_from = self.banned.hold_from(text)
        return self._emit()

    def _mark(self) -> _Mark:
        held = self.generator.text_state.held_bytes
        cp = self.sequence.checkpoint(self.generator)
        return _Mark(cp, len(self._out), len(self._visible()), bool(held))

    def _visible(self) -> str:
        return self._out + self.generator.text_state.held_text

    def _run_hooks(
        self, chunk: Chunk, row: np.ndarray, before: Checkpoint
    ) -> tuple[Chunk, Resample | Rewind | _TakeBack | None]:
        step: Step | None = None
        for hook in self.hooks:
            if step is None or step.token != chunk.tokens[0]:
                text = self._out + chunk.text + self.generator.text_state.held_text
                index = len(self.generator.tokens) - 1
                step = Step(
                    self.sequence.vocab, len(self.sequence), index, chunk.tokens[0], text, row
                )
            action = hook(step)
            if action is None:
                continue
            if isinstance(action, Override):
                self._undo_candidate(before)
                chunk = self.generator.accept(action.token, row)
            elif isinstance(action, Resample | Rewind):
                return chunk, action
            else:
                raise TypeError(
                    f"hook {hook!r} returned {action!r}; "
                    "expected None, Override, Resample or Rewind"
                )
        return chunk, self._repeats(chunk)

    def _json_text(self, candidate: str = "") -> str:
        """The text a constraint reads: the healed prompt text, the output, the candidate's."""
        gen = self.generator
        return gen.healed + self._out + candidate + gen.text_state.held_text

    def _repeats(self, chunk: Chunk) -> Resample | _TakeBack | None:
        """With arrays whose items must be unique: the candidate's redraw, excluding every
        token that would spell what it spells up to where an item became equal to an earlier
        one; for a number, taking the item back whole (zeros and exponents would spell the
        same value again), for an array or object, its last character before the closer;
        None where the candidate repeats no item."""
        if self._unique is None:
            return None
        text = self._json_text(chunk.text)
        scan = self._unique
        if not text.startswith(scan.text):  # (a rewind went back past what was read)
            scan = self._unique = scan.reread()
        trial = scan.copy()
        at = trial.feed(text[len(scan.text) :])
        if at is None:
            self._unique_next = trial
            return None
        healed = len(self.generator.healed)
        if text[trial.repeated] in "-0123456789":
            return _TakeBack(trial.repeated - healed)
        if text[trial.repeated] in "[{":  # an array or object: change its last value, inner
            # ones' too (not the whitespace before a closer, which a grammar allows 24 of, nor
            # an inner closer, after which a number grew zeros), a number or literal whole
            last = len(text[:at].rstrip(" \t\n\r]}")) - 1
            while last > trial.repeated and text[last - 1] in SCALAR and text[last] in SCALAR:
                last -= 1
            return _TakeBack(max(trial.repeated, last) - healed)
        token = chunk.tokens[0]
        piece = self.sequence.vocab.piece(token).decode("utf-8", "replace")
        start = len(text) - len(piece)
        if "\ufffd" in piece or not text.endswith(piece) or at < start:
            return Resample(exclude=[token])
        lead = text[start : at + 1].encode()
        return Resample(exclude=[token, *self.sequence.vocab.tokens_starting_with(lead).tolist()])

    def _take_back(self, char: int) -> Chunk:
        """Rewind to the token where character ``char`` of the text (a repeated number's
        first) is, and ban that token there; where it is final, the last token only."""
        index = self._token_of(max(0, char))
        if not self._reachable(index):
            index = len(self.generator.tokens) - 1
        return self._rewind_to(index, ban=True)

    # forced tokens --------------------------------------------------------------------------
    def _fast_forward(self, chunk: Chunk, reserve: int = 0) -> Chunk:
        n_tokens = len(self.generator.tokens)
        super()._fast_forward(Chunk("", ()), reserve)  # (their text joins the output)
        if len(self.generator.tokens) == n_tokens:
            return chunk
        if self._unique is not None:  # (the text is outside unique arrays: nothing repeats)
            self._unique.feed(self._json_text()[len(self._unique.text) :])
            self._unique.keep()
        return join_chunks([chunk, self._emit()])

    def _forced_tokens(self, reserve: int) -> list[int]:
        """The forced tokens a plain run appends, up to the first character that would be in
        an array whose items must be unique (a rewind may have to take that text back: it is
        sampled, each token with its checkpoint). None right after a rewind: the token there
        may be banned, and is sampled."""
        if len(self._marks) != len(self.generator.tokens):
            return []
        forced = super()._forced_tokens(reserve)
        scan = self._unique
        if scan is None or not forced:
            return forced
        if scan.text != self._json_text():
            return []
        pieces = [self.sequence.vocab.piece(token) for token in forced]
        room = scan.outside(b"".join(pieces).decode("ascii"))  # (forced text is ASCII)
        ends = itertools.accumulate(len(piece) for piece in pieces)
        return [token for token, end in zip(forced, ends, strict=True) if end <= room]

    def _take_forced(self, token: int) -> Chunk:
        """Append a forced token with a mark no rewind reaches (its text is final once taken:
        see :meth:`_forced_tokens`)."""
        held = self.generator.text_state.held_bytes
        mark = _Mark(None, len(self._out), len(self._visible()), bool(held))
        self._marks.append(mark)
        self._visible_at.append(mark.visible)
        chunk = super()._take_forced(token)
        self._out += chunk.text
        return chunk

    def _undo_candidate(self, before: Checkpoint) -> None:
        """Take back the candidate the generator accepted, keeping the randomness it drew (the
        next draw here must not repeat it)."""
        assert before.generation is not None
        drawn = self.generator.rng.bit_generator.state
        self.generator.restore(before.generation)
        self.generator.rng.bit_generator.state = drawn

    # rewinds -----------------------------------------------------------------------------
    def _rewind(self, action: Rewind, who: str) -> Chunk:
        n_gen = len(self.generator.tokens)
        if action.chars is None:
            n = 1 if action.n is None else action.n
        else:
            text = self._visible()
            if action.chars > len(text):
                raise RewindError(
                    f"{who} asked to rewind {action.chars} characters, but only {len(text)} "
                    "were generated; the prompt cannot be rewound"
                )
            n = n_gen - self._token_of(len(text) - action.chars)
        if n > min(self.lookback, n_gen):
            raise RewindError(
                f"{who} asked to rewind {n} tokens, but only {min(self.lookback, n_gen)} can be "
                f"(generated: {n_gen}, lookback={self.lookback}); the prompt cannot be rewound"
            )
        return self._rewind_to(n_gen - n, action.ban)

    def _rewind_to(self, index: int, ban: bool, also: Set[int] = frozenset()) -> Chunk:
        """Drop the generated tokens from ``index`` on; with ``ban``, forbid the one there
        (and the tokens ``also``)."""
        if not self._retry():
            self._rewind_quietly(index)
            return self._end("retries")
        token = self.generator.tokens[index]
        self._rewind_quietly(index)
        self._rewinds += 1
        if ban:
            self._bans.setdefault(index, set()).update({token, *also})
        return self._emit()

    def _spellings(self, index: int, text: str, start: int) -> frozenset[int]:
        """The tokens that, in place of generated token ``index``, would start the banned
        literal matched at character ``start`` as it does: its other spellings (" c", " ca",
        " cat" beside " cats"). Banned together, generation leaves the phrase instead of
        writing it again in smaller pieces (a constraint that allows every spelling would
        use up the retries). Only the token itself for a regular expression's match, or
        where the token's text is not the text before the match (a healed first token, a
        character begun in an earlier token)."""
        phrase = self.banned.literal_at(text, start)
        if phrase is None or index >= len(self.generator.tokens) or self._marks[index].held_bytes:
            return frozenset()
        vocab = self.sequence.vocab
        lead = text[self._visible_at[index] : start].encode()
        found = vocab.tokens_extending(lead + phrase.encode()).tolist()
        spellings = frozenset(t for t in found if len(vocab.piece(t)) > len(lead))
        return spellings if self.generator.tokens[index] in spellings else frozenset()

    def _rewind_quietly(self, index: int) -> None:
        mark = self._marks[index]
        if not self._reachable(index) or mark.checkpoint is None:
            raise RewindError(
                f"cannot rewind to generated token {index}: the text before it is final "
                "(already streamed)"
            )
        self.sequence.rewind(mark.checkpoint, self.generator)
        del self._marks[index + 1 :]
        del self._visible_at[index + 1 :]
        del self.token_entries[index:]
        self._out = self._out[: mark.out_len]
        for later in [i for i in self._bans if i > index]:
            del self._bans[later]  # the text before them changed: they no longer apply
        self._scan_from = min(self._scan_from, self.banned.hold_from(self._out))
        if self._unique is not None:
            self._unique = self._unique.reread(self._json_text())

    def rewind(self, checkpoint: Checkpoint) -> None:
        """Go back to a checkpoint taken with :meth:`checkpoint` in this generation, while the
        text after it is still held back (a stream holds back what a rewind could reach: the
        last ``lookback`` tokens with hooks or validators, the start of a possible banned
        phrase); streamed text is final.

        Raises:
            RewindError: the checkpoint is not of this generation's current history, or the
                text after it was already streamed.
            ValueError: the checkpoint was taken without the generator's state.
        """
        if checkpoint.generation is None:
            raise ValueError("rewind to a checkpoint taken with run.checkpoint()")
        index = checkpoint.generation.n_tokens
        if index == len(self.generator.tokens) and self._is_end(checkpoint):
            # The current end has no mark (one is made when the next token is sampled), and
            # rewinding to it drops no text: final text stays as it is.
            self.sequence.rewind(checkpoint, self.generator)
        else:
            mark = self._marks[index] if index < len(self._marks) else None
            if mark is None or mark.checkpoint is None or mark.checkpoint.stamp != checkpoint.stamp:
                raise RewindError(
                    f"cannot rewind to generated token {index}: not in this generation's "
                    "current history, or the text before it is final (already streamed)"
                )
            self._rewind_quietly(index)
        self.finish_reason = self.generator.finish_reason  # a finished run's end stays finished
        self._user_rewinds += 1

    def drop_unreleased(self) -> None:
        """Drop the tokens whose text was not released yet (held back while a rewind could
        reach it): a stream closed early leaves the sequence spelling what it streamed.

        Nothing changes where the sequence has moved on (appended to, rewound, or another
        run started on it since), is closed or its model is, or where this thread is inside
        a decode (a stream the garbage collector closes there: the decode may be the
        sequence's own)."""
        seq, ctx = self.sequence, self.sequence.model.context
        if seq.is_closed or not ctx.is_open or ctx.locked_here:
            return
        if seq.run_epoch != self._epoch or not self.ends_sequence:
            return
        index = self._emitted_tokens
        if index < len(self.generator.tokens) and self._marks[index].checkpoint is not None:
            # (a model being closed, or a history rewound and written again alike: as it is)
            with contextlib.suppress(ClosedError, RewindError):
                self._rewind_quietly(index)

    def _is_end(self, checkpoint: Checkpoint) -> bool:
        """Whether ``checkpoint`` was taken at the sequence's current end."""
        seq = self.sequence
        return checkpoint.n_tokens == len(seq) and checkpoint.stamp == seq.checkpoint().stamp

    def _exhausted(self, index: int) -> Chunk:
        """Every token is ruled out here: the token before was a dead end (unless it is final).
        Where an item of a unique array was to begin, every item tried repeated another: the
        array takes no more, and the text after its last item is taken back (the "," and
        whitespace before the next one would only lead here again). Inside such an item, its
        text so far is given up: spelled in other tokens, it would only lead here again."""
        after = self._unique.close_last() if self._unique is not None else None
        if after is not None:
            return self._take_back(after - len(self.generator.healed))
        if self._unique is not None and not (self.hooks or self.validators or self.banned):
            # Inside an item: what it has so far leads only to repeats (a hook's reasons are
            # its own, a banned phrase may begin before the item), and no token may spell it
            # again.
            self._unique.give_up_item()
        if index == 0 or not self._reachable(index - 1):
            return self._end("retries")
        return self._rewind_to(index - 1, ban=True)

    def _reachable(self, index: int) -> bool:
        mark = self._marks[index]
        return mark.checkpoint is not None and mark.out_len >= self._emitted

    def _retry(self) -> bool:
        return self._rewinds + self._resamples < self.max_retries

    def _token_of(self, char: int) -> int:
        """The generated token holding the first byte of character ``char``."""
        n = len(self.generator.tokens)
        if char >= len(self._visible()):  # the next character: not complete yet
            index = n
        else:
            index = bisect.bisect_right(self._visible_at, char, 0, n) - 1
        # A character that was waiting for bytes when a token began started in an earlier one.
        while index > 0 and self._starts_inside(index, char):
            index -= 1
        return index

    def _starts_inside(self, index: int, char: int) -> bool:
        if index == len(self.generator.tokens):
            return bool(self.generator.text_state.held_bytes) and len(self._visible()) == char
        mark = self._marks[index]
        return mark.held_bytes and mark.visible == char

    # output ------------------------------------------------------------------------------
    def _emit(self) -> Chunk:
        """The output text no rewind can reach any more (all of it once generation ended)."""
        gen = self.generator
        if gen.is_done:
            return self._chunk(len(self._out), len(gen.tokens), gen.finish_reason)
        final = len(gen.tokens)
        if self.hooks or self.validators:
            final = max(0, final - self.lookback)
        if self.banned:
            final = min(final, self._banned_hold())
        if self._unique is not None and (start := self._unique.held_from) is not None:
            # An item of a unique array is open: until it ends, a redraw that finds no token
            # left may have to take back tokens of it.
            final = min(final, self._token_of(max(0, start - len(gen.healed))))
        for mark in self._marks[self._emitted_tokens : final]:
            mark.checkpoint = None
        end = self._marks[final].out_len if final < len(self._marks) else len(self._out)
        return self._chunk(max(end, self._emitted), final, None)

    def _banned_hold(self) -> int:
        """The first generated token a banned match could still start in: after the text so
        far, or after the text before any token a rewind can still reach (a rewind changes
        what follows there: with "\\nT" banned, ".\\n\\n" released its first "\\n", the
        second was banned for the "The" after it, and the model wrote ".\\nThe"). One level:
        a rewind after a rewind may still find a match that starts in released text (see
        :meth:`_match_token`)."""
        text = self._out  # (text held for a stop string is not looked at yet)
        hold = self.banned.hold_from(text)
        for index in range(max(self._emitted_tokens, self._token_of(hold)), len(self._marks)):
            hold = min(hold, self.banned.hold_from(text, min(self._visible_at[index], len(text))))
        return self._token_of(hold)

    def _end(self, reason: FinishReason) -> Chunk:
        """Finish early; first cut any banned match that counts now that the text ends."""
        while True:
            held = self.generator.text_state.held_bytes
            self._out += self.generator.end(reason).text
            if held and self.token_entries:  # a split character's U+FFFD: its last token's text
                last = self.token_entries[-1]
                self.token_entries[-1] = replace(last, text=last.text + decode_flush(held))
            start = self.banned.find(self._out, self._scan_from, True) if self.banned else None
            if start is None:
                return self._chunk(
                    len(self._out), len(self.generator.tokens), self.generator.finish_reason
                )
            at = self._match_token(start)
            if at >= len(self.generator.tokens):
                raise RewindError(f"a banned phrase at character {start} is in released text")
            self._rewind_quietly(at)

    def _match_token(self, start: int) -> int:
        """The token to rewind to for a banned match at character ``start``: the one holding
        its first byte, or where that is released text already (a chain of rewinds changed
        what followed it), the first token a rewind can reach, which the match runs into."""
        return max(self._token_of(start), self._emitted_tokens)

    def _chunk(self, end: int, n_tokens: int, reason: FinishReason | None) -> Chunk:
        text = self._out[self._emitted : end]
        tokens = tuple(self.generator.tokens[self._emitted_tokens : n_tokens])
        self._emitted, self._emitted_tokens = end, max(n_tokens, self._emitted_tokens)
        logprob, entries = None, tuple(self.token_entries[n_tokens - len(tokens) : n_tokens])
        if self.generator.logprobs is not None and tokens:
            logprob = math.fsum(e.logprob for e in entries)
        top = entries[0].top if len(entries) == 1 else ()  # (several: each entry's own)
        if reason is None:
            return Chunk(text, tokens, logprob=logprob, top_logprobs=top, logprobs=entries)
        self.finish_reason = reason
        stop = self.generator.stop_hit
        return Chunk(text, tokens, reason, stop, logprob, top, stats=self.stats(), logprobs=entries)

    def stats(self) -> GenerationStats:
        """What the generation has cost so far."""
        return self.cost(self._rewinds + self._user_rewinds, self._resamples)
