"""Streaming on the real model: joined chunks equal the detokenized tokens cut at the stop,
token healing, logprobs, a generator fed logits from elsewhere, and rewinding held text."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import llama_cpp_python

import lcgen

SUBJECTS = [
    "the sea",
    "a robot",
    "東京",
    "coffee ☕",
    "winter",
    "a lost key",
    "Ελλάδα",
    "jazz",
    "the moon",
    "bread",
    "a red fox",
    "trains",
    "über cities",
    "rain",
    "chess",
    "日本語",
    "a lighthouse",
    "maps",
    "bees 🐝",
    "silence",
    "glass",
    "an old song",
    "the desert",
    "numbers",
    "clocks",
]
PROMPTS = [f"Write two sentences about {s}:" for s in SUBJECTS] + [
    f"Q: What do you know about {s}?\nA:" for s in SUBJECTS
]
STOPS = ["\n\n", ".", "the"]


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Reference cut: the stop whose occurrence ends first wins (longest on a tie)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or (at + len(stop), -len(stop)) < best[:2]):
            best = (at + len(stop), -len(stop), stop)
    if best is None:
        return text, None
    return text[: best[0] + best[1]], best[2]


@pytest.mark.parametrize("seed", [1, 2])
def test_joined_chunks_equal_detokenized_tokens_cut_at_the_stop(
    model: lcgen.Model, seed: int
) -> None:
    assert len(PROMPTS) == 50
    hits = 0
    for prompt in PROMPTS:
        chunks = list(model.stream(prompt, max_tokens=16, temperature=0.9, seed=seed, stop=STOPS))
        tokens = [t for c in chunks for t in c.tokens]
        if model.is_eog(tokens[-1]):
            tokens = tokens[:-1]
        expected, stop = cut_at_stop(model.detokenize(tokens), STOPS)
        assert "".join(c.text for c in chunks) == expected, prompt
        assert chunks[-1].stop == stop
        assert chunks[-1].finish_reason == (
            "length" if stop is None and len(chunks) == 16 else "stop"
        )
        hits += stop is not None
    assert hits > 10


def test_a_character_split_between_two_calls_is_whole_in_the_sequence(
    model: lcgen.Model,
) -> None:
    """Each call's text is its own tokens' (the second's bytes of the character are U+FFFD
    each, as the README says); the sequence's text has the character."""
    fish = model.tokenize("🐟", add_bos=False)
    assert len(fish) > 1, fish  # (the character's bytes split between tokens)
    with model.sequence("Fish: ") as seq:
        calls = [seq.generate(max_tokens=1, logit_bias={token: 100}) for token in fish]
        assert [t for call in calls for t in call.tokens] == fish and seq.text.endswith("🐟")
        assert all(str(call) == model.detokenize(list(call.tokens)) for call in calls)
        assert str(calls[0]) == "\ufffd"  # (max_tokens ended the first inside it)


def test_stop_token_ids(model: lcgen.Model) -> None:
    seven = model.tokenize(" 7")[-1]
    chunks = list(model.stream("1, 2, 3, 4,", max_tokens=16, stop_tokens=[seven]))
    assert chunks[-1].tokens == (seven,) and chunks[-1].finish_reason == "stop"
    assert chunks[-1].stop is None
    assert "".join(c.text for c in chunks) == " 5, 6, "  # digits are single tokens


@pytest.mark.parametrize(
    ("prompt", "starts"),
    [('<a href="http:', "//"), ("The capital of Fra", "nce"), ("import nump", "y")],
)
def test_token_healing(model: lcgen.Model, prompt: str, starts: str) -> None:
    healed = model.generate(prompt, max_tokens=8, token_healing=True)
    plain = model.generate(prompt, max_tokens=8)
    assert healed.startswith(starts)
    assert healed != plain
    with model.sequence(prompt) as seq:
        removed = model.token_piece(seq.tokens[-1])
        out = seq.generate(max_tokens=8, token_healing=True)
        assert out == healed
        # The text is consistent: the prompt plus the streamed text is the sequence's text.
        assert seq.text == prompt + out
        first_new = model.token_piece(seq.tokens[len(model.tokenize(prompt)) - 1])
        assert first_new.startswith(removed) or removed.startswith(first_new)


def test_the_token_healing_re_creates_is_not_a_stop_token(model: lcgen.Model) -> None:
    """A prompt ending in a newline, with the newline a stop token: the token that wrote the
    prompt's own newline again ended the generation, empty (a stop string never matched it)."""
    prompt = "List:\n1. apples\n"
    newline = model.tokenize("\n")[-1]
    ask = {"max_tokens": 20, "stop_tokens": [newline], "token_healing": True}
    healed = model.generate(prompt, **ask)  # type: ignore[arg-type]
    assert healed == model.generate(prompt, max_tokens=20, stop=["\n"], token_healing=True)
    assert healed and healed.finish_reason == "stop" and healed.tokens[0] == newline
    assert healed.tokens[-1] == newline  # the next newline, the generation's own, ends it
    streamed = list(model.stream(prompt, logprobs=1, **ask))  # type: ignore[arg-type]
    assert "".join(c.text for c in streamed) == healed


def test_token_healing_composes_with_checkpoints(model: lcgen.Model) -> None:
    with model.sequence('<a href="http:', seed=3) as seq:
        cp = seq.checkpoint()
        a = seq.generate(max_tokens=10, token_healing=True, temperature=0.8)
        seq.rewind(cp)
        assert seq.generate(max_tokens=10, token_healing=True, temperature=0.8) == a


def test_a_sequence_saved_before_healing_replaced_its_token_keeps_its_prompt(
    model: lcgen.Model,
) -> None:
    # Saved between the run's start (which takes the last token away) and its first step,
    # the file held the prompt cut short: 'The capital of' for 'The capital of Fra'.
    with model.sequence("The capital of Fra") as seq:
        run = seq.run(max_tokens=4, token_healing=True)
        saved = seq.to_bytes()
        healed = "".join(run.step().text for _ in range(4))
    with lcgen.Sequence.from_bytes(model, saved) as back:
        assert back.text == "The capital of Fra"
        assert back.generate(max_tokens=4, token_healing=True) == healed


def test_a_sequence_rewound_by_count_past_a_healed_token_saves_what_it_holds(
    model: lcgen.Model,
) -> None:
    """After a healed generation, a rewind by count to just before the healed token looked
    like healing still under way: the file held the token again ('... France is' for the
    live '... France'), and the loaded sequence went on differently."""
    with model.sequence("The capital of France is") as seq:
        n = len(seq)
        seq.generate(max_tokens=4, token_healing=True)
        seq.rewind(len(seq) - (n - 1))
        saved, tokens = seq.to_bytes(), seq.tokens
    with lcgen.Sequence.from_bytes(model, saved) as back:
        assert back.tokens == tokens and back.text == "The capital of France"
    # Rewound with its generator to where the run started, healing is under way again: the
    # file holds the whole prompt.
    with model.sequence("The capital of France is") as seq:
        run = seq.run(max_tokens=4, token_healing=True)
        start = seq.checkpoint(run.generator)
        run.step()
        run.step()
        seq.rewind(start, run.generator)
        saved = seq.to_bytes()
    with lcgen.Sequence.from_bytes(model, saved) as back:
        assert back.text == "The capital of France is"


def test_a_generation_that_ends_before_healing_is_done_keeps_the_prompt(
    model: lcgen.Model,
) -> None:
    """Healing took ' Fra' off 'The capital of Fra'; a generation that ended before its
    tokens wrote it again left the sequence without it (the next call went on from there)."""
    prompt = "The capital of Fra"
    (space,) = model.tokenize(" ", add_bos=False)  # continues ' Fra' but does not finish it

    def first_a_space(step: lcgen.Step) -> lcgen.Override | None:
        return lcgen.Override(space) if step.index == 0 and step.token != space else None

    cases: list[dict[str, Any]] = [
        {"max_tokens": 0},
        {"max_tokens": 1, "hooks": [first_a_space]},
        {"max_tokens": 4, "hooks": [lambda step: lcgen.Rewind(1)], "max_retries": 1},
    ]
    for options in cases:
        with model.sequence(prompt) as seq:
            out = seq.generate(token_healing=True, **options)
            assert out == "" and seq.text == prompt, options
            after = seq.generate(max_tokens=3)  # goes on from the whole prompt
            assert seq.text == prompt + after
    with model.sequence(prompt) as seq:  # a stream closed part way
        stream = seq.stream(max_tokens=4, token_healing=True, hooks=[first_a_space])
        assert next(stream).text == ""
        stream.close()
        assert seq.text == prompt
    with model.sequence(prompt) as seq:  # closed before its first chunk (its body never ran)
        seq.stream(max_tokens=4, token_healing=True).close()
        assert seq.text == prompt and seq.tokens == model.tokenize(prompt)
    with model.sequence(prompt) as seq:  # a run never stepped: dropped, or superseded
        run = seq.run(max_tokens=4, token_healing=True)
        del run
        assert seq.text == prompt
        held = seq.run(max_tokens=4, token_healing=True)
        after = seq.generate(max_tokens=3)  # goes on from the whole prompt
        assert seq.text == prompt + after
        with pytest.raises(lcgen.RewindError, match="changed outside this generation"):
            held.step()
    with model.sequence(prompt) as seq:  # a healing run superseded by another healing one
        run = seq.run(max_tokens=4, token_healing=True)
        run = seq.run(max_tokens=4, token_healing=True)  # the first, dropped, leaves it be
        assert seq.text == "The capital of"  # the second run's healing holds
        out = ""
        while not run.is_done:  # (the first run's finalizer put its token back: RewindError)
            out += run.step().text
        assert seq.text == prompt + out
    with model.sequence(prompt) as seq:
        seq.stream(max_tokens=4, token_healing=True)  # dropped at once, never started
        assert seq.text == prompt
    with model.sequence(prompt) as seq:
        outliving = seq.stream(max_tokens=4, token_healing=True, hooks=[first_a_space])
        next(outliving)
    outliving.close()  # its sequence closed before it: nothing to put back, no error
    # Batches: each generation's sequence ends with its own tokens until the batch is done.
    for options in cases[1:]:
        texts = model.generate([prompt, "Hello wor"], token_healing=True, **options)
        assert [str(t) for t in texts] == ["", ""]


@pytest.mark.parametrize(
    "options",
    [
        {"stop_tokens": [10**6]},
        {"logit_bias": {10**6: 1.0}},
        {"grammar": lcgen.Grammar("root ::= <no-such-token>")},
    ],
)
def test_a_refused_call_with_token_healing_keeps_the_prompt(
    model: lcgen.Model, options: dict[str, object]
) -> None:
    """The run took the prompt's last token away for healing before the vocabulary refused
    an option: each corrected retry then lost one more prompt token."""
    with model.sequence("The capital of Fra") as seq:
        tokens = list(seq.tokens)
        with pytest.raises((ValueError, lcgen.GrammarError)):
            seq.generate(max_tokens=4, token_healing=True, **options)  # type: ignore[arg-type]
        assert seq.tokens == tokens and seq.text == "The capital of Fra"
        assert seq.stats.rewinds == 0
        assert seq.generate(max_tokens=4, token_healing=True) == model.generate(
            "The capital of Fra", max_tokens=4, token_healing=True
        )


def test_logprobs(model: lcgen.Model) -> None:
    chunks = list(model.stream("The sky is", max_tokens=6, logprobs=3))
    steps: list[lcgen.Step] = []
    model.generate("The sky is", max_tokens=6, hooks=[steps.append])  # type: ignore[list-item]
    rows = [np.array(step.logits, dtype=np.float64) for step in steps]
    for chunk, row in zip(chunks, rows, strict=True):
        log_softmax = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        (token,) = chunk.tokens
        assert chunk.logprob == pytest.approx(log_softmax[token], abs=1e-5)
        assert [t for t, _, _ in chunk.top_logprobs] == list(np.argsort(-log_softmax)[:3])
        assert chunk.top_logprobs[0][0] == token  # greedy
        assert [lp for _, _, lp in chunk.top_logprobs] == sorted(
            (lp for _, _, lp in chunk.top_logprobs), reverse=True
        )
    only = next(iter(model.stream("The sky is", max_tokens=1, logprobs=0)))
    assert only.logprob is not None and only.top_logprobs == ()
    assert next(iter(model.stream("The sky is", max_tokens=1))).logprob is None
    with pytest.raises(ValueError, match="logprobs must be"):
        model.generate("x", logprobs=-1)


def test_generator_fed_by_an_independent_decode_reproduces_stream(
    model: lcgen.Model, model_path: Path
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    options = {"max_tokens": 24, "temperature": 0.8, "seed": 5, "stop": ["\n\n"], "logprobs": 2}
    prompt = "Write a haiku about rain:"
    expected = list(model.stream(prompt, **options))  # type: ignore[arg-type]
    llm = llama_cpp_python(model, model_path, n_ctx=512, flash_attn=True)
    llm.eval(llm.tokenize(prompt.encode()))
    gen = lcgen.Generator(model, **options)  # type: ignore[arg-type]
    chunks = []
    while not gen.is_done:
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        chunk = gen.step(np.ctypeslib.as_array(row, shape=(model.n_vocab,)))
        chunks.append(chunk)
        llm.eval(list(chunk.tokens))
    llm.close()
    assert expected[-1].stats is not None  # the sequence's stream reports its cost
    assert chunks == [*expected[:-1], dataclasses.replace(expected[-1], stats=None)]


def test_rewinding_into_held_stop_text_regenerates_the_same(model: lcgen.Model) -> None:
    stop = [" 7, 8, 9"]
    with model.sequence("1, 2, 3, 4,", seed=1) as seq:
        run = seq.run(max_tokens=20, stop=stop)
        chunks: list[lcgen.Chunk] = []
        saved = None
        while not run.is_done:
            chunks.append(run.step())
            if run.generator.text_state.held_text and saved is None:
                saved = (run.checkpoint(), len(chunks))
        assert saved is not None, "no step held text back"
        cp, n = saved
        first = chunks[n:]
        run.rewind(cp)
        again = []
        while not run.is_done:
            again.append(run.step())
        assert [dataclasses.replace(c, stats=None) for c in again] == [
            dataclasses.replace(c, stats=None) for c in first
        ]
        assert again[-1].stats is not None and again[-1].stats.rewinds == 1
        assert "".join(c.text for c in chunks) == " 5, 6,"
        assert chunks[-1].stop == stop[0]


def test_a_stream_of_no_tokens_still_ends_with_a_last_chunk(model: lcgen.Model) -> None:
    chunks = list(model.stream("Hello", max_tokens=0))
    assert len(chunks) == 1 and chunks[0].text == "" and chunks[0].tokens == ()
    assert chunks[0].finish_reason == "length" and chunks[0].stats is not None
    assert chunks[0].stats.tokens == 0
    assert model.generate("Hello", max_tokens=0).finish_reason == "length"
