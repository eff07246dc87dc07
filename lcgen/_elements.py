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
import itertools
import math
import os
import weakref
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lcgen.backtrack import Backtracker
from lcgen.errors import SlotsExhaustedError
from lcgen.generator import Chunk
from lcgen.sequence import Run, Sequence, common_prefix, step

if TYPE_CHECKING:
    from lcgen.generate import GenerateSpec
    from lcgen.model import Model

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

    def materialize(self, model: Model, elem: Element) -> bool:
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


_POOLS: weakref.WeakKeyDictionary[Model, Pool] = weakref.WeakKeyDictionary()


def pool_of(model: Model) -> Pool:
    pool = _POOLS.get(model)
    if pool is None:
        pool = _POOLS[model] = Pool()
    return pool


# text <-> tokens ---------------------------------------------------------------------------
def text_of(model: Model, tokens: Seq[int]) -> str:
    """The element's text: its token pieces joined (invalid UTF-8 becomes U+FFFD)."""
    return b"".join(model.token_piece(t) for t in tokens).decode("utf-8", "replace")


def prefix_tokens(
    model: Model, tokens: list[int], logprobs: list[float], n_chars: int
) -> tuple[list[int], list[float]]:
    """Tokens for the first ``n_chars`` characters of the text: the whole tokens inside them
    are kept (with their log-probabilities), the partial last one is tokenized again."""
    pieces = [model.token_piece(t) for t in tokens]
    data = b"".join(pieces)
    target = data.decode("utf-8", "replace")[:n_chars]
    ends = list(itertools.accumulate(map(len, pieces), initial=0))
    k = bisect.bisect_right(ends, len(target.encode())) - 1
    # A U+FFFD in the text stands for 1-3 bytes: step back until the kept bytes fit.
    while k > 0 and not target.startswith(data[: ends[k]].decode("utf-8", "replace")):
        k -= 1
    rest = target[len(data[: ends[k]].decode("utf-8", "replace")) :]
    tail = model.tokenize(rest, add_bos=False) if rest else []
    return tokens[:k] + tail, logprobs[:k] + [0.0] * len(tail)


def _cut(model: Model, elem: Element, n_chars: int) -> None:
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


def cut_at_stop(model: Model, elem: Element, text_before: str, emitted: str) -> None:
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
    run: Run | Backtracker
    text_before: str
    parts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def take(self, chunk: Chunk) -> None:
        self.parts.append(chunk.text)
        self.logprobs.extend([chunk.logprob or 0.0] * len(chunk.tokens))


def _finish(model: Model, pool: Pool, job: _Job, last: Chunk | None) -> None:
    elem = job.elem
    assert elem.seq is not None
    generated = job.run.token_logprobs if isinstance(job.run, Backtracker) else job.logprobs
    settle(elem, elem.seq.tokens, generated)
    if last is not None and last.stop is not None:
        cut_at_stop(model, elem, job.text_before, "".join(job.parts))
    elem.busy = False
    pool.touch(elem)


def _start(
    spec: GenerateSpec,
    pool: Pool,
    waiting: deque[tuple[Element, int]],
    running: list[_Job],
) -> None:
    """Start waiting elements while slots can be had (finished elements give theirs up)."""
    while waiting:
        elem, seed = waiting[0]
        if not pool.materialize(spec.model, elem):
            if running:
                return
            raise SlotsExhaustedError(
                f"all {spec.model.context.n_seq_max} sequence slots are held by sequences "
                "outside continuous states: close some, or load the model with more n_seq_max"
            )
        waiting.popleft()
        assert elem.seq is not None
        elem.busy = True
        job = _Job(elem, elem.seq.run(**spec.generator_options(seed)), "")
        job.text_before = text_of(spec.model, elem.tokens)
        if job.run.is_done:  # max_tokens=0
            _finish(spec.model, pool, job, None)
        else:
            running.append(job)


def run(spec: GenerateSpec, elements: list[Element], seeds: list[int]) -> None:
    """Generate on every element in place, all live ones decoded in one batch per step."""
    pool = pool_of(spec.model)
    waiting = deque(zip(elements, seeds, strict=True))
    running: list[_Job] = []
    try:
        while waiting or running:
            _start(spec, pool, waiting, running)
            if not running:
                continue
            pairs = [(job.elem.seq, job.run) for job in running]
            chunks = step([(seq, run) for seq, run in pairs if seq is not None])
            still = []
            for job, chunk in zip(running, chunks, strict=True):
                job.take(chunk)
                if job.run.is_done:
                    _finish(spec.model, pool, job, chunk)
                else:
                    still.append(job)
            running = still
    finally:
        for job in running:  # interrupted: the sequence holds tokens the element does not
            job.elem.busy = False
            job.elem.release()
