"""Log-probabilities on what generation returns: per token on ``Text.logprobs`` and on each
``Chunk``, with the texts of the token and of the most likely alternatives."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import lcgen
from lcgen.decoding.results import TokenLogprob, TopLogprob

PROMPT = "The capital of France is"
JAPANESE = [{"role": "user", "content": "Say hello in Japanese."}]


def _joined(entries: tuple[TokenLogprob, ...] | None) -> str:
    assert entries is not None
    return "".join(e.text for e in entries)


def test_text_carries_the_logprobs_the_stream_carries(cold_model: lcgen.Model) -> None:
    text = cold_model.generate(PROMPT, max_tokens=16, logprobs=3)
    chunks = list(cold_model.stream(PROMPT, max_tokens=16, logprobs=3))
    from_chunks = tuple(e for c in chunks for e in c.logprobs)
    assert text.logprobs == from_chunks
    assert text.logprobs is not None and len(text.logprobs) == len(text.tokens) == 16
    assert tuple(e.token for e in text.logprobs) == text.tokens
    for chunk in chunks:  # the chunk's own fields agree with its one entry
        (entry,) = chunk.logprobs
        assert (chunk.logprob, chunk.top_logprobs) == (entry.logprob, entry.top)


def test_greedy_picks_the_best_of_the_top_n(model: lcgen.Model) -> None:
    text = model.generate(PROMPT, max_tokens=12, logprobs=4)
    assert text.logprobs is not None
    for entry in text.logprobs:
        assert len(entry.top) == 4 and entry.logprob <= 0
        assert entry.logprob == max(top.logprob for top in entry.top)
        assert entry.top[0].token == entry.token
        assert [t.logprob for t in entry.top] == sorted(
            (t.logprob for t in entry.top), reverse=True
        )
        assert sum(math.exp(t.logprob) for t in entry.top) <= 1 + 1e-9
        # a whole-character piece reads the same as the chosen token's text
        assert entry.top[0].text == entry.text
        token, text_, logprob = entry.top[1]  # a plain (token, text, logprob) tuple
        assert isinstance(token, int) and isinstance(text_, str) and logprob <= entry.logprob


def test_texts_join_to_the_output_text(model: lcgen.Model) -> None:
    text = model.generate(PROMPT, max_tokens=20, logprobs=1)
    assert _joined(text.logprobs) == text
    reply = model.chat(JAPANESE, max_tokens=16, logprobs=2)  # characters split across tokens
    assert _joined(reply.logprobs) == reply
    assert any(ord(ch) > 0x3000 for ch in reply), reply  # measured: the reply is Japanese
    assert any(e.text == "" for e in reply.logprobs or ())


def test_a_stop_string_cuts_the_text_not_the_tokens(model: lcgen.Model) -> None:
    full = model.generate(PROMPT, max_tokens=20)
    stop = full.split()[1]  # a word inside the output
    text = model.generate(PROMPT, max_tokens=20, logprobs=2, stop=stop)
    assert text.stop == stop and text.logprobs is not None
    assert len(text.logprobs) == len(text.tokens)
    assert _joined(text.logprobs).startswith(text + stop)


def test_an_end_token_adds_no_text(model: lcgen.Model) -> None:
    plain = model.generate(PROMPT, max_tokens=2, logprobs=0)
    assert plain.logprobs is not None
    end = plain.logprobs[1].token  # treat the second token as a stop token
    text = model.generate(PROMPT, max_tokens=8, logprobs=3, stop_tokens=[end])
    assert text.logprobs is not None and text.logprobs[-1].token == end
    assert text.logprobs[-1].text == "" and text.logprobs[-1].top[0].text != ""
    assert _joined(text.logprobs) == text
    assert all(e.top == () for e in plain.logprobs)  # logprobs=0: no alternatives


def test_chat_stream_and_batch_carry_them(model: lcgen.Model) -> None:
    for out in model.generate(["The sky is", "Water boils at"], max_tokens=6, logprobs=2):
        assert out.logprobs is not None and len(out.logprobs) == len(out.tokens)
        assert _joined(out.logprobs) == out
    chunks = list(model.chat_stream(JAPANESE, max_tokens=6, logprobs=2))
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)
    assert all(len(t) == 3 for c in chunks for t in c.top_logprobs)


def test_without_logprobs_there_are_none(model: lcgen.Model) -> None:
    assert model.generate(PROMPT, max_tokens=3).logprobs is None
    # asked for, with no token kept: none, not None
    assert model.generate(PROMPT, max_tokens=0, logprobs=2).logprobs == ()
    rejected = model.generate(
        PROMPT, max_tokens=3, logprobs=2, hooks=[lambda step: lcgen.Rewind(1)], max_retries=1
    )
    assert rejected.finish_reason == "retries" and rejected.logprobs == ()
    assert model.generate([PROMPT, PROMPT], max_tokens=0, logprobs=1)[1].logprobs == ()
    assert all(c.logprobs == () for c in model.stream(PROMPT, max_tokens=3))


def test_backtracking_runs_carry_them_per_token(model: lcgen.Model) -> None:
    """Hooks, validators and banned phrases release text several tokens at a time: each chunk
    carries one entry per token it releases, and the kept tokens' entries are those of the
    positions they were sampled at (a rewound token leaves none behind)."""
    plain = model.generate(PROMPT, max_tokens=10, logprobs=2)
    passing = model.generate(PROMPT, max_tokens=10, logprobs=2, hooks=[lambda step: None])
    assert passing.logprobs == plain.logprobs  # a hook that accepts everything changes nothing
    banned = model.generate(PROMPT, max_tokens=10, logprobs=2, banned=["Paris"])
    assert "Paris" in plain and "Paris" not in banned and banned.stats.rewinds >= 1
    assert banned.logprobs is not None and len(banned.logprobs) == len(banned.tokens)
    assert tuple(e.token for e in banned.logprobs) == banned.tokens
    assert _joined(banned.logprobs) == banned
    kept = 0  # the tokens before the rewound one are the plain run's, with its entries
    while banned.tokens[kept] == plain.tokens[kept]:
        kept += 1
    assert plain.logprobs is not None
    assert banned.logprobs[:kept] == plain.logprobs[:kept]
    # With a hook the stream holds back the last `lookback` tokens: they come out together.
    chunks = list(
        model.stream(PROMPT, max_tokens=10, logprobs=2, banned=["Paris"], hooks=[lambda s: None])
    )
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)
    assert any(len(c.tokens) > 1 for c in chunks)
    for chunk in chunks:
        if chunk.tokens:
            assert chunk.logprob == pytest.approx(math.fsum(e.logprob for e in chunk.logprobs))
    assert tuple(e for c in chunks for e in c.logprobs) == banned.logprobs


@pytest.mark.parametrize(
    "options",
    [{}, {"banned": ["zebra"]}, {"hooks": [lambda step: None]}, {"speculate": "ngram"}],
    ids=["plain", "banned", "hook", "speculate"],
)
def test_a_chunk_of_one_token_carries_its_top_logprobs(
    model: lcgen.Model, options: dict[str, object]
) -> None:
    """Backtracking and speculative runs' chunks carried none (their entries did)."""
    chunks = list(model.stream(PROMPT * 3, max_tokens=12, logprobs=2, **options))  # type: ignore[call-overload]
    one = [c for c in chunks if len(c.tokens) == 1]
    assert one or "hooks" in options  # (a hook's lookback releases tokens several at once)
    assert all(len(c.top_logprobs) == 2 for c in one)
    assert all(c.top_logprobs == c.logprobs[0].top for c in one)
    assert all(c.top_logprobs == () for c in chunks if len(c.tokens) > 1)


def test_a_token_put_in_by_a_hook_has_its_logprob(model: lcgen.Model) -> None:
    plain = model.generate(PROMPT, max_tokens=4, logprobs=3)
    assert plain.logprobs is not None
    second_best = plain.logprobs[0].top[1]

    def override_first(step: lcgen.Step) -> lcgen.Override | None:
        return lcgen.Override(second_best.token) if step.index == 0 else None

    text = model.generate(PROMPT, max_tokens=4, logprobs=3, hooks=[override_first])
    assert text.logprobs is not None and text.tokens[0] == second_best.token
    first = text.logprobs[0]
    assert first.logprob == pytest.approx(second_best.logprob, abs=1e-5)
    assert first.top == plain.logprobs[0].top  # the same position, the same alternatives
    assert _joined(text.logprobs) == text


def test_a_validator_rewind_keeps_them_aligned(model: lcgen.Model) -> None:
    seen: list[int] = []

    def no_commas(text: str) -> lcgen.Rewind | None:
        seen.append(len(text))
        return lcgen.Rewind(1, ban=True) if "," in text else None

    text = model.generate("List three colors:", max_tokens=12, logprobs=1, validators=[no_commas])
    assert "," not in text and text.logprobs is not None
    assert len(text.logprobs) == len(text.tokens) and _joined(text.logprobs) == text


def _one_hot(model: lcgen.Model, token: int) -> np.ndarray:
    logits = np.zeros(model.n_vocab, dtype=np.float32)
    logits[token] = 30.0
    return logits


@pytest.mark.parametrize(
    ("n_bytes", "texts"),
    [(3, ["", "", "日"]), (2, ["", "\ufffd"])],  # the whole character; cut by max_tokens
)
def test_a_split_character_belongs_to_its_last_token(
    model: lcgen.Model, n_bytes: int, texts: list[str]
) -> None:
    tokens = [model.vocab.byte_tokens[b] for b in "日".encode()[:n_bytes]]
    gen = lcgen.Generator(model, max_tokens=n_bytes, logprobs=2)
    chunks = [gen.step(_one_hot(model, token)) for token in tokens]
    assert [c.logprobs[0].text for c in chunks] == texts
    assert "".join(c.text for c in chunks) == "".join(texts)
    for chunk, token in zip(chunks, tokens, strict=True):
        top = chunk.logprobs[0].top
        assert isinstance(top[0], TopLogprob) and top[0].token == token
        assert top[0].text == "\ufffd"  # one byte of a character, read alone


def test_a_split_character_at_a_retries_end_belongs_to_its_last_token(
    model: lcgen.Model,
) -> None:
    first_byte = model.vocab.byte_tokens["日".encode()[0]]

    def hook(step: lcgen.Step) -> lcgen.Override | lcgen.Resample | None:
        if step.index == 0 and step.token != first_byte:
            return lcgen.Override(first_byte)
        return lcgen.Resample(exclude=[step.token]) if step.index == 1 else None

    options: dict[str, Any] = {"max_tokens": 4, "logprobs": 1, "hooks": [hook], "max_retries": 2}
    text = model.generate(PROMPT, **options)
    assert text.finish_reason == "retries" and text.tokens == (first_byte,)
    assert text.logprobs is not None
    assert "".join(e.text for e in text.logprobs) == str(text) == "\ufffd"
    chunks = list(model.stream(PROMPT, **options))
    assert [e.text for c in chunks for e in c.logprobs] == [c.text for c in chunks if c.text]


# scoring a prompt ---------------------------------------------------------------------------
# A scored prompt is decoded in batches of up to 64 tokens, a generation one token a step, and
# cached cells sit where the pool had room: logits move between batch shapes and cell layouts
# (measured here: up to 0.28 in log-probability, 0.03 on average), so comparisons across them
# allow this much; the same shapes on an empty cache give the same bits.
SHAPE_TOLERANCE = 0.35
PASSAGE = "The capital of France is Paris. The capital of Germany is Berlin. " * 6


def test_prompt_logprobs_score_every_token_after_the_first(model: lcgen.Model) -> None:
    tokens = model.tokenize(PASSAGE)
    decoded = model.context.n_decoded
    scored = model.prompt_logprobs(PASSAGE, top=3)
    assert model.context.n_decoded - decoded == len(tokens)  # each token decoded once
    assert [e.token for e in scored] == tokens[1:]
    assert "".join(e.text for e in scored) == model.detokenize(tokens[1:])
    for entry in scored:
        assert entry.logprob <= 0 and len(entry.top) == 3
        assert [t.logprob for t in entry.top] == sorted(
            (t.logprob for t in entry.top), reverse=True
        )
        assert entry.top[0].logprob >= entry.logprob
    # The repeated sentences are predictable the second time round.
    half = len(scored) // 2
    assert sum(e.logprob for e in scored[half:]) > sum(e.logprob for e in scored[:half])
    again = model.prompt_logprobs(tokens)  # ids or text alike
    assert [e.token for e in again] == tokens[1:]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(again, scored, strict=True)) <= (
        SHAPE_TOLERANCE
    )


@pytest.mark.parametrize("prompt", ["日本語のテキスト", "🙂🙂 ok"])
def test_prompt_logprobs_of_a_first_character_that_spans_tokens(
    model: lcgen.Model, prompt: str
) -> None:
    """The token that ends the character the first token begins has it as its text (it was
    U+FFFD: the decoder never saw the first token)."""
    tokens = model.tokenize(prompt)
    with pytest.raises(UnicodeDecodeError):
        model.token_piece(tokens[0]).decode()
    joined = "".join(e.text for e in model.prompt_logprobs(prompt))
    assert joined == prompt  # (the first token completes no character)


def test_prompt_logprobs_agree_with_a_generation_and_across_chunks(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = model.tokenize("The capital of France is")
    out = model.generate("The capital of France is", max_tokens=12, temperature=0, logprobs=2)
    scored = model.prompt_logprobs(prompt + list(out.tokens), top=2)[-len(out.tokens) :]
    for made, score in zip(out.logprobs or [], scored, strict=True):
        assert made.token == score.token
        assert abs(made.logprob - score.logprob) <= SHAPE_TOLERANCE
        if made.top[0].logprob - made.top[1].logprob > SHAPE_TOLERANCE:
            assert score.top[0].token == made.token  # greedy's choice, where it is clear
    whole = model.prompt_logprobs(PASSAGE)
    monkeypatch.setattr(lcgen.model, "_SCORE_CHUNK", 5)  # chunk boundaries every 5 tokens
    chunked = model.prompt_logprobs(PASSAGE)
    assert [e.token for e in chunked] == [e.token for e in whole]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(whole, chunked, strict=True)) <= (
        SHAPE_TOLERANCE
    )


def test_prompt_logprobs_repeat_bit_for_bit_whatever_the_small_chunks(
    cold_model: lcgen.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = cold_model.prompt_logprobs(PASSAGE, top=2)
    assert cold_model.prompt_logprobs(PASSAGE, top=2) == first
    # Batches of 2 to 6 tokens share llama.cpp's kernels with single tokens: chunks of 5 and
    # of 1 give the same bits, each chunk's first token scored with the row the last left.
    monkeypatch.setattr(lcgen.model, "_SCORE_CHUNK", 5)
    fives = cold_model.prompt_logprobs(PASSAGE, top=2)
    monkeypatch.setattr(lcgen.model, "_SCORE_CHUNK", 1)
    assert cold_model.prompt_logprobs(PASSAGE, top=2) == fives


def test_prompt_logprobs_refuse_what_cannot_be_scored(model: lcgen.Model) -> None:
    with pytest.raises(ValueError, match="empty"):
        model.prompt_logprobs([])
    with pytest.raises(ValueError, match="top"):
        model.prompt_logprobs("hi there", top=-1)
    with pytest.raises(ValueError):
        model.prompt_logprobs([1, model.n_vocab])
    with pytest.raises(lcgen.ContextFullError, match=rf"context is {model.n_ctx}"):
        model.prompt_logprobs("word " * (model.n_ctx + 5))
    assert model.prompt_logprobs(model.tokenize("Hi")[:1]) == []


def test_logprobs_beside_a_parsed_schema_are_refused_not_lost(model: lcgen.Model) -> None:
    """generate and chat with ``schema=`` return the parsed value: the logprobs asked for were
    computed, then dropped with no word (a plain dict came back)."""
    city = {"type": "string", "maxLength": 12}
    schema = {"properties": {"city": city}, "required": ["city"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Name a city as JSON."}]
    calls = [
        lambda: model.generate(PROMPT, schema=schema, logprobs=1),
        lambda: model.generate([PROMPT, PROMPT], schema=schema, logprobs=0),
        lambda: model.chat(messages, schema=schema, logprobs=2),
    ]
    before = model.context.n_decoded
    for call in calls:
        with pytest.raises(ValueError, match=r"logprobs=\d with schema=: the result is the parsed"):
            call()
    assert model.context.n_decoded == before  # refused before decoding
    # the ways the message names keep them
    chunks = list(model.stream(PROMPT, schema=schema, logprobs=1, max_tokens=60))
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)
    grammar = lcgen.Grammar.from_json_schema(schema)
    text = model.generate(PROMPT, grammar=grammar, logprobs=1, max_tokens=60)
    assert text.logprobs is not None and len(text.logprobs) == len(text.tokens)
