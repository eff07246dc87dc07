"""Beam search on live sequences: forks share the KV prefix, every beam of every batch element
is decoded in one batch per step.

Each step ranks the ``width`` best next tokens of every live beam by the sequence's summed
log-probability, and keeps the ``width`` best continuations that are still going; those that
finish (end-of-generation token, stop string, grammar end, ``max_tokens``) join the finished
beams, ranked by ``sum / n_generated ** length_penalty``. A batch element is done when no live
beam can still beat the ``width``-th finished one. A beam with several kept children is forked
(no KV copied); one with none is closed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from lcgen.continuous.elements import Element, Pool, cut_at_stop, settle, text_of
from lcgen.continuous.specs import GenerateSpec
from lcgen.decoding import Chunk, Generator
from lcgen.decoding.sampling import log_normalizer, top_ids
from lcgen.errors import SlotsExhaustedError
from lcgen.runtime import Run, Scheduler, Sequence
from lcgen.runtime.tokens import ModelLike

__all__ = ["BeamSearch", "search"]


@dataclass(slots=True)
class _Beam:
    seq: Sequence | None
    gen: Generator
    logprobs: list[float] = field(default_factory=list)  # of the tokens generated so far
    parts: list[str] = field(default_factory=list)  # the text the generator emitted
    last: Chunk | None = None

    @property
    def score(self) -> float:
        return math.fsum(self.logprobs)


@dataclass(slots=True, eq=False)
class BeamSearch:
    """The beam search of one batch element, as a run the scheduler steps: each step decodes
    every live beam, keeps the best continuations and forks them."""

    spec: GenerateSpec
    pool: Pool
    root: Element
    text_before: str
    live: list[_Beam]
    finished: list[tuple[float, Element]] = field(default_factory=list)  # (rank, beam), best first

    @property
    def width(self) -> int:
        return self.spec.beams or 1

    @property
    def is_done(self) -> bool:
        """No live beam can end ranked above the ``width``-th finished one."""
        if not self.live:
            return True
        width, length_penalty = self.width, self.spec.length_penalty
        if len(self.finished) < width:
            return False
        best = max(self.live, key=lambda b: b.score)
        # The summed log-probability only falls; over the lengths still possible, the rank of
        # a negative sum is highest at the longest one (length_penalty > 0) or the next (< 0).
        n = best.gen.max_tokens if length_penalty > 0 else len(best.gen.tokens) + 1
        return best.score / math.pow(max(n, 1), length_penalty) <= self.finished[width - 1][0]

    def sequences(self) -> list[Sequence]:
        return [beam.seq for beam in self.live if beam.seq is not None]

    def advance(self, rows: Seq[np.ndarray]) -> Chunk | None:
        _step(self, list(rows))
        if self.is_done:
            self.close_live()
        return None

    def close_live(self) -> None:
        """Close the live beams' sequences (stopped early: they cannot beat the finished)."""
        for beam in self.live:
            if beam.seq is not None:
                beam.seq.close()

    @property
    def results(self) -> list[Element]:
        """The finished beams, best first."""
        return [elem for _, elem in self.finished]


def _best_tokens(beam: _Beam, row: np.ndarray, width: int, bans: list[int]) -> list[int]:
    """The ``width`` most likely allowed next tokens, most likely first."""
    ranked = row
    if bans or beam.gen.grammar is not None:
        ranked = np.array(row, dtype=np.float32)
        ranked[bans] = -np.inf
        if beam.gen.grammar is not None:
            ranked[~beam.gen.grammar.allowed()] = -np.inf
    # Width 1 takes the argmax as greedy sampling does (the first of ties).
    best = [int(np.argmax(ranked))] if width == 1 else [int(i) for i in top_ids(ranked, width)]
    return [tok for tok in best if np.isfinite(ranked[tok])]


def _rank(beam: _Beam, length_penalty: float) -> float:
    return beam.score / math.pow(max(len(beam.gen.tokens), 1), length_penalty)


Kept = tuple[int, int, _Beam]  # (parent index, token, child)


def _expand(search: BeamSearch, rows: list[np.ndarray], width: int, bans: list[int]) -> list[Kept]:
    """The best continuations, best first: all that finish among the first ``2 * width``
    candidates, and up to ``width`` that go on."""
    candidates = []
    for i, (beam, row) in enumerate(zip(search.live, rows, strict=True)):
        log_norm = log_normalizer(row)
        for tok in _best_tokens(beam, row, width, bans):
            logprob = float(row[tok]) - log_norm
            candidates.append((beam.score + logprob, i, tok, logprob))
    candidates.sort(key=lambda c: -c[0])
    kept: list[Kept] = []
    n_live = 0
    for _, i, tok, logprob in candidates[: 2 * width]:
        parent = search.live[i]
        child = _Beam(None, parent.gen.clone(), [*parent.logprobs, logprob], list(parent.parts))
        child.last = child.gen.accept(tok)
        child.parts.append(child.last.text)
        if not child.gen.is_done:
            if n_live == width:
                continue
            n_live += 1
        kept.append((i, tok, child))
    return kept


def _step(search: BeamSearch, rows: list[np.ndarray]) -> None:
    """Advance one batch element by a token: expand, rank, fork the kept beams."""
    spec, pool, width, model = search.spec, search.pool, search.width, search.spec.model
    kept = _expand(search, rows, width, spec.bans)
    going = [k for k in kept if not k[2].gen.is_done]
    entries: list[tuple[float, Kept | None, Element | None]] = [
        (rank, None, elem) for rank, elem in search.finished
    ]
    entries += [(_rank(k[2], spec.length_penalty), k, None) for k in kept if k[2].gen.is_done]
    entries.sort(key=lambda e: -e[0])
    for _, _, elem in entries[width:]:
        if elem is not None:
            elem.release()
    entries = entries[:width]
    _fork_children(model, pool, search.live, going + [k for _, k, _ in entries if k is not None])
    finished = []
    for rank, k, elem in entries:
        if elem is None:
            assert k is not None
            elem = _finished(model, pool, search, k)
        finished.append((rank, elem))
    search.finished = finished
    search.live = [child for _, _, child in going]


def _fork(model: ModelLike, pool: Pool, seq: Sequence, required: bool) -> Sequence | None:
    if model.context.n_free_slots == 0:
        pool.evict()  # a finished beam (or another idle element) keeps its tokens only
    try:
        return seq.fork()
    except SlotsExhaustedError:
        if required:
            raise
        return None


def _fork_children(model: ModelLike, pool: Pool, parents: list[_Beam], kept: list[Kept]) -> None:
    """Give each kept child a sequence: forks of its parent, the parent's own for the last
    one; a finished child gets one only while a slot can be had. Parents without children
    are closed first."""
    by_parent: dict[int, list[tuple[int, _Beam]]] = {}
    for i, tok, child in kept:
        by_parent.setdefault(i, []).append((tok, child))
    for i, parent in enumerate(parents):
        if i not in by_parent and parent.seq is not None:
            parent.seq.close()
    for i, children in by_parent.items():
        seq = parents[i].seq
        assert seq is not None
        children.sort(key=lambda c: c[1].gen.is_done)  # going ones first
        for _, child in children[1:]:
            child.seq = _fork(model, pool, seq, required=not child.gen.is_done)
        children[0][1].seq = seq
        for tok, child in children:
            if child.seq is not None:
                child.seq.append_tokens([tok])


def _finished(model: ModelLike, pool: Pool, search: BeamSearch, kept: Kept) -> Element:
    """A finished beam as an element (holding its sequence, if it has one, as an idle one)."""
    beam = kept[2]
    elem = Element(list(search.root.tokens), list(search.root.logprobs))
    tokens = beam.seq.tokens if beam.seq is not None else elem.tokens + beam.gen.tokens
    settle(elem, tokens, beam.logprobs)
    if beam.seq is not None:
        pool.adopt(elem, beam.seq)
    if beam.last is not None and beam.last.stop is not None:
        cut_at_stop(model, elem, search.text_before, "".join(beam.parts))
    return elem


def _start(spec: GenerateSpec, pool: Pool, root: Element, started: list[BeamSearch]) -> Run | None:
    """Start the search after ``root`` when it can have its ``width`` slots (idle elements give
    theirs up); at most ``n_seq_max // width`` searches run at once."""
    model, width = spec.model, spec.beams or 1
    active = sum(not s.is_done for s in started)
    if active >= max(1, model.context.n_seq_max // width):
        return None
    while model.context.n_free_slots < width and pool.evict():
        pass
    if active and model.context.n_free_slots < width:
        return None
    if not pool.materialize(model, root):
        raise SlotsExhaustedError("no sequence slot is free for a beam search root")
    seq, root.seq = root.seq, None
    assert seq is not None
    gen = seq.run_plan(spec.element_plan(None)).generator
    search = BeamSearch(spec, pool, root, text_of(model, root.tokens), [_Beam(seq, gen)])
    started.append(search)
    return search


def search(spec: GenerateSpec, pool: Pool, roots: list[Element]) -> list[list[Element]]:
    """Beam search after each root, ``spec.beams`` wide, through the scheduler: as many batch
    elements at once as the model's slots hold ``beams`` live sequences each, the rest queued,
    every live beam of every running search decoded in one batch per step.

    Returns:
        Per root, the finished beams as elements, best first (at most ``spec.beams``).
    """
    started: list[BeamSearch] = []
    results: list[list[Element]] = [[] for _ in roots]
    scheduler = Scheduler(spec.model.context)
    for root in roots:
        scheduler.submit(functools.partial(_start, spec, pool, root, started))
    try:
        for event in scheduler:
            if event.is_last:
                assert isinstance(event.run, BeamSearch)
                results[event.ticket] = event.run.results
    finally:
        for search in started:
            search.close_live()
    return results
