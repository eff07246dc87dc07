"""The elements of continuous states and the slots they share; running a spec on them.

An element of a :class:`~lcgen.continuous.SequenceState` is its tokens (the truth) and the
log-probabilities of those generated. While the model has slots, an element also holds a live
:class:`~lcgen.Sequence` with its KV cache, so continuing it decodes only new tokens. When more
elements are needed than the model's ``n_seq_max`` slots, the least recently used element that
is not generating gives its slot up and keeps its tokens only; it is rebuilt when next used,
from the longest prefix a live sequence still holds (a sibling sample with the same prompt, the
state it was sliced from), so only the tokens no live sequence shares are decoded again. All
elements being generated are decoded together, one batch per step.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from lcgen.continuous.specs import GenerateSpec
from lcgen.decoding import Chunk
from lcgen.runtime import Backtracker, PlainRun, Run, Scheduler, Sequence
from lcgen.runtime.tokens import ModelLike, common_prefix

_SHARED_MIN = 2  # a prefix worth forking holds at least one decoded cell (the last is pending)


class Element:
    """One element of a state: tokens (the truth), a log-probability per token (0 for tokens
    not generated), and the live sequence holding their KV cache while it has a slot."""

    __slots__ = ("__weakref__", "busy", "last_used", "logprobs", "origin", "seq", "tokens")

    def __init__(
        self, tokens: list[int], logprobs: list[float], origin: Element | None = None
    ) -> None:
        self.tokens = tokens
        self.logprobs = logprobs
        self.seq: Sequence | None = None
        self.origin = origin  # the live element this one was derived from: keeps its cache
        self.busy = False
        self.last_used = 0

    @property
    def is_live(self) -> bool:
        return self.seq is not None and not self.seq.is_closed

    @property
    def weight(self) -> float:
        return math.fsum(self.logprobs)

    def derive(self, tokens: list[int], logprobs: list[float]) -> Element:
        """A new element whose tokens start like this one's (it may fork this one's cache)."""
        return Element(tokens, logprobs, self if self.is_live else self.origin)

    def release(self) -> None:
        if self.seq is not None:
            self.seq.close()
            self.seq = None


class Pool:
    """The elements of one model that hold live sequences (weakly: a dropped state frees its
    slots), and the policy that hands slots out."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Element] = weakref.WeakSet()
        self._clock = itertools.count(1)

    def adopt(self, elem: Element, seq: Sequence) -> None:
        elem.seq, elem.origin = seq, None
        self._live.add(elem)
        self.touch(elem)

    def touch(self, elem: Element) -> None:
        elem.last_used = next(self._clock)

    def live(self) -> list[Element]:
        return [e for e in list(self._live) if e.is_live]

    def source(self, tokens: Seq[int]) -> Element | None:
        """The live element sharing the longest prefix with ``tokens`` (at least 2 tokens)."""
        best, best_n = None, _SHARED_MIN - 1
        for elem in self.live():
            n = common_prefix(elem.tokens, tokens)
            if n > best_n:
                best, best_n = elem, n
        return best

    def evict(self, keep: Element | None = None) -> bool:
        """Free the slot of the least recently used idle element; False when there is none."""
        idle = [e for e in self.live() if not e.busy and e is not keep]
        if not idle:
            return False
        min(idle, key=lambda e: e.last_used).release()
        return True

    def materialize(self, model: ModelLike, elem: Element) -> bool:
        """Give ``elem`` a live sequence holding its tokens, every one decoded but the last.

        Forks the live sequence sharing the longest prefix (or, with no slot free, takes it
        over when it is idle); starts a new one when none shares a prefix. Returns False when
        no slot can be had now (all are generating).
        """
        if elem.is_live:
            self.touch(elem)
            return True
        src = self.source(elem.tokens)
        if model.context.n_free_slots == 0:
            if src is not None and src.seq is not None and not src.busy:
                seq, src.seq = src.seq, None
                seq.reuse(elem.tokens)
                return self._ready(elem, seq)
            if not self.evict(keep=src):
                return False
        if src is not None and src.seq is not None:
            seq = src.seq.fork()
            seq.reuse(elem.tokens)
        else:
            seq = Sequence(model, elem.tokens)
        return self._ready(elem, seq)

    def _ready(self, elem: Element, seq: Sequence) -> bool:
        seq.prefill()  # so forks share these cells and each step decodes one token per element
        self.adopt(elem, seq)
        return True


_POOLS: weakref.WeakKeyDictionary[ModelLike, Pool] = weakref.WeakKeyDictionary()


def pool_of(model: ModelLike) -> Pool:
    pool = _POOLS.get(model)
    if pool is None:
        pool = _POOLS[model] = Pool()
        model.context.reclaimers.append(pool.evict)  # a sequence needing a slot takes an idle one
    return pool


# text <-> tokens ---------------------------------------------------------------------------
def text_of(model: ModelLike, tokens: Seq[int]) -> str:
    """The element's text: its token pieces joined (invalid UTF-8 becomes U+FFFD)."""
    return b"".join(model.vocab.piece(t) for t in tokens).decode("utf-8", "replace")


def prefix_tokens(
    model: ModelLike, tokens: list[int], logprobs: list[float], n_chars: int
) -> tuple[list[int], list[float]]:
    """Tokens for the first ``n_chars`` characters of the text: the whole tokens inside them
    are kept (with their log-probabilities), the partial last one is tokenized again."""
    pieces = [model.vocab.piece(t) for t in tokens]
    data = b"".join(pieces)
    target = data.decode("utf-8", "replace")[:n_chars]
    ends = list(itertools.accumulate(map(len, pieces), initial=0))
    k = bisect.bisect_right(ends, len(target.encode())) - 1
    # A U+FFFD in the text stands for 1-3 bytes: step back until the kept bytes fit.
    while k > 0 and not target.startswith(data[: ends[k]].decode("utf-8", "replace")):
        k -= 1
    rest = target[len(data[: ends[k]].decode("utf-8", "replace")) :]
    tail = model.vocab.tokenize(rest, add_bos=False) if rest else []
    return tokens[:k] + tail, logprobs[:k] + [0.0] * len(tail)


def _cut(model: ModelLike, elem: Element, n_chars: int) -> None:
    """Cut an element (and its live sequence) to the first ``n_chars`` characters."""
    elem.tokens, elem.logprobs = prefix_tokens(model, elem.tokens, elem.logprobs, n_chars)
    if elem.seq is not None and elem.is_live:
        elem.seq.reuse(elem.tokens)


def settle(elem: Element, new_tokens: list[int], generated: Seq[float]) -> None:
    """Record a finished generation on ``elem``: its tokens now, and the log-probabilities of
    the ``len(generated)`` tokens generated at their end."""
    kept = common_prefix(elem.tokens, new_tokens)  # less than all when token healing redid one
    pad = len(new_tokens) - kept - len(generated)
    elem.logprobs = elem.logprobs[:kept] + [0.0] * pad + list(generated)
    elem.tokens = new_tokens


def cut_at_stop(model: ModelLike, elem: Element, text_before: str, emitted: str) -> None:
    """After a stop string, drop the text past the emitted text (the stop, unless included)."""
    n_chars = len(text_before) + len(emitted)
    if len(text_of(model, elem.tokens)) != n_chars:
        _cut(model, elem, n_chars)


def random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# running a spec --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Job:
    """One element being generated."""

    elem: Element
    text_before: str
    run: PlainRun | Backtracker | None = None
    parts: list[str] = field(default_factory=list)

    def take(self, chunk: Chunk | None) -> None:
        if chunk is not None:
            self.parts.append(chunk.text)


def _start(spec: GenerateSpec, pool: Pool, job: _Job, seed: int) -> Run | None:
    """Give the element a live sequence (None: no slot can be had now) and start its run."""
    if not pool.materialize(spec.model, job.elem):
        return None
    assert job.elem.seq is not None
    job.elem.busy = True
    job.run = job.elem.seq.run_plan(spec.element_plan(seed))
    return job.run


def _finish(model: ModelLike, pool: Pool, job: _Job, last: Chunk | None) -> None:
    elem, run = job.elem, job.run
    assert elem.seq is not None and run is not None
    settle(elem, elem.seq.tokens, run.token_logprobs)
    if last is not None and last.stop is not None:
        cut_at_stop(model, elem, job.text_before, "".join(job.parts))
    elem.busy = False
    pool.touch(elem)


def run(spec: GenerateSpec, elements: list[Element], seeds: list[int]) -> None:
    """Generate on every element in place through the scheduler: all live ones decoded in one
    batch per step, the rest queued for slots."""
    pool = pool_of(spec.model)
    jobs = [_Job(elem, text_of(spec.model, elem.tokens)) for elem in elements]
    scheduler = Scheduler(spec.model.context)
    for job, seed in zip(jobs, seeds, strict=True):
        scheduler.submit(functools.partial(_start, spec, pool, job, seed))
    try:
        for event in scheduler:
            job = jobs[event.ticket]
            job.take(event.chunk)
            if event.is_last:
                _finish(spec.model, pool, job, event.chunk)
    finally:
        for job in jobs:
            if job.elem.busy:  # interrupted: the sequence holds tokens the element does not
                job.elem.busy = False
                job.elem.release()
