"""What a decode costs on this machine, learned from the decodes themselves.

Whether a short batch is padded to the size where llama.cpp's CPU flash attention works in tiles
(see :meth:`lcgen.runtime.context.Context._padding`) depends on how the time of one
``llama_decode`` grows with its batch and the cache, and that differs between machines: a rule
fitted on a 2-core laptop CPU (50 tokens after 1,500 cached: 935 ms row by row, 310 ms padded to
64) padded 50 tokens after 300 on a 2-core AVX-512 machine, where the padded batch took 1.18
times as long.

So the wall time of every decode is kept (the most recent few per path and batch size within a
factor 2; the paths: batches under ``TILE`` tokens, and from ``TILE`` on), and each path's time
is fitted by least squares on relative errors as a line in n (the batch's tokens) that bends at
each size class (a token's cost falls as batches grow, unevenly), plus ``n·cells`` (each row's
attention walks the cells in use). Until a path has data, the laptop's rule stands in, scaled to
the machine by the decodes seen so far; a bend with no data near it stays straight.
"""

from __future__ import annotations

from collections import deque

import numpy as np

TILE = 64  # llama.cpp's CPU flash attention works in tiles of rows from this many tokens
KEEP = 16  # decodes kept per path and batch size class
REFIT = 8  # new decodes before a path is fitted again
PRIOR_WEIGHT = 0.05  # of each prior coefficient, against one decode's relative error
# Where each path's line may bend (tokens).
KNOTS = {False: (2, 4, 8, 16, 32), True: (128, 256)}
# The prior shape (seconds: a, b per token, c per token and 1,024 cells), fitted on a 2-core
# laptop CPU: 50 tokens after 1,500 cached took 935 ms row by row and 310 ms padded to 64; 12
# tokens 232 ms.
PRIOR = {False: (0.0, 2.8e-3, 10.9e-3), True: (0.0, 2.65e-3, 0.92e-3)}


def _features(n: np.ndarray, cells: np.ndarray, tiled: bool) -> np.ndarray:
    n = np.asarray(n, dtype=np.float64)
    cols = [np.ones_like(n), n, n * np.asarray(cells, dtype=np.float64) / 1024]
    cols += [np.maximum(n - k, 0.0) for k in KNOTS[tiled]]
    return np.stack(cols, -1)


def _prior(tiled: bool) -> np.ndarray:
    return np.array([*PRIOR[tiled], *(0.0 for _ in KNOTS[tiled])])


class DecodeCosts:
    """The fitted time of a decode of ``n`` tokens with ``cells`` KV cells in use."""

    def __init__(self) -> None:
        self._seen: dict[bool, dict[int, deque[tuple[int, int, float]]]] = {False: {}, True: {}}
        self._fits: dict[bool, np.ndarray] = {}
        self._new = {False: 0, True: 0}  # decodes since each path's last fit

    def observe(self, n: int, cells: int, seconds: float) -> None:
        """Record that a decode of ``n`` tokens, ``cells`` cells in use after it, took
        ``seconds``."""
        if n <= 0 or cells < 0 or not 1e-6 <= seconds <= 1e4:  # no decode takes less
            return
        tiled = n >= TILE
        kept = self._seen[tiled].get(n.bit_length())
        if kept is None:  # a size not seen before: fit again at once
            kept = self._seen[tiled][n.bit_length()] = deque(maxlen=KEEP)
            self._new[tiled] = REFIT
        kept.append((n, cells, seconds))
        self._new[tiled] += 1

    @property
    def n_kept(self) -> int:
        """How many decodes the fit rests on now."""
        return sum(len(recent) for path in self._seen.values() for recent in path.values())

    def reset(self) -> None:
        """Forget every decode (the thread count changed: the old times no longer hold)."""
        for path in self._seen.values():
            path.clear()
        self._fits.clear()

    def seconds(self, n: np.ndarray | int, cells: np.ndarray | int) -> np.ndarray:
        """The predicted seconds of a decode of each of ``n`` tokens (at least 1), ``cells``
        cells in use after it (one count, or one for each)."""
        n = np.atleast_1d(np.asarray(n, dtype=np.int64))
        cells = np.broadcast_to(np.asarray(cells, dtype=np.int64), n.shape)
        out = np.empty(len(n))
        for tiled in (False, True):
            at = (n >= TILE) == tiled
            if at.any():
                out[at] = _features(n[at], cells[at], tiled) @ self._fit(tiled)
        lone = float(_features(np.ones(1), np.zeros(1), False)[0] @ self._fit(False))
        floored: np.ndarray = np.maximum(out, 0.1 * max(lone, 1e-6))
        return floored

    def _samples(self, tiled: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kept decodes of a path: tokens, cells and seconds."""
        kept = [s for recent in self._seen[tiled].values() for s in recent]
        n, cells, t = (np.array(col, dtype=np.float64) for col in zip(*kept, strict=True))
        return n, cells, t

    def _scale(self) -> float:
        """The machine's speed against the prior shape: the median ratio over the decodes
        kept (1 before any)."""
        ratios = [
            t / (_features(n, cells, tiled) @ _prior(tiled))
            for tiled in (False, True)
            if self._seen[tiled]
            for n, cells, t in [self._samples(tiled)]
        ]
        return float(np.median(np.concatenate(ratios))) if ratios else 1.0

    def _fit(self, tiled: bool) -> np.ndarray:
        cached = self._fits.get(tiled)
        if cached is not None and self._new[tiled] < REFIT:
            return cached
        self._new[tiled] = 0
        prior = _prior(tiled) * self._scale()
        if not self._seen[not tiled]:
            self._fits.pop(not tiled, None)  # a prior alone follows the scale
        if not self._seen[tiled]:
            self._fits[tiled] = prior
            return prior
        n, cells, t = self._samples(tiled)
        x = _features(n, cells, tiled) / t[:, None]  # relative errors: 1 ms and 1 s weigh alike
        # Each coefficient may move by its own size (the others by a token's cost) at little
        # cost.
        scale = np.where(prior > 0, prior, prior[1])
        w = np.sqrt(PRIOR_WEIGHT)
        a = np.vstack([x, np.diag(w / scale)])
        b = np.concatenate([np.ones(len(t)), w * prior / scale])
        fit: np.ndarray = np.linalg.lstsq(a, b, rcond=None)[0]
        self._fits[tiled] = fit
        return fit
