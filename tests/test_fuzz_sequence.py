"""Random operation sequences (append, generate with and without speculation, checkpoint,
rewind, fork, close, reopen on the same tokens, save/load) checked against a reference that only
keeps token lists and re-decodes them from scratch.

``LCGEN_FUZZ_EXAMPLES`` sets the number of examples (200 in CI; ``make fuzz`` runs 10,000).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import lcgen
from lcgen.registry import resolve

EXAMPLES = int(os.environ.get("LCGEN_FUZZ_EXAMPLES", "200"))
SLOTS = 4
MAX_LEN = 160
# Logits of the same tokens differ by up to ~1 between decode schedules (batch vs one by one)
# and KV cell layouts; a wrong cache differs by far more (measured: 7.8 and up).
TOLERANCE = 2.5
TEXTS = [" and then", " the cat", " 日本", "!", " Once upon a time", "\n", " 42", " é"]

# (token, identity) pairs after a (ROOT, identity) head: a rewound-then-regrown token is a new
# one, and two sequences never share a head unless one was forked from the other.
History = tuple[tuple[int, int], ...]
ROOT = -1

_models: dict[str, lcgen.Model] = {}


def _model(role: str) -> lcgen.Model:
    if role not in _models:
        path: Path = resolve("smollm2-135m", download=False)
        # The oracle decodes every sequence from scratch; the model under test reuses cached
        # prefixes of closed sequences.
        _models[role] = lcgen.Model(path, n_ctx=1024, n_seq_max=SLOTS, cache=role != "oracle")
    return _models[role]


def seq_tokens(hist: list[tuple[int, int]]) -> list[int]:
    return [t for t, _ in hist[1:]]


def next_logits(seq: lcgen.Sequence) -> np.ndarray:
    """The logits for the next token of seq, leaving seq as it was."""
    rows: list[np.ndarray] = []
    seq.generate(max_tokens=1, hooks=[lambda step: rows.append(step.logits)])
    seq.rewind(1)
    return rows[0]


class SequenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = _model("under-test")
        self.oracle = _model("oracle")
        # Each example starts from an empty KV store, so that a failing one replays (what an
        # earlier example parked would otherwise decide which prefixes are cached).
        self.model.cache.clear()
        self.live: list[tuple[lcgen.Sequence, list[tuple[int, int]]]] = []
        self.checkpoints: list[tuple[lcgen.Checkpoint, History]] = []
        # Token lists to reopen: closed sequences' and the prompts generations started from.
        self.seen: list[list[int]] = []
        self.ids = iter(range(1, 10**9))

    def _fresh(self, tokens: list[int]) -> list[tuple[int, int]]:
        return [(t, next(self.ids)) for t in tokens]

    def _new_history(self, tokens: list[int]) -> list[tuple[int, int]]:
        return self._fresh([ROOT, *tokens])

    @initialize(text=st.sampled_from(TEXTS))
    def start(self, text: str) -> None:
        seq = self.model.sequence("Story:" + text)
        self.live.append((seq, self._new_history(seq.tokens)))

    def teardown(self) -> None:
        for seq, _ in self.live:
            seq.close()
        assert self.model.cache.stats.live == 0

    def _pick(self, i: int) -> tuple[lcgen.Sequence, list[tuple[int, int]]]:
        return self.live[i % len(self.live)]

    @rule(i=st.integers(0, 7), text=st.sampled_from(TEXTS))
    def append(self, i: int, text: str) -> None:
        seq, hist = self._pick(i)
        if len(seq) < MAX_LEN:
            hist += self._fresh(seq.append(text))

    @rule(
        i=st.integers(0, 7),
        n=st.integers(1, 6),
        seed=st.none() | st.integers(0, 3),
        speculate=st.booleans(),
    )
    def generate(self, i: int, n: int, seed: int | None, speculate: bool) -> None:
        seq, hist = self._pick(i)
        temperature = 0.0 if seed is None else 0.9
        if not len(seq):
            try:
                seq.generate(max_tokens=n)
            except ValueError:
                return
            raise AssertionError("generating on an empty sequence did not raise")
        if len(seq) < MAX_LEN:
            before = len(seq)
            self.seen.append(seq.tokens)
            extra = {"speculate": "ngram", "num_draft": 3} if speculate else {}
            seq.generate(max_tokens=n, temperature=temperature, seed=seed, **extra)
            hist += self._fresh(seq.tokens[before:])

    @rule(i=st.integers(0, 7))
    def checkpoint(self, i: int) -> None:
        seq, hist = self._pick(i)
        self.checkpoints.append((seq.checkpoint(), tuple(hist)))

    @precondition(lambda self: bool(self.checkpoints))
    @rule(i=st.integers(0, 7), j=st.integers(0, 50))
    def rewind_to_checkpoint(self, i: int, j: int) -> None:
        seq, hist = self._pick(i)
        cp, cp_hist = self.checkpoints[j % len(self.checkpoints)]
        if tuple(hist[: len(cp_hist)]) == cp_hist:
            seq.rewind(cp)
            del hist[len(cp_hist) :]
        else:
            try:
                seq.rewind(cp)
            except lcgen.RewindError:
                return
            raise AssertionError("rewind to an unreachable checkpoint did not raise")

    @rule(i=st.integers(0, 7), k=st.integers(-2, 40))
    def rewind_by(self, i: int, k: int) -> None:
        seq, hist = self._pick(i)
        if 0 <= k <= len(seq):
            seq.rewind(k)
            del hist[len(hist) - k :]
        else:
            try:
                seq.rewind(k)
            except lcgen.RewindError:
                return
            raise AssertionError(f"rewind({k}) of {len(seq)} tokens did not raise")

    @rule(i=st.integers(0, 7))
    def fork(self, i: int) -> None:
        seq, hist = self._pick(i)
        if self.model.cache.stats.live == SLOTS:
            try:
                seq.fork()
            except lcgen.SlotsExhaustedError:
                return
            raise AssertionError("fork beyond the free slots did not raise")
        self.live.append((seq.fork(), list(hist)))

    @precondition(lambda self: len(self.live) > 1)
    @rule(i=st.integers(0, 7))
    def close(self, i: int) -> None:
        seq, _ = self.live.pop(i % len(self.live))
        self.seen.append(seq.tokens)
        seq.close()
        seq.close()

    @precondition(lambda self: self.model.cache.stats.live < SLOTS)
    @rule(i=st.integers(0, 15), prompt=st.booleans())
    def reopen(self, i: int, prompt: bool) -> None:
        """A new sequence on the tokens of a generation's prompt or of a closed sequence, or
        of a live one: the store may hold their cells and the logits after them (then nothing
        is pending)."""
        choices = self.seen[-2:] if prompt and self.seen else [s.tokens for s, _ in self.live]
        tokens = choices[i % len(choices)]
        if tokens:
            seq = self.model.sequence(tokens)
            self.live.append((seq, self._new_history(seq.tokens)))

    @rule(i=st.integers(0, 7))
    def save_and_load(self, i: int) -> None:
        index = i % len(self.live)
        seq, hist = self.live[index]
        data = seq.to_bytes()
        seq.close()
        loaded = lcgen.Sequence.from_bytes(self.model, data)
        # A loaded sequence is a new one: checkpoints of the old one do not apply to it.
        self.live[index] = (loaded, self._new_history(seq_tokens(hist)))

    @rule(i=st.integers(0, 7))
    def logits_match_a_fresh_decode(self, i: int) -> None:
        seq, _ = self._pick(i)
        if not len(seq):
            return
        ours = next_logits(seq)
        with self.oracle.sequence(seq.tokens) as fresh:
            theirs = next_logits(fresh)
        assert float(np.abs(ours - theirs).max()) < TOLERANCE
        top2 = np.sort(theirs)[-2:]
        if top2[1] - top2[0] > 2 * TOLERANCE:
            assert int(ours.argmax()) == int(theirs.argmax())

    @invariant()
    def tokens_match_the_reference(self) -> None:
        for seq, hist in self.live:
            assert seq.tokens == seq_tokens(hist)
            assert seq.text == self.model.detokenize(seq.tokens)
            # exactly the decoded tokens have cells: no draft cell is ever left behind
            assert self.model.context.ledger.held(seq.slot) == seq.n_decoded


SequenceMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_random_operations_match_the_reference = SequenceMachine.TestCase
