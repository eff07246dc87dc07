"""The continuous API on the real bundled model: indexing tables, and invariants of slicing,
adding, batches x samples and slots."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import lcgen
from lcgen import generate
from lcgen.continuous import Continuous, SequenceState, continuous
from lcgen.errors import BatchMismatch, LcgenError, SampleMismatch

PROMPTS = ["The capital of France is", "Once upon a time"]
GRID = [["a0", "a1", "a2"], ["b0", "b1", "b2"]]


@pytest.fixture(autouse=True)
def _no_slot_leaks(model: lcgen.Model) -> Iterator[None]:
    """Every test ends with all slots free again (its states closed or dropped)."""
    yield
    gc.collect()
    assert model.cache.stats.live == 0


def greedy(model: lcgen.Model, max_tokens: int = 12, **options: object) -> Continuous:
    return continuous(generate.text(model, max_tokens=max_tokens, **options))  # type: ignore[arg-type]


# indexing ----------------------------------------------------------------------------------
# (grid, key, expected texts): the shorthands of every shape, and integers and slices.
INDEXING = [
    ([["hello"]], slice(1, 4), [["ell"]]),
    ([["hello"]], -1, [["o"]]),
    ([["hello"]], (0, 0, slice(None, 2)), [["he"]]),
    ([["hello"]], (0, slice(None, 3)), [["hel"]]),
    ([GRID[0]], 1, [["a1"]]),
    ([GRID[0]], (slice(1, None), slice(None, 1)), [["a", "a"]]),
    ([GRID[0]], (0, 2, slice(1, None)), [["2"]]),
    ([["a0"], ["b0"]], 1, [["b0"]]),
    ([["a0"], ["b0"]], (slice(None), slice(1, None)), [["0"], ["0"]]),
    ([["a0"], ["b0"]], (-1, 0), [["b"]]),
    (GRID, 1, [GRID[1]]),
    (GRID, (1, 2), [["b2"]]),
    (GRID, (slice(None), 0), [["a0"], ["b0"]]),
    (GRID, (slice(None), slice(None, None, 2)), [["a0", "a2"], ["b0", "b2"]]),
    (GRID, (1, 2, slice(None, 1)), [["b"]]),
    (GRID, (slice(None), -1, 1), [["2"], ["2"]]),
]


@pytest.mark.parametrize(("grid", "key", "expected"), INDEXING)
def test_indexing_shorthands(
    model: lcgen.Model, grid: list[list[str]], key: object, expected: list[list[str]]
) -> None:
    state = SequenceState.from_text(model, grid)
    picked = state[key]  # type: ignore[index]
    assert picked.texts == expected
    assert picked.shape == (len(expected), len(expected[0]))
    assert list(picked) == [t for row in expected for t in row]
    assert len(picked) == picked.shape[0] * picked.shape[1]


@pytest.mark.parametrize(
    ("grid", "key", "error", "named"),
    [
        (GRID, 2, IndexError, "batch index 2"),
        (GRID, (0, 3), IndexError, "sample index 3"),
        (GRID, (0, 0, 7), IndexError, "character index 7"),
        (GRID, (0, 0, 0, 0), IndexError, "4"),
        (GRID, "x", TypeError, "'x'"),
        (GRID, (0, 1.5), TypeError, "1.5"),
        (GRID, slice(5, None), IndexError, "slice(5, None, None)"),
    ],
)
def test_bad_indexes_name_the_value(
    model: lcgen.Model, grid: list[list[str]], key: object, error: type[Exception], named: str
) -> None:
    with pytest.raises(error, match=named.replace("(", r"\(").replace(")", r"\)")):
        SequenceState.from_text(model, grid)[key]  # type: ignore[index]


# slicing keeps the cache -------------------------------------------------------------------
def test_slice_then_continue_equals_a_fresh_run(model: lcgen.Model) -> None:
    text = greedy(model, 16)
    story = text(PROMPTS[0])
    full = str(story)
    space = full.index(" ", len(PROMPTS[0]) + 3)
    # inside a generated word, at a token boundary, inside the prompt, and everything
    cuts = (space + 3, space, len(PROMPTS[0]) - 4, len(full))
    continued = {}
    for cut in cuts:
        sliced = story[:cut]
        assert str(sliced) == full[:cut]
        # The comparison below needs the kept tokens to be the text's own tokenization.
        assert sliced.tokens[0][0] == model.tokenize(full[:cut])
        kept = _common(story.tokens[0][0], sliced.tokens[0][0])
        before = model.context.n_decoded
        with text(sliced) as went_on:
            decoded = model.context.n_decoded - before
            continued[cut] = went_on.tokens
            n_generated = len(went_on.tokens[0][0]) - len(sliced.tokens[0][0])
        # Only the retokenized tail is decoded before generating (at least the last token,
        # for its logits): the rest comes from the cache.
        reused = min(kept, len(sliced.tokens[0][0]) - 1)
        assert decoded == len(sliced.tokens[0][0]) - reused + n_generated - 1
    model.cache.clear()  # the runs below start from nothing
    for cut in cuts:
        with text(full[:cut]) as fresh:
            assert fresh.tokens == continued[cut], cut


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_slices_not_from_the_start_and_partial_tokens(model: lcgen.Model) -> None:
    state = SequenceState.from_text(model, [["Hello wonderful world"]])
    middle = state[6:15]
    assert str(middle) == "wonderful" and middle.tokens[0][0] == model.tokenize("wonderful")
    partial = state[:10]  # "Hello wond": "Hello" kept, " wond" tokenized again
    assert str(partial) == "Hello wond"
    assert partial.tokens[0][0][:1] == state.tokens[0][0][:1]
    assert model.detokenize(partial.tokens[0][0]) == "Hello wond"
    assert str(state[::2]) == "Hello wonderful world"[::2]


# adding ------------------------------------------------------------------------------------
def test_adding_text_and_states(model: lcgen.Model) -> None:
    a = SequenceState.from_text(model, [["x"], ["y"]])
    b = SequenceState.from_text(model, [["1", "2", "3"]])
    assert (a + " and").texts == [["x and"], ["y and"]]
    assert ("Say: " + a).texts == [["Say: x"], ["Say: y"]]
    assert (a + b).texts == [["x1", "x2", "x3"], ["y1", "y2", "y3"]]
    assert (b + a).shape == (2, 3)
    with pytest.raises(BatchMismatch, match=r"\(2, 1\) and \(3, 1\)"):
        a + SequenceState.from_text(model, [["p"], ["q"], ["r"]])
    with pytest.raises(SampleMismatch, match=r"\(1, 3\) and \(1, 2\)"):
        b + SequenceState.from_text(model, [["p", "q"]])
    assert issubclass(BatchMismatch, LcgenError) and issubclass(SampleMismatch, LcgenError)
    with pytest.raises(TypeError):
        a + 3  # type: ignore[operator]


def test_mixing_generators_on_one_sequence(model: lcgen.Model) -> None:
    text = greedy(model, 10)
    pick = continuous(generate.choice(model, [" happy", " sad"]))
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    as_json = continuous(generate.json(model, schema, max_tokens=30))
    s = text("Write a story about a cat:")
    s = text(s)  # keep going
    asked = s + " The cat felt"
    before = model.context.n_decoded
    picked = pick(asked)
    felt = str(picked)[len(str(asked)) :]
    assert felt in (" happy", " sad")
    n_new = len(picked.tokens[0][0]) - len(asked.tokens[0][0])
    # s's pending last token, the appended text, each chosen token but the last
    n_pending = len(asked.tokens[0][0]) - len(s.tokens[0][0]) + 1
    assert model.context.n_decoded - before == n_pending + n_new - 1
    s = picked
    prefix = str(s) + ". As JSON: "
    s = as_json(s + ". As JSON: ")
    value = json.loads(str(s)[len(prefix) :])
    assert set(value) == {"name", "age"} and len(value["name"]) <= 6
    assert list(s) == [str(s)] and s.weights.shape == (1, 1) and s.weights[0, 0] < 0


def test_only_new_tokens_are_decoded_when_continuing(model: lcgen.Model) -> None:
    text = greedy(model, 8)
    s = text(PROMPTS[1])
    appended = model.tokenize(" Then", add_bos=False)
    before = model.context.n_decoded
    s2 = text(s + " Then")
    n_generated = len(s2.tokens[0][0]) - len(s.tokens[0][0]) - len(appended)
    # the pending last token of s, the appended text, and each generated token but the last
    assert model.context.n_decoded - before == 1 + len(appended) + n_generated - 1
    assert str(s2).startswith(str(s) + " Then")
    assert s2.weights[0, 0] < s.weights[0, 0] < 0


def test_a_stop_string_ends_the_state_text(model: lcgen.Model) -> None:
    prompt = "1, 2, 3, 4,"
    expected = prompt + model.generate(prompt, max_tokens=16, stop=" 7,")
    counting = continuous(generate.text(model, max_tokens=16, stop=" 7,"))
    with counting(prompt) as s:
        assert str(s) == expected  # the stop string and what its token held after it are cut
        assert s.tokens[0][0] == model.tokenize(expected)
        with counting(s) as again:  # the same stop comes next: nothing is added
            assert str(again) == expected
        with greedy(model, 4)(s) as more:
            assert str(more).startswith(expected + " 7,")


def test_a_stop_after_a_state_that_ends_inside_a_character(model: lcgen.Model) -> None:
    # One token cuts the state inside a fox (4 bytes, more than one token); the next
    # generation completes it. Its text counted those bytes as U+FFFDs of its own, and the
    # state's as one more: the cut fell two characters late, leaving the stop string in.
    cut = continuous(generate.text(model, max_tokens=1))("Faces: \U0001f98a \U0001f98a \U0001f98a")
    assert str(cut).endswith("\ufffd")
    whole = SequenceState.from_text(model, str(cut)[:-1] + "\U0001f98a")
    for beams in (None, 2):
        spec = generate.text(model, max_tokens=10, stop=["\n"], beams=beams)
        for texts in (list(continuous(spec)(cut)), list(continuous(spec)(whole))):
            assert all("\n" not in text for text in texts), texts
            assert any(text.endswith("\U0001f98a") for text in texts), texts  # the fox kept


# batches x samples -------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch_by_samples_equals_each_element_alone(model: lcgen.Model, temperature: float) -> None:
    text = greedy(model, 10, temperature=temperature)
    model.cache.clear()  # nothing cached: each prompt is decoded, once
    before = model.context.n_decoded
    with text(PROMPTS, num_samples=3, seed=11) as both:
        decoded = model.context.n_decoded - before
        assert both.shape == (2, 3)
        n_prompts = [len(model.tokenize(p)) for p in PROMPTS]
        n_generated = sum(len(t) - n_prompts[b] for b, row in enumerate(both.tokens) for t in row)
        # Each prompt is decoded once, whole: every sample samples its first token from the
        # logits kept after it, and decodes each token it generates but its last.
        assert decoded == sum(n_prompts) + n_generated - 2 * 3
        expected = both.tokens
        weights = both.weights
    for b, prompt in enumerate(PROMPTS):
        for j in range(3):
            model.cache.clear()  # alone in its layout (a cached prefix places cells elsewhere)
            with text(prompt, seed=11 + j) as alone:
                assert alone.tokens[0][0] == expected[b][j], (b, j)
                assert alone.weights[0, 0] == pytest.approx(weights[b, j], abs=1e-3)
    if temperature:
        assert len({tuple(t) for t in expected[0]}) > 1  # the samples differ


def test_more_elements_than_slots_are_queued(model_path: Path, model: lcgen.Model) -> None:
    with lcgen.Model(model_path, n_seq_max=3, n_ctx=1024) as small:
        text = continuous(generate.text(small, max_tokens=6))
        queued = text(PROMPTS, num_samples=3)
        assert queued.shape == (2, 3)
        tokens = queued.tokens
        # Continued, each element starts from what the store still holds of it.
        more = continuous(generate.text(small, max_tokens=2))(queued)
        assert [
            [t[: len(o)] for t, o in zip(*rows, strict=True)]
            for rows in zip(more.tokens, tokens, strict=True)
        ] == tokens
        del queued, more
        gc.collect()
        assert small.cache.stats.live == 0
        with text(PROMPTS[0]) as alone:  # the first wave: fresh cells, as a lone run's
            assert [alone.tokens[0][0]] * 3 == tokens[0]
        # The later wave lands in cells the first wave freed, in another order than a lone
        # run's: logits may differ in the last bits (up to ~0.5), enough to flip a near-tie.
        # Each of its tokens must be the lone run's argmax or within that noise of it.
        for elem_tokens in tokens[1]:
            assert_greedy_up_to_noise(small, PROMPTS[1], elem_tokens)
        # Seeded: for the same reason, compare with the same call in the same layout (both
        # from an empty cache: a cached prefix puts the new cells elsewhere in the pool).
        sample = continuous(generate.text(small, max_tokens=6, temperature=0.8))
        small.cache.clear()
        with sample(PROMPTS, num_samples=3, seed=3) as first:
            drawn = first.tokens
        small.cache.clear()
        with sample(PROMPTS, num_samples=3, seed=3) as again:
            assert again.tokens == drawn
        assert len({tuple(t) for t in drawn[1]}) > 1


def assert_greedy_up_to_noise(
    model: lcgen.Model, prompt: str, tokens: list[int], tolerance: float = 0.5
) -> None:
    """Each token after the prompt is within ``tolerance`` of the best logit of a lone run
    fed the same tokens (and at least half of them are its argmax exactly)."""
    prompt_tokens = model.tokenize(prompt)
    assert tokens[: len(prompt_tokens)] == prompt_tokens
    fed = tokens[len(prompt_tokens) :]
    rows: list[np.ndarray] = []

    def feed(step: lcgen.Step) -> lcgen.Override:  # the lone run takes the given tokens
        rows.append(step.logits)
        return lcgen.Override(fed[step.index])

    model.generate(prompt, max_tokens=len(fed), hooks=[feed])
    exact = 0
    for tok, row in zip(fed, rows, strict=True):
        assert row[tok] >= row.max() - tolerance, (tok, float(row.max() - row[tok]))
        exact += int(row[tok] == row.max())
    assert 2 * exact >= len(fed)


# slots -------------------------------------------------------------------------------------
def test_states_hold_no_slots_over_100_states(model: lcgen.Model) -> None:
    text = greedy(model, 2)
    s = text("Count: 1")
    for i in range(100):
        s = text(s[:8] + f" {i}") if i % 2 else text(f"Count: {i}")
        assert model.cache.stats.live == 0
    with text(["a", "b"], num_samples=2) as kept:
        assert kept.n_cached == 4  # every element's KV is in the store
    before = model.context.n_decoded
    assert text(kept).shape == (2, 2)
    # Continuing decodes no old token but each element's pending last one; then the first of
    # its 2 new tokens (the last new one is never decoded): 2 tokens for each of 4 elements.
    assert model.context.n_decoded - before == 4 * 2
    del s


def test_a_constrained_output_cut_short_raises_with_the_state(model: lcgen.Model) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    prompts = ["A cat as JSON:", "A dog as JSON:"]
    short = continuous(generate.json(model, schema, max_tokens=3))
    with pytest.raises(lcgen.IncompleteOutputError, match="2 of 2 elements") as info:
        short(prompts)
    state = info.value.state
    assert isinstance(state, SequenceState) and state.shape == (2, 1)
    texts = list(state)
    assert texts[0].startswith(prompts[0]) and texts[0][len(prompts[0]) :] == info.value.text
    assert info.value.text.startswith("{")  # what was generated, three tokens of it
    done = continuous(generate.json(model, schema, max_tokens=60))(prompts)
    for prompt, text in zip(prompts, done, strict=True):
        assert isinstance(json.loads(text[len(prompt) :])["name"], str)
    options = [" alpha beta gamma delta", " epsilon zeta eta theta"]  # each over 2 tokens
    cut = continuous(generate.choice(model, options, max_tokens=2))
    with pytest.raises(lcgen.IncompleteOutputError, match="1 of 1 elements") as info:
        cut("Pick one:")
    assert info.value.text not in options and any(o.startswith(info.value.text) for o in options)
    beams = continuous(generate.choice(model, options, max_tokens=2, beams=2))
    with pytest.raises(lcgen.IncompleteOutputError, match="2 beams stopped") as info:
        beams("Pick one:")
    assert info.value.state.shape == (1, 2)
    # room to finish: each beam an option, no text twice (the same words in other tokens
    # take no beam of their own)
    done = continuous(generate.choice(model, options, max_tokens=24, beams=2))("Pick one:")
    endings = [text[len("Pick one:") :] for text in done]
    assert endings and all(e in options for e in endings) and len(set(endings)) == len(endings)


def test_state_api_and_errors(model: lcgen.Model) -> None:
    text = greedy(model, 4)
    with pytest.raises(TypeError, match="spec"):
        continuous("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_samples"):
        text("x", num_samples=0)
    # a bare TypeError from "1" + 0, and True taken as 1
    for seed in ("1", True, -1):
        with pytest.raises(ValueError, match=f"seed must be an int >= 0 or None, got {seed!r}"):
            text("x", seed=seed)  # type: ignore[arg-type]
    # a million samples held 1.2 GB before the first decode
    with pytest.raises(ValueError, match="num_samples=1000000 makes 1,000,000 samples, over the"):
        text("x", num_samples=10**6)
    with pytest.raises(ValueError, match="num_samples=4000 of 2 batch elements makes 8,000"):
        text(PROMPTS, num_samples=4000)
    with pytest.raises(ValueError, match="num_samples=5000 makes 5,000 samples"):
        SequenceState.from_text(model, "x", num_samples=5000)
    wide = SequenceState.from_text(model, GRID)
    with pytest.raises(SampleMismatch, match=r"\(2, 3\)"):
        text(wide, num_samples=2)
    with pytest.raises(TypeError, match="42"):
        text(42)  # type: ignore[arg-type]
    s = text(PROMPTS[0])
    # an element with no tokens (SmolLM2 adds no BOS) named none: "the sequence is empty:
    # append a prompt", from deep inside, after the other elements' prompts were decoded
    before = model.context.n_decoded
    for empty, at in [(s[:0], "(0, 0)"), ([PROMPTS[0], ""], "(1, 0)"), (s[3:3], "(0, 0)")]:
        with pytest.raises(ValueError, match=rf"element \{at[:-1]}\) of the state has no tokens"):
            text(empty)
    assert model.context.n_decoded == before
    assert "shape=(1, 1)" in repr(s) and repr(str(s)) in repr(s)
    assert s.shape == (1, 1) and len(s) == 1 and s.weights.shape == (1, 1)
    assert s.texts == [[str(s)]]
    s.close()
    s.close()


# backtracking inside a spec --------------------------------------------------------------------
def test_banned_phrases_and_hooks_work_in_a_continuous_spec(model: lcgen.Model) -> None:
    prompt = "The history of Rome is a rich"
    assert "tapestry" in model.generate(prompt, max_tokens=24)  # measured
    text = greedy(model, 24, banned=["tapestry"])
    with text(prompt) as s:
        (out,) = list(s)
        assert out.startswith(prompt) and "tapestry" not in out
        # The weight is the summed log-probability of the tokens kept, as the stream reports it.
        chunks = list(model.stream(prompt, max_tokens=24, banned=["tapestry"], logprobs=0))
        assert prompt + "".join(c.text for c in chunks) == out
        assert s.weights[0, 0] == pytest.approx(sum(c.logprob or 0.0 for c in chunks))
    seen: list[int] = []
    with greedy(model, 6, hooks=[lambda step: seen.append(step.token)])([prompt, prompt]) as b:
        assert len(seen) == 12 and b.shape == (2, 1)
    with pytest.raises(ValueError, match="beam search does not take"):
        generate.text(model, beams=2, banned=["x"])
    with pytest.raises(ValueError, match="beam search does not speculate"):
        generate.text(model, beams=2, speculate="ngram")
    with pytest.raises(ValueError, match="empty"):
        generate.text(model, banned=[""])


def test_token_healing_in_a_spec_keeps_each_log_probability_on_its_token(
    model: lcgen.Model,
) -> None:
    """Healing re-creates the prompt's last token, most often as itself: it was counted as
    kept, so every generated log-probability sat one token late and continuing the state
    dropped the last one from the weight."""
    prompt = "The capital of France is"
    healed = continuous(generate.text(model, max_tokens=4, token_healing=True))
    with healed(prompt) as s:
        chunks = list(model.stream(prompt, max_tokens=4, token_healing=True, logprobs=0))
        assert chunks[0].text == ""  # the healed token, re-created as itself
        logprobs = [c.logprob or 0.0 for c in chunks]
        assert str(s) == prompt + "".join(c.text for c in chunks)
        assert s.weights[0, 0] == pytest.approx(sum(logprobs), abs=1e-3)
        # A slice at a token's end keeps the log-probabilities of the tokens it keeps.
        two = len(prompt) + len(chunks[1].text)
        with s[:two] as cut:
            assert cut.weights[0, 0] == pytest.approx(logprobs[0] + logprobs[1], abs=1e-3)
        # Continued, then sliced back: the weight it had.
        with greedy(model, 3)(s) as more, more[: len(str(s))] as back:
            assert back.weights[0, 0] == pytest.approx(s.weights[0, 0], abs=1e-6)


def test_an_element_whose_generation_ends_before_healing_is_done_keeps_the_prompt(
    model: lcgen.Model,
) -> None:
    """Healing took ' Fra' off 'The capital of Fra'; an element whose generation ended before
    its tokens wrote it again was left without it ('The capital of ' and the output)."""
    prompt = "The capital of Fra"
    (space,) = model.tokenize(" ", add_bos=False)  # continues ' Fra' but does not finish it

    def first_a_space(step: lcgen.Step) -> lcgen.Override | None:
        return lcgen.Override(space) if step.index == 0 and step.token != space else None

    cut = greedy(model, 1, token_healing=True, hooks=[first_a_space], logprobs=0)
    with cut([prompt, prompt]) as s:
        assert s.texts == [[prompt], [prompt]]
        options = {"max_tokens": 1, "token_healing": True, "hooks": [first_a_space]}
        (chunk,) = model.stream(prompt, logprobs=0, **options)  # type: ignore[arg-type]
        assert chunk.text == "" and chunk.logprob is not None
        # The space's log-probability on the space, 0 on the text put back after it.
        assert s.weights[0, 0] == pytest.approx(chunk.logprob, abs=1e-3)
        with greedy(model, 3)(s) as more:  # goes on from the whole prompt
            assert str(more[0]).startswith(prompt) and len(str(more[0])) > len(prompt)
    # Nothing generated (every candidate rejected): the removed token itself is back.
    rewinds = [lambda step: lcgen.Rewind(1)]
    none = greedy(model, 4, token_healing=True, hooks=rewinds, max_retries=1)
    with none(prompt) as s, SequenceState.from_text(model, prompt) as whole:
        assert s.texts == [[prompt]] and s.tokens == whole.tokens


def test_states_never_keep_a_new_sequence_from_a_slot(model_path: Path) -> None:
    with lcgen.Model(model_path, n_seq_max=2, n_ctx=1024) as small:
        text = continuous(generate.text(small, max_tokens=4))
        first, second = text("Count: 1,"), text("Count: 5,")
        assert first.n_cached == second.n_cached == 1 and small.cache.stats.live == 0
        with small.sequence("Hello") as seq:  # the least recently used state's cells go
            seq.generate(max_tokens=2)
        assert first.n_cached == 0 and second.n_cached == 1
        again = text(first)  # decoded again from its tokens, and goes on
        assert str(again).startswith(str(first))


def test_a_batch_that_outgrows_the_context_queues_for_cells() -> None:
    # Prompts that together need more cells than the context has: each element waits until
    # its prompt fits (it was prefilled at once, and the batch failed with ContextFullError).
    prompts = [
        f"Document {i}: " + "The river flows past the old mill and the bakery. " * 9 + "Summary:"
        for i in range(3)
    ]
    with lcgen.load("smollm2-135m", n_threads=1, n_ctx=256) as small:
        assert 3 * len(small.tokenize(prompts[0])) > 256
        texts = small.generate(prompts, max_tokens=5)
        expected = [p + str(t) for p, t in zip(prompts, texts, strict=True)]
        small.cache.clear()
        state = continuous(generate.text(small, max_tokens=5))(prompts)
        assert list(state) == expected
        small.cache.clear()
        assert continuous(generate.text(small, max_tokens=5, beams=3))(prompts[:2]).shape[0] == 2
        small.cache.clear()
        two = continuous(generate.text(small, max_tokens=5))(prompts[0], num_samples=2)
        assert two.shape == (1, 2)
