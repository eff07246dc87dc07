"""The thread count of each decode, fitted to the cores the process really gets.

llama.cpp's CPU threads wait for each other after every operation of the graph (hundreds per
token), so one thread that shares its core with another program stalls them all: while another
process keeps one of two cores busy, 2 threads decode many times slower than 1 (the
``threads-busy`` bench row). How many cores are free is measured, not guessed: the process's
CPU time over a decode's wall time is the number of threads that really ran. With every thread
on its own core that share is the thread count (waiting threads spin); when it falls short by
half a core or more over several decodes, the count drops to the cores the threads got. While
below the most, a decode now and then runs with one thread more, and the count goes up when
those decodes got their cores and were faster; such probes back off while they lose. An idle
machine pays nothing: no probe runs at the full count.

The count changes speed only: ggml's CPU kernels split work by rows, so the logits are
bit-identical for any count (a tested invariant).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

KEEP = 8  # decodes whose CPU share decides a drop, and recent times kept per size class
SHORT = 0.5  # a drop when the threads got this many cores fewer than they are
# While below the most threads, a probe after PROBE_AFTER seconds of decoding, doubling up to
# PROBE_AFTER_MAX while the probes lose, and never before PROBE_COST times what the last
# probe took (a probe on a still busy machine can take a second: this bounds what probes cost).
PROBE_AFTER = 0.25
PROBE_AFTER_MAX = 8.0
PROBE_COST = 30
PROBE_CALLS = 4  # decodes a probe measures
FASTER = 0.9  # a probe wins when its decodes take less than this share of the current ones
STALLED = 2.0  # a probe decode this many times slower than the current ones ends the probe


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
        self._wait = PROBE_AFTER  # seconds of decoding before the next probe
        self._probe: list[tuple[int, float, float]] | None = None  # (size, wall, cpu) at n + 1
        self.probes = 0
        self.changes = 0

    def before(self, n_tokens: int) -> None:
        """Apply the thread count the next decode (of ``n_tokens`` tokens) uses."""
        if (
            self._probe is None
            and self.n < self.n_max
            and self._decoded >= self._wait
            and self._recent.get(size_class(n_tokens))
        ):
            self._probe = []
            self.probes += 1
        want = self.n if self._probe is None else self.n + 1
        if want != self._applied:
            self._apply(want)
            self._applied = want

    def after(self, n_tokens: int, wall: float, cpu: float) -> None:
        """Record the wall and process CPU seconds the decode of ``n_tokens`` tokens took."""
        size = size_class(n_tokens)
        if self._probe is not None:
            self._probe.append((size, wall, cpu))
            current = self._recent.get(size)
            stalled = current and wall > STALLED * statistics.fmean(current)
            if stalled or len(self._probe) >= PROBE_CALLS:
                self._decide_probe()
            return
        self._decoded += wall
        self._recent.setdefault(size, deque(maxlen=KEEP)).append(wall)
        self._share.append((wall, cpu))
        if self.n > 1 and len(self._share) == KEEP:
            got = sum(c for _, c in self._share) / max(sum(w for w, _ in self._share), 1e-9)
            if got < self.n - SHORT:
                self._set(max(1, min(self.n - 1, round(got))))

    def _decide_probe(self) -> None:
        probe, self._probe = self._probe or [], None
        pairs = [
            (wall, statistics.fmean(self._recent[size]))
            for size, wall, _ in probe
            if self._recent.get(size)
        ]
        took = sum(w for _, w, _ in probe)
        got = sum(c for _, _, c in probe) / max(took, 1e-9)
        if (
            len(pairs) == len(probe) >= PROBE_CALLS
            and got >= self.n + 1 - SHORT
            and sum(w for w, _ in pairs) < FASTER * sum(c for _, c in pairs)
        ):
            self._set(self.n + 1)
            for size, seconds, _ in probe:
                self._recent.setdefault(size, deque(maxlen=KEEP)).append(seconds)
        else:
            self._wait = max(min(2 * self._wait, PROBE_AFTER_MAX), PROBE_COST * took)
            self._decoded = 0.0

    def _set(self, n: int) -> None:
        self.n = n
        self.changes += 1
        self._share.clear()
        self._recent = {}
        self._wait = PROBE_AFTER
        self._decoded = 0.0
