"""Rows, targets and rounds: how samples are taken and turned into medians and verdicts.

A row is built from the workload by a factory (listed in ``bench.ROWS``); each round it
returns one :class:`Sample` per series (an implementation, or a variant of one operation).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from bench.runners import Lcgen, LlamaCppPython, RawLoop, Sample, Workload

# What a sample's figure is, per unit: a rate, a time per operation, or a plain count.
UNITS: dict[str, Callable[[Sample], float]] = {
    "tokens/s": lambda s: s.count / s.seconds,
    "ms": lambda s: 1e3 * s.seconds / s.count,
    "GB/s": lambda s: s.count / s.seconds / 1e9,
    "bytes": lambda s: s.count,
    "count": lambda s: s.count,
}


@dataclass(frozen=True, slots=True)
class Bench:
    """Everything a row gets: the workload, the implementations, a folder for scratch files."""

    work: Workload
    limit: RawLoop
    llama_cpp_python: LlamaCppPython
    lcgen: Lcgen
    scratch: Path


T = TypeVar("T")


class Lazy(Generic[T]):
    """What a row loads itself (another model, a second llama-cpp-python) on first use, and
    frees once after its last round (pass :meth:`close` as the row's ``close``).

    Args:
        make: loads it, given the bench.
        free: frees it.
    """

    def __init__(self, make: Callable[[Bench], T], free: Callable[[T], None]) -> None:
        self._make, self._free = make, free
        self._value: T | None = None

    def get(self, bench: Bench) -> T:
        if self._value is None:
            self._value = self._make(bench)
        return self._value

    def close(self) -> None:
        if self._value is not None:
            value, self._value = self._value, None
            self._free(value)


@dataclass(frozen=True, slots=True)
class Target:
    """A bound a figure must meet: at least ``bound``, or at most it when ``is_max``."""

    bound: float
    is_max: bool = False

    def is_met(self, value: float) -> bool:
        return value <= self.bound if self.is_max else value >= self.bound

    def __str__(self) -> str:
        return f"{'<=' if self.is_max else '>='} {self.bound:g}"


def at_least(bound: float) -> Target:
    return Target(bound)


def at_most(bound: float) -> Target:
    return Target(bound, is_max=True)


@dataclass(frozen=True, slots=True)
class Check:
    """The median of ``series``, divided by ``baseline``'s median when one is named, against
    ``target`` (None: reported without a verdict)."""

    series: str
    baseline: str | None = None
    target: Target | None = None


RoundFn = Callable[[Bench, int], Mapping[str, Sample]]


@dataclass(frozen=True, slots=True)
class Row:
    """One benchmark.

    Attributes:
        name: the ``--rows`` name.
        how: what is timed, in a sentence or two (printed under the tables).
        units: each series' unit, in the order the series are reported.
        run: one round (its index given): a sample per series.
        checks: the figures with targets.
        on_long_sequence: works on the lcgen runner's long sequence, which stays open from one
            such row to the next; every other row runs with it closed.
        close: frees what the row loaded itself (another model), once after all rounds.
    """

    name: str
    how: str
    units: Mapping[str, str]
    run: RoundFn
    checks: tuple[Check, ...] = ()
    on_long_sequence: bool = False
    close: Callable[[], None] | None = None


RowFactory = Callable[[Workload], Row]


class SkipRow(Exception):
    """Raised by a row factory when the row cannot run here (e.g. its model is not
    installed): the row is left out of the run, with this message."""


def interleaved(measures: Mapping[str, Callable[[Bench], Sample]]) -> RoundFn:
    """A round that runs every implementation once, the order rotating from round to round."""
    names = list(measures)

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        shift = r % len(names)
        return {name: measures[name](bench) for name in names[shift:] + names[:shift]}

    return run


@dataclass(frozen=True, slots=True)
class Series:
    """All samples of one series (an implementation or variant) in one row."""

    row: str
    implementation: str
    unit: str
    samples: tuple[Sample, ...]

    @property
    def values(self) -> list[float]:
        return [UNITS[self.unit](s) for s in self.samples]

    @property
    def median(self) -> float:
        return statistics.median(self.values)


@dataclass(frozen=True, slots=True)
class CheckResult:
    row: str
    check: Check
    value: float
    unit: str  # "x" for a ratio

    @property
    def name(self) -> str:
        c = self.check
        return f"{self.row}: {c.series}" + (f" / {c.baseline}" if c.baseline else "")

    @property
    def verdict(self) -> str:
        target = self.check.target
        if target is None:
            return ""
        return "PASS" if target.is_met(self.value) else "MISS"


def run_rounds(bench: Bench, rows: Sequence[Row], repeats: int) -> list[Series]:
    """Run every row ``repeats`` times; the long sequence is closed before other rows."""
    samples: dict[tuple[str, str], list[Sample]] = {
        (row.name, name): [] for row in rows for name in row.units
    }
    try:
        for r in range(repeats):
            for row in rows:
                if not row.on_long_sequence:
                    bench.lcgen.close_long_sequence()
                for name, sample in row.run(bench, r).items():
                    samples[row.name, name].append(sample)
    finally:
        bench.lcgen.close_long_sequence()
        for row in rows:
            if row.close is not None:
                row.close()
    return [
        Series(row.name, name, unit, tuple(samples[row.name, name]))
        for row in rows
        for name, unit in row.units.items()
    ]


def evaluate(rows: Sequence[Row], series: Sequence[Series]) -> list[CheckResult]:
    """Every row's checks: a figure's median, or the median over rounds of the figure divided by
    its baseline in the same round (paired: both ran back to back, on the same machine state)."""
    found = {(s.row, s.implementation): s for s in series}
    results = []
    for row in rows:
        for check in row.checks:
            s = found[row.name, check.series]
            if check.baseline is None:
                results.append(CheckResult(row.name, check, s.median, s.unit))
            else:
                base = found[row.name, check.baseline].values
                ratio = statistics.median(a / b for a, b in zip(s.values, base, strict=True))
                results.append(CheckResult(row.name, check, ratio, "x"))
    return results


def same_tokens(series: Sequence[Series]) -> dict[str, bool]:
    """Per row, whether every series that records tokens produced the same ones (compared up to
    the shortest), a check that they all did the same work."""
    outputs: dict[str, list[tuple[int, ...]]] = {}
    for s in series:
        if s.samples and s.samples[0].tokens:
            outputs.setdefault(s.row, []).append(s.samples[0].tokens)
    result = {}
    for row, seqs in outputs.items():
        n = min(len(t) for t in seqs)
        result[row] = all(t[:n] == seqs[0][:n] for t in seqs)
    return result
