"""Drafts for speculative decoding: guesses at the next tokens, verified by the model in one
batch (see :meth:`lcgen.runtime.run.SequenceRun.advance`).

A draft never changes what is generated: every position is still sampled from the model's own
logits with the generation's sampler and RNG, and a draft token counts only where it equals the
token sampled there. A good draft saves steps; a bad one costs the time to decode it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

NGRAM_MAX = 4  # the longest suffix looked up
NGRAM_MIN = 2  # the shortest (single tokens match too often to be worth a draft)
MAX_DRAFT = 64
# Default caps. A prompt-lookup draft costs nothing to make, and a long one verified in one
# batch pays off where text is copied (measured on the 2-core CPU: 64 against 8 took the
# copy-heavy bench from 1.3-1.4x to 1.6-1.7x, with free text and JSON unchanged). A draft
# model decodes each draft token in turn, so its drafts stay short.
NGRAM_DRAFT = MAX_DRAFT
MODEL_DRAFT = 8
# After a draft that missed part way, drafts start again this short and double back up: the
# text has most likely left what it was copying (measured: a 43-token draft right after such a
# miss had nothing accepted; restarting at 4 took the copy-heavy bench from 1.55x to 1.8x).
RESTART = 4
# What a draft is worth (see AdaptiveLength.worth). Each draft token is taken to add TOKEN_COST of a
# lone decode to the step that verifies it: measured 0.48 on a 2-core AMD Zen 4 (9.0 ms for one
# token, 15.5 for two, then 4.3 ms for each more up to 64) and about 0.3 on a 2-core laptop CPU
# (prefill against decode). A fixed figure, not a timed one: draft lengths, so batch shapes and
# logits, stay the same from run to run. The chance that a draft token is accepted is estimated from
# the drafts' feedback, each draft's counts weighing DECAY times the next one's, and
# PRIOR_ACCEPTANCE, weighing PRIOR_WEIGHT draft tokens, before any. Chosen by replaying the greedy
# generations of eight chat prompts (a story, a copy, code, a list, a summary, answers about a
# passage, a recipe, an explanation) with each machine's batch costs: tokens per second with prompt
# lookup against without, geometric mean 1.035 -> 1.148 with the Zen 4's costs, 1.291 -> 1.385 with
# 0.32 per draft token and 1.611 -> 1.622 with 0.15 (the copy alone 1.42 -> 1.45, 1.87 -> 1.88 and
# 2.61 -> 2.56); within 0.01 of that for decays 0.7-0.9 and priors 0.7-0.9, a prior weighing 2
# tokens ramps a copy's drafts up more slowly (1.35 on the Zen 4).
TOKEN_COST = 0.5
PRIOR_ACCEPTANCE = 0.8
PRIOR_WEIGHT = 0.5
DECAY = 0.8


@dataclass(frozen=True, slots=True)
class Speculation:
    """How a generation drafts (``speculate``, ``num_draft``).

    Attributes:
        method: ``"ngram"`` (prompt lookup over the sequence's own tokens) or ``"model"``.
        num_draft: the most draft tokens verified in one step.
        draft: with ``"model"``, the draft model (an :class:`lcgen.Model` with the same
            vocabulary).
    """

    method: str = "ngram"
    num_draft: int = NGRAM_DRAFT
    draft: Any = None


class Drafter(Protocol):
    """What a run asks of a drafter."""

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        """A draft to follow ``tokens``: at most ``room`` tokens, possibly none."""
        ...

    def feedback(self, drafted: int, accepted: int) -> None:
        """``accepted`` of the ``drafted`` tokens of the last draft were sampled."""
        ...

    def close(self) -> None:
        """Free what the drafter holds (the generation ended, or its sequence was closed); a
        later :meth:`propose` may take it again (a rewound run goes on)."""
        ...


class AdaptiveLength:
    """The draft length policy drafters share: the length doubles (up to ``num_draft``) after
    a draft taken whole and shrinks to what was accepted, at most ``RESTART``, after a miss;
    after a draft of which nothing was accepted, drafting pauses for 2, 4, 8 ... 32 steps,
    doubling with each such miss in a row (so text that drafts do not predict costs almost
    nothing).

    :meth:`worth` gives the length, up to that, expected to make tokens fastest.

    Args:
        num_draft: the most tokens in one draft.
    """

    def __init__(self, num_draft: int) -> None:
        self.num_draft = num_draft
        self.length = num_draft
        self._pause = self._misses = 0
        self._hits = PRIOR_ACCEPTANCE * PRIOR_WEIGHT  # accepted draft tokens, decayed
        self._fails = (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT  # drafts cut by a miss, decayed

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is accepted where the tokens before it
        were."""
        return self._hits / (self._hits + self._fails)

    def next_length(self, room: int) -> int:
        """How many tokens to draft now at most (0 while pausing)."""
        if self._pause:
            self._pause -= 1
            return 0
        return max(0, min(self.length, room))

    def worth(self, k: int) -> int:
        """The length, from 1 up to ``k``, of the draft expected to make tokens fastest: with
        a draft of ``j`` tokens, each accepted with chance ``p`` where those before it were,
        a step makes ``1 + p + ... + p^j`` tokens in ``1 + j * TOKEN_COST`` lone decodes
        (so a 1-token draft pays only where ``p`` is over ``TOKEN_COST``).

        Prompt lookup cuts its drafts so. A draft model's cost a decode of it for each token,
        and what they cost against what they save was not measured (the bundled models have
        no smaller model of their vocabulary), so its drafts keep the length rule alone."""
        if k <= 1:
            return k
        p = min(self.acceptance, 0.999)
        j = np.arange(1, k + 1)
        made = (1 - p ** (j + 1)) / (1 - p)
        return int(j[np.argmax(made / (1 + j * TOKEN_COST))])

    def feedback(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self._hits = DECAY * self._hits + accepted
        self._fails = DECAY * self._fails + (accepted < drafted)
        if accepted == drafted:
            self.length = min(self.num_draft, 2 * self.length)
        else:
            self.length = max(1, min(accepted, RESTART))
        if accepted:
            self._misses = 0
        else:
            self.hold_off()

    def hold_off(self) -> None:
        """Pause drafting as after a draft of which nothing was accepted (also when no draft
        could be made: a draft model without room for one tries again after the pause)."""
        self._misses += 1
        self._pause = min(2**self._misses, 32)

    def close(self) -> None:
        pass


class NgramDrafter(AdaptiveLength):
    """Prompt lookup: finds the latest earlier occurrence of the sequence's last n tokens
    (n from 4 down to 2) and proposes the tokens that followed it, as many as
    :meth:`~AdaptiveLength.worth` finds worth verifying of those :class:`AdaptiveLength`
    allows.

    A match shorter than ``NGRAM_MAX`` whose earlier occurrences disagree on the next token
    proposes nothing: such a draft is a guess between continuations (a JSON value after its
    key's ``": "``, a common word pair in prose) and is almost always wrong (measured over
    the bench's copy, story and JSON generations: 119 such draft tokens, 5 accepted)."""

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        k = self.next_length(room)
        if k <= 0 or len(tokens) <= NGRAM_MIN:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        n_ids = len(ids)
        for n in range(min(NGRAM_MAX, n_ids - 1), NGRAM_MIN - 1, -1):
            tail = ids[n_ids - n :]
            starts = np.flatnonzero(ids[: n_ids - n] == tail[0])  # not the tail itself
            for i in range(1, n):
                starts = starts[ids[starts + i] == tail[i]]
            if starts.size:
                after = starts + n  # where each occurrence's continuation starts
                if n < NGRAM_MAX and (ids[after] != ids[after[-1]]).any():
                    return []
                at = int(after[-1])
                draft: list[int] = ids[at : at + k].tolist()
                return draft[: self.worth(len(draft))]
        return []
