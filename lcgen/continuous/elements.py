"""The elements of continuous states, and running a spec on them through the scheduler.

An element of a :class:`~lcgen.continuous.SequenceState` is its tokens (the truth) and the
log-probabilities of those generated. It holds no slot: the model's KV store keeps the cells of
every sequence that closes, so an element being continued, sliced, sampled again or added to
opens a sequence that starts from the longest prefix the store holds (its own last generation,
a sibling sample with the same prompt, the state it was sliced from) and decodes only the rest.
All elements being generated are decoded together, one batch per step; more elements than
slots wait their turn.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from lcgen.continuous.specs import GenerateSpec
from lcgen.decoding import Chunk
from lcgen.decoding.results import Text, incomplete
from lcgen.errors import IncompleteOutputError
from lcgen.runtime import Backtracker, PlainRun, Run, Scheduler, Sequence
from lcgen.runtime.kvstore import common_prefix
from lcgen.runtime.tokens import ModelLike


@dataclass(slots=True)
class Element:
    """One element of a state: tokens (the truth) and a log-probability per token (0 for
    tokens not generated)."""

    tokens: list[int]
    logprobs: list[float]

    @property
    def weight(self) -> float:
        return math.fsum(self.logprobs)

    def copy(self) -> Element:
        return Element(list(self.tokens), list(self.logprobs))


def open_prefilled(model: ModelLike, tokens: list[int]) -> Sequence:
    """A sequence of ``tokens`` decoded now (from the longest cached prefix), the logits after
    them kept, so that siblings opened next share these cells and logits instead of decoding
    them."""
    seq = Sequence(model, tokens)
    try:
        seq.prefill()
    except BaseException:
        seq.close()
        raise
    return seq


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
    """Cut an element to the first ``n_chars`` characters."""
    elem.tokens, elem.logprobs = prefix_tokens(model, elem.tokens, elem.logprobs, n_chars)


def settle(elem: Element, new_tokens: list[int], generated: Seq[float], after: int = 0) -> int:
    """Record a finished generation on ``elem``: its tokens now, and the log-probabilities of
    the ``len(generated)`` tokens generated before their last ``after`` (the prompt's text
    that token healing cut short put back). Returns how many of its tokens before stayed (all
    but one when token healing redid the last)."""
    # (Token healing re-creates the last token, most often as itself: it was generated.)
    end = len(new_tokens) - after
    kept = min(common_prefix(elem.tokens, new_tokens), end - len(generated))
    pad = end - kept - len(generated)
    elem.logprobs = elem.logprobs[:kept] + [0.0] * pad + list(generated) + [0.0] * after
    elem.tokens = new_tokens
    return kept


def cut_at_stop(
    model: ModelLike, elem: Element, last: Chunk | None, text_before: str, emitted: str, kept: int
) -> None:
    """After a stop, drop the text past the emitted text: a stop string (unless included) or
    a stop token's text, which a generation's text leaves out too. ``kept``: the element's
    tokens before the generation's (see :func:`settle`)."""
    if last is None or last.finish_reason != "stop":
        return
    # Where the text before ended inside a character that the generation's first bytes
    # completed, each side counted its part of it as U+FFFD (the generation never saw the
    # bytes before): the joined text holds that character once.
    text = text_of(model, elem.tokens)
    split = len(text_of(model, elem.tokens[:kept])) + len(text_of(model, elem.tokens[kept:]))
    n_chars = len(text_before) + len(emitted) - (split - len(text))
    if len(text) != n_chars:
        _cut(model, elem, n_chars)


def random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# running a spec --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Job:
    """One element being generated."""

    elem: Element
    text_before: str
    seq: Sequence | None = None
    run: PlainRun | Backtracker | None = None
    chunks: list[Chunk] = field(default_factory=list)
    incomplete: IncompleteOutputError | None = None  # a constrained output cut short

    def take(self, chunk: Chunk | None) -> None:
        if chunk is not None:
            self.chunks.append(chunk)

    def close(self) -> None:
        if self.seq is not None:
            self.seq.close()  # its cells stay cached for the next use of the element


def _start(spec: GenerateSpec, job: _Job, seed: int) -> Run:
    """Open the element's sequence and start its run."""
    job.seq = open_prefilled(spec.model, job.elem.tokens)
    job.run = job.seq.run_plan(spec.element_plan(seed))
    return job.run


def _finish(spec: GenerateSpec, job: _Job, last: Chunk | None) -> None:
    assert job.seq is not None and job.run is not None
    model = spec.model
    after = 0
    if job.run.generator.heal and job.run.ends_sequence:  # healing cut short: the prompt's
        after = job.seq.end_heal(job.run.generator.heal)  # text back after the output
    kept = settle(job.elem, job.seq.tokens, job.run.token_logprobs, after)
    emitted = "".join(c.text for c in job.chunks)
    cut_at_stop(model, job.elem, last, job.text_before, emitted, kept)
    job.incomplete = incomplete(
        Text.of(job.chunks),
        spec.plan.constraint,
        model.vocab,
        spec.plan.stop_tokens,
        job.run.generator.healed,
    )
    job.close()


def run(
    spec: GenerateSpec, elements: list[Element], seeds: list[int]
) -> list[IncompleteOutputError | None]:
    """Generate on every element in place through the scheduler: all running ones decoded in
    one batch per step, the rest queued for slots.

    Returns:
        Per element, None, or the error saying how its constrained output was cut short.
    """
    jobs = [_Job(elem, text_of(spec.model, elem.tokens)) for elem in elements]
    scheduler = Scheduler(spec.model.cache)
    for job, seed in zip(jobs, seeds, strict=True):
        start = functools.partial(_start, spec, job, seed)
        scheduler.submit(start, prefills=job.elem.tokens)
    try:
        for event in scheduler:
            job = jobs[event.ticket]
            job.take(event.chunk)
            if event.is_last:
                _finish(spec, job, event.chunk)
    finally:
        for job in jobs:  # interrupted: the elements keep their tokens from before
            job.close()
    return [job.incomplete for job in jobs]
