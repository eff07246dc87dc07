"""The continuous-generation proposal's test cases (its ``SequenceState`` slicing, KV cache kept
on slices, weights and mismatches), ported to lcgen and run at default settings.

The states are made once per module, as the proposal's are, on a model of this module's own
(the shared one's KV store is cleared before every test): everything below depends on the KV
store keeping the cells of every state's elements, since a state holds no slot.

Where lcgen's documented semantics differ from the proposal's, the case checks lcgen's, and
says so:
- "KV cache preserved": the store holds the cells of every whole token inside the slice (a
  token the slice cuts is tokenized again), so continuing decodes none of them again. The
  proposal starts over for slices of several elements; lcgen keeps those too. (With 8 slots
  instead of the default, the states made first lose their cells: a parked generation holds
  a slot, and 16 of them do not fit in 8; the least recently used go.)
- ``state + "text"`` keeps the weights (no token of the text was generated); ``"text" + state``
  starts them again at 0.
- A string added to a state is appended to every element, and an axis of size 1 broadcasts;
  shapes that cannot broadcast raise ``BatchMismatchError`` / ``SampleMismatchError``.
- ``num_samples=1`` on a state of 3 samples continues each sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import lcgen
from lcgen import SequenceState, continuous, generate

NUM_SAMPLES = 3
UNIT_PROMPT = "This is a prompt to test the slicing of `sequence_state`."
MULT_PROMPTS = [f"[BATCH_{i}]{UNIT_PROMPT}" for i in (1, 2, 3)]
CHOICES = ["Positive", "Negative"]
Key = int | slice


class States:
    """The proposal's module-level generators and responses."""

    def __init__(self, model: lcgen.Model) -> None:
        self.model = model
        self.pick = continuous(generate.choice(model, CHOICES, temperature=1.0))
        self.case_1 = self.pick(UNIT_PROMPT, seed=1)  # batch 1, 1 sample
        self.case_2 = self.pick(UNIT_PROMPT, num_samples=NUM_SAMPLES, seed=2)  # batch 1
        self.case_3 = self.pick(MULT_PROMPTS, seed=3)  # 1 sample each
        self.responses = self.pick(MULT_PROMPTS, num_samples=NUM_SAMPLES, seed=4)  # 3 x 3


@pytest.fixture(scope="module")
def states(model_path: Path) -> Iterator[States]:
    with lcgen.Model(model_path) as model:  # default settings
        yield States(model)


def kept(state: SequenceState) -> bool:
    """Every element's KV cache is kept: all its tokens but the last are in the store."""
    return state.n_cached == len(state)


def kept_on_slice(state: SequenceState, key: tuple[Key, Key, slice]) -> bool:
    """Every element of ``state[key]`` keeps the KV cache of the whole tokens inside the slice
    (a token the slice cuts is tokenized again: its pieces are new); continuing it decodes no
    token of the cached prefix again."""
    sliced = state[key]
    batch, sample, _ = key
    rows = range(state.shape[0])[batch] if isinstance(batch, slice) else [batch]
    cols = range(state.shape[1])[sample] if isinstance(sample, slice) else [sample]
    sources = [state.tokens[b][s] for b in rows for s in cols]
    cache = state.model.cache
    for tokens, source in zip((t for row in sliced.tokens for t in row), sources, strict=True):
        whole = next(
            (i for i, (a, b) in enumerate(zip(tokens, source, strict=False)) if a != b),
            min(len(tokens), len(source)),
        )
        if cache.cached(tokens) < min(whole, len(tokens) - 1):
            return False
    return True


# case 1: batch 1, 1 sample -----------------------------------------------------------------
@pytest.mark.parametrize("key", [slice(0, 5, 1), slice(1, 5, 1), slice(2, 5, 1)])
def test_slice_ids_size_key(states: States, key: slice) -> None:
    assert list(states.case_1[key]) == [UNIT_PROMPT[key]]


@pytest.mark.parametrize("key", [slice(0, 7, 1), slice(0, 16, 1), slice(0, 12, 1), slice(0, 8, 1)])
def test_preserved_kv_cache_case_1(states: States, key: slice) -> None:
    assert kept_on_slice(states.case_1, (0, 0, key))


# case 2: batch 1, 3 samples ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("sample", "key"), [(1, slice(0, 5, 1)), (0, slice(1, 5, 1)), (2, slice(2, 5, 1))]
)
def test_slice_ids_size_key_samples_key(states: States, sample: int, key: slice) -> None:
    assert list(states.case_2[sample, key]) == [UNIT_PROMPT[key]]


@pytest.mark.parametrize(
    ("sample", "key"), [(2, slice(0, 8, 1)), (2, slice(0, 16, 1)), (1, slice(0, 12, 1))]
)
def test_preserved_kv_cache_special_case_2(states: States, sample: int, key: slice) -> None:
    assert kept_on_slice(states.case_2, (0, sample, key))


# case 3: batch 3, 1 sample -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("batch", "key"), [(1, slice(0, 5, 1)), (0, slice(1, 5, 1)), (2, slice(2, 5, 1))]
)
def test_slice_ids_size_key_batch_key(states: States, batch: int, key: slice) -> None:
    assert list(states.case_3[batch, key]) == [MULT_PROMPTS[batch][key]]


@pytest.mark.parametrize(
    ("batch", "key"),
    [(1, slice(0, 4, 1)), (0, slice(0, 2, 1)), (2, slice(0, 8, 1)), (2, slice(0, 16, 1))],
)
def test_preserved_kv_cache_special_case_3(states: States, batch: int, key: slice) -> None:
    assert kept_on_slice(states.case_3, (batch, 0, key))


# batch 3 x 3 samples: slicing is consistent with the prompts -------------------------------
def _expected(batch: Key, sample: Key, key: slice) -> list[str]:
    rows = range(3)[batch] if isinstance(batch, slice) else [batch]
    cols = range(NUM_SAMPLES)[sample] if isinstance(sample, slice) else [sample]
    return [MULT_PROMPTS[b][key] for b in rows for _ in cols]


@pytest.mark.parametrize(
    ("batch", "sample", "key"),
    [
        # batch: slice, samples: slice
        (slice(0, 2, 1), slice(2, 3, 1), slice(2, 4, 1)),
        (slice(2, 3, 1), slice(0, 2, 1), slice(2, 8, 1)),
        (slice(0, 3, 1), slice(0, 3, 1), slice(4, 8, 1)),
        # batch: int, samples: slice
        (0, slice(2, 3, 1), slice(2, 4, 1)),
        (1, slice(0, 2, 1), slice(2, 8, 1)),
        (2, slice(0, 3, 1), slice(4, 8, 1)),
        # batch: slice, samples: int
        (slice(0, 2, 1), 1, slice(2, 4, 1)),
        (slice(2, 3, 1), 2, slice(2, 8, 1)),
        (slice(0, 3, 1), 0, slice(4, 8, 1)),
        # batch: int, samples: int
        (0, 1, slice(2, 4, 1)),
        (1, 2, slice(2, 8, 1)),
        (2, 0, slice(4, 8, 1)),
    ],
)
def test_slicing_batch_samples_and_text(
    states: States, batch: Key, sample: Key, key: slice
) -> None:
    assert list(states.responses[batch, sample, key]) == _expected(batch, sample, key)


@pytest.mark.parametrize(
    ("batch", "sample", "key"),
    [
        (0, 1, slice(0, 4, 1)),
        (1, 2, slice(0, 8, 1)),
        (0, 2, slice(0, 16, 1)),
        (0, 0, slice(0, 4, 1)),
        (1, 1, slice(0, 8, 1)),
    ],
)
def test_preserved_kv_cache(states: States, batch: int, sample: int, key: slice) -> None:
    assert kept_on_slice(states.responses, (batch, sample, key))


@pytest.mark.parametrize(
    ("batch", "sample", "key"),
    [
        (slice(None), slice(None), slice(0, 4, 1)),
        (slice(None), slice(None), slice(0, 8, 1)),
        (slice(2, 3, 1), slice(0, 2, 1), slice(0, 12, 1)),
        (slice(0, 3, 1), slice(0, 3, 1), slice(0, 16, 1)),
        (0, slice(2, 3, 1), slice(0, 4, 1)),
        (slice(0, 2, 1), 1, slice(0, 8, 1)),
    ],
)
def test_kv_cache_kept_for_slices_of_several_elements(
    states: States, batch: Key, sample: Key, key: slice
) -> None:
    """The proposal starts these over (its cache is one tensor per state); lcgen keeps them."""
    assert kept_on_slice(states.responses, (batch, sample, key))


# weights -----------------------------------------------------------------------------------
def test_weight_accumulation_same_sequence_generator(states: States) -> None:
    again = states.pick(states.responses, seed=5)
    assert np.all(again.weights < states.responses.weights)


def test_weight_accumulation_different_type_generation(states: States) -> None:
    text = continuous(generate.text(states.model, max_tokens=10, temperature=1.0))
    assert np.all(text(states.responses, seed=6).weights < states.responses.weights)


def test_weight_accumulation_added_sequence_generators(states: States) -> None:
    other = states.pick(states.responses, seed=7)
    total = (states.responses + other).weights
    np.testing.assert_allclose(total, states.responses.weights + other.weights, rtol=1e-12)


def test_weight_accumulation_added_string(states: States) -> None:
    """lcgen: appending text keeps the weights; text in front starts them again at 0."""
    assert np.all((states.case_1 + "a test string.").weights == states.case_1.weights)
    assert np.all((states.responses + " more").weights == states.responses.weights)
    assert np.all(("a test string." + states.responses).weights == 0)


# mismatches --------------------------------------------------------------------------------
@pytest.mark.parametrize("num_samples", [1, 5, 8])
def test_exception_if_num_samples_changes(states: States, num_samples: int) -> None:
    responses = states.responses
    if num_samples == 1:  # lcgen: continues each of the 3 samples
        assert states.pick(responses, num_samples=1, seed=8).shape == (3, NUM_SAMPLES)
        return
    with pytest.raises(lcgen.SampleMismatchError) as info:
        states.pick(responses, num_samples=num_samples)
    assert f"already has {NUM_SAMPLES} samples" in str(info.value)
    assert f"asking for {num_samples} samples" in str(info.value)


def test_exception_added_sequence_state_str_batch_mismatch(states: States) -> None:
    two = SequenceState.from_text(states.model, ["This is a test prompt.", "And another."])
    with pytest.raises(lcgen.BatchMismatchError, match=r"\(3, 3\).*\(2, 1\)"):
        states.responses + two


def test_exception_added_sequence_state_sequence_state_batch_mismatch(states: States) -> None:
    with pytest.raises(lcgen.BatchMismatchError, match=r"\(3, 3\).*\(2, 2\)"):
        states.responses + states.responses[:2, :2, :]
    broadcast = states.responses + states.responses[:1, :1, :]  # lcgen: size 1 broadcasts
    assert broadcast.shape == (3, NUM_SAMPLES)


def test_every_state_is_still_cached_at_the_end(states: States) -> None:
    """1 + 3 + 3 + 9 elements made and more continued from them: the store kept them all."""
    for state in (states.case_1, states.case_2, states.case_3, states.responses):
        assert kept(state)


def test_the_checks_fail_once_the_cache_is_gone(states: States) -> None:
    """(Last: it empties the store.) What the checks above see is the store's cells."""
    states.model.cache.clear()
    assert not kept(states.case_1)
    assert not kept_on_slice(states.responses, (1, 2, slice(0, 8, 1)))
    assert not kept_on_slice(states.case_1, (0, 0, slice(0, 16, 1)))
