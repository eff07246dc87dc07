"""How the controls compose: invariants over combinations that each control's own tests leave
out (each test names the combination). Defects found this way have their regression test
here; where a combination held, a compact invariant stays only if no other test covers it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcgen
from lcgen import continuous, generate
from lcgen.runtime.run import step

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON_PROMPT = "A person as JSON:\n"


def test_logprobs_zero_keeps_an_entry_for_every_token_a_grammar_forces(
    model: lcgen.Model,
) -> None:
    # logprobs=0 asks for every token's log-probability (no alternatives): fast-forwarded
    # tokens were appended without one, and text.logprobs came back None.
    grammar = lcgen.Grammar.from_json_schema(PERSON)
    out = model.generate(JSON_PROMPT, grammar=grammar, max_tokens=60, logprobs=0)
    assert out.logprobs is not None
    assert [e.token for e in out.logprobs] == list(out.tokens)
    assert out.stats.forced == 0
    chunks = list(model.stream(JSON_PROMPT, grammar=grammar, max_tokens=60, logprobs=0))
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)


def test_continuous_json_weights_stay_on_their_tokens(model: lcgen.Model) -> None:
    # A state's weights are its generated tokens' log-probabilities; tokens a constraint
    # forced (fast-forward) count 0. They had no entry, so the sampled tokens' ones were
    # shifted onto later tokens: a slice after the first token weighed 0.
    state = continuous(generate.json(model, PERSON, max_tokens=60))(JSON_PROMPT)
    grammar = lcgen.Grammar.from_json_schema(PERSON)
    (first,) = model.stream(JSON_PROMPT, grammar=grammar, max_tokens=1, logprobs=0)
    (entry,) = first.logprobs
    assert entry.logprob < 0
    assert state.tokens[0][0][len(model.tokenize(JSON_PROMPT))] == entry.token
    head = state[0, 0, : len(JSON_PROMPT) + len(entry.text)]
    assert head.weights[0, 0] == entry.logprob
    assert state.weights[0, 0] <= head.weights[0, 0]


def test_a_stop_token_ends_a_state_without_its_text_as_it_ends_a_generation(
    model: lcgen.Model,
) -> None:
    # generate leaves a stop token's text out (as a stop string's); continuous states, beams
    # included, kept the token, and its text ('.') ended the state.
    prompt = "Once upon a time, a dragon and a knight"
    period = model.tokenize(".", add_bos=False)
    out = model.generate(prompt, max_tokens=16, stop_tokens=period)
    assert out.finish_reason == "stop" and not str(out).endswith(".")
    for beams in (None, 1):
        spec = generate.text(model, max_tokens=16, stop_tokens=period, beams=beams)
        state = continuous(spec)(prompt)
        assert list(state) == [prompt + str(out)]
        assert state.tokens[0][0] == model.tokenize(prompt) + list(out.tokens[:-1])


# random combinations ---------------------------------------------------------------------------
PROMPTS = [
    "Once upon a time, a dragon and a knight",
    "The keeper climbed the stairs. The keeper climbed the",
    "Q: 2+2?\nA:",
]
STOPS = [".", " the", "\n", "ed", "e t", ", "]
BANS: list[str | re.Pattern[str]] = ["the", "knight", " a ", "ing", re.compile(r"\bcolou?r\b")]


@st.composite
def option_sets(draw: st.DrawFn) -> dict[str, Any]:
    """Generation options, several controls at once."""
    options: dict[str, Any] = {"max_tokens": draw(st.integers(1, 20))}
    if draw(st.booleans()):
        options.update(temperature=0.8, seed=draw(st.integers(0, 9)))
    if draw(st.booleans()):
        options.update(stop=draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=2)))
        options.update(include_stop=draw(st.booleans()))
    if draw(st.booleans()):
        options.update(banned=draw(st.lists(st.sampled_from(BANS), min_size=1, max_size=2)))
    options.update(logprobs=draw(st.sampled_from([None, None, 0, 2])))
    if draw(st.booleans()):
        options.update(speculate="ngram", num_draft=draw(st.sampled_from([1, 3, 64])))
    options.update(token_healing=draw(st.sampled_from([False, False, True])))
    constraint = draw(st.sampled_from([None, None, "regex", "choice"]))
    if constraint == "regex":
        options.update(regex=r"[ a-z,]{0,40}\.")
    elif constraint == "choice":
        options.update(choice=[" the end", " a start", " three"])
    if draw(st.booleans()):
        options.update(logit_bias={260: -2.0})  # ' the'
    return options


def _generate_or_error(model: lcgen.Model, prompt: str, options: dict[str, Any]) -> Any:
    try:
        return model.generate(prompt, **options)
    except (lcgen.IncompleteOutputError, lcgen.NoCandidatesError) as exc:
        return type(exc)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompt=st.sampled_from(PROMPTS), options=option_sets())
def test_any_controls_together_keep_stream_text_tokens_and_logprobs_in_step(
    cold_model: lcgen.Model, prompt: str, options: dict[str, Any]
) -> None:
    """Stops, bans, logprobs, speculation, healing, constraints and biases at once: the stream
    joins to the text, carries its tokens and one log-probability entry per token, the stats
    count what the context decoded, and the output holds no banned phrase and no stop string
    before its end."""
    before = cold_model.context.n_decoded
    out = _generate_or_error(cold_model, prompt, options)
    if isinstance(out, type):
        return
    stats = out.stats
    assert cold_model.context.n_decoded - before == stats.decoded
    if stats.rewinds == stats.resamples == 0 and out.finish_reason != "retries":
        assert stats.tokens == stats.steps + stats.accepted + stats.forced
    chunks = list(cold_model.stream(prompt, **options))
    assert "".join(c.text for c in chunks) == out
    assert tuple(t for c in chunks for t in c.tokens) == out.tokens
    assert out.stats.tokens == len(out.tokens)
    if options["logprobs"] is not None:
        assert out.logprobs is not None
        assert [e.token for e in out.logprobs] == list(out.tokens)
        assert [e.token for c in chunks for e in c.logprobs] == list(out.tokens)
    for phrase in options.get("banned", ()):
        if isinstance(phrase, str):
            assert phrase not in out
    body = out[: -len(out.stop)] if options.get("include_stop") and out.stop else out
    assert not any(stop in body for stop in options.get("stop", ()))


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompt=st.sampled_from(PROMPTS), options=option_sets())
def test_any_controls_together_regenerate_the_same_after_a_rewind(
    cold_model: lcgen.Model, prompt: str, options: dict[str, Any]
) -> None:
    """A sequence rewound to a checkpoint before a generation with any of the controls above
    generates the same tokens again (the sequence's seeded RNG is restored with it). Without
    parked prefixes the regenerated cells take the same places in the pool: with them, a
    near-tie can fall the other way (the KV cache's Exactness)."""
    options.pop("seed", None)
    with cold_model.sequence(prompt, seed=7) as seq:
        checkpoint = seq.checkpoint()
        first = _sequence_generate(seq, options)
        after_first = seq.tokens
        seq.rewind(checkpoint)
        again = _sequence_generate(seq, options)
        assert again == first and seq.tokens == after_first


def _sequence_generate(seq: lcgen.Sequence, options: dict[str, Any]) -> object:
    try:
        out = seq.generate(**options)
    except (lcgen.IncompleteOutputError, lcgen.NoCandidatesError) as exc:
        return type(exc)
    return (str(out), out.tokens, out.logprobs)


def test_one_sequence_twice_in_a_step_is_refused_before_llama_cpp_sees_it(
    model: lcgen.Model,
) -> None:
    # One run submitted twice (or two runs on one sequence) put the sequence twice into one
    # batch: llama.cpp refused it ("positions are decreasing"), a DecodeError naming nothing.
    with model.sequence("The keeper climbed the stairs.") as seq:
        run = seq.run(max_tokens=3)
        scheduler = lcgen.Scheduler(model.cache)
        scheduler.submit(lambda: run)
        scheduler.submit(lambda: run)
        with pytest.raises(ValueError, match=rf"slot {seq.slot}\) is in one step twice"):
            list(scheduler)
        other = seq.run(max_tokens=3)
        with pytest.raises(ValueError, match="in one step twice"):
            step([seq.run(max_tokens=3), other])
        assert seq.generate(max_tokens=3).stats.tokens == 3  # the sequence is as it was
