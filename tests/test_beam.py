"""Beam search on the real bundled model: width 1 is greedy, width 4 scores at least as well."""

from __future__ import annotations

import contextlib
import gc
import math
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lcgen
from lcgen import generate
from lcgen.continuous import continuous

PROMPTS = ["The capital of France is", "My favourite food is"]


@pytest.fixture(autouse=True)
def _no_slot_leaks(model: lcgen.Model) -> Iterator[None]:
    yield
    gc.collect()
    assert model.cache.stats.live == 0


def no_end(model: lcgen.Model) -> dict[int, float]:
    """A ban on the end-of-generation tokens: every sequence gets max_tokens tokens."""
    return {tok: -math.inf for tok in range(model.n_vocab) if model.is_eog(tok)}


def test_width_one_is_greedy(model: lcgen.Model) -> None:
    greedy = continuous(generate.text(model, max_tokens=12))
    beam = continuous(generate.text(model, max_tokens=12, beams=1))
    for prompt in PROMPTS:
        model.cache.clear()  # each from nothing: the same cells, to the last bit
        g = greedy(prompt)
        model.cache.clear()
        with beam(prompt) as b:
            assert b.shape == (1, 1)
            assert b.tokens == g.tokens
            assert b.weights[0, 0] == pytest.approx(g.weights[0, 0], abs=1e-9)


def test_width_four_scores_at_least_greedy(model: lcgen.Model) -> None:
    bans = no_end(model)
    greedy = continuous(generate.text(model, max_tokens=10, logit_bias=bans))
    beam = continuous(
        generate.text(model, max_tokens=10, logit_bias=bans, beams=4, length_penalty=0.0)
    )
    with beam(PROMPTS) as beams:  # both prompts searched together: 8 live sequences
        assert beams.shape == (2, 4)
        found = beams.weights
        tokens = beams.tokens
    for b, prompt in enumerate(PROMPTS):
        n_prompt = len(model.tokenize(prompt))
        assert all(len(t) == n_prompt + 10 for t in tokens[b])
        assert len({tuple(t) for t in tokens[b]}) == 4  # four different beams
        assert list(found[b]) == sorted(found[b], reverse=True)  # ranked (no length penalty)
        with greedy(prompt) as g:
            # The same tokens scored in another KV layout may differ in the last bits.
            assert found[b, 0] >= g.weights[0, 0] - 1e-3


def test_beams_up_to_the_end_of_the_context_share_it(model_path: Path) -> None:
    # max_tokens=None: each of k beams may take a k-th of the room the prompt leaves (they
    # all had the whole room, and together ran out of cells: ContextFullError).
    with lcgen.Model(model_path, n_ctx=256) as small:
        n_prompt = len(small.tokenize(PROMPTS[0]))
        for width in (2, 4):
            search = continuous(
                generate.text(small, max_tokens=None, logit_bias=no_end(small), beams=width)
            )
            with search(PROMPTS[0]) as beams:
                lengths = {len(t) - n_prompt for t in beams.tokens[0]}
            assert lengths == {(256 - n_prompt) // width}
        long_prompt = small.detokenize(small.tokenize("word " * 300)[: 256 - 3])
        n_long = len(small.tokenize(long_prompt))
        with pytest.raises(lcgen.ContextFullError, match=f"leave {256 - n_long} of .* 4 beams"):
            continuous(generate.text(small, max_tokens=None, beams=4))(long_prompt)
        assert small.cache.stats.live == 0


def test_length_penalty_ranks_finished_beams(model: lcgen.Model) -> None:
    beam = continuous(generate.text(model, max_tokens=12, beams=3, length_penalty=1.0))
    with beam(PROMPTS[0]) as beams:
        n_prompt = len(model.tokenize(PROMPTS[0]))
        ranks = [
            w / max(len(t) - n_prompt, 1)
            for w, t in zip(beams.weights[0], beams.tokens[0], strict=True)
        ]
        assert ranks == sorted(ranks, reverse=True)
        assert all(text.startswith(PROMPTS[0]) for text in beams)


def test_beams_with_a_constraint(model: lcgen.Model) -> None:
    pick = continuous(generate.choice(model, [" Paris", " Lyon", " Rome"], beams=3))
    with pick(PROMPTS[0]) as picked:
        endings = [text[len(PROMPTS[0]) :] for text in picked]
        # Every beam spells a choice, each a different one (the same words in other tokens
        # take no beam of their own)
        assert sorted(endings) == [" Lyon", " Paris", " Rome"]
        assert endings[0] == " Paris"  # the most likely, first
    # more beams than texts: one beam per text
    with continuous(generate.choice(model, [" happy", " sad"], beams=5))("I feel") as feel:
        assert sorted(feel.texts[0]) == ["I feel happy", "I feel sad"]
    # max_tokens=0: the prompt back, as without beams
    with continuous(generate.text(model, max_tokens=0, beams=3))("Hi") as same:
        assert same.texts == [["Hi"]]


@pytest.mark.parametrize("beams", [1, 2])
def test_beams_under_a_constraint_that_forces_text(model: lcgen.Model, beams: int) -> None:
    # The start forced the text ahead (fast-forward) into the generator, not the beams' texts:
    # " Marseille" came back as " Mar", weight 0, no error.
    prompt = "The second city of France is"
    for option in [" Marseille", " Toulouse, in the south"]:
        with continuous(generate.choice(model, [option], beams=beams))(prompt) as picked:
            assert picked.texts == [[prompt + option]] and picked.weights[0][0] < 0
    with continuous(generate.regex(model, r" Lyon-Villeurbanne", beams=beams))(prompt) as lyon:
        assert lyon.texts == [[prompt + " Lyon-Villeurbanne"]]


def test_beams_look_past_candidates_that_all_finish(model: lcgen.Model) -> None:
    # Every one of the first 2 * width candidates hits the stop string (a space): the search
    # kept none going and returned the prompt alone.
    prompt = "The capital of France is"
    with continuous(generate.text(model, max_tokens=5, beams=4, stop=[" "]))(prompt) as found:
        texts = found.texts[0]
        assert len(texts) == 4 and len(set(texts)) == 4
        assert prompt in texts  # a space first: the stop string, at once
        assert all(" " not in text[len(prompt) :] for text in texts)


def test_beam_arguments(model: lcgen.Model) -> None:
    with pytest.raises(ValueError, match="n_seq_max=32"):
        generate.text(model, beams=33)
    with pytest.raises(ValueError, match=r"temperature=0\.7"):
        generate.text(model, beams=2, temperature=0.7)
    # truncation settings would be ignored: refused, named (their defaults pass)
    with pytest.raises(ValueError, match=r"top_k=1, min_p=0\.9"):
        generate.text(model, beams=2, top_k=1, min_p=0.9)
    with pytest.raises(ValueError, match=r"top_p=0\.01"):
        generate.text(model, beams=2, top_p=0.01)
    generate.text(model, beams=2, top_k=40, top_p=0.95, min_p=0.05)
    with pytest.raises(ValueError, match="beams must be"):
        generate.text(model, beams=0)
    with pytest.raises(ValueError, match=r"\['presence_penalty'\]"):
        generate.text(model, beams=2, presence_penalty=0.5)
    with pytest.raises(ValueError, match=r"\['repeat_penalty', 'frequency_penalty'\]"):
        generate.text(model, beams=2, repeat_penalty=1.2, frequency_penalty=0.5)
    with pytest.raises(ValueError, match="num_samples=2"):
        continuous(generate.text(model, beams=2, max_tokens=2))("x", num_samples=2)
    # a state of several samples: one search per element is not what beams do (width 1 kept
    # the first sample of each and dropped the others)
    samples = continuous(generate.text(model, max_tokens=2, temperature=0.8))(
        PROMPTS, num_samples=3, seed=7
    )
    for width in (1, 2):
        with pytest.raises(lcgen.SampleMismatchError, match=r"\(2, 3\)"):
            continuous(generate.text(model, max_tokens=2, beams=width))(samples)


@pytest.mark.parametrize("beams", [None, 1, 3])
def test_no_token_under_a_constraint_is_incomplete_with_beams_too(
    model: lcgen.Model, beams: int | None
) -> None:
    spec = generate.choice(model, [" Paris", " Lyon"], max_tokens=0, beams=beams)
    with pytest.raises(lcgen.IncompleteOutputError) as cut:
        continuous(spec)(PROMPTS[0])
    assert cut.value.state is not None and list(cut.value.state) == [PROMPTS[0]]


def test_a_batch_keeps_a_rectangle_of_complete_beams(model: lcgen.Model) -> None:
    # "hell" + "o" and "hello" are the same text: prompts end with different numbers of
    # distinct beams, and every element keeps as many as the one with fewest (this raised
    # "a state needs a non-empty rectangle").
    prompts = ["The answer is ", "Pick one: ", "x", "Name: ", "He said "]
    pattern = r"(hello|hell|help) world"
    searched = continuous(generate.regex(model, pattern, beams=3))
    alone = [len(searched(p).texts[0]) for p in prompts]
    with searched(prompts) as beams:
        assert beams.shape == (len(prompts), min(alone))
        for prompt, row in zip(prompts, beams.texts, strict=True):
            endings = [text[len(prompt) :] for text in row]
            assert len(set(endings)) == len(endings)
            assert all(e in ("hello world", "hell world", "help world") for e in endings)
    # A beam the token budget cut short is dropped where others are complete.
    # (This raised IncompleteOutputError: the third beam had 3 tokens of the long option.)
    options = [" Paris", " London", " the city of lights on the river Seine"]
    pick = continuous(generate.choice(model, options, max_tokens=3, beams=3))
    with pick(PROMPTS[0]) as picked:
        assert [text[len(PROMPTS[0]) :] for text in picked] == [" Paris", " London"]


def test_a_stop_string_that_never_occurs_changes_no_beam(model: lcgen.Model) -> None:
    # Text held back in case it starts the stop string made " around" and " 1" look like the
    # same (empty) text, and the worse beam was dropped.
    found = []
    for stop in (None, [" around the world"]):
        model.cache.clear()  # each from nothing: the same cells
        with continuous(generate.text(model, max_tokens=6, beams=3, stop=stop))(
            "Water boils at"
        ) as beams:
            found.append((beams.texts, beams.tokens))
    assert found[0] == found[1]
    assert len(set(found[0][0][0])) == 3


def test_beam_searches_in_several_threads_take_turns() -> None:
    # Each search holds slots while it forks more: two threads' searches each waited for the
    # other's slots forever. Run in a child, so that a hang fails the test instead of CI.
    program = textwrap.dedent("""
        import threading, lcgen
        from lcgen import continuous, generate
        model = lcgen.load("smollm2-135m", n_threads=1, n_seq_max=4)
        beam = continuous(generate.text(model, max_tokens=8, beams=4))
        out = {}
        def work(i):
            out[i] = beam(f"Prompt {i % 2}: The capital of France is").texts
        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 3 and model.cache.stats.live == 0
        for i, texts in out.items():
            assert 1 <= len(texts[0]) <= 4, texts  # distinct texts: maybe fewer than 4
            assert all(t.startswith(f"Prompt {i % 2}: The capital") for t in texts[0])
        print("PASS")
    """)
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and "PASS" in done.stdout, done.stderr[-3000:]


def test_a_beam_is_cut_only_where_its_own_output_stopped_short(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finished beams were flagged cut in a dict by ``id(element)``: a cut beam that dropped
    out left its flag to the later beam Python gave its id, so complete beams were dropped, or
    raised IncompleteOutputError, at random (9 of 48 searches)."""
    import re

    from lcgen.continuous import beam as beam_module
    from lcgen.continuous.elements import text_of

    pattern = r" [a-z]+( [a-z]+){0,5}\."
    seen: list[tuple[str, bool]] = []
    search = beam_module.search

    def watched(spec: Any, roots: Any) -> Any:
        results = search(spec, roots)
        seen.extend(
            (text_of(model, e.tokens), cut is not None) for row in results for e, cut in row
        )
        return results

    monkeypatch.setattr(beam_module, "search", watched)
    prompts = ["The capital of France is", "My favourite animal is", "Yesterday I went to"]
    for stop, width in [([" the"], 4), ([" a", " i"], 3), ([" a", " i"], 4)]:
        spec = generate.regex(model, pattern, beams=width, max_tokens=14, stop=stop)
        for prompt in prompts:
            with contextlib.suppress(lcgen.IncompleteOutputError):
                continuous(spec)(prompt)
            for text, cut in seen:
                assert cut == (re.fullmatch(pattern, text[len(prompt) :]) is None), text
            assert seen  # (the searches ran through the watched function)
            seen.clear()
