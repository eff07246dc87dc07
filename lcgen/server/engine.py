"""The engine: one thread that owns a :class:`~lcgen.Scheduler` over the model.

Request handlers (on the event loop) put jobs into a thread-safe inbox; the engine thread takes
them, submits one run per choice, and steps: every running choice of every request is decoded
in one batch per step, so a new request joins the running batch at the next step. Each event's
chunk goes to its request's asyncio queue through ``loop.call_soon_threadsafe``. All choices
start from the model's prefix cache (``model.cache``): a choice's prompt is prefilled as it is
admitted, so the choices and requests admitted after it share those cells instead of decoding
them again. A cancelled job (its client went away) leaves the batch at the next step and its
slots are given back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

import lcgen
from lcgen import Chunk, SlotBusyError


class QueueFullError(Exception):
    """More choices would wait for a slot than the server's ``max_queue`` allows."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Text (and tokens) that became final for one choice; on its last, ``healed``: the
    prompt's text token healing had the choice re-create."""

    index: int
    chunk: Chunk
    healed: str = ""


@dataclass(frozen=True, slots=True)
class Finished:
    """A choice ended; ``cached_tokens``: prompt tokens it took from the prefix cache."""

    index: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Failed:
    """A choice could not be generated."""

    index: int
    error: BaseException


Item = Piece | Finished | Failed


class Job:
    """One request's work: a prompt and a plan per choice; results arrive as items on an
    asyncio queue of the loop that made the job.

    Args:
        prompts: the prompt tokens of each choice.
        plans: the plan of each choice (one seed each).
        loop: the event loop of the request handler.
    """

    def __init__(
        self, prompts: list[list[int]], plans: list[lcgen.Plan], loop: asyncio.AbstractEventLoop
    ) -> None:
        if len(prompts) != len(plans) or not prompts:
            raise ValueError("a job needs one plan per prompt, and at least one prompt")
        self.prompts, self.plans, self.n = prompts, plans, len(prompts)
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._loop = loop
        self.is_done = False  # every choice ended (set on the event loop)

    def put(self, item: Item) -> None:
        """Hand an item to the request (from the engine thread)."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def items(self) -> AsyncIterator[Item]:
        """The items in the order the engine made them, until every choice has ended."""
        open_choices = self.n
        while open_choices:
            item = await self._queue.get()
            open_choices -= not isinstance(item, Piece)
            yield item
        self.is_done = True


@dataclass(slots=True)
class _Choice:
    job: Job
    index: int
    seq: lcgen.Sequence | None = None
    started: bool = False


@dataclass(slots=True)
class _Guarded:
    """A choice's run as the scheduler sees it: an error ends this run instead of the batch
    (``error`` is set and it is done); ``advance`` never raises."""

    seq: lcgen.Sequence | None
    run: lcgen.PlainRun | lcgen.Backtracker | None
    error: BaseException | None = None

    @property
    def is_done(self) -> bool:
        return self.error is not None or self.run is None or self.run.is_done

    def sequences(self) -> tuple[lcgen.Sequence, ...]:
        return () if self.is_done or self.seq is None else (self.seq,)

    def advance(self, rows: Seq[np.ndarray]) -> Chunk | None:
        assert self.run is not None
        try:
            return self.run.advance(rows)
        except Exception as exc:  # the grammar or the hooks failed on this choice only
            self.error = exc
            return None


Message = tuple[Literal["submit", "cancel", "close"], Job | None]


@dataclass(slots=True)
class _Counts:
    waiting: int = 0  # choices submitted, not yet started
    running: int = 0  # choices started, not yet ended
    lock: threading.Lock = field(default_factory=threading.Lock)


class Engine:
    """Runs every request's choices on one model, in one thread, through one scheduler.

    Args:
        model: the model (its prefix cache is shared by all requests).
        max_queue: the most choices that may wait for a slot; :meth:`submit` refuses more.
    """

    def __init__(self, model: lcgen.Model, *, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue!r}")
        self.model, self.max_queue = model, max_queue
        self._scheduler = lcgen.Scheduler(model.cache)
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._choices: dict[int, _Choice] = {}  # ticket -> a choice not ended yet
        self._tickets: dict[Job, list[int]] = {}
        self._counts = _Counts()
        self._closed = False  # (a job submitted after close would wait on nobody, for ever)
        self._thread = threading.Thread(target=self._loop, name="lcgen-engine", daemon=True)

    @property
    def n_waiting(self) -> int:
        return self._counts.waiting

    @property
    def n_running(self) -> int:
        return self._counts.running

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread: running and waiting choices fail; their sequences are closed;
        jobs submitted later are refused."""
        with self._counts.lock:
            self._closed = True
            self._inbox.put(("close", None))  # (the engine ends the jobs sent before it)
        if self._thread.is_alive():
            self._thread.join()

    # called from the event loop ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            ValueError: the job has more choices than the slots and ``max_queue`` hold: it
                could never wait.
            QueueFullError: more than ``max_queue`` choices would wait for a slot.
            ClosedError: the engine was closed (the server is shutting down).
        """
        slots = self.model.context.n_seq_max
        if job.n > self.max_queue + slots:
            raise ValueError(
                f"the request asks for {job.n} choices (prompts x n); this server runs "
                f"{slots} at once and queues at most {self.max_queue}: ask for fewer"
            )
        with self._counts.lock:
            if self._closed:
                raise lcgen.ClosedError("the server is shutting down")
            # Those that find a slot free do not wait (submitted choices count as waiting
            # until the engine thread starts them).
            free = max(0, slots - self._counts.running)
            queued = self._counts.waiting - free  # (those the free slots take do not wait)
            if queued + job.n > self.max_queue:
                raise QueueFullError(
                    f"the server is busy: {max(queued, 0)} choices wait for a slot, and this "
                    f"request's {job.n} would make more than {self.max_queue} wait; retry later"
                )
            self._counts.waiting += job.n
            self._inbox.put(("submit", job))  # (under the lock: before a close, or refused)

    def cancel(self, job: Job) -> None:
        """Drop a job whose client went away (nothing happens when it has ended)."""
        if not job.is_done:
            self._inbox.put(("cancel", job))

    # the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while self._receive(block=not self._scheduler.has_work):
            try:
                events = self._scheduler.step()
            except Exception as exc:  # the batch failed as a whole (e.g. no free KV cells)
                for ticket, choice in list(self._choices.items()):
                    if choice.started:
                        self._end(ticket, exc)
                continue
            for event in events:
                owner = self._choices.get(event.ticket)
                if owner is None:
                    continue
                if event.chunk is not None:
                    run = event.run
                    healed = ""
                    if event.chunk.finish_reason and isinstance(run, _Guarded) and run.run:
                        healed = run.run.generator.healed
                    owner.job.put(Piece(owner.index, event.chunk, healed))
                if event.is_last:
                    run = event.run
                    self._end(event.ticket, run.error if isinstance(run, _Guarded) else None)
        for ticket in list(self._choices):
            self._end(ticket, lcgen.ClosedError("the server is shutting down"))

    def _receive(self, block: bool) -> bool:
        """Take the inbox's messages (waiting for one when ``block``); False on close."""
        messages = [self._inbox.get()] if block else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for kind, job in messages:
            if kind == "close":
                return False
            assert job is not None
            if kind == "submit":
                self._tickets[job] = [self._submit(_Choice(job, i)) for i in range(job.n)]
            else:
                for ticket in self._tickets.get(job, ()):
                    if ticket in self._choices:
                        # told like any end: a handler still waiting on the job's items
                        # (a request whose client went away) returns instead of waiting forever
                        self._end(ticket, None)
        return True

    def _submit(self, choice: _Choice) -> int:
        prompt = choice.job.prompts[choice.index]
        ticket = self._scheduler.submit(lambda: self._start(choice), prefills=prompt)
        self._choices[ticket] = choice
        return ticket

    def _start(self, choice: _Choice) -> _Guarded:
        """Open the choice's sequence from the longest cached prefix, prefill it (so the
        choices admitted next share its cells) and start its run."""
        job = choice.job
        try:
            seq = self.model.sequence(job.prompts[choice.index])
        except SlotBusyError:  # another thread took the slot: the choice waits on (not started)
            raise
        except Exception as exc:
            seq, failed = None, exc
        with self._counts.lock:
            self._counts.waiting -= 1
            self._counts.running += 1
        choice.started = True
        try:
            if seq is None:
                raise failed
            choice.seq = seq
            choice.seq.prefill()
            return _Guarded(choice.seq, choice.seq.run_plan(job.plans[choice.index]))
        except Exception as exc:
            return _Guarded(None, None, exc)

    def _end(self, ticket: int, error: BaseException | None) -> None:
        """A choice ended (finished, failed or cancelled): close its sequence (its cells stay
        cached, its slot is free) and tell the request."""
        choice = self._choices.pop(ticket)
        self._scheduler.cancel(ticket)
        with self._counts.lock:
            if choice.started:
                self._counts.running -= 1
            else:
                self._counts.waiting -= 1
        cached = 0
        if choice.seq is not None:
            cached = choice.seq.stats.tokens_reused
            choice.seq.close()
        done = Finished(choice.index, cached)
        choice.job.put(done if error is None else Failed(choice.index, error))
        tickets = self._tickets.get(choice.job, [])
        if not any(t in self._choices for t in tickets):
            self._tickets.pop(choice.job, None)
