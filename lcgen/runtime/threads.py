"""The thread count of each decode, fitted to the cores the process really gets.

llama.cpp's CPU threads wait for each other after every operation of the graph (hundreds per
token), so one thread that shares its core with another program stalls them all: while another
process keeps one of two cores busy, 2 threads decode many times slower than 1 (the
``threads-busy`` bench row). How many cores are free is measured, not guessed: the process's
CPU time over a decode's wall time is the number of threads that really ran. With every thread
on its own core that share is the thread count (waiting threads spin); when it falls short by
half a core or more over several decodes, a few decodes try the cores the threads got. While
below the most, a few decodes now and then try one thread more. Either way the count moves only
when those decodes were faster (and, going up, got their cores); probes that lose back off, so
a machine where the share misleads pays a bounded share of its time, and an idle one nothing
(no probe runs at the full count while the threads get their cores).

Below 512 KV cells the count changes speed only: ggml's CPU kernels split work by rows, so the
logits are bit-identical for any count (a tested invariant). From 512 cells on, ggml's
flash-attention kernel splits a single token's attention over the cache between the threads
and adds the parts up, so those logits move in their last bits with the count: a fixed
``n_threads`` keeps long runs reproducible bit for bit (the README says so).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

KEEP = 8  # decodes whose CPU share calls for fewer threads; recent times kept per size class
SHORT = 0.5  # fewer threads are tried when the threads got this many cores fewer than they are
# While below the most threads, a probe one thread up after PROBE_AFTER seconds of decoding,
# doubling up to PROBE_AFTER_MAX while such probes lose, and never before PROBE_COST times what
# the last probe took (a probe on a still busy machine can take a second: this bounds what
# probes cost). A lost probe down waits the same way before the next.
PROBE_AFTER = 0.25
PROBE_AFTER_MAX = 8.0
PROBE_COST = 30
PROBE_CALLS = 4  # decodes a probe measures
FASTER = 0.9  # a probe wins when its decodes take less than this share of the current ones
STALLED = 2.0  # a probe decode this many times slower than the current ones ends the probe
LATEST = 3  # decodes whose CPU share says how many cores the threads get now


@dataclass(slots=True)
class Span:
    """One decode's part in :class:`Overlaps`: made before it starts, so that whatever
    interrupts it (Ctrl-C right after its start was counted) can still end it."""

    n_threads: int
    mark: float = 0.0  # the thread-seconds of decoding when it started
    running: bool = False


class Overlaps:
    """The decodes in flight in this process, of every context: the process's CPU time over a
    decode is its own threads' only while it runs alone (two models decoding in two threads
    each saw the other's threads as its own, and kept too many threads on busy cores)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads = 0  # threads of the decodes running now
        self._total = 0.0  # thread-seconds of decoding so far
        self._at = time.perf_counter()

    # (Between the clock's call and the lock's end, only arithmetic and stores: no point where
    # Python runs a signal handler, so a Ctrl-C finds a span counted in and marked, or neither.)
    def start(self, span: Span) -> None:
        """The decode of ``span`` starts."""
        with self._lock:
            now = time.perf_counter()
            self._total += self._threads * (now - self._at)
            self._at = now
            self._threads += span.n_threads
            span.mark, span.running = self._total, True

    def end(self, span: Span) -> float:
        """The decode of ``span`` ends (if it started); returns the thread-seconds of every
        decode since its start."""
        with self._lock:
            now = time.perf_counter()
            if not span.running:
                return 0.0
            self._total += self._threads * (now - self._at)
            self._at = now
            self._threads -= span.n_threads
            span.running = False
            return self._total - span.mark


OVERLAPS = Overlaps()


def own_cpu(cpu: float, wall: float, n_threads: int, thread_seconds: float) -> float:
    """A decode's share of the process's ``cpu`` seconds: its threads' part of the
    ``thread_seconds`` of the decodes that overlapped it (all of it where it ran alone)."""
    if thread_seconds <= 0:
        return cpu
    return cpu * min(1.0, n_threads * wall / thread_seconds)


def _cores_used(decodes: Iterable[tuple[float, float]]) -> float:
    """Cores used over (wall, CPU seconds) decodes: their CPU time over their wall time."""
    pairs = list(decodes)
    return sum(c for _, c in pairs) / max(sum(w for w, _ in pairs), 1e-9)


def size_class(n_tokens: int) -> int:
    """Batches whose times are compared with each other: token counts within a factor 2."""
    return n_tokens.bit_length()


class ThreadTuner:
    """Fits a context's thread count to the cores it gets, from the times of its decodes.

    Call :meth:`before` ahead of each ``llama_decode`` (it applies the count that decode uses)
    and :meth:`after` with the wall and process CPU seconds it took.

    Args:
        n_max: the most threads (the cores this process may use).
        apply: sets the context's thread count.
    """

    def __init__(self, n_max: int, apply: Callable[[int], None]) -> None:
        self.n_max = n_max
        self.n = n_max  # the count decodes use outside probes
        self._apply = apply
        self._applied = n_max
        self._share: deque[tuple[float, float]] = deque(maxlen=KEEP)  # (wall, cpu) at self.n
        self._recent: dict[int, deque[float]] = {}  # size class -> recent wall seconds at self.n
        self._decoded = 0.0  # wall seconds of decoding since the last probe or change
        self._wait = PROBE_AFTER  # seconds of decoding before the next probe up
        self._wait_down = 0.0  # ... and before the next probe down
        self._target: int | None = None  # the count a probe tries
        self._probe: list[tuple[int, float, float]] = []  # its decodes: (size, wall, cpu)
        self.probes = 0
        self.changes = 0

    @property
    def applied(self) -> int:
        """The thread count decodes use now (a probe's, during one)."""
        return self._applied

    @property
    def probing(self) -> bool:
        """Whether decodes now try another thread count than :attr:`n`."""
        return self._target is not None

    def before(self, n_tokens: int) -> None:
        """Apply the thread count the next decode (of ``n_tokens`` tokens) uses."""
        if (
            self._target is None
            and self.n < self.n_max
            and self._decoded >= self._wait
            and self._recent.get(size_class(n_tokens))
        ):
            self._start_probe(self.n + 1)
        want = self.n if self._target is None else self._target
        if want != self._applied:
            self._apply(want)
            self._applied = want

    def after(self, n_tokens: int, wall: float, cpu: float) -> None:
        """Record the wall and process CPU seconds the decode of ``n_tokens`` tokens took."""
        size = size_class(n_tokens)
        if self._target is not None:
            self._probe.append((size, wall, cpu))
            current = self._recent.get(size)
            stalled = current and wall > STALLED * statistics.fmean(current)
            if stalled or len(self._probe) >= PROBE_CALLS:
                self._decide_probe()
            return
        self._decoded += wall
        self._recent.setdefault(size, deque(maxlen=KEEP)).append(wall)
        self._share.append((wall, cpu))
        if (
            self.n > 1
            and len(self._share) == KEEP
            and self._decoded >= self._wait_down
            and _cores_used(self._share) < self.n - SHORT
        ):
            # How many cores the threads get now: the last few decodes (the window may reach
            # back to before the load came).
            got = _cores_used(list(self._share)[-LATEST:])
            self._start_probe(max(1, min(self.n - 1, round(got))))

    def _start_probe(self, target: int) -> None:
        self._target, self._probe = target, []
        self.probes += 1

    def _decide_probe(self) -> None:
        target, probe = self._target, self._probe
        assert target is not None
        self._target, self._probe = None, []
        pairs = [
            (wall, statistics.fmean(self._recent[size]))
            for size, wall, _ in probe
            if self._recent.get(size)
        ]
        took = sum(w for _, w, _ in probe)
        got = _cores_used([(w, c) for _, w, c in probe])
        if (
            len(pairs) == len(probe) >= PROBE_CALLS
            and (target < self.n or got >= target - SHORT)
            and sum(w for w, _ in pairs) < FASTER * sum(c for _, c in pairs)
        ):
            self._set(target)
            for size, seconds, _ in probe:
                self._recent.setdefault(size, deque(maxlen=KEEP)).append(seconds)
            return
        backoff = PROBE_COST * took
        if target > self.n:
            self._wait = max(min(2 * self._wait, PROBE_AFTER_MAX), backoff)
        else:
            self._wait_down = max(
                min(2 * max(self._wait_down, PROBE_AFTER / 2), PROBE_AFTER_MAX), backoff
            )
        self._decoded = 0.0

    def _set(self, n: int) -> None:
        self.n = n
        self.changes += 1
        self._share.clear()
        self._recent = {}
        self._wait, self._wait_down = PROBE_AFTER, 0.0
        self._decoded = 0.0
