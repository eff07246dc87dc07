"""The one scheduler: admit waiting work while slots allow, step every admitted run in one
batch, retire the finished ones.

``Model.generate`` of a list of prompts, the continuous API's batches and samples, and beam
search all run through it; each brings its own notion of starting a run (opening a sequence,
forking a cached prefix) and of finishing one (closing it, keeping its tokens). The scheduler
knows only the :class:`~lcgen.runtime.run.Run` protocol.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from lcgen.decoding import Chunk
from lcgen.errors import SlotBusyError
from lcgen.runtime.kvstore import KVStore
from lcgen.runtime.run import Run, step

# Start a run: open its sequences (from the longest cached prefix) and set it up.
Start = Callable[[], Run]


@dataclass(frozen=True, slots=True)
class Event:
    """What one step did to one run.

    Attributes:
        ticket: the number :meth:`Scheduler.submit` gave the work.
        run: the run.
        chunk: the text that became final in this step (None: none; a run that finished as
            it started, with ``max_tokens=0``, has no step at all).
    """

    ticket: int
    run: Run
    chunk: Chunk | None

    @property
    def is_last(self) -> bool:
        """Whether the run is finished: the owner retires it now (closes or parks its
        sequences) before the next step admits more work."""
        return self.run.is_done


class Scheduler:
    """Runs any number of generations on one model, as many at once as slots allow.

    Submit work with :meth:`submit`, then iterate: each step admits waiting work in the order
    it was submitted (while the slots it asks for can be had), decodes the pending tokens of
    every running generation whose new cells fit the memory in one batch (the rest wait),
    advances each, and yields an :class:`Event` per run stepped. Handle an event whose
    ``is_last`` is set by retiring its run (closing its sequences: their cells stay cached);
    the next step admits more.

    Args:
        cache: the model's KV store (``model.cache``), which hands out the slots.
    """

    def __init__(self, cache: KVStore) -> None:
        if not isinstance(cache, KVStore):
            raise TypeError(
                f"Scheduler takes the model's KV store (model.cache), got {cache!r:.60}"
            )
        self.cache = cache
        self._tickets = itertools.count()
        self._waiting: deque[tuple[int, Start, int, Seq[int] | None]] = deque()
        self._running: list[tuple[int, Run, int]] = []

    def submit(self, start: Start, *, n_slots: int = 1, prefills: Seq[int] | None = None) -> int:
        """Queue a generation that needs ``n_slots`` slots at most while it runs (a beam
        search: its width), and whose ``start`` decodes ``prefills`` at once (a prompt, from
        the longest cached prefix of it: the generation waits until the cells that still
        needs fit beside the running work); returns its ticket (0, 1, ... in the order of
        submission)."""
        if not callable(start):
            raise TypeError(f"start must be a callable that starts a run, got {start!r:.60}")
        if isinstance(n_slots, bool) or not isinstance(n_slots, int):
            raise TypeError(f"n_slots must be an int, got {n_slots!r:.60}")
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots!r}")
        ticket = next(self._tickets)
        self._waiting.append((ticket, start, n_slots, prefills))
        return ticket

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def __iter__(self) -> Iterator[Event]:
        while self.has_work:
            yield from self.step()

    def step(self) -> list[Event]:
        """Admit, decode one batch, advance every running generation.

        Raises:
            SlotsExhaustedError: nothing runs, and the next waiting work cannot get a slot:
                they are all held by this thread's live sequences or pinned prefixes.
        """
        events = self._admit()
        if self._running:
            stepped = self._fitting()
            chunks = step([run for _, run, _ in stepped])
            events += [
                Event(ticket, run, chunk)
                for (ticket, run, _), chunk in zip(stepped, chunks, strict=True)
            ]
            self._running = [job for job in self._running if not job[1].is_done]
        return events

    def _fitting(self) -> list[tuple[int, Run, int]]:
        """The running work whose next step's new cells fit the memory (free cells and those
        only parked entries hold), in order of admission: the first always (alone it fits, or
        its error says why not); the rest from the first that does not fit wait a step, so a
        burst of long prompts queues for cells instead of failing the batch."""
        free = self.cache.free_cells()
        stepped: list[tuple[int, Run, int]] = []
        for job in self._running:
            seqs = job[1].sequences()
            need = sum(seq.n_pending for seq in seqs)
            if need > free:  # drafts only save time: dropped before anything waits for them
                for seq in seqs:
                    seq.drop_draft()
                need = sum(seq.n_pending for seq in seqs)
            if not stepped and need > free:
                free = self._make_room(need, free)
            if stepped and need > free:
                break
            stepped.append(job)
            free -= need
        return stepped

    def _make_room(self, need: int, free: int) -> int:
        """Where the first running generation's next step needs more than the ``free`` cells,
        pause the youngest others, one sequence each, by dropping their cells (their tokens
        stay; they decode them again once cells are free), until it fits: elements that fit
        the context alone but not together all the way to ``max_tokens`` then finish one after
        another instead of failing the batch when every one needs a cell. Returns the free
        cells now."""
        for _, run, _ in reversed(self._running[1:]):
            if need <= free:
                break
            seqs = run.sequences()
            # (not a beam: its forks would lose the cells they share)
            if len(seqs) == 1 and seqs[0].drop_cells():
                free = self.cache.free_cells()
        return free

    def cancel(self, ticket: int) -> Run | None:
        """Drop submitted work: waiting work is never started; a running run leaves the batch
        (its owner closes its sequences, which frees their slots at once).

        Returns:
            The run when it was running; None when it was waiting, finished or unknown.
        """
        for i, (waiting, *_) in enumerate(self._waiting):
            if waiting == ticket:
                del self._waiting[i]
                return None
        for i, (running, run, _) in enumerate(self._running):
            if running == ticket:
                del self._running[i]
                return run
        return None

    def _admit(self) -> list[Event]:
        """Start waiting work while its slots can be had (the first always: opening a
        sequence waits for other threads' slots, or raises when only this one holds them);
        runs done from the start (nothing to generate) come back as events without a step."""
        done: list[Event] = []
        while self._waiting:
            ticket, start, n_slots, prefills = self._waiting[0]
            if self._running or done:
                if not self._has_room(n_slots, prefills):
                    break
                # Another thread may have taken the slot seen free: this one holds slots now,
                # so it must not wait for theirs (each could wait for the other's forever).
                try:
                    with self.cache.without_waiting():
                        run = start()
                except SlotBusyError:
                    break
            else:
                run = start()
            self._waiting.popleft()
            if not all(hasattr(run, a) for a in ("is_done", "sequences", "advance")):
                raise TypeError(f"a start must return a run (seq.run(...)), got {run!r:.60}")
            if run.is_done:
                done.append(Event(ticket, run, None))
            else:
                self._running.append((ticket, run, n_slots))
        return done

    def _has_room(self, n_slots: int, prefills: Seq[int] | None) -> bool:
        """Whether ``n_slots`` more fit beside what the running work may still take (every
        slot it reserved but does not hold yet: a beam search forks as it goes), and the cells
        ``prefills`` needs beside those its next step decodes."""
        sequences = [seq for _, run, _ in self._running for seq in run.sequences()]
        reserved = sum(n for _, _, n in self._running)
        if reserved - len(sequences) + n_slots > self.cache.available_slots():
            return False
        pending = sum(seq.n_pending for seq in sequences)
        if prefills is None:
            return True
        n_cells = len(prefills) - self.cache.cached(prefills)
        return n_cells + pending <= self.cache.free_cells()
