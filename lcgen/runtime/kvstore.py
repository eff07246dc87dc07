"""The model keeps its KV cache: every sequence starts from the longest cached prefix.

llama.cpp's unified KV cache is one pool of cells shared by up to ``n_seq_max`` sequence ids,
the slots. The store hands slots to sequences and, when a sequence closes, keeps ("parks") its
cells under its tokens instead of wiping them. A sequence opened on tokens T starts from the
slot whose cells share the longest prefix with T: a parked entry (taken over when nothing of it
would be lost or no slot is free, else copied with ``llama_memory_seq_cp``, which shares cells
and copies no KV bytes), a pinned entry, or a live sequence's decoded prefix; only the rest of T
is decoded. Parked entries are evicted least recently used when a slot or cells are needed, or
when the cells held pass the budget; live and pinned entries never are. Slots are a scheduling
resource: a thread that needs one while other threads hold all of them waits for one.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import math
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lcgen._numbers import check_bool
from lcgen.errors import SlotBusyError, SlotsExhaustedError, StateFileError
from lcgen.runtime import statefile
from lcgen.runtime.context import Context, DecodeRequest, check_fits, finished
from lcgen.vocab import Vocab

EntryState = Literal["live", "parked", "pinned", "dropped"]
_BLOB_LEN = struct.Struct("<Q")
# A thread waiting for a slot runs the garbage collector this often (seconds; see _wait).
COLLECT_EVERY = 5.0


class _ThreadMark:
    """One per thread, gone when its thread ends (with the thread's locals)."""

    __slots__ = ("__weakref__",)


ThreadRef = weakref.ref[_ThreadMark]
_marks = threading.local()


def this_thread() -> ThreadRef:
    """The calling thread, as a reference that dies when the thread ends (a thread's ident
    does not tell: the next thread gets it again)."""
    ref: ThreadRef | None = getattr(_marks, "ref", None)
    if ref is None:
        _marks.mark = mark = _ThreadMark()
        _marks.ref = ref = weakref.ref(mark)
    return ref


@dataclass(eq=False, slots=True)
class Entry:
    """What one slot holds.

    Attributes:
        slot: the llama.cpp sequence id.
        tokens: a live sequence's tokens (the same list; those past the cells are pending), or
            the tokens a parked or pinned entry's cells hold.
        state: ``"live"`` (a sequence uses it), ``"parked"`` (kept until evicted),
            ``"pinned"`` (kept until unpinned) or ``"dropped"`` (its slot is gone).
        last_used: a clock value, for least-recently-used eviction.
        owner: the thread that opened a live entry, or decoded it last (:func:`this_thread`).
        end_logits: ``(n, logits)``: the logits after the first ``n`` tokens, kept from the
            decode that made their cells (read-only; None once those cells or tokens change).
        broken: its cells gave logits with NaN (a forged saved state): dropped, not parked,
            when the sequence closes (every call that reused them failed).
        holder: the sequence that holds a live entry (a weak reference): one gone while its
            entry is live did not park it (Ctrl-C cut its finalizer short), and
            :meth:`KVStore._collect` does.
    """

    slot: int
    tokens: list[int]
    state: EntryState = "live"
    last_used: int = 0
    owner: ThreadRef | None = None
    end_logits: tuple[int, np.ndarray] | None = None
    broken: bool = False
    holder: weakref.ref[Any] | None = None

    def keep_logits(self, n: int, row: np.ndarray) -> None:
        """Keep a copy of ``row``, the logits after the first ``n`` tokens."""
        kept = np.array(row, dtype=np.float32)
        kept.flags.writeable = False
        self.end_logits = (n, kept)

    def cut(self, n_cells: int) -> None:
        """The entry's cells were cut to ``n_cells``: drop kept logits past them."""
        if self.end_logits is not None and self.end_logits[0] > n_cells:
            self.end_logits = None


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What the model's KV store did and holds.

    Attributes:
        hits: sequences that started from a cached prefix.
        misses: sequences that found none (a sequence loaded from a file looks for none).
        tokens_reused: prompt tokens those hits did not decode.
        tokens_decoded: every token the context decoded.
        evictions: parked entries dropped for room (slots, cells or the budget).
        cells_held: KV cells in use (live, parked and pinned, each shared cell once).
        budget: the most cells the store lets entries hold before it evicts.
        entries: parked and pinned entries.
        pinned: pinned entries.
        live: slots used by live sequences.
        free_slots: slots holding nothing.
        waiting: threads waiting for another thread to give a slot back.
    """

    hits: int
    misses: int
    tokens_reused: int
    tokens_decoded: int
    evictions: int
    cells_held: int
    budget: int
    entries: int
    pinned: int
    live: int
    free_slots: int
    waiting: int


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start (slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_prefixes(prompts: Seq[Seq[int]], minimum: int) -> list[list[int]]:
    """The longest prefixes (of at least ``minimum`` tokens) that two or more of ``prompts``
    share, none a prefix of another, longest first. A prompt given twice shares all of
    itself. Decoding these once covers every shared prefix: a shorter one is a prefix of one
    of them."""
    order = sorted(map(tuple, prompts))  # a prompt shares the most with a neighbour here
    found: set[tuple[int, ...]] = set()
    for a, b in itertools.pairwise(order):
        n = common_prefix(a, b)
        if n >= minimum:
            found.add(a[:n])
    ordered = sorted(found)  # a prefix comes right before the prefixes that extend it
    kept = [
        p for p, q in itertools.zip_longest(ordered, ordered[1:], fillvalue=()) if q[: len(p)] != p
    ]
    return [list(p) for p in sorted(kept, key=len, reverse=True)]


def check_slot_timeout(value: object) -> None:
    """Refuse a ``slot_timeout`` that is not a number of seconds >= 0, or None.

    Raises:
        TypeError: not a number (a string such as ``"1"``).
        ValueError: below 0, or NaN.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | None):
        raise TypeError(f"slot_timeout must be a number of seconds or None, got {value!r}")
    if value is not None and not value >= 0:
        raise ValueError(f"slot_timeout must be >= 0 seconds or None, got {value!r}")


class KVStore:
    """The KV cache of one model's context (``model.cache``).

    Args:
        context: the context whose slots and cells it manages.
        vocab: for :meth:`pin` of text.
        fingerprint: the model's fingerprint (for :meth:`save` and :meth:`load`).
        enabled: keep closed sequences' cells for later ones; False wipes a slot on close, so
            a sequence reuses only what a live sequence (a fork, a sibling sample) or a pinned
            prefix holds.
        budget: the most cells entries may hold before parked ones are evicted (None: the
            whole pool, so parked entries go only when their room is needed).
        slot_timeout: how long a thread waits for a slot that other threads hold (None: as
            long as it takes).
    """

    def __init__(
        self,
        context: Context,
        vocab: Vocab,
        fingerprint: Callable[[], str],
        *,
        enabled: bool = True,
        budget: int | None = None,
        slot_timeout: float | None = None,
    ) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"the cache budget must be >= 0 cells, got {budget!r}")
        check_slot_timeout(slot_timeout)
        self._ctx, self._vocab, self._fingerprint = context, vocab, fingerprint
        self.enabled = enabled
        self.budget = context.n_cells if budget is None else budget
        self.slot_timeout = slot_timeout
        self._free = list(range(context.n_seq_max - 1, -1, -1))
        self._entries: dict[int, Entry] = {}
        self._clock = itertools.count(1)
        # Critical sections take the lock itself (a C lock: its exit cannot be interrupted by
        # Ctrl-C, where a Condition's Python __exit__ could be, leaving it held for good).
        self._lock = context.lock
        self._cond = threading.Condition(context.lock)
        self._hits = self._misses = self._reused = self._evictions = 0
        self._uncounted = threading.local()  # see uncounted()
        self._waiters: set[ThreadRef] = set()  # threads waiting for a slot
        self._dropped: collections.deque[Entry] = collections.deque()  # see dropped
        self._collected_at = -math.inf  # when a waiting thread last ran the garbage collector
        # Beam searches take turns: each holds slots while it forks more, and two in different
        # threads could each wait for the other's slots forever.
        self._beam_turn = threading.RLock()  # (an RLock knows its owner: see beam_turn)
        self._local = threading.local()  # .no_wait: this thread's opens raise, not wait
        context.on_full = self._evict_for_cells

    @contextlib.contextmanager
    def without_waiting(self) -> Iterator[None]:
        """Within it, this thread's requests for a slot that other threads hold raise
        :class:`SlotBusyError` at once instead of waiting (a thread holding slots that waits
        for another's could wait forever, each for the other)."""
        before = getattr(self._local, "no_wait", False)
        self._local.no_wait = True
        try:
            yield
        finally:
            self._local.no_wait = before

    @contextlib.contextmanager
    def beam_turn(self) -> Iterator[None]:
        """Hold the turn for a beam search (one thread at a time forks beams).

        Raises:
            SlotsExhaustedError: another thread's search kept the turn past ``slot_timeout``.
        """
        turn = self._beam_turn
        timeout = -1 if self.slot_timeout is None else self.slot_timeout
        try:  # (given back whenever this thread holds it: Ctrl-C may come right after it)
            got = turn.acquire(blocking=False)  # (at once in a search inside a search)
            if not got:
                # Waiting for the turn counts as waiting for a slot: a search that holds the
                # turn and waits for this thread's slots then sees that none will come.
                me = this_thread()
                with self._lock:
                    self._waiters.add(me)
                    self._cond.notify_all()
                try:
                    got = turn.acquire(timeout=timeout)
                finally:
                    with self._lock:
                        self._waiters.discard(me)
            if not got:
                raise SlotsExhaustedError(
                    f"another thread's beam search held the slots past slot_timeout="
                    f"{self.slot_timeout} s"
                )
            yield
        finally:
            with contextlib.suppress(RuntimeError):  # (not acquired: nothing to give back)
                turn.release()

    # opening and closing sequences ------------------------------------------------------
    def open(self, tokens: Seq[int], *, limit: int | None = None) -> tuple[Entry, int]:
        """A live entry for a sequence of ``tokens``, holding the cells of the longest cached
        prefix.

        Args:
            tokens: the sequence's tokens (checked).
            limit: reuse at most this many (default: all but the last token, which a sequence
                keeps pending so that its next step has logits; or all of them where an entry
                kept the logits after exactly ``tokens``).

        Returns:
            The entry (its ``tokens`` is a new list of ``tokens``; its ``end_logits`` those of
            the source that its reused cells cover) and how many of them have cells already.

        Raises:
            SlotsExhaustedError: every slot is held by a live or pinned sequence and no other
                thread can give one back (or none did within ``slot_timeout``).
        """
        whole = limit is None
        limit = max(0, len(tokens) - 1) if limit is None else limit
        self._local.opened = self._local.taken = None
        with self._lock:
            # Until the entry is registered a slot taken for it is neither free nor held: an
            # exception (Ctrl-C) on the way gives it back (see _give_back).
            try:
                deadline = self._deadline()
                while True:  # the best source is chosen again after every wait: it may change
                    self._park_dropped()
                    src, n_reused = self._best(tokens, limit, whole)
                    if src is not None and self._takes_over(src, n_reused):
                        entry = src  # (registered already, parked)
                        if n_reused < self._ctx.ledger.held(entry.slot):
                            self._evictions += 1  # its tail is lost
                        if not self._ctx.truncate(entry.slot, n_reused):
                            self._ctx.clear_slot(entry.slot)  # the window lost what it needs
                            n_reused = 0
                        entry.cut(n_reused)
                        break
                    slot = self._try_slot(keep=src)
                    if slot is not None:
                        entry = Entry(slot, [])
                        if src is not None and n_reused:
                            self._ctx.copy_slot(src.slot, entry.slot, n_reused)
                            if self._ctx.holds_window(entry.slot, n_reused):
                                entry.end_logits = src.end_logits
                                entry.cut(n_reused)
                            else:
                                self._ctx.clear_slot(entry.slot)
                                n_reused = 0
                        break
                    self._wait(deadline)
                self._count(n_reused)
                self._register(entry, list(tokens))
            except BaseException:
                self._give_back()
                raise
            return entry, n_reused

    def _register(self, entry: Entry, tokens: list[int]) -> None:
        """Make ``entry`` this thread's live one, registered; it goes live last, once
        :meth:`abandon_opened` can find it."""
        entry.tokens, entry.owner, entry.holder = tokens, this_thread(), None
        entry.last_used = next(self._clock)
        self._entries[entry.slot] = entry
        self._local.opened, self._local.taken = entry, None
        entry.state = "live"

    def abandon_opened(self) -> None:
        """Park the entry this thread's last :meth:`open` or :meth:`fork` made live where an
        exception (Ctrl-C) kept a sequence from taking it (the caller's ``except``): it would
        be live for good, owned by none. Idempotent, as parking is."""
        entry, self._local.opened = getattr(self._local, "opened", None), None
        if entry is not None and entry.state == "live":
            self.park(entry)

    def fork(self, entry: Entry) -> Entry:
        """A live entry sharing all of ``entry``'s cells (none are copied), same tokens."""
        self._local.opened = self._local.taken = None
        with self._lock:
            try:  # (see open)
                slot = self._take_slot(keep=entry)
                held = self._ctx.ledger.held(entry.slot)
                if held:
                    self._ctx.copy_slot(entry.slot, slot, held)
                child = Entry(slot, [])
                child.end_logits = entry.end_logits
                self._register(child, list(entry.tokens))
            except BaseException:
                self._give_back()
                raise
            return child

    def park(self, entry: Entry) -> None:
        """A sequence closed: keep its cells under its tokens (or wipe them with the cache
        off). Idempotent.

        A sequence may be closed by the garbage collector (a stream dropped half-way: its
        generator's cleanup, or the sequence's finalizer), which runs inside any allocation,
        the store's and the context's own loops included. Where this thread holds their lock,
        the entry waits for the next call that takes it (or a waiting thread's next look:
        see :meth:`_wait`): parking there would change what those loops walk."""
        self._dropped.append(entry)
        self._park_dropped_outside()

    def _park_dropped_outside(self) -> None:
        """Park the dropped entries now, unless this thread is inside the store's or the
        context's work (see :meth:`park`)."""
        if not self._ctx.locked_here:
            with self._lock:
                self._park_pending()

    def _park_dropped(self) -> None:
        while self._dropped:
            self._park(self._dropped.popleft())

    def _park(self, entry: Entry) -> None:
        with self._lock:
            if entry.state != "live" or self._entries.get(entry.slot) is not entry:
                return
            held = self._ctx.ledger.held(entry.slot)
            if held > len(entry.tokens) and self._ctx.is_open:  # cells past its tokens (a
                # step cut short as the model closed): they spell nothing the entry knows
                held = len(entry.tokens) if self._ctx.truncate(entry.slot, len(entry.tokens)) else 0
            if not (self.enabled and held and self._ctx.is_open) or entry.broken:
                self._drop(entry)
                return
            entry.tokens, entry.state, entry.owner = entry.tokens[:held], "parked", None
            entry.cut(held)
            entry.last_used = next(self._clock)
            self._dedupe(entry)
            self._fit_budget()
            self._cond.notify_all()

    def cached(self, prompt: str | Seq[int], *, special: bool = False) -> int:
        """How many of a prompt's tokens a sequence opened on them now would not decode (all
        of them where an entry kept the logits after exactly these tokens).

        Args:
            prompt: text (tokenized as a prompt, BOS included) or token ids.
            special: parse special-token text in ``prompt``.

        Raises:
            ClosedError: the model is closed.
            TypeError: ``prompt`` is neither text nor token ids.
            ValueError: a token id is outside the vocabulary.
        """
        self._ctx.check_open()
        tokens = self._tokens_of(prompt, special)
        with self._lock:
            return self._best(tokens, max(0, len(tokens) - 1), True)[1]

    def free_cells(self) -> int:
        """Cells a decode could have now: free ones and those only parked entries hold (they
        are evicted for it).

        Raises:
            ClosedError: the model is closed (its cells are gone).
        """
        self._ctx.check_open()
        self._park_dropped_outside()
        with self._lock:
            kept = {slot for slot, e in self._entries.items() if e.state != "parked"}
            return self._ctx.n_cells - self._ctx.ledger.n_cells(kept)

    def available_slots(self) -> int:
        """Slots a new sequence could have now: free ones and those of parked entries.

        Raises:
            ClosedError: the model is closed.
        """
        self._ctx.check_open()
        self._park_dropped_outside()
        with self._lock:
            return self._n_available()

    # choosing ------------------------------------------------------------------------------
    def _best(self, tokens: Seq[int], limit: int, whole: bool) -> tuple[Entry | None, int]:
        """The entry whose cells share the longest prefix with ``tokens`` (on a tie: one that a
        takeover would lose nothing of, then a parked one), and that length; with ``whole``,
        past ``limit`` to all of ``tokens`` where an entry kept the logits after them."""
        best: Entry | None = None
        best_key = (0, False, False, 0)
        for entry in self._entries.values():
            held = self._ctx.ledger.held(entry.slot)
            n = min(common_prefix(entry.tokens, tokens), held)
            kept = entry.end_logits
            if not (whole and kept is not None and kept[0] == n == len(tokens)):
                n = min(n, limit)
            key = (n, n == held, entry.state == "parked", entry.last_used)
            # An entry whose window has moved past what the prefix needs cannot give it:
            # another (a pinned prefix) may.
            if n > 0 and key > best_key and self._ctx.serves(entry.slot, n):
                best, best_key = entry, key
        return best, best_key[0]

    def _takes_over(self, src: Entry, n_reused: int) -> bool:
        """Take a parked entry's slot itself when nothing of it is lost (the new tokens extend
        it), or when no slot is free and it is the one eviction would take anyway; else copy
        its prefix and keep it for others."""
        if src.state != "parked":
            return False
        if n_reused == self._ctx.ledger.held(src.slot):
            return True
        return not self._free and self._lru_parked() is src

    def _try_slot(self, keep: Entry | None) -> int | None:
        """A free slot; else the least recently used parked entry's (never ``keep``'s);
        else None."""
        if not self._free:
            victim = self._lru_parked(keep)
            if victim is None:
                return None
            self._evict(victim)
        # No call between taking the slot and noting it (Ctrl-C lands only at calls):
        # :meth:`_give_back` finds it there until the entry is registered.
        slot = self._free[-1]
        del self._free[-1]
        self._local.taken = slot
        return slot

    def _give_back(self) -> None:
        """Give the slot this thread took last (:meth:`_try_slot`), where an exception
        (Ctrl-C) kept its entry from being registered, back wiped: it would be neither free
        nor held, for good."""
        slot, self._local.taken = getattr(self._local, "taken", None), None
        if slot is not None and self._entries.get(slot) is None and slot not in self._free:
            self._ctx.clear_slot(slot)
            self._free.append(slot)
            self._cond.notify_all()

    def _take_slot(self, keep: Entry | None, deadline: float | None = None) -> int:
        """A slot as :meth:`_try_slot` finds one, waiting for other threads when none is (up
        to ``deadline``, else ``slot_timeout`` from now)."""
        deadline = self._deadline() if deadline is None else deadline
        while True:
            self._park_dropped()
            if (slot := self._try_slot(keep)) is not None:
                return slot
            self._wait(deadline)

    def _deadline(self) -> float | None:
        return None if self.slot_timeout is None else time.monotonic() + self.slot_timeout

    def _wait(self, deadline: float | None) -> None:
        """Wait for another thread to give a slot back (the caller then chooses again).

        Raises:
            SlotsExhaustedError: no other running thread holds a live sequence, or every
                thread that holds one waits for a slot too (each would wait for the others
                forever), or ``slot_timeout`` passed.
            SlotBusyError: within :meth:`without_waiting`.
        """
        self._ctx.check_open()  # closed while this thread waited: ClosedError
        me = this_thread()
        owners = [e.owner for e in self._entries.values() if e.state == "live"]
        # A thread that ended holding a sequence will not close it: count running ones only.
        holders = {o for o in owners if o is not None and o() is not None} - {me}
        stuck = not holders or holders <= self._waiters
        now = time.monotonic()
        # A sequence dropped inside a reference cycle keeps its slot until the cyclic garbage
        # collector runs, which a waiting thread (allocating nothing) never starts: collect
        # now and then, and before giving up.
        if (stuck or now - self._collected_at >= COLLECT_EVERY) and self._collect(now):
            return
        if not holders:
            ended = sum(o is not None and o() is None for o in owners)
            prefix = (
                f"{ended} sequence slots are held by threads that have ended without closing "
                "their sequences, so none would come free: "
                if ended
                else ""
            )
            raise SlotsExhaustedError(prefix + self._exhausted_message())
        if getattr(self._local, "no_wait", False):
            raise SlotBusyError(self._exhausted_message())
        if stuck:
            raise SlotsExhaustedError(
                f"every other thread that holds a sequence slot ({len(holders)}) is waiting "
                "for one too, so none would come free: " + self._exhausted_message()
            )
        left = None if deadline is None else deadline - now
        if left is not None and left <= 0:
            raise SlotsExhaustedError(
                f"no sequence slot came free within slot_timeout={self.slot_timeout} s: "
                + self._exhausted_message()
            )
        collect_in = self._collected_at + COLLECT_EVERY - now  # then wake to collect again
        left = collect_in if left is None else min(left, collect_in)
        self._waiters.add(me)
        try:
            self._cond.wait(left)
        finally:
            self._waiters.discard(me)

    def _collect(self, now: float) -> bool:
        """Run the garbage collector (the finalizers of dropped sequences park them, once
        this thread's loop lets them: see :meth:`park`); whether that made a slot free or
        parked one (else the caller would only look again at what it saw)."""
        self._collected_at = now
        before = self._n_available()
        gc.collect()
        self._park_pending()
        return self._n_available() > before

    def _park_pending(self) -> None:
        """Park the dropped entries, and the live ones whose sequence is gone: Ctrl-C inside
        its finalizer (which parks it) left the slot held by nothing, for good."""
        self._park_dropped()
        for entry in list(self._entries.values()):
            if entry.state == "live" and entry.holder is not None and entry.holder() is None:
                self._park(entry)

    def _n_available(self) -> int:
        return len(self._free) + sum(e.state == "parked" for e in self._entries.values())

    def wake(self) -> None:
        """Wake the threads waiting for a slot (the model was closed: they raise
        :class:`~lcgen.ClosedError`)."""
        with self._lock:
            self._cond.notify_all()

    def _exhausted_message(self) -> str:
        live = sum(e.state == "live" for e in self._entries.values())
        pinned = sum(e.state == "pinned" for e in self._entries.values())
        return (
            f"all {self._ctx.n_seq_max} sequence slots are in use ({live} by live sequences, "
            f"{pinned} by pinned prefixes): close a sequence (seq.close() or a with-block), "
            f"unpin a prefix, or load the model with n_seq_max > {self._ctx.n_seq_max}"
        )

    def _lru_parked(self, keep: Entry | None = None) -> Entry | None:
        parked = [e for e in self._entries.values() if e.state == "parked" and e is not keep]
        return min(parked, key=lambda e: e.last_used) if parked else None

    # dropping ------------------------------------------------------------------------------
    def _drop(self, entry: Entry) -> None:
        """Wipe a slot and make it free (finished where Ctrl-C interrupts it)."""
        finished(lambda: self._wipe(entry))
        self._cond.notify_all()

    def _wipe(self, entry: Entry) -> None:
        """:meth:`_drop`'s edit (idempotent)."""
        self._ctx.clear_slot(entry.slot)
        entry.end_logits = None
        if self._entries.get(entry.slot) is entry:
            if entry.slot not in self._free:
                self._free.append(entry.slot)
            del self._entries[entry.slot]
        entry.state = "dropped"

    def _evict(self, entry: Entry) -> None:
        self._drop(entry)
        self._evictions += 1

    def _evict_for_cells(self) -> bool:
        """The memory is full: evict the least recently used parked entry (False: none). With
        none, the garbage collector runs first: a sequence dropped inside a reference cycle
        holds its cells until it does (a generation that fits failed part-way)."""
        with self._lock:
            victim = self._lru_parked()
            loading = getattr(self._local, "loading", False)
            if victim is None and not loading:  # (parking could drop the entry it loads)
                gc.collect()
                self._park_pending()
                victim = self._lru_parked()
            if victim is None:
                return False
            self._evict(victim)
            return True

    def _dedupe(self, entry: Entry) -> None:
        """Drop the parked entries ``entry`` covers (their tokens start it), or ``entry``
        itself when it is parked and a parked or pinned one covers it, or pinned and another
        pinned one holds the same tokens (a pinned entry that a longer one covers stays: it
        was asked for)."""
        mine, first = entry.tokens, self._ctx.first_served(entry.slot)
        for other in list(self._entries.values()):
            if other is entry or other.state == "live":
                continue
            theirs = other.tokens
            if (
                other.state == "parked"
                and len(theirs) <= len(mine)
                and mine[: len(theirs)] == theirs
                and first <= self._ctx.first_served(other.slot)
            ):
                self._drop(other)
            elif self._covered_by(other, mine, entry.state == "pinned", first):
                self._drop(entry)
                return

    def _fit_budget(self) -> None:
        while self._ctx.ledger.n_cells() > self.budget:
            victim = self._lru_parked()
            if victim is None:
                return
            self._evict(victim)

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Sequences this thread opens inside are left out of the hit and reuse counts (a
        batch's own sequence of the prefix its prompts share: each prompt counts reusing it)."""
        self._uncounted.on = True
        try:
            yield
        finally:
            self._uncounted.on = False

    def _count(self, n_reused: int) -> None:
        if getattr(self._uncounted, "on", False):
            return
        if n_reused:
            self._hits += 1
            self._reused += n_reused
        else:
            self._misses += 1

    # the public cache API ------------------------------------------------------------------
    def pin(self, prompt: str | Seq[int], *, special: bool = False) -> int:
        """Decode ``prompt`` now (what is not cached already) and keep its cells until
        :meth:`unpin`: a system prompt or a document every later call starts from.

        Args:
            prompt: text (tokenized as a prompt, BOS included) or token ids.
            special: parse special-token text in ``prompt``.

        Returns:
            How many tokens were decoded for it.

        Raises:
            ValueError: the prompt is empty.
            SlotsExhaustedError: no slot can be had for it.
            ContextFullError: it is longer than the context, or the memory has no room for it.
        """
        tokens = self._tokens_of(prompt, special)
        if not tokens:
            raise ValueError("nothing to pin: the prompt is empty")
        check_fits(len(tokens), self._ctx.n_ctx)
        with self._lock:
            for entry in self._entries.values():
                if entry.state == "pinned" and entry.tokens == tokens:
                    return 0
            entry, n_reused = self.open(tokens, limit=len(tokens))
            try:
                if n_reused < len(tokens):
                    request = DecodeRequest(entry.slot, tokens[n_reused:], n_reused)
                    (row,) = self._ctx.decode([request])
                    assert row is not None
                    entry.keep_logits(len(tokens), row)
            except BaseException:
                self._drop(entry)
                raise
            entry.state, entry.owner = "pinned", None
            self._dedupe(entry)
            return len(tokens) - n_reused

    def unpin(self, prompt: str | Seq[int], *, special: bool = False) -> bool:
        """Let a pinned prefix be evicted like any parked one. Returns whether it was pinned.

        Raises:
            ClosedError: the model is closed.
        """
        self._ctx.check_open()
        tokens = self._tokens_of(prompt, special)
        with self._lock:
            for entry in self._entries.values():
                if entry.state == "pinned" and entry.tokens == tokens:
                    entry.state, entry.last_used = "parked", next(self._clock)
                    self._fit_budget()  # (it may hold more cells than the budget)
                    self._cond.notify_all()
                    return True
            return False

    def _tokens_of(self, prompt: str | Seq[int], special: bool) -> list[int]:
        if isinstance(prompt, str):
            return self._vocab.tokenize(prompt, special=special)
        return self._vocab.check_tokens(prompt)

    @property
    def stats(self) -> CacheStats:
        """What the store did and holds now (a value); a closed model's holds nothing."""
        held = not self._ctx.closing
        if held:
            self._park_dropped_outside()
        with self._lock:
            states = [e.state for e in self._entries.values()] if held else []
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                tokens_reused=self._reused,
                tokens_decoded=self._ctx.n_decoded,
                evictions=self._evictions,
                cells_held=self._ctx.ledger.n_cells() if held else 0,
                budget=self.budget,
                entries=states.count("parked") + states.count("pinned"),
                pinned=states.count("pinned"),
                live=states.count("live"),
                free_slots=len(self._free) if held else 0,
                waiting=len(self._waiters),
            )

    def clear(self, *, pinned: bool = False) -> None:
        """Drop every parked entry (and, with ``pinned``, every pinned one); live sequences
        keep theirs.

        Raises:
            ClosedError: the model is closed.
        """
        check_bool("pinned", pinned)
        self._ctx.check_open()
        self._park_dropped_outside()  # sequences closed where parking had to wait
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.state == "parked" or (pinned and entry.state == "pinned"):
                    self._drop(entry)

    # persistence ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, pinned_only: bool = False) -> int:
        """Write the parked and pinned entries (or only the pinned ones) to ``path``
        atomically, for :meth:`load` in another process of the same model.

        Returns:
            How many entries were written.

        Raises:
            StateFileError: ``path`` cannot be written (a directory, a missing folder...).
            ClosedError: the model is closed (its entries are gone).
        """
        check_bool("pinned_only", pinned_only)
        self._ctx.check_open()
        self._park_dropped_outside()
        with self._lock:
            kept = [
                e
                for e in self._entries.values()
                if e.state == "pinned" or (e.state == "parked" and not pinned_only)
            ]
            header: dict[str, Any] = {
                "model": self._fingerprint(),
                "kv": list(self._ctx.kv_types),
                "entries": [_entry_header(e) for e in kept],
            }
            sizes = [self._ctx.seq_state_size(e.slot) for e in kept]
            # The logits each entry kept, after every entry's state (its header says after
            # how many tokens): a prompt that is one of them samples without decoding, from
            # the logits the saving process had.
            rows = [statefile.logits_bytes(k[1]) for e in kept if (k := _saved_logits(e))]

            def write_kv(out: bytearray, offset: int, size: int) -> int:
                at = offset
                for entry, most in zip(kept, sizes, strict=True):
                    n = self._ctx.seq_state_into(entry.slot, out, at + _BLOB_LEN.size, most)
                    _BLOB_LEN.pack_into(out, at, n)
                    at += _BLOB_LEN.size + n
                for row in rows:
                    _BLOB_LEN.pack_into(out, at, len(row))
                    out[at + _BLOB_LEN.size : at + _BLOB_LEN.size + len(row)] = row
                    at += _BLOB_LEN.size + len(row)
                return at - offset

            total = sum(sizes) + sum(map(len, rows)) + _BLOB_LEN.size * (len(kept) + len(rows))
            data = statefile.encode(header, total, write_kv, statefile.CACHE)
        statefile.write_atomic(path, data, statefile.CACHE)
        return len(kept)

    def load(self, path: str | os.PathLike[str]) -> int:
        """Load entries written by :meth:`save` (as they were: parked or pinned).

        With the cache off (``cache=False``, which keeps nothing of closed sequences) only the
        file's pinned entries are loaded; its parked ones are skipped.

        Returns:
            How many of the file's entries the cache holds once loaded (those it held
            already are not loaded again): not those skipped (parked ones with the cache
            off), nor those evicted to make room for later ones (more parked entries than
            slots, or than the cell budget).

        Raises:
            StateFileError: the file is corrupt, truncated, of another format version or of
                another model (nothing is loaded then).
            SlotsExhaustedError: the slots neither pinned prefixes nor this thread's live
                sequences hold cannot take the file's pinned entries (nothing is loaded then;
                where they take every such slot, the file's parked entries are skipped); or,
                as for any open, none came free in time (slots other threads hold are waited
                for, up to ``slot_timeout`` for the whole file).
        """
        self._ctx.check_open()  # (a closed model's ledger answered: a count came back)
        header, kv = statefile.decode(statefile.read_file(path, statefile.CACHE), statefile.CACHE)
        if header.get("model") != self._fingerprint():
            raise StateFileError(
                f"the cache file {os.fspath(path)!r} was saved with another model "
                f"(fingerprint {str(header.get('model'))[:12]})"
            )
        statefile.check_kv_types(header, self._ctx.kv_types, f"the cache file {os.fspath(path)!r}")
        items = _checked_entries(header, self._vocab, self._ctx.n_ctx)
        kept = [n for _, _, n in items if n is not None]
        blobs = _split_blobs(kv, len(items) + len(kept))
        rows = iter(_logits_rows(blobs[len(items) :], kept, self._vocab.n_vocab))
        row_of = [next(rows) if n is not None else None for _, _, n in items]  # (file order)
        loaded: list[Entry] = []
        with self._lock:
            # What the cache holds already is not loaded again (a file saved from this cache:
            # its pinned entries would take the slots its parked ones need).
            todo = [
                (tokens, pinned, blob, row)
                for (tokens, pinned, _), blob, row in zip(items, blobs, row_of, strict=False)
                if (pinned or self.enabled) and not self._covered(tokens, pinned)
            ]
            # Shortest first: an entry shares the cells of the longest prefix that one loaded
            # before it holds, so a prefix's holder comes first; and a sliding window's
            # restored positions start no later in a longer entry (see Context.share_prefix).
            todo.sort(key=lambda item: len(item[0]))
            # Slots other threads' live sequences hold come back (loading waits for them as
            # any open does); pinned ones and this thread's own do not.
            n_pinned = sum(item[1] for item in todo)
            me = this_thread()
            pinned_now = sum(e.state == "pinned" for e in self._entries.values())
            mine = sum(e.state == "live" and e.owner is me for e in self._entries.values())
            room = self._ctx.n_seq_max - pinned_now - mine
            if n_pinned == room:  # no slot beside the pinned ones: the parked are skipped
                todo = [item for item in todo if item[1]]
            if todo and n_pinned > room:
                raise SlotsExhaustedError(
                    f"the cache file {os.fspath(path)!r} has {len(todo)} entries to load, "
                    f"{n_pinned} of them pinned, and {room} of the {self._ctx.n_seq_max} slots "
                    f"can take them ({pinned_now} hold pinned prefixes, {mine} this thread's "
                    "live sequences): unpin prefixes, close sequences, or load the model with "
                    f"a larger n_seq_max"
                )
            deadline = self._deadline()  # one slot_timeout for the whole file
            self._local.loading = True
            try:
                for tokens, pinned, blob, logits in todo:
                    loaded.append(self._load_entry(tokens, blob, deadline))
                    loaded[-1].state = "pinned" if pinned else "parked"
                    loaded[-1].end_logits = logits
            except BaseException:
                for entry in loaded:
                    if entry.state != "dropped":  # an evicted one's slot may be another's now
                        self._drop(entry)
                raise
            finally:
                self._local.loading = False
            for entry in loaded:
                if entry.state != "dropped":
                    self._dedupe(entry)
            self._fit_budget()
            return sum(self._covered(t, pinned) for t, pinned, _ in items if pinned or self.enabled)

    def _covered(self, tokens: list[int], pinned: bool) -> bool:
        """Whether an entry holds ``tokens`` already, as :meth:`_dedupe` would keep it over a
        new one: a parked or pinned entry that starts with them (for a pinned one, a pinned
        entry of exactly them), and serves what an entry restored from a file of them would
        (with a sliding window, llama.cpp's file holds the positions the last one needs)."""
        first = max(0, len(tokens) - 1)
        return any(self._covered_by(e, tokens, pinned, first) for e in self._entries.values())

    def _covered_by(self, other: Entry, tokens: list[int], pinned: bool, first: float) -> bool:
        """Whether ``other`` holds ``tokens`` as a new entry of them would be kept for: a
        parked or pinned entry that starts with them and serves every prefix from ``first``
        tokens on (see :meth:`Context.first_served`: with a sliding window, an entry restored
        from a file or whose old cells another sequence took serves its longer prefixes
        only), or for a pinned one, a pinned entry of exactly them."""
        if other.state == "live" or self._ctx.ledger.held(other.slot) < len(tokens):
            return False
        if self._ctx.first_served(other.slot) > first:
            return False
        if pinned:
            return other.state == "pinned" and other.tokens == tokens
        return other.tokens[: len(tokens)] == tokens

    def _load_entry(self, tokens: list[int], blob: memoryview, deadline: float | None) -> Entry:
        """Restore one entry into a slot of its own, sharing the longest prefix that another
        entry holds (llama.cpp restores a sequence into cells of its own)."""
        self._local.taken = None
        try:  # (Ctrl-C after the slot was taken: see open)
            entry = Entry(self._take_slot(None, deadline), tokens, "parked", next(self._clock))
            self._entries[entry.slot] = entry
        except BaseException:
            self._give_back()
            raise
        try:
            n = self._ctx.set_seq_state(entry.slot, blob)
            if n != len(tokens):
                raise StateFileError(
                    f"a cache entry of {len(tokens)} tokens holds the state of {n} positions"
                )
        except BaseException:
            self._drop(entry)  # load() drops only the entries it got back
            raise
        self._share_prefix(entry)
        return entry

    def _share_prefix(self, entry: Entry) -> None:
        """Let a restored entry hold the cells of the longest prefix that another entry holds
        in place of its own copy of them, as the cache that saved them shared theirs (the
        same bytes where it did; else the same tokens, as any cached prefix is reused)."""
        best, n_best = None, 0
        for other in self._entries.values():
            if other is not entry:
                n = min(
                    common_prefix(other.tokens, entry.tokens), self._ctx.ledger.held(other.slot)
                )
                if n > n_best:
                    best, n_best = other, n
        if best is not None:
            self._ctx.share_prefix(best.slot, entry.slot, n_best)


def _entry_header(entry: Entry) -> dict[str, Any]:
    """What a cache file's header says of an entry: its tokens, whether it is pinned, and
    after how many of them the logits it kept are (written after every entry's state)."""
    out: dict[str, Any] = {"tokens": entry.tokens, "pinned": entry.state == "pinned"}
    if kept := _saved_logits(entry):
        out["logits"] = kept[0]
    return out


def _saved_logits(entry: Entry) -> tuple[int, np.ndarray] | None:
    """The logits a cache file keeps for ``entry``: those it kept after some of its tokens."""
    kept = entry.end_logits
    return kept if kept is not None and kept[0] <= len(entry.tokens) else None


def _checked_entries(
    header: dict[str, Any], vocab: Vocab, n_ctx: int
) -> list[tuple[list[int], bool, int | None]]:
    """The (tokens, pinned, after how many tokens its kept logits are) of each entry a cache
    file's header lists.

    Raises:
        StateFileError: the header is malformed (a forged file whose checksum was recomputed),
            or an entry holds more tokens than the context (``n_ctx``).
    """
    entries = header.get("entries")
    if not isinstance(entries, list):
        raise StateFileError("the cache file's header lists no entries")
    out = []
    for item in entries:
        tokens = item.get("tokens") if isinstance(item, dict) else None
        try:
            checked = vocab.check_tokens(tokens) if isinstance(tokens, list) else None
        except (TypeError, ValueError):
            checked = None
        if not checked:
            raise StateFileError(
                f"a cache entry's tokens are not token ids of this model: {item!r:.80}"
            )
        if len(checked) > n_ctx:
            raise StateFileError(
                f"a cache entry holds {len(checked)} tokens, more than the context's {n_ctx}"
            )
        n = item.get("logits")
        if n is not None and not (type(n) is int and 0 < n <= len(checked)):
            raise StateFileError(f"a cache entry's logits follow {n!r:.20} of its tokens")
        out.append((checked, bool(item.get("pinned")), n))
    return out


def _logits_rows(
    blobs: list[memoryview], after: list[int], n_vocab: int
) -> list[tuple[int, np.ndarray]]:
    """The kept logits a cache file holds, each as an entry keeps them: (after how many
    tokens, a read-only row of ``n_vocab`` logits).

    Raises:
        StateFileError: a row is not ``n_vocab`` finite logits.
    """
    out = []
    for n, blob in zip(after, blobs, strict=True):
        if len(blob) != n_vocab * statefile.LOGITS.itemsize:
            raise StateFileError(
                f"a cache entry's logits are {len(blob)} bytes, not {n_vocab} float32 values"
            )
        out.append((n, statefile.read_logits(blob, "a cache entry's")))
    return out


def _split_blobs(kv: memoryview, n: int) -> list[memoryview]:
    blobs, at = [], 0
    for _ in range(n):
        if at + _BLOB_LEN.size > len(kv):
            raise StateFileError("the cache file holds fewer entries than its header lists")
        (size,) = _BLOB_LEN.unpack_from(kv, at)
        at += _BLOB_LEN.size
        if at + size > len(kv):
            raise StateFileError("a cache entry's state runs past the end of the file")
        blobs.append(kv[at : at + size])
        at += size
    if at != len(kv):
        raise StateFileError("the cache file holds more data than its header lists")
    return blobs
