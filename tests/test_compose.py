"""How the controls compose: invariants over combinations that each control's own tests leave
out (each test names the combination). Defects found this way have their regression test
here; where a combination held, a compact invariant stays only if no other test covers it.
"""

from __future__ import annotations

import lcgen
from lcgen import continuous, generate

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
