"""Checkpoints: a sequence's state at one token position, as a value; and a sequence's costs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lcgen.decoding import GeneratorState

RngState = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A sequence's state at one token position; taking one copies no KV data.

    Attributes:
        n_tokens: the sequence's length (the position the next token goes to).
        stamp: identifies the token history up to ``n_tokens`` (shared by forks).
        seq_uid: the sequence it was taken on (for error messages).
        rng_state: the sampler RNG's state at that position.
        generation: taken in the middle of a generation, the generator's state (text held
            back, healing progress, grammar state, tokens generated); None between calls.
    """

    n_tokens: int
    stamp: int
    seq_uid: int
    rng_state: RngState
    generation: GeneratorState | None = None


@dataclass(slots=True)
class SequenceStats:
    """What rewinding has cost a sequence so far.

    Attributes:
        rewinds: rewinds done.
        fallbacks: rewinds the KV memory could not do in place (sliding-window or recurrent
            memory), so the kept tokens were decoded again.
        tokens_redecoded: tokens decoded again because of those fallbacks.
        tokens_decoded: every token of this sequence passed to ``llama_decode`` so far.
        tokens_reused: tokens whose KV cells came from the model's KV store when the sequence
            was opened (not decoded for it).
    """

    rewinds: int = 0
    fallbacks: int = 0
    tokens_redecoded: int = 0
    tokens_decoded: int = 0
    tokens_reused: int = 0
