"""Continuous generation: :class:`SequenceState` (batch x samples x text) and :func:`continuous`.

::

    text = continuous(generate.text(model, max_tokens=20))
    s = text("Write a story about a cat:")       # a SequenceState
    s = text(s[:40] + " Then")                   # the KV cache of the first 40 characters is kept

A state is a value: its elements' tokens and the log-probabilities of the tokens generated.
It holds no slot: the model's KV store keeps the cells of every generation, so continuing,
slicing and adding decode only the tokens the store does not hold (see
:mod:`lcgen.continuous.elements`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from typing import Any, ClassVar, SupportsIndex

import numpy as np

from lcgen._numbers import plain
from lcgen._unshared import Unshared
from lcgen.continuous import beam
from lcgen.continuous.elements import (
    Element,
    prefix_tokens,
    random_seed,
    run,
    text_of,
)
from lcgen.continuous.specs import GenerateSpec
from lcgen.decoding.options import shown
from lcgen.decoding.sampling import check_seed
from lcgen.errors import BatchMismatchError, IncompleteOutputError, SampleMismatchError
from lcgen.runtime.tokens import ModelLike

#: The most samples one call makes: ``num_samples`` times the batch elements (where
#: ``num_samples`` > 1). Each sample is an element of its own (its prompt's tokens copied) and a
#: generation of its own through the model's slots, at most 256 at once (llama.cpp's most
#: sequences, 32 by default): 4,096 are 16 rounds of the most slots a model can have, enough
#: to estimate a distribution; a million held 1.2 GB before the first decode. The server's
#: ``n`` is at most 16: its clients share one model. More samples: make them in several calls.
MAX_SAMPLES = 4096

__all__ = ["Continuous", "SequenceState", "continuous"]

Index = int | slice


# the state ---------------------------------------------------------------------------------
class SequenceState(Unshared):
    """Batch x samples sequences, each a text with the KV cache behind it.

    Made by a :func:`continuous` generator (or :meth:`from_text`). Index it as
    ``state[batch, sample, chars]``, with shorthands: a state of one batch element takes
    ``state[sample, chars]``, one of one sample per batch element ``state[batch, chars]``, and
    a single sequence ``state[chars]``; with one index on a larger state it selects batch
    elements (or samples when the batch is 1). Integers and slices work on every axis; the
    result always keeps both axes (an integer leaves an axis of size 1). The last axis slices
    the text; a slice from the start keeps the KV cache up to the last whole token inside it.

    ``list(state)`` gives the texts, batch-major; ``len(state)`` their number; ``state.shape``
    is ``(batch, samples)``; ``state.weights`` the summed log-probabilities of the generated
    tokens. A state holds no slot: its elements' KV cells stay in the model's KV store
    (``model.cache``) until evicted, and ``state.n_cached`` says how many are held whole.
    """

    instead: ClassVar[str] = (
        "it holds live sequences in the model's KV cache; keep its texts or tokens instead"
    )

    def __init__(self, model: ModelLike, elements: list[list[Element]]) -> None:
        if not elements or not elements[0] or any(len(r) != len(elements[0]) for r in elements):
            raise ValueError("a state needs a non-empty rectangle of elements")
        self.model = model
        self._elements = elements

    @classmethod
    def from_text(
        cls, model: ModelLike, prompt: str | Seq[str] | Seq[Seq[str]], *, num_samples: int = 1
    ) -> SequenceState:
        """A state of texts (nothing decoded yet): a string; a list, one per batch element; or
        a list of equally long lists, ``[batch][sample]``.

        Raises:
            TypeError: ``prompt`` is none of those.
            ValueError: a list is empty or the lists differ in length, or ``num_samples`` < 1
                or over :data:`MAX_SAMPLES` (with the batch).
        """
        num_samples = _check_num_samples(num_samples)
        grid = _text_grid(prompt, num_samples)
        _check_num_samples(num_samples, len(grid))

        def element(text: str) -> Element:
            tokens = model.vocab.tokenize(text)
            return Element(tokens, [0.0] * len(tokens))

        return cls(model, [[element(text) for text in row] for row in grid])

    # reading -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return len(self._elements), len(self._elements[0])

    @property
    def texts(self) -> list[list[str]]:
        """The texts, as ``texts[batch][sample]``."""
        return [[text_of(self.model, e.tokens) for e in row] for row in self._elements]

    @property
    def tokens(self) -> list[list[list[int]]]:
        """The token ids, as ``tokens[batch][sample]``."""
        return [[list(e.tokens) for e in row] for row in self._elements]

    @property
    def weights(self) -> np.ndarray:
        """Each element's summed log-probability of its generated tokens, shape ``shape``."""
        return np.array([[e.weight for e in row] for row in self._elements], dtype=np.float64)

    @property
    def n_cached(self) -> int:
        """How many elements the model's KV store holds whole (all tokens but the last, which
        the next step decodes, or all with the logits after them): continuing them decodes no
        old token."""
        cache = self.model.cache
        return sum(
            cache.cached(e.tokens) >= max(0, len(e.tokens) - 1)
            for row in self._elements
            for e in row
        )

    def __len__(self) -> int:
        return self.shape[0] * self.shape[1]

    def __iter__(self) -> Iterator[str]:
        for row in self.texts:
            yield from row

    def __str__(self) -> str:
        return next(iter(self)) if len(self) == 1 else repr(self)

    def __repr__(self) -> str:
        shown = [
            text if len(text) <= 40 else text[:37] + "..." for text in itertools.islice(self, 4)
        ]
        more = ", ..." if len(self) > 4 else ""
        return f"<lcgen.SequenceState shape={self.shape}: {', '.join(map(repr, shown))}{more}>"

    def element_at(self, b: int, s: int) -> Element:
        """The element at (b, s), broadcasting an axis of size 1."""
        row = self._elements[b if len(self._elements) > 1 else 0]
        return row[s if len(row) > 1 else 0]

    def _map(self, fn: Callable[[Element], Element]) -> SequenceState:
        return SequenceState(self.model, [[fn(e) for e in row] for row in self._elements])

    # indexing ------------------------------------------------------------------------------
    def __getitem__(self, key: Index | tuple[Index, ...]) -> SequenceState:
        batch, sample, chars = self._split_key(key)
        rows = [self._elements[b] for b in _positions(batch, self.shape[0], "batch")]
        cols = _positions(sample, self.shape[1], "sample")
        return SequenceState(
            self.model, [[_slice_text(self.model, row[s], chars) for s in cols] for row in rows]
        )

    def _split_key(self, key: Index | tuple[Index, ...]) -> tuple[Index, Index, Index]:
        keys = key if isinstance(key, tuple) else (key,)
        n_batch, n_samples = self.shape
        everything = slice(None)
        if len(keys) == 3:
            return keys[0], keys[1], keys[2]
        if len(keys) == 2:
            if n_batch > 1 and n_samples > 1:
                return keys[0], keys[1], everything
            if n_samples == 1:
                return keys[0], everything, keys[1]
            return everything, keys[0], keys[1]
        if len(keys) == 1:
            if n_batch == 1 and n_samples == 1:
                return everything, everything, keys[0]
            if n_batch == 1:
                return everything, keys[0], everything
            return keys[0], everything, everything
        raise IndexError(
            f"a state takes 1 to 3 indices [batch, sample, chars], got {len(keys)}: {key!r}"
        )

    # adding --------------------------------------------------------------------------------
    def __add__(self, other: str | SequenceState) -> SequenceState:
        """``state + "text"`` appends to every element (only the text is decoded later);
        ``state + state`` concatenates element-wise, an axis of size 1 broadcasting.

        Raises:
            BatchMismatchError, SampleMismatchError: the shapes do not fit (both are named).
        """
        if isinstance(other, str):
            extra = self.model.vocab.tokenize(other, add_bos=False)
            return self._map(lambda e: Element(e.tokens + extra, e.logprobs + [0.0] * len(extra)))
        if not isinstance(other, SequenceState):
            return NotImplemented
        if other.model is not self.model:
            raise ValueError("cannot add states of different models")
        shape = _broadcast(self.shape, other.shape)
        return SequenceState(
            self.model,
            [
                [
                    self._concat(self.element_at(b, s), other.element_at(b, s))
                    for s in range(shape[1])
                ]
                for b in range(shape[0])
            ],
        )

    def __radd__(self, other: str) -> SequenceState:
        """``"text" + state``: a new prompt (nothing of the old cache applies; weights reset)."""
        if not isinstance(other, str):
            return NotImplemented
        model = self.model

        def fresh(e: Element) -> Element:
            tokens = model.vocab.tokenize(other + text_of(model, e.tokens))
            return Element(tokens, [0.0] * len(tokens))

        return self._map(fresh)

    def _concat(self, a: Element, b: Element) -> Element:
        bos = self.model.vocab.bos
        skip = 1 if b.tokens[:1] == [bos] and bos >= 0 else 0
        return Element(a.tokens + b.tokens[skip:], a.logprobs + b.logprobs[skip:])

    # lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Nothing to give back: a state holds no slot (its KV cells stay in the model's cache
        until evicted). Kept so that states work in with-blocks."""

    def __enter__(self) -> SequenceState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_num_samples(num_samples: object, n_batch: int = 1) -> int:
    """``num_samples`` as an int; refused when it is not an int in [1, MAX_SAMPLES], or makes
    more than :data:`MAX_SAMPLES` samples of ``n_batch`` batch elements (a batch alone is not
    bounded)."""
    num_samples = plain(num_samples)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if num_samples > 1 and num_samples * n_batch > MAX_SAMPLES:
        of = f" of {n_batch} batch elements" if n_batch > 1 else ""
        raise ValueError(
            f"num_samples={num_samples}{of} makes {num_samples * n_batch:,} samples, over the "
            f"{MAX_SAMPLES:,} one call makes: make them in several calls"
        )
    return num_samples


def _text_grid(prompt: object, num_samples: int) -> list[list[str]]:
    if isinstance(prompt, str):
        return [[prompt] * num_samples]
    rows = list(prompt) if isinstance(prompt, list | tuple) else None
    if rows and all(isinstance(p, str) for p in rows):
        return [[p] * num_samples for p in rows]
    if rows and all(
        isinstance(r, list | tuple) and all(isinstance(p, str) for p in r) for r in rows
    ):
        if num_samples != 1:
            raise ValueError(f"a [batch][sample] list of texts takes no num_samples={num_samples}")
        grid = [list(r) for r in rows]
        if not grid[0] or any(len(r) != len(grid[0]) for r in grid):
            raise ValueError(
                f"the [batch][sample] lists must be non-empty and equally long: {shown(prompt)}"
            )
        return grid
    raise TypeError(
        "expected a text, a non-empty list of texts or a list of lists of texts, got "
        f"{shown(prompt)}"
    )


def _positions(index: Index, size: int, axis: str) -> list[int]:
    if isinstance(index, slice):
        picked = list(range(*index.indices(size)))
        if not picked:
            raise IndexError(f"{axis} slice {index!r} selects nothing of {axis} size {size}")
        return picked
    i = _as_int(index, axis)
    if not -size <= i < size:
        raise IndexError(f"{axis} index {i} is out of range for {axis} size {size}")
    return [i % size]


def _as_int(index: object, axis: str) -> int:
    if isinstance(index, bool) or not isinstance(index, SupportsIndex):
        raise TypeError(f"{axis} index must be an int or a slice, got {index!r}")
    return operator.index(index)


def _slice_text(model: ModelLike, elem: Element, chars: Index) -> Element:
    """The element with its text indexed by ``chars`` (a character, or a slice)."""
    if chars == slice(None):
        return elem.copy()
    text = text_of(model, elem.tokens)
    if not isinstance(chars, slice):
        i = _as_int(chars, "character")
        if not -len(text) <= i < len(text):
            raise IndexError(f"character index {i} is out of range for a text of {len(text)}")
        chars = slice(i % len(text), i % len(text) + 1)
    start, stop, stride = chars.indices(len(text))
    if start == 0 and stride == 1:
        return Element(*prefix_tokens(model, elem.tokens, elem.logprobs, stop))
    tokens = model.vocab.tokenize(text[chars])  # not a prefix: a fresh sequence
    return Element(tokens, [0.0] * len(tokens))


def _broadcast(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    out = []
    for axis, (x, y), error in (
        ("batch", (a[0], b[0]), BatchMismatchError),
        ("sample", (a[1], b[1]), SampleMismatchError),
    ):
        if x != y and 1 not in (x, y):
            raise error(
                f"cannot add states of shapes {a} and {b}: {axis} sizes {x} and {y} differ "
                "(they must be equal, or one of them 1)"
            )
        out.append(max(x, y))
    return out[0], out[1]


class Continuous:
    """A generation spec bound for continuous use: call it on a prompt, a list of prompts or
    a :class:`SequenceState`; it returns a new state (made by :func:`continuous`)."""

    def __init__(self, spec: GenerateSpec) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"<lcgen.Continuous {self.spec.plan!r}, beams={self.spec.beams}>"

    def __call__(
        self,
        prompt: str | Seq[str] | SequenceState,
        *,
        num_samples: int = 1,
        seed: int | None = None,
    ) -> SequenceState:
        """Generate after each element of ``prompt``.

        Args:
            prompt: a prompt, a list of prompts (the batch axis), or a state to continue (its
                KV cache is reused: only tokens not yet decoded are decoded).
            num_samples: samples per batch element, decoded together (the prompt once).
            seed: sample ``j`` of every batch element samples with seed ``seed + j`` (None:
                the spec's seed; neither: fresh random seeds).

        Returns:
            A new state of shape ``(batch, num_samples)`` (``(batch, beams)`` with beam
            search, best beam first); the input state is left as it was.

        Raises:
            IncompleteOutputError: with a constraint, an element stopped before its output
                matched it (``max_tokens``, a stop string); the state made (every element,
                as generated) is on the error's ``state``.
            SampleMismatchError: samples (or beams) were asked of a state that has several per
                batch element already.
            ValueError: ``num_samples`` < 1 or over :data:`MAX_SAMPLES` (with the batch), a
                ``seed`` that is not an int >= 0, a state of another model, or an element
                with no tokens.
        """
        model, spec = self.spec.model, self.spec
        num_samples = _check_num_samples(num_samples)  # before the prompts are tokenized
        seed = check_seed(seed)
        state = self._as_state(prompt)
        _check_num_samples(num_samples, state.shape[0])
        if spec.beams is not None and num_samples != 1:
            raise ValueError(
                f"with beams the sample axis holds the beams; num_samples={num_samples}"
            )
        width = spec.beams or num_samples
        n_batch, n_in = state.shape
        if n_in > 1 and (width > 1 or spec.beams is not None):  # (a beam search per element)
            raise SampleMismatchError(
                f"the state of shape {state.shape} already has {n_in} samples per batch element; "
                f"index one sample before asking for {width} {'beams' if spec.beams else 'samples'}"
            )
        empty = next(
            (
                (b, s)
                for b in range(n_batch)
                for s in range(n_in)
                if not state.element_at(b, s).tokens
            ),
            None,
        )
        if empty is not None:  # (Sequence.run_plan's "append a prompt" named no element)
            raise ValueError(
                f"element {empty} of the state has no tokens (an empty prompt or slice, and "
                "the model adds no BOS): there is nothing to generate after; give it text, "
                "such as state + 'Once upon a time'"
            )
        if spec.beams is not None:
            roots = [state.element_at(b, 0).copy() for b in range(n_batch)]
            return _beam_state(model, beam.search(spec, roots))
        n_out = max(n_in, num_samples)
        base = seed if seed is not None else spec.plan.sampler.seed
        rows = [[state.element_at(b, s).copy() for s in range(n_out)] for b in range(n_batch)]
        seeds = [
            base + s if base is not None else random_seed() for _ in rows for s in range(n_out)
        ]
        errors = run(spec, [e for row in rows for e in row], seeds)
        cut = {divmod(i, n_out): c for i, c in enumerate(errors) if c is not None}
        return _complete_or_raise(SequenceState(model, rows), cut, f"of {len(errors)} elements")

    def _as_state(self, prompt: Any) -> SequenceState:
        if isinstance(prompt, SequenceState):
            if prompt.model is not self.spec.model:
                raise ValueError("the state was made with another model than this generator's")
            return prompt
        return SequenceState.from_text(self.spec.model, prompt)


def _beam_state(
    model: ModelLike, found: list[list[tuple[Element, IncompleteOutputError | None]]]
) -> SequenceState:
    """The state of beam searches' results (per batch element, best first, the beams a
    constraint cut short last): where every element has complete beams, only those, as many
    per element as the element with fewest (a state is a rectangle; elements can end with
    fewer distinct texts than the width); else all beams, and an IncompleteOutputError."""
    complete = [sum(c is None for _, c in row) for row in found]
    n = min(complete) or min(len(row) for row in found)
    rows = [row[:n] for row in found]
    out = SequenceState(model, [[elem for elem, _ in row] for row in rows])
    cut = {(b, s): c for b, row in enumerate(rows) for s, (_, c) in enumerate(row) if c}
    return _complete_or_raise(out, cut, "beams")


def _complete_or_raise(
    out: SequenceState, cut: dict[tuple[int, int], IncompleteOutputError], what: str
) -> SequenceState:
    """``out``, unless some of its elements (at the keys of ``cut``) were cut short of their
    constraint: then an :class:`IncompleteOutputError` about the first, with ``out`` on it."""
    if not cut:
        return out
    at, first = next(iter(cut.items()))
    raise IncompleteOutputError(
        f"{len(cut)} {what} stopped before their output matched the constraint; the first, at "
        f"{at}: {first} (the state made is on the error's .state)",
        first.text,
        out,
    )


def continuous(spec: GenerateSpec) -> Continuous:
    """Make a generation spec (``generate.text(...)``, ``.choice``, ``.json``, ``.regex``,
    ``.grammar``) callable on prompts and :class:`SequenceState` values.

    Raises:
        TypeError: ``spec`` is not a :class:`~lcgen.generate.GenerateSpec`.
    """
    if not isinstance(spec, GenerateSpec):
        raise TypeError(f"continuous() takes a generate.* spec, got {spec!r}")
    return Continuous(spec)
