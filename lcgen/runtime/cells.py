"""A mirror of llama.cpp's KV cell pool: which cells exist, and which sequence ids share them.

llama.cpp makes cells by decoding, shares them between sequence ids only when one id copies
another's prefix (``llama_memory_seq_cp`` of ``[0, n)``), and lcgen drops them only as a suffix
(``llama_memory_seq_rm`` from a position on). So every id holds positions ``[0, n)`` as a chain
of runs, each run the start of an *origin* (the cells one id decoded in one go, from one
position on); an origin's cells live while some id's run still reaches them. llama.cpp has no
call that counts used cells; this ledger counts them exactly under those two rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Run:
    origin: int
    start: int  # the origin's first position (every run of an origin starts there)
    end: int


class CellLedger:
    """The cells of a context's memory, per sequence id."""

    def __init__(self) -> None:
        self._runs: dict[int, list[_Run]] = {}
        self._origins = itertools.count()

    def held(self, seq_id: int) -> int:
        """How many positions ``seq_id`` holds (``[0, n)``)."""
        runs = self._runs.get(seq_id)
        return runs[-1].end if runs else 0

    def decoded(self, seq_id: int, pos: int, n: int) -> None:
        """``seq_id`` decoded ``n`` new cells at positions ``[pos, pos + n)``."""
        if n <= 0:
            return
        runs = self._runs.setdefault(seq_id, [])
        last = runs[-1] if runs else None
        if last is not None and last.end == pos and not self._reached_beyond(last, seq_id):
            runs[-1] = _Run(last.origin, last.start, pos + n)
        else:
            runs.append(_Run(next(self._origins), pos, pos + n))

    def _reached_beyond(self, run: _Run, seq_id: int) -> bool:
        """Whether another id holds cells of ``run``'s origin past its end (then new cells at
        its end are not that origin's: they are other cells at the same positions)."""
        return any(
            r.origin == run.origin and r.end > run.end
            for other, runs in self._runs.items()
            if other != seq_id
            for r in runs
        )

    def copied(self, src: int, dst: int, n: int) -> None:
        """``dst`` (empty) now shares ``src``'s cells at positions ``[0, n)``."""
        assert not self._runs.get(dst), f"copy into a sequence id that holds cells: {dst}"
        self._runs[dst] = _clip(self._runs.get(src, []), n)

    def removed(self, seq_id: int, pos: int) -> None:
        """``seq_id`` dropped its cells from position ``pos`` on (all of them for 0)."""
        runs = _clip(self._runs.get(seq_id, []), pos)
        if runs:
            self._runs[seq_id] = runs
        else:
            self._runs.pop(seq_id, None)

    def n_cells(self, seq_ids: Collection[int] | None = None) -> int:
        """How many distinct cells exist (that ``seq_ids`` hold, when given)."""
        ends: dict[int, tuple[int, int]] = {}
        for seq_id, runs in self._runs.items():
            if seq_ids is not None and seq_id not in seq_ids:
                continue
            for r in runs:
                start, end = ends.get(r.origin, (r.start, r.start))
                ends[r.origin] = (start, max(end, r.end))
        return sum(end - start for start, end in ends.values())

    def exclusive(self, seq_id: int) -> int:
        """How many cells only ``seq_id`` holds (what dropping it frees)."""
        reach = self._reach_of_others(seq_id)
        return sum(
            max(0, r.end - max(r.start, reach.get(r.origin, r.start)))
            for r in self._runs.get(seq_id, [])
        )

    def shared_prefix(self, seq_id: int) -> int:
        """How many of ``seq_id``'s first positions other ids hold too (dropping their cells
        frees none)."""
        reach = self._reach_of_others(seq_id)
        n = 0
        for r in self._runs.get(seq_id, []):
            shared = min(r.end, max(r.start, reach.get(r.origin, r.start)))
            if shared < r.end:
                return shared
            n = r.end
        return n

    def _reach_of_others(self, seq_id: int) -> dict[int, int]:
        """Per origin, the end of its cells that ids other than ``seq_id`` hold."""
        reach: dict[int, int] = {}
        for other, runs in self._runs.items():
            if other != seq_id:
                for r in runs:
                    reach[r.origin] = max(reach.get(r.origin, r.start), r.end)
        return reach


def _clip(runs: list[_Run], pos: int) -> list[_Run]:
    out = []
    for r in runs:
        if r.end <= pos:
            out.append(r)
        else:
            if pos > r.start:
                out.append(_Run(r.origin, r.start, pos))
            break
    return out
