"""Speculative decoding: drafts verified in one batch change how many steps a generation takes,
never what it generates.

Exactness as stated in the README: every position is sampled from the model's own logits with
the generation's sampler and RNG, so the tokens equal those of a run without speculation given
the same logits. Verifying several tokens in one batch can move logits in the last bits, so a
token may differ only where the top two logits are within that noise; the tests compare with
:func:`assert_same_where_clear` (and every prompt here has clear margins: the outputs are equal).
Decode counts prove what was decoded: every step decodes its pending token and its draft.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcgen

NOISE = 1.5  # the most a logit moved between batch shapes (measured: 1.47, see test_cache)

PASSAGE = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He carried a lamp, "
    "a notebook and a flask of tea. At the top he wiped the great lens, checked the clockwork "
    "that turned it, and wrote the weather in his notebook: wind, sea, cloud and the ships "
    "that passed. In forty years he had missed only one evening, the night his daughter was "
    "born in the village below."
)
COPY = [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]
PROMPTS = [
    f"{PASSAGE}\n\nThe same text again, word for word:\n\n",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]


def reference(
    model: lcgen.Model, prompt: str | list[int], **options: object
) -> tuple[lcgen.Text, list]:
    """A run without speculation, and the logits each token was chosen from (a hook records
    them; it accepts every token)."""
    rows: list[np.ndarray] = []

    def record(step: lcgen.Step) -> None:
        rows.append(np.array(step.logits))

    with model.sequence(prompt) as seq:
        out = seq.generate(hooks=[record], **options)  # type: ignore[call-overload]
    return out, rows


def speculative(model: lcgen.Model, prompt: str | list[int], **options: object) -> lcgen.Text:
    with model.sequence(prompt) as seq:
        out: lcgen.Text = seq.generate(speculate="ngram", **options)  # type: ignore[call-overload]
    return out


def assert_same_where_clear(ours: Sequence[int], ref: lcgen.Text, rows: list) -> None:
    """Equal tokens up to the first difference, and that one only at a near-tie."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)):
        if a != b:
            top2 = np.sort(rows[i])[-2:]
            assert top2[1] - top2[0] < 2 * NOISE, f"token {i} differs at a clear margin"
            return
    assert len(ours) == len(ref.tokens)


def check_counts(model: lcgen.Model, prompt: str, out: lcgen.Text) -> None:
    """Each step yields its sampled token plus the draft tokens accepted before it; the first
    step decodes the prompt, every later one its pending token and its draft."""
    s = out.stats
    assert s.tokens == s.steps + s.accepted
    n_prompt = len(model.tokenize(prompt))
    assert s.decoded == n_prompt + (s.steps - 1) + s.drafted
    assert s.redecoded == 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_the_same_and_counts_add_up(model: lcgen.Model, prompt: str) -> None:
    ref, rows = reference(model, prompt, max_tokens=60, temperature=0)
    model.cache.clear()
    out = model.generate(prompt, max_tokens=60, temperature=0, speculate="ngram")
    assert_same_where_clear(out.tokens, ref, rows)
    assert str(out) == str(ref) and out.finish_reason == ref.finish_reason
    check_counts(model, prompt, out)


@pytest.mark.parametrize("options", [{}, {"temperature": 0.3, "seed": 7}], ids=["greedy", "seeded"])
def test_replaying_the_verified_rows_one_at_a_time_gives_the_same_tokens_bit_for_bit(
    model: lcgen.Model, options: dict[str, object]
) -> None:
    """The bit-exact reference: the rows each position was sampled from in a speculative run
    (several per batch), replayed one at a time through a generator without speculation and
    with the same seed, give the same tokens. The walk samples exactly as one-token decoding
    does given the same logits; only the batch shapes (and so the last bits) differ."""
    rows: list[np.ndarray] = []

    def record(step: lcgen.Step) -> None:
        rows.append(np.array(step.logits))

    out = speculative(model, PROMPTS[0], max_tokens=64, hooks=[record], **options)
    # Some rows came from batches of several (6 to 20 accepted drafts, by CPU and options).
    assert out.stats.accepted >= 3 and len(rows) == len(out.tokens)
    replay = lcgen.Generator(model, max_tokens=64, **options)  # type: ignore[arg-type]
    assert tuple(t for row in rows for t in replay.step(row).tokens) == out.tokens


def test_copying_takes_several_tokens_per_step(model: lcgen.Model) -> None:
    plain = model.chat(COPY, max_tokens=80, temperature=0)
    model.cache.clear()
    fast = model.chat(COPY, max_tokens=80, temperature=0, speculate="ngram")
    assert fast.tokens == plain.tokens
    assert fast.stats.accepted > 0.6 * fast.stats.tokens  # the passage is copied
    assert fast.stats.tokens_per_step > 3
    assert plain.stats.steps == plain.stats.tokens and plain.stats.drafted == 0


@pytest.mark.parametrize("seed", [1, 7, 123])
def test_seeded_sampling_is_the_same(model: lcgen.Model, seed: int) -> None:
    prompt = model.chat_tokens(COPY)
    options = {"max_tokens": 50, "temperature": 0.5, "top_p": 0.95, "seed": seed}
    ref, rows = reference(model, prompt, **options)
    out = speculative(model, prompt, **options)
    assert_same_where_clear(out.tokens, ref, rows)
    assert out.stats.accepted > 0


def test_a_schema_constrained_output_is_the_same_and_validates(model: lcgen.Model) -> None:
    schema = {
        "type": "object",
        "properties": {"keeper": {"type": "string"}, "years": {"type": "integer"}},
        "required": ["keeper", "years"],
        "additionalProperties": False,
    }
    prompt = f"{PASSAGE}\n\nAs JSON with the keeper's description and the years he served:\n"
    ref = model.generate(prompt, schema=schema, max_tokens=80, temperature=0)
    out = model.generate(prompt, schema=schema, max_tokens=80, temperature=0, speculate="ngram")
    assert out == ref
    assert set(out) == {"keeper", "years"} and isinstance(out["years"], int)


PETS = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "kind", "age"],
        "properties": {
            "name": {"enum": ["Tommy", "Annabel", "Bobby"]},
            "kind": {"enum": ["catfish", "doggo", "parrot"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 9},
        },
    },
}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_constrained_output_is_the_same_with_forced_text(
    model: lcgen.Model, seed: int
) -> None:
    """Forced text (fast-forward) is appended unsampled: a draft's walk stops where the
    grammar forces text. The walk sampled there, drew from the RNG, and every later token
    changed."""
    pets = '{"name":"Tommy","kind":"catfish","age":3},{"name":"Bobby","kind":"parrot","age":7}'
    prompt = f"Pets as JSON:\n[{pets}]\n[{pets}]\nMore pets as JSON:\n"
    options = {"schema": PETS, "json_whitespace": "compact", "max_tokens": 120, "seed": seed}
    runs = []
    for spec in (None, "ngram"):
        model.cache.clear()  # the same batches from the prompt on (the cache's own exactness)
        runs.append(list(model.stream(prompt, temperature=0.9, speculate=spec, **options)))  # type: ignore[arg-type]
    plain, spec = ([t for c in chunks for t in c.tokens] for chunks in runs)
    assert spec == plain
    assert runs[1][-1].stats.forced == runs[0][-1].stats.forced > 0


def test_drafts_that_do_not_fit_the_cache_are_dropped_not_fatal(model_path: Path) -> None:
    # The cells are shared by every live sequence: with 14 free, a run that stops after 14
    # tokens fits, its drafts (which ask for their cells up front) did not: ContextFullError.
    story = "The keeper climbed the stairs at dusk, wiped the lens and lit the wick. "
    with lcgen.load(model_path, n_ctx=512, n_threads=2) as small:
        prompt = small.tokenize(f"Repeat exactly:\n{story * 3}")
        filler = small.tokenize("Lorem ipsum dolor sit amet, sed do eiusmod tempor. " * 60)
        with small.sequence(filler[: small.n_ctx - len(prompt) - 14]) as other:
            other.prefill()
            outs = []
            for spec in (None, "ngram"):
                with small.sequence(prompt) as seq:
                    options = {"max_tokens": 40, "stop": ["lit"], "speculate": spec}
                    outs.append(seq.generate(**options))  # type: ignore[arg-type]
    plain, drafted = outs
    assert drafted == plain and plain.finish_reason == "stop"
    assert drafted.stats.accepted > 0


def test_a_batch_drops_drafts_that_do_not_fit_instead_of_pausing_others(
    model_path: Path,
) -> None:
    # The scheduler counted the drafts as cells the step needed: it paused the other element
    # (dropped its prompt's cells, decoded again later) to make room for them.
    story = "The keeper climbed the stairs at dusk, wiped the lens and lit the wick. "
    with lcgen.load(model_path, n_ctx=512, n_threads=2, n_seq_max=4) as small:
        prompts = [f"Repeat exactly:\n{story * 3}", f"Repeat this:\n{story * 3}"]
        n = sum(len(small.tokenize(p)) for p in prompts)
        filler = small.tokenize("Lorem ipsum dolor sit amet, sed do eiusmod tempor. " * 60)
        with small.sequence(filler[: small.n_ctx - n - 2 * 16]) as other:
            other.prefill()
            runs = []
            for spec in (None, "ngram"):
                small.cache.clear()
                options = {"max_tokens": 40, "stop": ["lit"], "speculate": spec}
                runs.append(small.generate(prompts, **options))  # type: ignore[call-overload]
    plain, drafted = runs
    assert drafted == plain and all(o.finish_reason == "stop" for o in plain)
    assert all(o.stats.redecoded == 0 and o.stats.accepted > 0 for o in drafted)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_a_hook_that_raises_mid_walk_loses_no_streamed_tokens(
    model: lcgen.Model, spec: str | None
) -> None:
    # The walk's tokens before the failure stay in the sequence: their chunk was dropped with
    # the exception, and the stream missed them.
    raised: set[int] = set()

    def hook(step: lcgen.Step) -> None:
        if step.index in (12, 25, 40) and step.index not in raised:
            raised.add(step.index)
            raise RuntimeError(f"refused at {step.index}")

    model.cache.clear()
    with model.sequence(model.tokenize(f"Repeat exactly:\n{PASSAGE}")) as seq:
        run = seq.run(hooks=[hook], lookback=1, max_tokens=60, speculate=spec)
        tokens: list[int] = []
        text, errors = "", 0
        while not run.is_done:
            try:
                chunk = run.step()
            except RuntimeError:
                errors += 1
                continue
            tokens += chunk.tokens
            text += chunk.text
        assert errors >= 2
        assert tokens == run.generator.tokens
        assert text == model.detokenize(tokens)


def test_a_chunk_s_logprob_is_the_sum_of_its_entries_with_bans_and_drafts(
    model: lcgen.Model,
) -> None:
    # A walk joined a banned-phrase check's empty chunk (no logprob) with released tokens:
    # the chunk had entries but logprob None.
    prompt = f"Repeat exactly:\n{PASSAGE}\n{PASSAGE}"
    stream = model.stream(prompt, max_tokens=60, banned=[" lens"], logprobs=1, speculate="ngram")
    chunks = list(stream)
    assert sum(len(c.tokens) > 1 for c in chunks) > 3  # drafts accepted
    for c in chunks:
        if c.logprobs:
            assert c.logprob == pytest.approx(sum(e.logprob for e in c.logprobs))
        else:
            assert c.logprob is None


def test_stop_strings_banned_phrases_and_logprobs_compose(model: lcgen.Model) -> None:
    prompt = PROMPTS[0]
    for options in (
        {"stop": ["notebook"]},
        {"banned": ["great lens", "tea"]},
        {"stop": ["daughter"], "logprobs": 2},
    ):
        ref = model.generate(prompt, max_tokens=80, temperature=0, **options)  # type: ignore[call-overload]
        out = model.generate(prompt, max_tokens=80, temperature=0, speculate="ngram", **options)  # type: ignore[call-overload]
        assert (str(out), out.tokens, out.finish_reason, out.stop) == (
            str(ref),
            ref.tokens,
            ref.finish_reason,
            ref.stop,
        ), options
        assert out.stats.drafted > 0
        if "banned" in options:
            assert "great lens" not in out and "tea" not in out
        if "logprobs" in options:
            assert out.logprobs is not None and ref.logprobs is not None
            assert [e.token for e in out.logprobs] == list(out.tokens)
            got = np.array([e.logprob for e in out.logprobs])
            want = np.array([e.logprob for e in ref.logprobs])
            assert np.allclose(got, want, atol=0.05)


def test_streamed_text_joins_to_the_output(model: lcgen.Model) -> None:
    chunks = list(model.stream(PROMPTS[0], max_tokens=60, temperature=0, speculate="ngram"))
    text = lcgen.Text.of(chunks)
    assert "".join(c.text for c in chunks) == str(text)
    assert str(text) == model.detokenize(list(text.tokens))
    assert any(len(c.tokens) > 1 for c in chunks)  # a step that took several tokens


def test_a_batch_verifies_every_sequences_drafts_together(model: lcgen.Model) -> None:
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1]]
    refs = [reference(model, p, max_tokens=40, temperature=0) for p in prompts]
    outs = model.generate(prompts, max_tokens=40, temperature=0, speculate="ngram")
    for out, (ref, rows) in zip(outs, refs, strict=True):
        # The third prompt meets a near-tie (a margin of 0.04) at token 10 to 12: a batch of
        # other shapes moves it either way, with speculation or without.
        assert_same_where_clear(out.tokens, ref, rows)
    assert outs[0].stats.accepted > 0


def test_continuous_generators_take_speculation(model: lcgen.Model) -> None:
    """The continuous API's elements (batch x samples, seeded) run through the same runs."""
    count = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,"
    prompts = [count, "Count on: 100, 101, 102,"]
    plain = lcgen.continuous(lcgen.generate.text(model, max_tokens=16, temperature=0.5))
    fast = lcgen.continuous(
        lcgen.generate.text(model, max_tokens=16, temperature=0.5, speculate="ngram")
    )
    a = plain(prompts, num_samples=2, seed=3)
    b = fast(prompts, num_samples=2, seed=3)
    # Sampled, the same draws pick the same tokens unless the batch-shape noise moves a
    # probability across a draw (measured on a story prompt: once in 64 tokens); counting
    # leaves no such margin.
    assert b.tokens == a.tokens
    assert next(iter(b)).startswith(count + " 15, 16")


class Scripted:
    """A drafter that proposes the reference continuation with one token replaced at
    ``wrong`` (or the continuation as it is, for ``wrong`` beyond the draft)."""

    def __init__(self, start: int, continuation: Sequence[int], k: int, wrong: int) -> None:
        self.start, self.continuation, self.k, self.wrong = start, continuation, k, wrong
        self.results: list[tuple[int, int]] = []
        self.closed = False

    def propose(self, tokens: Sequence[int], room: int) -> list[int]:
        at = len(tokens) - self.start
        draft = list(self.continuation[at : at + min(self.k, room)])
        if self.wrong < len(draft):
            draft[self.wrong] = (draft[self.wrong] + 1) % 1000
        return draft

    def feedback(self, drafted: int, accepted: int) -> None:
        self.results.append((drafted, accepted))

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("wrong", [0, 1, 3, 5, 9])
def test_a_draft_rejected_at_any_position(model: lcgen.Model, wrong: int) -> None:
    prompt = PROMPTS[1]
    ref = model.generate(prompt, max_tokens=30, temperature=0)
    with model.sequence(prompt) as seq:
        run = seq.run(max_tokens=30, temperature=0, speculate="ngram")
        drafter = Scripted(len(seq), ref.tokens, 6, wrong)
        run.drafter = drafter  # type: ignore[assignment]
        text = lcgen.Text.of(_drive(run))
        assert text.tokens == ref.tokens
        for drafted, accepted in drafter.results[:-1]:  # the last may end the generation
            assert accepted == min(wrong, drafted)
        assert seq.n_decoded == len(seq) - 1  # no draft cell is left behind
        assert drafter.closed  # told when the generation ended
        assert model.context.ledger.held(seq.slot) == seq.n_decoded


def _drive(run: lcgen.PlainRun | lcgen.Backtracker) -> list[lcgen.Chunk]:
    chunks = []
    while not run.is_done:
        chunks.append(run.step())
    return chunks


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    drafts=st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 9), st.booleans()), min_size=1, max_size=12
    )
)
def test_any_drafts_leave_the_output_unchanged(
    model: lcgen.Model, drafts: list[tuple[int, int, bool]]
) -> None:
    """Random drafts (right up to a random position, of random lengths, or nothing) never
    change the tokens, and never leave cells behind."""
    prompt = PROMPTS[2]
    ref = model.generate(prompt, max_tokens=24, temperature=0)

    class Random:
        def __init__(self, start: int) -> None:
            self.start, self.i = start, 0

        def propose(self, tokens: Sequence[int], room: int) -> list[int]:
            k, wrong, skip = drafts[self.i % len(drafts)]
            self.i += 1
            if skip:
                return []
            at = len(tokens) - self.start
            draft = list(ref.tokens[at : at + min(k, room)])
            if wrong < len(draft):
                draft[wrong] = 13
            return draft

        def feedback(self, drafted: int, accepted: int) -> None:
            pass

        def close(self) -> None:
            pass

    with model.sequence(prompt) as seq:
        run = seq.run(max_tokens=24, temperature=0, speculate="ngram")
        run.drafter = Random(len(seq))  # type: ignore[assignment]
        text = lcgen.Text.of(_drive(run))
        assert text.tokens == ref.tokens
        assert model.context.ledger.held(seq.slot) == seq.n_decoded == len(seq) - 1


def test_rewind_inside_a_speculative_generation_regenerates_the_same(model: lcgen.Model) -> None:
    prompt = PROMPTS[0]
    with model.sequence(prompt) as seq:
        run = seq.run(max_tokens=50, temperature=0.7, seed=3, speculate="ngram")
        chunks = [run.step(), run.step()]
        cp = run.checkpoint()
        n_before = len(run.generator.tokens)
        first = _drive(run)
        run.rewind(cp)
        again = _drive(run)
        assert lcgen.Text.of(again).tokens == lcgen.Text.of(first).tokens
        assert len(lcgen.Text.of(chunks).tokens) == n_before
        assert model.context.ledger.held(seq.slot) == seq.n_decoded == len(seq) - 1


def test_a_checkpoint_from_a_run_without_speculation_is_valid_with_it(
    model: lcgen.Model,
) -> None:
    prompt = PROMPTS[0]
    with model.sequence(prompt) as seq:
        plain = seq.run(max_tokens=40, temperature=0)
        plain.step()
        cp = seq.checkpoint()
        rest = lcgen.Text.of(_drive(plain))
        seq.rewind(cp)
        fast = seq.run(max_tokens=39, temperature=0, speculate="ngram")
        assert lcgen.Text.of(_drive(fast)).tokens == rest.tokens


def test_a_sequence_left_mid_draft_generates_normally_after(model: lcgen.Model) -> None:
    prompt = PROMPTS[0]
    ref = model.generate(prompt, max_tokens=30, temperature=0)
    with model.sequence(prompt) as seq:
        run = seq.run(max_tokens=30, temperature=0, speculate="ngram")
        first = [run.step() for _ in range(3)]  # abandoned with a draft for its next step
        rest = seq.generate(max_tokens=30 - len(lcgen.Text.of(first).tokens), temperature=0)
        assert lcgen.Text.of(first).tokens + rest.tokens == ref.tokens


def test_json_mode_in_chat_is_the_same(model: lcgen.Model) -> None:
    messages = [{"role": "user", "content": f"{PASSAGE}\nGive the keeper's tools as JSON."}]
    tools = {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}
    schema = {"type": "object", "properties": {"tools": tools}, "required": ["tools"]}
    ref = model.chat(messages, schema=schema, max_tokens=120, temperature=0)
    out = model.chat(messages, schema=schema, max_tokens=120, temperature=0, speculate="ngram")
    assert out == ref and json.dumps(out)


# a draft model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_model(model_path: Path) -> Iterator[lcgen.Model]:
    """The bundled model loaded a second time: a draft model that predicts the model exactly
    (up to batch-shape noise)."""
    with lcgen.Model(model_path, n_ctx=2048, n_seq_max=4) as m:
        yield m


def test_a_model_drafting_for_itself_is_almost_always_right(
    model: lcgen.Model, draft_model: lcgen.Model
) -> None:
    prompt = PROMPTS[1]  # free text: prompt lookup finds little here, a draft model does
    ref, rows = reference(model, prompt, max_tokens=48, temperature=0)
    model.cache.clear()
    out = model.generate(prompt, max_tokens=48, temperature=0, speculate=draft_model)
    assert_same_where_clear(out.tokens, ref, rows)
    check_counts(model, prompt, out)
    assert out.stats.accepted >= 0.9 * out.stats.drafted and out.stats.tokens_per_step > 3
    assert draft_model.cache.stats.live == 0  # the drafter's sequence closed with the run


def test_a_draft_model_that_is_often_wrong_changes_nothing(
    model: lcgen.Model, draft_model: lcgen.Model
) -> None:
    """Sampling at temperature 1.2 while the draft model drafts greedily: many drafts are
    rejected part-way, and the output is still the seeded run's own."""
    prompt = PROMPTS[1]
    options = {"max_tokens": 40, "temperature": 1.2, "seed": 11}
    ref, rows = reference(model, prompt, **options)
    out = model.generate(prompt, speculate=draft_model, num_draft=4, **options)  # type: ignore[call-overload]
    assert_same_where_clear(out.tokens, ref, rows)
    assert out.stats.drafted > 0 and out.stats.accepted < out.stats.drafted


def test_draft_models_that_cannot_work_are_refused(
    model: lcgen.Model, draft_model: lcgen.Model
) -> None:
    with pytest.raises(ValueError, match="the draft model is the model generating"):
        model.generate("Hi", max_tokens=2, speculate=model)
    with (
        lcgen.load("gemma3-270m", n_ctx=512, n_seq_max=1) as other,
        pytest.raises(ValueError, match=r"vocabulary \(262144 tokens, .*\) differs"),
    ):
        model.generate("Hi", max_tokens=2, speculate=other)
    with pytest.raises(TypeError, match=r"a draft lcgen\.Model"):
        model.generate("Hi", max_tokens=2, speculate=42)
    with model.sequence("Hi there") as seq:  # a refused run leaves the sequence as it was
        before = seq.tokens
        with pytest.raises(ValueError, match="model generating"):
            seq.run(token_healing=True, speculate=model)
        assert seq.tokens == before


LISTS = [f"List {i}: " + "one two three four five six seven eight nine ten " * 12 for i in (0, 1)]


def test_a_draft_model_short_of_cells_leaves_a_batch_as_it_was(
    model: lcgen.Model, model_path: Path
) -> None:
    """Two 125-token prompts and a draft model of 256 cells: one draft sequence fits, the other
    goes without drafts (a draft is only a speed-up) until the first one's generation ends and
    its cells can be evicted; neither fails."""
    refs = [reference(model, prompt, max_tokens=20, temperature=0) for prompt in LISTS]
    with lcgen.Model(model_path, n_ctx=256, n_threads=1) as small:
        outs = model.generate(LISTS, max_tokens=20, temperature=0, speculate=small)
        assert small.cache.stats.live == 0
    for out, (ref, rows) in zip(outs, refs, strict=True):
        assert_same_where_clear(out.tokens, ref, rows)
    assert all(out.stats.drafted > 0 for out in outs)


def test_a_draft_model_short_of_slots_drafts_where_it_has_one(
    model: lcgen.Model, model_path: Path
) -> None:
    """A draft model of one slot: the batch's second sequence drafts once the first's drafter
    gave the slot back; a generation while a stream holds the slot drafts nothing."""
    prompts = [PROMPTS[1], PROMPTS[3]]
    refs = [reference(model, prompt, max_tokens=24, temperature=0) for prompt in prompts]
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=1, n_threads=1) as small:
        outs = model.generate(prompts, max_tokens=24, temperature=0, speculate=small)
        for out, (ref, rows) in zip(outs, refs, strict=True):
            assert_same_where_clear(out.tokens, ref, rows)
            assert out.stats.drafted > 0
        stream = model.stream(prompts[0], max_tokens=24, temperature=0, speculate=small)
        first = next(stream)
        out = model.generate(prompts[1], max_tokens=24, temperature=0, speculate=small)
        assert_same_where_clear(out.tokens, *refs[1])
        assert out.stats.drafted == 0
        rest = list(stream)
        assert_same_where_clear([t for c in [first, *rest] for t in c.tokens], *refs[0])
        assert rest[-1].stats is not None and rest[-1].stats.drafted > 0
        assert small.cache.stats.live == 0


def test_closing_a_sequence_gives_its_draft_models_slot_back(
    model: lcgen.Model, model_path: Path
) -> None:
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=1, n_threads=1) as small:
        seq = model.sequence("Once upon a time")
        run = seq.run(max_tokens=20, speculate=small)
        run.step()
        run.step()
        assert small.cache.stats.live == 1
        seq.close()  # the run is still referenced: closing the sequence closes its drafter
        assert small.cache.stats.live == 0
        with model.sequence("Once upon a time") as seq:
            kept = seq.run(max_tokens=20, speculate=small)
            kept.step()
            kept.step()
        assert small.cache.stats.live == 0  # the with-block closed it
        out = model.generate("Once upon a time", max_tokens=8, speculate=small)
        assert out.stats.drafted > 0


def test_a_run_a_newer_one_replaced_gives_its_draft_models_slot_back(
    model: lcgen.Model, model_path: Path
) -> None:
    """Runs the caller still holds, replaced by newer runs on the same sequence, kept their
    draft-model slots: once they held them all, later runs drafted nothing, silently."""
    with (
        lcgen.Model(model_path, n_ctx=512, n_seq_max=2, n_threads=1) as small,
        model.sequence("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,") as seq,
    ):
        held = []
        for _ in range(3):
            run = seq.run(max_tokens=8, speculate=small)
            run.step()
            held.append(run)
        assert small.cache.stats.live <= 1  # the last run's
        out = seq.generate(max_tokens=12, speculate=small)
        assert out.stats is not None and out.stats.drafted > 0


def test_a_draft_model_closed_mid_stream_leaves_the_generation_going(
    model: lcgen.Model, model_path: Path
) -> None:
    # The generation died with "ClosedError: the model ... is closed", naming no draft.
    greedy = {"max_tokens": 16, "temperature": 0.0}
    ref, rows = reference(model, "Once upon a time", **greedy)
    small = lcgen.Model(model_path, n_ctx=512, n_seq_max=2, n_threads=1)
    stream = model.stream("Once upon a time", speculate=small, **greedy)  # type: ignore[call-overload]
    chunks = [next(stream), next(stream)]
    small.close()
    chunks += list(stream)
    text = lcgen.Text.of(chunks)
    assert text.stats is not None and text.stats.tokens == 16
    assert_same_where_clear(text.tokens, ref, rows)
    # Closed, it is refused as a draft model (it was taken, and drafted nothing, once its
    # vocabulary had been read).
    # It is named as the draft model: of the same file, "the model ... is closed" read as
    # the model generating, which is open.
    with pytest.raises(lcgen.ClosedError, match=r"the draft model \(speculate=\) is closed"):
        model.generate("Once upon a time", speculate=small, **greedy)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"speculate": "medusa"}, ValueError, "speculate must be 'ngram'"),
        ({"speculate": 3}, TypeError, "speculate must be 'ngram'"),
        ({"speculate": "ngram", "num_draft": 0}, ValueError, "num_draft must be"),
        ({"speculate": "ngram", "num_draft": "4"}, TypeError, "num_draft must be an int"),
        ({"speculate": "ngram", "num_draft": 65}, ValueError, "num_draft must be"),
        ({"num_draft": 4}, ValueError, r"num_draft=4 needs speculate"),  # else a silent no-op
    ],
)
def test_bad_speculation_options_are_named(
    options: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        lcgen.make_plan(**options)  # type: ignore[arg-type]


def test_draft_caps_default_by_how_drafts_are_made(model: lcgen.Model) -> None:
    # Prompt lookup drafts cost nothing to make: long ones by default; a draft model decodes
    # each draft token in turn: short ones. A given num_draft wins either way.
    ngram = lcgen.make_plan(speculate="ngram").speculation
    assert ngram is not None and ngram.num_draft == 64
    drafted = lcgen.make_plan(speculate=model).speculation
    assert drafted is not None and drafted.num_draft == 8
    given = lcgen.make_plan(speculate="ngram", num_draft=5).speculation
    assert given is not None and given.num_draft == 5


def test_draft_length_restarts_short_after_a_miss_and_doubles_back() -> None:
    from lcgen.decoding.speculation import AdaptiveLength

    policy = AdaptiveLength(64)
    lengths = []
    for drafted_accepted in [(64, 64), (64, 47), (4, 4), (8, 8), (16, 2), (2, 0)]:
        lengths.append(policy.next_length(room=1000))
        policy.feedback(*drafted_accepted)
    # a whole draft keeps the cap; a miss part way restarts at 4 (never the 47 taken, which
    # would send a long draft after text that has most likely left its source)
    assert lengths == [64, 64, 4, 8, 16, 2]
    assert [policy.next_length(room=1000) for _ in range(3)] == [0, 0, 1]  # paused 2 steps
    assert policy.next_length(room=0) == 0


def test_drafts_are_as_long_as_their_acceptance_makes_them_worth() -> None:
    from lcgen.decoding.speculation import TOKEN_COST, AdaptiveLength, NgramDrafter

    policy = AdaptiveLength(64)
    assert [policy.worth(k) for k in (0, 1)] == [0, 1]
    assert policy.worth(64) == 2  # before any feedback: a guess at 0.8 a token, 2 tokens
    grown = []
    for _ in range(5):  # drafts taken whole: each next one is worth more
        k = policy.worth(64)
        policy.feedback(k, k)
        grown.append(policy.worth(64))
    assert grown == sorted(grown) and grown[0] > 2 and grown[-1] > 32
    shrunk = []
    for _ in range(5):  # drafts of which nothing was taken
        policy.feedback(8, 0)
        shrunk.append(policy.worth(64))
    assert shrunk == sorted(shrunk, reverse=True) and shrunk[-1] < grown[-1]
    # where a draft token is taken less often than it costs, one token is drafted at most
    # (a draft of 1 is how a drafter learns that drafts are taken again)
    rare = AdaptiveLength(64)
    for i in range(10):
        rare.feedback(4, i % 2)
    assert rare.acceptance < TOKEN_COST and rare.worth(64) == 1
    # prompt lookup cuts what it found: a whole copy is there, two tokens are worth a try
    assert NgramDrafter(64).propose([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], room=64) == [4, 5]


@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 64)), max_size=30))
def test_a_draft_worth_is_within_its_bounds(feedback: list[tuple[int, int]]) -> None:
    from lcgen.decoding.speculation import AdaptiveLength

    policy = AdaptiveLength(64)
    for drafted, accepted in feedback:
        policy.feedback(drafted, min(drafted, accepted))
        assert 0 < policy.acceptance < 1
        assert all(1 <= policy.worth(k) <= k for k in (1, 2, 7, 64))


def test_a_short_match_with_several_continuations_drafts_nothing() -> None:
    from lcgen.decoding.speculation import NgramDrafter

    drafter = NgramDrafter(8)
    for _ in range(4):
        drafter.feedback(8, 8)  # its drafts were taken whole: none is cut for their worth
    # `5 6` was followed by 7 once and by 9 once: a guess between the two, no draft
    assert drafter.propose([5, 6, 7, 1, 5, 6, 9, 2, 5, 6], room=8) == []
    # one continuation seen: drafted, the latest occurrence's tokens
    assert drafter.propose([5, 6, 7, 1, 3, 5, 6], room=8) == [7, 1, 3, 5, 6]
    # a full-length match drafts its latest occurrence's continuation even where older
    # occurrences went elsewhere
    assert drafter.propose([1, 2, 3, 4, 8, 1, 2, 3, 4, 9, 1, 2, 3, 4], room=3) == [9, 1, 2]


def test_a_hook_that_raises_inside_a_draft_leaves_the_counts_adding_up(
    model: lcgen.Model,
) -> None:
    """A hook raised on a draft token it had confirmed: that token still counted as accepted,
    and the step that raised as a step (tokens 30, steps 13, accepted 18)."""

    class Raised(Exception):
        pass

    calls = 0

    def hook(step: lcgen.Step) -> None:
        nonlocal calls
        calls += 1
        if calls % 7 == 0:
            raise Raised

    raised = 0
    with model.sequence(PROMPTS[0]) as seq:
        run = seq.run(max_tokens=40, hooks=[hook], speculate="ngram")
        while not run.is_done:
            try:
                last = run.step()
            except Raised:
                raised += 1
    s = last.stats
    assert raised >= 3 and s is not None and s.accepted > 0 and s.rewinds == 0
    assert s.tokens == s.steps + s.accepted + s.forced


def test_a_step_that_ran_out_of_retries_without_a_token_is_not_counted(
    model: lcgen.Model,
) -> None:
    """Stats add up (tokens = steps + accepted + forced without rewinds) where the run ends
    with 'retries': its last step took no token and was counted."""

    def unsure(step: lcgen.Step) -> lcgen.Resample | None:
        return lcgen.Resample(exclude=[step.token]) if step.prob < 0.3 else None

    for speculate in (None, "ngram"):
        out = model.generate(
            "Repeat exactly:\n" + "The keeper lit the wick at dusk. " * 3,
            max_tokens=40,
            hooks=[unsure],
            speculate=speculate,
        )
        s = out.stats
        assert out.finish_reason == "retries" and s.rewinds == 0, (out, s)
        assert s.tokens == s.steps + s.accepted + s.forced, s
