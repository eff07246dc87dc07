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

import dataclasses
import functools
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from lcgen.continuous.elements import (
    Element,
    cut_at_stop,
    open_prefilled,
    settle,
    text_of,
)
from lcgen.continuous.specs import GenerateSpec
from lcgen.decoding import Chunk, Generator
from lcgen.decoding.results import Text, incomplete
from lcgen.decoding.sampling import log_normalizer, top_ids
from lcgen.errors import ContextFullError, IncompleteOutputError
from lcgen.runtime import Run, Scheduler, Sequence

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


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished beam: its rank, its element and text, and how a constraint was left cut short
    (``max_tokens`` or a stop string before the grammar was complete), or None. (Held here:
    in a dict by ``id(element)``, a dropped beam's flag went to the later beam Python gave its
    id, and a complete beam was reported cut.)"""

    rank: float
    elem: Element
    text: str
    cut: IncompleteOutputError | None


@dataclass(slots=True, eq=False)
class BeamSearch:
    """The beam search of one batch element, as a run the scheduler steps: each step decodes
    every live beam, keeps the best continuations and forks them."""

    spec: GenerateSpec
    root: Element
    text_before: str
    live: list[_Beam]
    finished: list[Finished] = field(default_factory=list)  # best first

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
        return best.score / math.pow(max(n, 1), length_penalty) <= self.finished[width - 1].rank

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
    def results(self) -> list[tuple[Element, IncompleteOutputError | None]]:
        """The finished beams, best first, each with how its constrained output was cut short
        (``max_tokens`` or a stop string before the grammar was complete), or None."""
        return [(done.elem, done.cut) for done in self.finished]


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
    candidates, and up to ``width`` that go on; of continuations with the same text (the
    same words in other tokens, which a constraint allows as readily) only the best. Where
    the first candidates all finish (a stop string most tokens end in), later ones are looked
    at for those that go on (width 1 is greedy: its one candidate)."""
    per_beam = width
    while True:
        kept, n_live, short = _expand_among(search, rows, width, bans, per_beam)
        if n_live == width or width == 1 or short or per_beam >= _MAX_CANDIDATES:
            return kept
        per_beam *= 4


# The most candidates a beam's expansion looks at for continuations that go on.
_MAX_CANDIDATES = 256


def _expand_among(
    search: BeamSearch, rows: list[np.ndarray], width: int, bans: list[int], per_beam: int
) -> tuple[list[Kept], int, bool]:
    """:func:`_expand` over each beam's ``per_beam`` best tokens; also how many of the kept go
    on, and whether some beam has no more tokens than those."""
    candidates = []
    short = False
    for i, (beam, row) in enumerate(zip(search.live, rows, strict=True)):
        log_norm = log_normalizer(row)
        best = _best_tokens(beam, row, per_beam, bans)
        short = short or len(best) < per_beam
        for tok in best:
            logprob = float(row[tok]) - log_norm
            candidates.append((beam.score + logprob, i, tok, logprob))
    candidates.sort(key=lambda c: -c[0])
    kept: list[Kept] = []
    seen: set[tuple[bytes, bool]] = set()
    n_live = 0
    for at, (_, i, tok, logprob) in enumerate(candidates):
        if n_live == width and at >= 2 * width:
            break
        parent = search.live[i]
        child = _Beam(None, parent.gen.clone(), [*parent.logprobs, logprob], list(parent.parts))
        child.last = child.gen.accept(tok)
        child.parts.append(child.last.text)
        # The text of every token, the text held back for a stop string or a character's
        # later bytes included (what the parts have emitted so far is not all of it).
        vocab = search.spec.model.vocab
        text = b"".join(vocab.piece(t) for t in child.gen.tokens)
        key = (text, child.gen.is_done)
        if key in seen or _repeats_an_item(search, text):
            continue
        if child.gen.is_done:
            if at >= 2 * width:
                continue
        else:
            if n_live == width:
                continue
            n_live += 1
        seen.add(key)
        kept.append((i, tok, child))
    return kept, n_live, short


def _repeats_an_item(search: BeamSearch, text: bytes) -> bool:
    """Whether a candidate's text makes an item of a ``uniqueItems`` array equal to an earlier
    one (its parent's text had none: so the candidate did)."""
    constraint = search.spec.plan.constraint
    if constraint is None or constraint.unique is None:
        return False
    return constraint.unique.duplicate_in(text.decode("utf-8", "replace"))


def _step(search: BeamSearch, rows: list[np.ndarray]) -> None:
    """Advance one batch element by a token: expand, rank, fork the kept beams that go on."""
    spec, width = search.spec, search.width
    kept = _expand(search, rows, width, spec.bans)
    going = [k for k in kept if not k[2].gen.is_done]
    ranked = list(search.finished)
    for _, _, child in kept:
        if child.gen.is_done:
            cut = _incomplete(spec, child)  # ranked below every complete beam
            rank = _rank(child, spec.length_penalty) if cut is None else -math.inf
            ranked.append(Finished(rank, _finished(search, child), "".join(child.parts), cut))
    ranked.sort(key=lambda done: -done.rank)
    texts = set()  # one beam per text: the best ranked (an earlier step's may be it)
    search.finished = []
    for done in ranked:
        if len(search.finished) == width:
            break
        if done.text not in texts:
            texts.add(done.text)
            search.finished.append(done)
    _fork_children(search.live, going)
    search.live = [child for _, _, child in going]


def _fork_children(parents: list[_Beam], going: list[Kept]) -> None:
    """Give each child that goes on a sequence: its parent's own for the first, forks (no KV
    copied) for the others. Parents without such children close theirs: the cells stay
    cached."""
    by_parent: dict[int, list[tuple[int, _Beam]]] = {}
    for i, tok, child in going:
        by_parent.setdefault(i, []).append((tok, child))
    for i, parent in enumerate(parents):
        if i not in by_parent and parent.seq is not None:
            parent.seq.close()
    for i, children in by_parent.items():
        seq = parents[i].seq
        assert seq is not None
        for _, child in children[1:]:
            child.seq = seq.fork()
        children[0][1].seq = seq
        for tok, child in children:
            assert child.seq is not None
            child.seq.append_tokens([tok])


def _incomplete(spec: GenerateSpec, beam: _Beam) -> IncompleteOutputError | None:
    """How a finished beam's output was cut short of the spec's constraint, or None."""
    last = beam.last
    reason, stop = (last.finish_reason, last.stop) if last is not None else ("length", None)
    text = Text.of([Chunk("".join(beam.parts), tuple(beam.gen.tokens), reason, stop)])
    return incomplete(text, spec.plan.constraint, spec.model.vocab, spec.plan.stop_tokens)


def _finished(search: BeamSearch, beam: _Beam) -> Element:
    """A finished beam as an element: the root's tokens and the generated ones."""
    root = search.root
    elem = Element(list(root.tokens), list(root.logprobs))
    kept = settle(elem, root.tokens + beam.gen.tokens, beam.logprobs)
    emitted = "".join(beam.parts)
    cut_at_stop(search.spec.model, elem, beam.last, search.text_before, emitted, kept)
    return elem


def _start(spec: GenerateSpec, root: Element, started: list[BeamSearch]) -> Run:
    """Start the search after ``root``: its sequence, decoded but for the last token."""
    seq = open_prefilled(spec.model, root.tokens)
    # Every token is a step's choice among the beams' candidates: forced text too (forcing
    # it ahead would take tokens the beams' log-probabilities and texts do not hold).
    plan = dataclasses.replace(spec.element_plan(None), fast_forward=False)
    if plan.max_tokens is None:  # up to the end of the context: beams share it, equally
        width, room = spec.beams or 1, spec.model.context.n_ctx - len(root.tokens)
        if room < width:
            seq.close()
            raise ContextFullError(
                f"the prompt's {len(root.tokens)} tokens leave {max(room, 0)} of the context's "
                f"{spec.model.context.n_ctx} cells: too few for one token on each of {width} "
                "beams (shorten the prompt or load the model with a larger n_ctx)"
            )
        plan = dataclasses.replace(plan, max_tokens=room // width)
    gen = seq.run_plan(plan).generator
    search = BeamSearch(spec, root, text_of(spec.model, root.tokens), [_Beam(seq, gen)])
    started.append(search)
    if gen.is_done:  # max_tokens=0: the root is the one result, as without beams
        beam = search.live.pop()
        cut = _incomplete(spec, beam)  # (a constraint the empty output does not match)
        search.finished = [Finished(0.0, _finished(search, beam), "", cut)]
        seq.close()
    return search


def search(
    spec: GenerateSpec, roots: list[Element]
) -> list[list[tuple[Element, IncompleteOutputError | None]]]:
    """Beam search after each root, ``spec.beams`` wide, through the scheduler: each search
    reserves ``beams`` slots, as many run at once as the slots allow, the rest wait; every live
    beam of every running search is decoded in one batch per step.

    Returns:
        Per root, the finished beams as elements, best first (at most ``spec.beams``), each
        with how its constrained output was cut short, or None (cut ones rank below the
        others).
    """
    started: list[BeamSearch] = []
    results: list[list[tuple[Element, IncompleteOutputError | None]]] = [[] for _ in roots]
    scheduler = Scheduler(spec.model.cache)
    for root in roots:
        scheduler.submit(
            functools.partial(_start, spec, root, started),
            n_slots=spec.beams or 1,
            prefills=root.tokens,
        )
    with spec.model.cache.beam_turn():  # a search forks while it holds slots: one thread's
        try:
            for event in scheduler:
                if event.is_last:
                    assert isinstance(event.run, BeamSearch)
                    results[event.ticket] = event.run.results
        finally:
            for search in started:
                search.close_live()
    return results
