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

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from lcgen._elements import Element, Pool, cut_at_stop, settle, text_of
from lcgen.errors import SlotsExhaustedError
from lcgen.generator import Chunk, Generator
from lcgen.sampling import log_normalizer, top_ids
from lcgen.sequence import Sequence, decode

if TYPE_CHECKING:
    from lcgen.generate import GenerateSpec
    from lcgen.model import Model

__all__ = ["search"]


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


@dataclass(slots=True)
class _Search:
    """The beam search of one batch element."""

    root: Element
    text_before: str
    live: list[_Beam]
    finished: list[tuple[float, Element]] = field(default_factory=list)  # (rank, beam), best first


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


def _expand(search: _Search, rows: list[np.ndarray], width: int, bans: list[int]) -> list[Kept]:
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


def _step(
    search: _Search, rows: list[np.ndarray], spec: GenerateSpec, pool: Pool, bans: list[int]
) -> None:
    """Advance one batch element by a token: expand, rank, fork the kept beams."""
    width, model = spec.beams or 1, spec.model
    kept = _expand(search, rows, width, bans)
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


def _fork(model: Model, pool: Pool, seq: Sequence, required: bool) -> Sequence | None:
    if model.context.n_free_slots == 0:
        pool.evict()  # a finished beam (or another idle element) keeps its tokens only
    try:
        return seq.fork()
    except SlotsExhaustedError:
        if required:
            raise
        return None


def _fork_children(model: Model, pool: Pool, parents: list[_Beam], kept: list[Kept]) -> None:
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


def _finished(model: Model, pool: Pool, search: _Search, kept: Kept) -> Element:
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


def _is_done(search: _Search, width: int, length_penalty: float) -> bool:
    """No live beam can end ranked above the ``width``-th finished one."""
    if not search.live:
        return True
    if len(search.finished) < width:
        return False
    best = max(search.live, key=lambda b: b.score)
    # The summed log-probability only falls; over the lengths still possible, the rank of a
    # negative sum is highest at the longest one (length_penalty > 0) or the next (< 0).
    n = best.gen.max_tokens if length_penalty > 0 else len(best.gen.tokens) + 1
    return best.score / math.pow(max(n, 1), length_penalty) <= search.finished[width - 1][0]


def _start(spec: GenerateSpec, pool: Pool, root: Element) -> _Search:
    if not pool.materialize(spec.model, root):
        raise SlotsExhaustedError("no sequence slot is free for a beam search root")
    seq, root.seq = root.seq, None
    assert seq is not None
    gen = seq.generator(**spec.generator_options(None))
    return _Search(root, text_of(spec.model, root.tokens), [_Beam(seq, gen)])


def search(spec: GenerateSpec, pool: Pool, roots: list[Element]) -> list[list[Element]]:
    """Beam search after each root, ``spec.beams`` wide; as many batch elements at once as
    the model's slots hold ``beams`` live sequences each, the rest queued.

    Returns:
        Per root, the finished beams as elements, best first (at most ``spec.beams``).
    """
    width, model = spec.beams or 1, spec.model
    bans = [tok for tok, _ in dict(spec.options.get("logit_bias") or {}).items()]
    per_group = max(1, model.context.n_seq_max // width)
    results: list[list[Element]] = []
    for at in range(0, len(roots), per_group):
        group = roots[at : at + per_group]
        while model.context.n_free_slots < len(group) * width and pool.evict():
            pass
        searches = [_start(spec, pool, root) for root in group]
        while active := [s for s in searches if not _is_done(s, width, spec.length_penalty)]:
            beams = [beam.seq for s in active for beam in s.live if beam.seq is not None]
            rows = decode(beams)
            offset = 0
            for s in active:
                n = len(s.live)
                _step(s, rows[offset : offset + n], spec, pool, bans)
                offset += n
        for s in searches:
            for beam in s.live:  # stopped early: they cannot beat the finished ones
                if beam.seq is not None:
                    beam.seq.close()
            results.append([elem for _, elem in s.finished])
    return results
