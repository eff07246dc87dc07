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
from dataclasses import dataclass

from lcgen.decoding import Chunk
from lcgen.errors import SlotsExhaustedError
from lcgen.runtime.context import Context
from lcgen.runtime.run import Run, step

# Start a run: take its slots and set it up; None when its slots cannot be had now.
Start = Callable[[], Run | None]


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
    """Runs any number of generations on one context, as many at once as slots allow.

    Submit work with :meth:`submit`, then iterate: each step admits waiting work in the order
    it was submitted (while each start can get its slots), decodes the pending tokens of every
    running generation in one batch, advances each, and yields an :class:`Event` per run.
    Handle an event whose ``is_last`` is set by retiring its run; the next step admits more.

    Args:
        context: the context the runs decode in.
    """

    def __init__(self, context: Context) -> None:
        self.context = context
        self._tickets = itertools.count()
        self._waiting: deque[tuple[int, Start]] = deque()
        self._running: list[tuple[int, Run]] = []

    def submit(self, start: Start) -> int:
        """Queue a generation; returns its ticket (0, 1, ... in the order of submission)."""
        ticket = next(self._tickets)
        self._waiting.append((ticket, start))
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
            SlotsExhaustedError: nothing runs, and the next waiting work cannot get its slots
                (they are held by sequences outside this scheduler).
        """
        events = self._admit()
        if self._running:
            runs = [run for _, run in self._running]
            chunks = step(runs)
            events += [Event(t, run, c) for (t, run), c in zip(self._running, chunks, strict=True)]
            self._running = [(t, run) for t, run in self._running if not run.is_done]
        return events

    def _admit(self) -> list[Event]:
        """Start waiting work while it can get its slots; runs done from the start (nothing
        to generate) come back as events without a step."""
        done: list[Event] = []
        while self._waiting:
            ticket, start = self._waiting[0]
            run = start()
            if run is None:
                if self._running or done:
                    break
                raise SlotsExhaustedError(
                    f"all {self.context.n_seq_max} sequence slots are held by sequences outside "
                    "this generation: close some (seq.close(), state.close()) or load the model "
                    "with a larger n_seq_max"
                )
            self._waiting.popleft()
            if run.is_done:
                done.append(Event(ticket, run, None))
            else:
                self._running.append((ticket, run))
        return done
