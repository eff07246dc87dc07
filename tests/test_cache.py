"""The model keeps its KV cache: every call starts from the longest cached prefix.

Decode counts (the context's counter), not timings, prove what was reused; outputs are compared
with a model that has no cache (``cold_model``) within the stated exactness: the same tokens
wherever the top-2 margin is clear, bit-identical logits when the same chunking is replayed, and
an identical prompt repeats its first run bit for bit (the store kept the logits after it).
"""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import PriorCosts

import lcgen
from lcgen.registry import resolve
from lcgen.runtime import kvstore

FEW_SHOT = "".join(
    f"Q: What is {a} plus {b}?\nA: {a + b}.\n\n" for a, b in [(2, 3), (7, 5), (10, 4), (6, 6)]
)
NOISE = 1.5  # the most a logit moved between cached and cold runs (measured: 1.47)


def steps_of(
    model: lcgen.Model, prompt: str, n: int, **options: Any
) -> tuple[list[int], list[np.ndarray]]:
    """Tokens after ``prompt`` (greedy unless ``options`` say otherwise) and the logits each
    was chosen from."""
    rows: list[np.ndarray] = []

    def record(step: lcgen.Step) -> None:
        rows.append(step.logits)

    text = model.generate(prompt, max_tokens=n, hooks=[record], **options)
    return list(text.tokens), rows


def assert_same_where_clear(
    ours: list[int], cold: list[int], cold_rows: list[np.ndarray], what: str
) -> None:
    """Equal tokens up to the first difference, and that one only at a near-tie."""
    for i, (a, b) in enumerate(zip(ours, cold, strict=False)):
        if a != b:
            top2 = np.sort(cold_rows[i])[-2:]
            assert top2[1] - top2[0] < 2 * NOISE, f"{what}: token {i} differs at a clear margin"
            return
    assert len(ours) == len(cold), what


# reuse across calls --------------------------------------------------------------------------
def test_calls_sharing_a_prefix_decode_only_the_rest(model: lcgen.Model) -> None:
    n_shared = len(model.tokenize(FEW_SHOT))
    costs = []
    for a, b in [(3, 4), (8, 1), (5, 9), (2, 2), (9, 9)]:
        prompt = f"{FEW_SHOT}Q: What is {a} plus {b}?\nA:"
        before = model.context.n_decoded
        out = model.generate(prompt, max_tokens=4)
        costs.append((model.context.n_decoded - before, len(model.tokenize(prompt)), out))
    first, *later = costs
    assert first[0] == first[1] + 3  # the whole prompt, then 3 of the 4 new tokens
    for decoded, n_prompt, out in later:
        assert out.stats.decoded == decoded  # the call's own count agrees with the context's
        assert decoded <= n_prompt - n_shared + 1 + 3  # the new question, its last token, 3
    stats = model.cache.stats
    assert stats.hits >= 4 and stats.tokens_reused >= 4 * (n_shared - 1)


def test_a_cached_prefix_changes_speed_not_tokens(
    model: lcgen.Model, cold_model: lcgen.Model
) -> None:
    for a, b in [(3, 4), (8, 1), (5, 9)]:
        prompt = f"{FEW_SHOT}Q: What is {a} plus {b}?\nA:"
        ours, _ = steps_of(model, prompt, 12)
        cold, cold_rows = steps_of(cold_model, prompt, 12)
        assert_same_where_clear(ours, cold, cold_rows, prompt[-20:])
    assert model.cache.stats.hits >= 2 and cold_model.cache.stats.hits == 0


def test_the_same_chunking_replayed_gives_bit_identical_logits(
    model: lcgen.Model, cold_model: lcgen.Model
) -> None:
    """A call on a prompt whose cells are cached but for the last token's logits (a longer
    prompt was decoded before) decodes the last token alone, then one token a step. A cold run
    that decodes in the same chunks gives the same logits to the bit."""
    prompt = "The history of the printing press begins"
    model.generate(prompt + " in", max_tokens=6)
    assert model.cache.cached(model.tokenize(prompt)) == len(model.tokenize(prompt)) - 1
    cached, cached_rows = steps_of(model, prompt, 10)
    with cold_model.sequence(prompt) as seq:
        seq.generate(max_tokens=1)  # the prompt in one chunk
        seq.rewind(1)  # keep its cells but the last: the last token is decoded alone next
        rows: list[np.ndarray] = []
        replayed = seq.generate(max_tokens=10, hooks=[lambda s: rows.append(s.logits)])
    assert cached == list(replayed.tokens)
    for a, b in zip(cached_rows, rows, strict=True):
        assert np.array_equal(a, b)


# the logits after a prompt ---------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_an_identical_prompt_starts_from_its_first_logits(
    model: lcgen.Model, options: dict[str, Any]
) -> None:
    """The store keeps the logits after a prompt: a call on the same prompt decodes nothing
    before its first token and samples it from the same logits, bit for bit; the tokens after
    are decoded as in the first call (greedy: the same wherever the top-2 margin is clear)."""
    prompt = f"A list of the tallest mountains on each continent ({len(options)}):"
    n_prompt = len(model.tokenize(prompt))
    first, first_rows = steps_of(model, prompt, 12, **options)
    assert model.cache.cached(model.tokenize(prompt)) == n_prompt
    for _ in range(2):
        before = model.context.n_decoded
        again, again_rows = steps_of(model, prompt, 12, **options)
        assert model.context.n_decoded - before == len(again) - 1  # the prompt: nothing
        assert np.array_equal(again_rows[0], first_rows[0]) and again[0] == first[0]
        if not options:
            assert_same_where_clear(again, first, first_rows, prompt)


def test_kept_logits_serve_every_entry_point(model: lcgen.Model) -> None:
    """Sequences, batches, forks, streams and pinned prompts start from kept logits; a save
    keeps them too (the sequence stays as it was) and loads to the same continuation."""
    prompt = "Three facts about the planet Mars:"
    tokens = model.tokenize(prompt)
    first = str(model.generate(prompt, max_tokens=8))
    before = model.context.n_decoded
    batch = model.generate([prompt] * 3, max_tokens=8)
    assert [str(t) for t in batch] == [first] * 3
    assert model.context.n_decoded - before == 3 * 7
    assert "".join(c.text for c in model.stream(prompt, max_tokens=8)) == first
    with model.sequence(prompt) as seq:
        assert seq.n_decoded == len(seq) == len(tokens)  # nothing pending: the kept logits
        with seq.fork() as child:
            assert str(child.generate(max_tokens=8)) == first
        data = seq.to_bytes()
        assert seq.n_decoded == len(seq)
        assert str(seq.generate(max_tokens=8)) == first
    with lcgen.Sequence.from_bytes(model, data) as loaded:
        assert loaded.n_decoded == len(tokens)
        before = model.context.n_decoded
        assert str(loaded.generate(max_tokens=8)) == first
        assert model.context.n_decoded - before == 7
    pinned = "You are a geologist. Name a rock:"
    assert model.cache.pin(pinned) == len(model.tokenize(pinned))
    before = model.context.n_decoded
    out = model.generate(pinned, max_tokens=4)
    assert model.context.n_decoded - before == out.stats.decoded == len(out.tokens) - 1
    model.cache.unpin(pinned)


def test_kept_logits_go_with_their_cells(model: lcgen.Model) -> None:
    """Rewinding into the prompt, token healing or a new prompt sharing only a prefix decode
    again: the kept logits are used only while the cells and tokens they follow are."""
    prompt = "The capital cities of Europe include"
    tokens = model.tokenize(prompt)
    first = str(model.generate(prompt, max_tokens=6))
    with model.sequence(prompt) as seq:
        seq.rewind(0)  # nothing dropped: the kept logits still follow every cell
        assert seq.n_decoded == len(tokens)
        assert str(seq.generate(max_tokens=6)) == first
        seq.rewind(6)  # back to the end of the prompt: the kept logits again
        assert seq.n_decoded == len(tokens)
        seq.rewind(1)  # into the prompt: its new last token is pending
        assert seq.n_decoded == len(tokens) - 2
    healed = model.generate(prompt, max_tokens=6, token_healing=True)
    assert healed.stats.decoded >= len(healed.tokens)  # the healed prompt end is decoded
    spec = model.generate(prompt, max_tokens=6, speculate="ngram")
    assert str(spec) == first
    shorter = tokens[:-1]
    assert model.cache.cached(shorter) == len(shorter) - 1  # no logits kept there


def test_the_cache_off_decodes_every_prompt(cold_model: lcgen.Model) -> None:
    prompt = "Water boils at"
    before = cold_model.context.n_decoded
    cold_model.generate(prompt, max_tokens=2)
    cold_model.generate(prompt, max_tokens=2)
    assert cold_model.context.n_decoded - before == 2 * (len(cold_model.tokenize(prompt)) + 1)
    stats = cold_model.cache.stats
    assert stats.entries == 0 and stats.cells_held == 0


# chat ----------------------------------------------------------------------------------------
def test_a_chat_loop_decodes_only_each_new_turn(model: lcgen.Model) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    for turn in range(4):
        before = model.context.n_decoded
        reply = model.chat(messages, max_tokens=12)
        decoded = model.context.n_decoded - before
        history = len(model.chat_tokens(messages))
        if turn:
            # The new user message and its template tokens, a few retokenized ones at the end
            # of the last reply, and the reply's own tokens; never the history again.
            assert decoded < 40 + len(reply.tokens) < history
        messages += [
            {"role": "assistant", "content": str(reply)},
            {"role": "user", "content": "And another one?"},
        ]
    assert model.cache.stats.tokens_reused > 3 * 30


# eviction, pins, budgets -----------------------------------------------------------------------
def test_slots_evict_the_least_recently_used(model_path: Path) -> None:
    with lcgen.Model(model_path, n_ctx=1024, n_seq_max=2) as small:
        for p in ["A cat", "A dog", "A cow"]:
            small.generate(p + " is an animal that", max_tokens=3)
        stats = small.cache.stats
        assert stats.entries == 2 and stats.evictions == 1 and stats.live == 0
        before = small.context.n_decoded
        small.generate("A cow is an animal that", max_tokens=3)  # still cached: the newest
        assert small.context.n_decoded - before == 2  # the prompt's logits were kept too
        before = small.context.n_decoded
        small.generate("A cat is an animal that", max_tokens=3)  # evicted: decoded again
        n_prompt = len(small.tokenize("A cat is an animal that"))
        assert small.context.n_decoded - before == n_prompt - 1 + 2  # but "A", which is shared


def test_a_closed_models_cache_holds_nothing_and_keeps_its_counts(model_path: Path) -> None:
    small = lcgen.Model(model_path, n_ctx=512, n_seq_max=2)
    small.cache.pin("A cat is an animal that")
    small.generate("A dog is an animal that", max_tokens=3)
    before = small.cache.stats
    assert before.cells_held > 0 and before.entries == 2 and before.free_slots == 0
    pinned = small.tokenize("A cat is an animal that")

    def room() -> list[int]:
        cache = small.cache
        return [cache.cached(pinned), cache.free_cells(), cache.available_slots()]

    assert room()[0] == len(pinned) and room()[1] > 0 and room()[2] == 1  # the parked one's
    small.close()
    after = small.cache.stats  # the context and its cells are gone
    held = [after.cells_held, after.entries, after.pinned, after.live, after.free_slots]
    assert held == [0] * 5
    counts = [(s.hits, s.misses, s.tokens_decoded) for s in (before, after)]
    assert counts[0] == counts[1]
    # what it would reuse or have room for is a ClosedError, as everything but stats (the
    # ledger outlived the context: cached() and free_cells() answered from it)
    for ask in (
        lambda: small.cache.cached(pinned),
        small.cache.free_cells,
        small.cache.available_slots,
    ):
        with pytest.raises(lcgen.ClosedError):
            ask()


def test_a_cell_budget_below_the_working_set_evicts_and_pins_survive(model_path: Path) -> None:
    with lcgen.Model(model_path, n_ctx=1024, n_seq_max=8, cache=120) as small:
        assert small.cache.pin(FEW_SHOT) == len(small.tokenize(FEW_SHOT))
        for i in range(12):
            small.generate(f"Story {i}: once upon a time there was a", max_tokens=8)
            stats = small.cache.stats
            # Over the budget only while the pinned prefix alone is (it is never evicted).
            assert stats.cells_held <= max(120, len(small.tokenize(FEW_SHOT)) + 30)
        stats = small.cache.stats
        assert stats.evictions > 0 and stats.pinned == 1
        before = small.context.n_decoded
        question = small.tokenize(FEW_SHOT + "Q: What is 1 plus 1?\nA:")
        small.generate(FEW_SHOT + "Q: What is 1 plus 1?\nA:", max_tokens=2)
        # The pinned tokens the question starts with (its tokenization may differ at the seam).
        pinned = small.tokenize(FEW_SHOT)
        kept = next(i for i, (a, b) in enumerate(zip(question, pinned, strict=False)) if a != b)
        assert small.context.n_decoded - before == len(question) - kept + 1
        assert small.cache.pin(FEW_SHOT) == 0  # already pinned
        assert small.cache.unpin(FEW_SHOT) and not small.cache.unpin(FEW_SHOT)
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=2, cache=20) as tiny:
        tiny.cache.pin("The quick brown fox jumps over the lazy dog. " * 4)
        assert tiny.cache.stats.cells_held > 20  # the pinned prefix alone is over the budget
        assert tiny.cache.unpin("The quick brown fox jumps over the lazy dog. " * 4)
        assert tiny.cache.stats.cells_held <= 20  # at once, not at the next call


def test_a_full_memory_evicts_parked_prefixes_instead_of_failing(model_path: Path) -> None:
    with lcgen.Model(model_path, n_ctx=256, n_seq_max=4) as small:
        words = ["Red", "Blue", "Green", "Amber", "Violet", "Silver", "Gold", "Cyan"]
        for word in words:  # no shared prefix: each prompt needs its own cells
            out = small.generate(f"{word}. " + "The quick brown fox jumps. " * 12, max_tokens=8)
            assert out.stats.tokens == 8
        assert small.cache.stats.evictions > 0
        assert small.cache.stats.cells_held <= 256


def test_a_batch_whose_prompts_outgrow_the_memory_waits_for_cells(model_path: Path) -> None:
    """Four prompts of ~150 tokens, no shared prefix, in 256 cells and 8 slots: they cannot
    all be decoded at once; the scheduler steps those whose new cells fit and the rest wait."""
    words = ["Red", "Blue", "Green", "Amber"]
    prompts = [f"{word}. " + "The quick brown fox jumps. " * 24 for word in words]
    with lcgen.Model(model_path, n_ctx=256, n_seq_max=8) as small:
        assert all(len(small.tokenize(p)) > 128 for p in prompts)
        outs = small.generate(prompts, max_tokens=6)
        assert [o.stats.tokens for o in outs] == [6] * 4
        assert small.cache.stats.cells_held <= 256
        lone = []
        for p in prompts:
            small.cache.clear()
            lone.append(small.generate(p, max_tokens=6))
    assert [str(o) for o in outs] == [str(o) for o in lone]


def test_a_batch_whose_generations_outgrow_the_memory_pauses_the_youngest(
    model_path: Path,
) -> None:
    """Each element fits the context alone, but not all of them together up to max_tokens:
    every element needed a cell with none free, and the whole batch failed with
    ContextFullError. Now the youngest elements drop their own cells (their tokens stay),
    the oldest go on, and the paused ones decode their tokens again when cells are free."""
    ban = {i: -math.inf for i in range(17)}  # no end of generation: each runs to max_tokens
    prompts = ["The history of the Roman empire " * 12, "A recipe for banana bread, step " * 12]
    with lcgen.Model(model_path, n_ctx=256, n_threads=1) as small:
        for p in prompts:
            assert small.generate(p, max_tokens=140, logit_bias=ban).stats.tokens == 140
        small.cache.clear()
        outs = small.generate(prompts, max_tokens=140, logit_bias=ban)
        assert [o.stats.tokens for o in outs] == [140, 140]
        assert outs[0].stats.redecoded == 0 and outs[1].stats.redecoded > 0  # paused
        # the same batch again from the same cache state: the same pauses, the same tokens
        small.cache.clear()
        again = small.generate(prompts, max_tokens=140, logit_bias=ban)
        assert [o.tokens for o in again] == [o.tokens for o in outs]
        # copies of one prompt keep the cells they share when paused
        copies = small.generate(["hello " * 200] * 2, max_tokens=50)
        assert [o.stats.tokens for o in copies] == [50, 50]
        assert copies[1].stats.redecoded < 50  # its own tokens only, not the shared prompt
        state = lcgen.continuous(lcgen.generate.text(small, max_tokens=6))(
            "hello " * 249, num_samples=2
        )
        assert state.shape == (1, 2)
        assert small.cache.stats.live == 0


@pytest.mark.parametrize("cached", [True, False])
def test_a_prefix_the_prompts_of_a_batch_share_is_decoded_once(
    model: lcgen.Model, cold_model: lcgen.Model, cached: bool
) -> None:
    m = model if cached else cold_model  # live sequences share their cells with the cache off
    m.cache.clear()
    questions = ["Q: What is 8 plus 1?\nA:", "Q: What is 3 plus 3?\nA:", "Q: What is 9 plus 2?"]
    prompts = [FEW_SHOT + q for q in questions] + [FEW_SHOT + questions[0]]
    n_prefix = len(m.tokenize(FEW_SHOT))
    n_prompts = sum(len(m.tokenize(p)) for p in prompts)
    before = m.context.n_decoded
    outs = m.generate(prompts, max_tokens=4)
    decoded = m.context.n_decoded - before
    # The few-shot prefix once (and the first question, asked twice, once), then each prompt's
    # own tokens and its generation: far fewer than the prompts' tokens.
    assert decoded <= n_prompts - 3 * n_prefix + 4 * 4
    assert all(o.stats.decoded < 16 for o in outs)
    assert outs[0] == outs[3]
    assert m.cache.stats.live == 0
    # Counted per prompt: the batch's own sequence of the shared prefix counted its reuse too.
    m.cache.clear()
    m.generate(FEW_SHOT + "Q: What is 1 plus 1?\nA:", max_tokens=2)  # caches the prefix
    before_stats = m.cache.stats
    m.generate(prompts[:2], max_tokens=2)
    after = m.cache.stats
    assert after.hits - before_stats.hits == 2
    reused = after.tokens_reused - before_stats.tokens_reused
    assert 2 * (n_prefix - 1) <= reused <= sum(len(m.tokenize(p)) for p in prompts[:2])


def test_copies_of_one_prompt_share_its_cells(model_path: Path) -> None:
    """8 copies of a ~150-token prompt in 256 cells: decoded apart they would need ~1,200
    (they would wait for each other's cells, each decoding the prompt)."""
    prompt = "Red. " + "The quick brown fox jumps. " * 24
    with lcgen.Model(model_path, n_ctx=256, n_seq_max=16) as small:
        lone = small.generate(prompt, max_tokens=6)
        small.cache.clear()
        before = small.context.n_decoded
        outs = small.generate([prompt] * 8, max_tokens=6)
        assert small.context.n_decoded - before <= len(small.tokenize(prompt)) + 8 * 6
        assert all(o == lone for o in outs)
        assert small.cache.stats.cells_held <= 256


@pytest.mark.parametrize("where", ["open", "fork"])
def test_ctrl_c_while_a_slot_is_copied_gives_the_slot_back(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # The slot was taken, then a KeyboardInterrupt came before its entry was registered: it
    # was neither free nor held, its cells in llama.cpp, for good.
    prefix = list(range(1000, 1100))
    with model.sequence([*prefix, 5]) as parked:
        parked.prefill()
        before = model.cache.stats
        context = model.context
        real = context.copy_slot

        def interrupted(src: int, dst: int, n: int) -> None:
            real(src, dst, n)
            raise KeyboardInterrupt

        monkeypatch.setattr(context, "copy_slot", interrupted)
        with pytest.raises(KeyboardInterrupt):
            model.sequence([*prefix, 7]) if where == "open" else parked.fork()
        monkeypatch.undo()
        after = model.cache.stats
        assert (after.free_slots, after.live) == (before.free_slots, before.live)
        with parked.fork() as child:  # the slot is usable again, and empty
            assert child.generate(max_tokens=3) == parked.generate(max_tokens=3)


def test_clear_and_save_take_sequences_whose_parking_waited(
    model: lcgen.Model, tmp_path: Path
) -> None:
    # A sequence closed inside the store's work (the garbage collector) is parked by the next
    # call that may: clear() and save() went on without it (cleared, it came back after).
    tokens = list(range(1000, 1100))
    for call in ("clear", "save"):
        seq = model.sequence(tokens)
        seq.prefill()
        with model.context.lock:
            seq.close()  # parking waits for the lock's holder
        if call == "clear":
            model.cache.clear()
            assert model.cache.cached(tokens) == 0
        else:
            assert model.cache.save(tmp_path / "cache.lcc") == 1
            model.cache.clear()


def test_clear_keeps_live_sequences_and_pins_unless_asked(model: lcgen.Model) -> None:
    model.cache.pin("A pinned prefix")
    model.generate("A parked one", max_tokens=2)
    with model.sequence("A live one") as seq:
        seq.generate(max_tokens=2)
        model.cache.clear()
        assert model.cache.stats.entries == 1 and model.cache.stats.live == 1
        seq.generate(max_tokens=2)  # unharmed
        model.cache.clear(pinned=True)
        assert model.cache.stats.entries == 0
    assert model.cache.stats.entries == 1  # the closed sequence is parked


def test_a_prompt_already_cached_is_pinned_all_the_same(model: lcgen.Model) -> None:
    """pin() of a prompt a parked sequence holds (and goes past) shares its cells, decodes
    nothing, and stays pinned (it was dropped as covered by the parked one: regression)."""
    prompt = "You are a helpful assistant. Answer in one word."
    model.generate(prompt, max_tokens=4)
    before = model.cache.stats
    assert model.cache.pin(prompt) == 0
    stats = model.cache.stats
    assert stats.pinned == before.pinned + 1 and stats.entries == before.entries + 1
    model.cache.clear()
    assert model.cache.stats.pinned == before.pinned + 1
    out = model.generate(prompt, max_tokens=3)  # from the pin's cells and kept logits
    assert out.stats.decoded == len(out.tokens) - 1
    assert model.cache.unpin(prompt) and not model.cache.unpin(prompt)


# slots are a scheduling resource ----------------------------------------------------------------
def test_threads_wait_for_slots_and_share_the_prefix(
    model_path: Path, cold_model: lcgen.Model
) -> None:
    prompts = [f"{FEW_SHOT}Q: What is {i} plus 2?\nA:" for i in range(8)]
    with lcgen.Model(model_path, n_ctx=2048, n_seq_max=3) as small:
        small.generate(FEW_SHOT, max_tokens=1)  # the shared prefix, cached once
        before = small.context.n_decoded
        outs: dict[int, lcgen.Text] = {}
        errors: list[BaseException] = []

        def ask(i: int) -> None:
            try:
                outs[i] = small.generate(prompts[i], max_tokens=6)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and len(outs) == 8
        decoded = small.context.n_decoded - before
        assert decoded < 8 * 30  # each question and its answer, never the few-shot prefix
        for i, prompt in enumerate(prompts):
            cold, rows = steps_of(cold_model, prompt, 6)
            assert_same_where_clear(list(outs[i].tokens), cold, rows, prompt[-12:])
        assert small.cache.stats.live == 0


def test_a_waiting_thread_chooses_its_source_again_when_it_wakes(
    model_path: Path, cold_model: lcgen.Model
) -> None:
    """A thread waits for a slot; the sequence it would copy its prefix from closes and is
    evicted before a slot comes free. When one does, it copies the prefix from another
    sequence that holds it, rather than decoding its whole prompt again."""
    prompt = FEW_SHOT + "Q: What is 8 plus 1?\nA:"
    with lcgen.Model(model_path, n_ctx=2048, n_seq_max=3) as small:
        ready = [threading.Event(), threading.Event()]
        release = [threading.Event(), threading.Event()]

        def hold(i: int, text: str) -> None:
            with small.sequence(text) as seq:
                seq.generate(max_tokens=1)
                ready[i].set()
                release[i].wait(60)

        holders = [
            threading.Thread(target=hold, args=(0, FEW_SHOT + "Q: What is 5 plus 5?\nA:")),
            threading.Thread(target=hold, args=(1, "An unrelated text about rivers.")),
        ]
        for i, holder in enumerate(holders):
            holder.start()
            assert ready[i].wait(60)
        first = small.sequence(FEW_SHOT + "Q: What is 3 plus 3?\nA:")  # the waiter's choice
        first.generate(max_tokens=1)
        rows: list[np.ndarray] = []
        result: list[lcgen.Text] = []

        def wait_and_generate() -> None:
            hook = lambda step: rows.append(step.logits)  # noqa: E731
            result.append(small.generate(prompt, max_tokens=6, hooks=[hook]))

        waiter = threading.Thread(target=wait_and_generate)
        waiter.start()
        deadline = time.monotonic() + 60
        while small.cache.stats.waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert small.cache.stats.waiting == 1
        first.close()  # parked; then evicted for a sequence that shares nothing with it
        takeover = small.sequence("Rivers flow to the sea.")
        takeover.generate(max_tokens=1)
        release[1].set()  # the waiter gets the unrelated sequence's slot
        holders[1].join(60)
        waiter.join(120)
        release[0].set()
        holders[0].join(60)
        takeover.close()
        assert len(result) == 1
        n_prompt, n_shared = len(small.tokenize(prompt)), len(small.tokenize(FEW_SHOT))
        assert result[0].stats.decoded <= n_prompt - n_shared + 6  # not the few-shot prefix
        _, cold_rows = steps_of(cold_model, prompt, 6)
        assert len(rows) == 6
        assert float(np.max(np.abs(rows[0] - cold_rows[0]))) < NOISE


def test_a_thread_that_holds_every_slot_gets_an_error_not_a_hang(model_path: Path) -> None:
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=2) as small:
        held = [small.sequence("one"), small.sequence("two")]
        with pytest.raises(lcgen.SlotsExhaustedError, match="2 by live sequences"):
            small.sequence("three")
        for seq in held:
            seq.close()
        assert small.generate("three", max_tokens=1).stats.tokens == 1


def test_sequences_handed_to_a_worker_are_the_workers_once_it_steps_them(
    model_path: Path,
) -> None:
    """A thread that opened every slot and handed the sequences to a worker waits for the
    worker to close one (it was told no slot would come: the check took the opener as the
    one that closes)."""
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=2) as small:
        handed, done = [small.sequence("one"), small.sequence("two")], threading.Event()
        stepped = threading.Event()

        def worker() -> None:
            for seq in handed:
                seq.generate(max_tokens=1)
            stepped.set()
            for _ in range(300):  # close once the opener waits for a slot (or gave up)
                if small.cache.stats.waiting or done.is_set():
                    break
                time.sleep(0.1)
            for seq in handed:
                seq.close()

        thread = threading.Thread(target=worker)
        thread.start()
        try:
            stepped.wait(30)
            assert small.generate("three", max_tokens=1).stats.tokens == 1
        finally:
            done.set()
            thread.join(60)
        assert small.cache.stats.live == 0


def test_slots_held_by_threads_that_ended_are_reported_not_waited_for(model_path: Path) -> None:
    """A worker that opened every slot and ended without closing its sequences will not give
    one back: a thread asking for a slot is told so (it waited forever), and can close them."""
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=2, slot_timeout=None) as small:
        kept: list[lcgen.Sequence] = []
        worker = threading.Thread(target=lambda: kept.extend(small.sequence(p) for p in "ab"))
        worker.start()
        worker.join(60)
        watchdog = threading.Timer(60, small.close)  # a wait ends in ClosedError, not a hang
        watchdog.start()
        try:
            with pytest.raises(lcgen.SlotsExhaustedError, match="threads that have ended"):
                small.generate("c", max_tokens=1)
        finally:
            watchdog.cancel()
        for seq in kept:
            seq.close()
        assert small.generate("c", max_tokens=1).stats.tokens == 1


@contextlib.contextmanager
def held_by_another_thread(model: lcgen.Model) -> Iterator[None]:
    """A sequence that another thread holds open until the block ends."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with model.sequence("held"):
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(30)
    try:
        yield
    finally:
        release.set()
        holder.join()


def test_slot_timeout_bounds_the_wait(model_path: Path) -> None:
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=1, slot_timeout=0.2) as small:
        with (
            held_by_another_thread(small),
            pytest.raises(lcgen.SlotsExhaustedError, match=r"slot_timeout=0\.2"),
        ):
            small.sequence("waiting")
        assert small.generate("waiting", max_tokens=1).stats.tokens == 1


def test_a_thread_that_holds_slots_is_not_left_waiting_for_anothers(model_path: Path) -> None:
    """A batch admits more work only without waiting: it holds slots, and waiting for another
    thread's (which may wait for its own) could last forever. Two threads' batches, each more
    prompts than slots, all finish."""
    with lcgen.Model(model_path, n_ctx=1024, n_seq_max=2) as small:
        with (
            held_by_another_thread(small),
            small.sequence("mine"),
            small.cache.without_waiting(),
            pytest.raises(lcgen.SlotBusyError, match="2 by live sequences"),
        ):
            small.sequence("third")
        outs: dict[int, list[lcgen.Text]] = {}

        def batch(k: int) -> None:
            outs[k] = small.generate([f"Batch {k}, number {i} is" for i in range(5)], max_tokens=3)

        threads = [threading.Thread(target=batch, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert sorted(outs) == [0, 1, 2] and all(len(o) == 5 for o in outs.values())
        assert small.cache.stats.live == 0


def test_threads_that_each_hold_a_slot_and_wait_for_another_do_not_wait_forever(
    model_path: Path,
) -> None:
    """Two sessions, one per thread, each ask for a second slot where only two exist: the
    second to wait finds the first waiting too and gets an error; closing its session lets
    the first one go on (it waited forever before)."""
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=2) as small:
        both = threading.Barrier(2)
        results: dict[str, str] = {}

        def user(name: str) -> None:
            try:
                with small.sequence(name) as session:
                    session.generate(max_tokens=1)
                    both.wait(30)
                    results[name] = str(small.generate("Hello", max_tokens=2))
            except lcgen.SlotsExhaustedError as exc:
                results[name] = f"error: {exc}"

        threads = [threading.Thread(target=user, args=(n,)) for n in ("A:", "B:")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        errors = [r for r in results.values() if r.startswith("error")]
        assert len(results) == 2 and len(errors) == 1, results
        assert "is waiting for one too" in errors[0]
        assert small.cache.stats.live == 0 and small.cache.stats.waiting == 0


def test_a_beam_search_waiting_for_the_slot_of_a_thread_waiting_for_its_turn_gives_up(
    model_path: Path,
) -> None:
    """X holds a sequence and asks for the beam turn; Y holds the turn and waits for X's slot
    to fork its beams: both waited forever. Waiting for the turn now counts as waiting."""
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=2) as small:
        x_session = small.sequence("The capital of France is")
        has_turn = threading.Event()
        errors: list[Exception] = []

        def search() -> None:
            try:
                with small.cache.beam_turn():
                    has_turn.set()
                    with small.sequence("one"), small.sequence("two"):  # the second waits
                        pass
            except lcgen.SlotsExhaustedError as exc:
                errors.append(exc)

        y = threading.Thread(target=search)
        y.start()
        assert has_turn.wait(30)
        with small.cache.beam_turn():  # X: waits until Y gives up
            pass
        y.join(30)
        x_session.close()
        assert not y.is_alive() and len(errors) == 1
        assert "is waiting for one too" in str(errors[0])


def test_a_slot_held_by_garbage_in_a_cycle_is_collected_for_a_waiting_thread(
    model_path: Path,
) -> None:
    """A stream dropped inside a reference cycle holds its slot until the cyclic garbage
    collector runs, which a waiting thread never started: it waited forever."""
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=1) as small:
        gc.disable()  # as if the collector's thresholds were not reached
        try:

            def leak() -> None:
                chunks = small.stream("Once upon a time", max_tokens=8)
                next(chunks)  # its sequence is live
                cycle: list[Any] = [chunks]
                cycle.append(cycle)

            leaker = threading.Thread(target=leak)
            leaker.start()
            leaker.join()
            assert small.cache.stats.live == 1
            out: list[lcgen.Text] = []
            waiter = threading.Thread(target=lambda: out.append(small.generate("Hi", max_tokens=2)))
            waiter.start()
            waiter.join(60)
            assert not waiter.is_alive() and out[0].stats.tokens == 2
            # The same in one thread: it holds the only slot (garbage), so it would not wait;
            # it collected nothing and raised SlotsExhaustedError.
            leak()
            assert small.cache.stats.live == 1
            assert small.generate("Hi", max_tokens=2).stats.tokens == 2
        finally:
            gc.enable()


def _generate(model: lcgen.Model) -> object:
    return model.generate("Hello", max_tokens=2)


def _beam_search(model: lcgen.Model) -> object:
    return lcgen.continuous(lcgen.generate.text(model, beams=2, max_tokens=8))("Once upon")


@pytest.mark.parametrize(
    ("n_seq_max", "work"),
    [(1, _generate), (2, _beam_search)],
    ids=["waiting to open", "a beam's fork waiting inside its step"],
)
def test_closing_the_model_wakes_a_thread_waiting_for_a_slot(
    model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    n_seq_max: int,
    work: Callable[[lcgen.Model], object],
) -> None:
    """A waiter woke when another thread happened to close a sequence; a beam's fork waits
    inside a step, which close waits to end: close waited until the waiter woke by itself to
    collect garbage (5 s; here never)."""
    monkeypatch.setattr(kvstore, "COLLECT_EVERY", 3600.0)
    small = lcgen.Model(model_path, n_ctx=512, n_seq_max=n_seq_max)
    errors: list[Exception] = []

    def wait_for_a_slot() -> None:
        try:
            work(small)
        except lcgen.ClosedError as exc:
            errors.append(exc)

    with held_by_another_thread(small):
        waiter = threading.Thread(target=wait_for_a_slot)
        waiter.start()
        while not small.cache.stats.waiting:
            time.sleep(0.01)
        closer = threading.Thread(target=small.close, daemon=True)
        closer.start()
        closer.join(10)  # (the holder gives its slot back after 30 s, which woke it too)
        assert not closer.is_alive()
        waiter.join(10)
        assert not waiter.is_alive() and len(errors) == 1


_INTERRUPTED = """
import random, signal, sys, time
import lcgen
model = lcgen.Model(sys.argv[1], n_ctx=512, n_seq_max=8, n_threads=1)
seq = model.sequence("The quick brown fox", seed=1)
seq.generate(max_tokens=4)
seq.save(sys.argv[2])
acts = {
    "open": lambda: model.sequence("The quick brown fox jumps"),
    "fork": lambda: seq.fork(),
    "load": lambda: lcgen.Sequence.load(model, sys.argv[2]),
    "save": lambda: model.cache.save(sys.argv[2] + ".lcc"),
}
def interrupt(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
rng, interrupts, end = random.Random(0), 0, time.monotonic() + 3
for name, act in acts.items():
    start = time.perf_counter()
    for _ in range(20):
        made = act()
        if name != "save":
            made.close()
    took = (time.perf_counter() - start) / 20
    stop = time.monotonic() + 2
    while time.monotonic() < stop:
        made = None
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, took * 1.2))
            made = act()
            signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:  # (a one-shot timer: it fired)
            interrupts += 1
        if made is not None and name != "save":
            made.close()
        store = model.cache
        store.stats  # parks what a collected sequence left
        live = [e for e in store._entries.values() if e.state == "live" and e is not seq._entry]
        slots = len(store._free) + len(store._entries)
        if live or slots != 8 or model.context.lock._is_owned():
            sys.exit(f"{name}: {len(live)} live entries owned by none, {slots} of 8 slots, "
                     f"lock held {model.context.lock._is_owned()}")
print(interrupts)
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="interrupts by SIGALRM timers")
def test_ctrl_c_anywhere_in_open_fork_load_or_save_loses_no_slot_and_leaves_no_lock(
    model_path: Path, tmp_path: Path
) -> None:
    """Ctrl-C (a timer's KeyboardInterrupt, at random points) while a sequence was opened,
    forked or loaded lost its slot for good, 1 to 4 interrupts in: none free and none held,
    or an entry live and owned by no sequence; in a cache save it could leave the model's
    lock held (another thread's call then hung)."""
    # interrupts that landed inside those calls
    assert _interrupts(_INTERRUPTED, model_path, tmp_path / "s.lcs") > 100


def _interrupts(script: str, *args: Path) -> int:
    """Run ``script`` (a harness of timer interrupts) with ``args``; the interrupts it counted,
    once it found nothing wrong (else its message fails the test)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


def test_a_sequence_whose_parking_ctrl_c_cut_short_gives_its_slot_back(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C inside a sequence's finalizer, after the store took its entry to park: the slot
    stayed live, held by no sequence, for good (all slots so after a few hundred interrupts).
    A live entry whose sequence is gone is parked at the next look."""
    model = lcgen.Model(model_path, n_ctx=256, n_seq_max=2, n_threads=1)
    store = model.cache
    seq = model.sequence("Hello there")
    park = store._park

    def interrupted(entry: object) -> None:
        monkeypatch.setattr(store, "_park", park)  # once
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_park", interrupted)
    with pytest.raises(KeyboardInterrupt):
        seq.close()
    assert store._entries[seq._slot].state == "live"  # the window: taken, not parked
    del seq
    assert store.stats.live == 0 and store.available_slots() == 2
    with model.sequence("one") as one, model.sequence("two") as two:
        assert one.generate(max_tokens=2) and two.generate(max_tokens=2)
    model.close()


def test_cells_of_a_sequence_in_a_reference_cycle_are_taken_back_when_memory_runs_out(
    model_path: Path,
) -> None:
    """A sequence dropped inside a reference cycle holds its cells until the garbage
    collector runs: a generation that fits the context failed part-way (its tokens lost)."""
    model = lcgen.Model(model_path, n_ctx=512, n_seq_max=4, n_threads=1)
    gc.disable()
    try:
        cycle: dict[str, object] = {}
        cycle["me"] = cycle
        cycle["seq"] = model.sequence("one two three " * 100)
        cycle["seq"].prefill()  # type: ignore[attr-defined]
        del cycle
        out = model.generate("Once upon a time", max_tokens=300)
    finally:
        gc.enable()
    assert len(out.tokens) == 300
    model.close()


_INTERRUPTED_EDITS = """
import random, signal, sys, time
import lcgen
model = lcgen.Model(sys.argv[1], n_ctx=512, n_seq_max=8, n_threads=1)
ctx, store = model.context, model.cache
seq = model.sequence("The quick brown fox", seed=1)
seq.generate(max_tokens=24)
mark = seq.checkpoint()
def fill():
    for prompt in ("Once upon a time", "Once upon a time there", "def f(x):", "Hello"):
        with model.sequence(prompt) as made:
            made.generate(max_tokens=2)
acts = {
    "cache.clear": (fill, store.clear),
    "rewind": (lambda: seq.generate(max_tokens=3), lambda: seq.rewind(mark)),
}
def interrupt(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
rng, interrupts = random.Random(0), 0
for name, (setup, act) in acts.items():
    setup()
    start = time.perf_counter()
    act()
    took = time.perf_counter() - start
    stop = time.monotonic() + 4
    while time.monotonic() < stop:
        setup()
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, took * 1.2))
            act()
            signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:  # (a one-shot timer: it fired)
            interrupts += 1
        store.stats
        for slot in range(8):
            held, last = ctx.ledger.held(slot), ctx.pos_range(slot)[1]
            if held != last + 1:
                sys.exit(f"{name}: slot {slot} holds {last + 1} positions, the ledger {held}")
        if sorted(store._free + list(store._entries)) != list(range(8)):
            sys.exit(f"{name}: free {store._free}, held {sorted(store._entries)}")
print(interrupts)
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="interrupts by SIGALRM timers")
def test_ctrl_c_in_a_cache_clear_or_a_rewind_leaves_the_cell_ledger_in_step(
    model_path: Path,
) -> None:
    """Ctrl-C during llama.cpp's removal of cells is raised as the call returns, before the
    ledger heard of it: 12 of 79 random interrupts (a cache clear, a rewind) left a slot's
    cells and the ledger apart for good (eviction, budgets and reuse read the ledger); and a
    rewind so interrupted left the sequence counting cells it no longer had (its next
    generate failed: llama.cpp refused positions past its cells)."""
    assert _interrupts(_INTERRUPTED_EDITS, model_path) > 20  # that landed inside those calls


def test_a_step_keeps_its_logits_while_other_threads_decode(cold_model: lcgen.Model) -> None:
    """A hook that waits on work in another thread (which decodes, here a prompt scored with
    more logit rows than llama.cpp's buffer held, so the buffer is reallocated), then asks
    for a redraw: the redraw reads the step's own logits. They were views into llama.cpp's
    buffer: the redraw read the other thread's logits (or freed memory, and the process
    died)."""
    prompt, text = "The capital of France is", "The quick brown fox jumps over the dog. " * 12

    def hook_with(work: Callable[[], object] | None) -> Callable[[lcgen.Step], Any]:
        done: list[int] = []

        def hook(step: lcgen.Step) -> lcgen.Resample | None:
            if step.index != 2 or done:
                return None
            done.append(step.token)
            if work is not None:
                other = threading.Thread(target=work)
                other.start()
                other.join(60)
            return lcgen.Resample(exclude=[step.token])

        return hook

    alone = cold_model.generate(prompt, max_tokens=8, hooks=[hook_with(None)])
    for work in (
        lambda: cold_model.generate("def fibonacci(n):", max_tokens=4),
        lambda: cold_model.prompt_logprobs(text),
    ):
        beside = cold_model.generate(prompt, max_tokens=8, hooks=[hook_with(work)])
        assert beside.tokens == alone.tokens


def test_a_sequence_closed_inside_the_stores_own_work_is_parked_after_it(
    model_path: Path,
) -> None:
    """The garbage collector can close a dropped stream's sequence inside any allocation,
    the store's loops over its entries included (same thread, its lock held): parking there
    changed the dict being walked (RuntimeError out of model.generate). Such a close now
    waits until the lock is let go."""
    with lcgen.Model(model_path, n_ctx=512, n_seq_max=2) as small:
        seq = small.sequence("Once upon a time")
        seq.generate(max_tokens=1)  # cells to park
        with small.context.lock:  # as inside the store's own work
            seq.close()
            assert seq.is_closed
            inside = small.cache.stats  # the entries a loop there walks: as they were
            assert inside.live == 1 and inside.entries == 0
        after = small.cache.stats
        assert after.live == 0 and after.entries == 1
        assert small.generate("Once upon a time", max_tokens=2).stats.tokens == 2


def test_more_prompts_than_slots_in_one_call_queue(model_path: Path) -> None:
    with lcgen.Model(model_path, n_ctx=1024, n_seq_max=2) as small:
        outs = small.generate([f"Number {i} is" for i in range(7)], max_tokens=3)
        assert len(outs) == 7 and all(o.stats.tokens == 3 for o in outs)
        assert small.cache.stats.live == 0


# persistence ------------------------------------------------------------------------------------
def test_a_saved_cache_loads_in_another_model_and_skips_the_prefix(
    model: lcgen.Model, model_path: Path, tmp_path: Path
) -> None:
    model.cache.pin(FEW_SHOT)
    expected = model.generate(FEW_SHOT + "Q: What is 4 plus 4?\nA:", max_tokens=4)
    path = tmp_path / "few-shot.lcc"
    assert model.cache.save(path, pinned_only=True) == 1
    whole = model.generate(FEW_SHOT, max_tokens=4, logprobs=0)
    with lcgen.Model(model_path) as other:
        assert other.cache.load(path) == 1 and other.cache.stats.pinned == 1
        before = other.context.n_decoded
        out = other.generate(FEW_SHOT + "Q: What is 4 plus 4?\nA:", max_tokens=4)
        assert str(out) == str(expected)
        assert other.context.n_decoded - before == out.stats.decoded < 20
        # The file keeps the logits after the pinned prompt: the prompt itself decodes none
        # of its tokens, and its first token is drawn from the saving process's logits.
        n_few = len(other.tokenize(FEW_SHOT))
        assert other.cache.cached(FEW_SHOT) == other.cache.cached(other.tokenize(FEW_SHOT)) == n_few
        with pytest.raises(TypeError, match="token ids are a list of int, got float"):
            other.cache.cached(2.5)  # type: ignore[arg-type]
        before = other.context.n_decoded
        again = other.generate(FEW_SHOT, max_tokens=4, logprobs=0)
        assert other.context.n_decoded - before == again.stats.decoded == 3
        assert again.tokens == whole.tokens
        assert again.logprobs[0].logprob == whole.logprobs[0].logprob  # the same row
    model.cache.unpin(FEW_SHOT)


def test_a_file_entry_the_cache_holds_already_leaves_the_next_ones_their_logits(
    model_path: Path, tmp_path: Path
) -> None:
    """Entries skipped on load (held already) took no row of logits, so each entry after them
    took the row of the one before: a call on B drew its first token from A's logits."""
    a, b, path = "The capital of France is", "I love eating fresh fish", tmp_path / "ab.lcc"
    with lcgen.Model(model_path, n_ctx=512) as first:
        first.generate(a, max_tokens=3)  # (listed first)
        expected = str(first.generate(b, max_tokens=3))
        assert first.cache.save(path) == 2
    with lcgen.Model(model_path, n_ctx=512) as other:
        other.generate(a, max_tokens=3)  # the file's entry of A is held: skipped
        assert other.cache.load(path) == 2
        assert other.cache.cached(b) == len(other.tokenize(b))
        assert str(other.generate(b, max_tokens=3)) == expected


def test_an_entry_parked_with_cells_past_its_tokens_keeps_its_tokens_only(
    model: lcgen.Model, tmp_path: Path
) -> None:
    """A step cut short as the model closed left cells (and kept logits) past the tokens of a
    parked entry: the cache file written then listed logits after more tokens than the entry
    had, and loading it back raised StateFileError."""
    model.cache.clear()
    seq = model.sequence("Cells past the tokens of a parked entry")
    seq.generate(max_tokens=4)
    entry = seq._entry
    n = len(entry.tokens) - 2
    del entry.tokens[n:]  # (as a step cut short leaves it: its cells and logits run on)
    entry.keep_logits(n + 1, np.zeros(model.n_vocab, dtype=np.float32))
    seq.close()
    assert entry.state == "parked" and len(entry.tokens) == n
    assert model.context.ledger.held(entry.slot) == n and entry.end_logits is None
    path = tmp_path / "parked.lcc"
    assert model.cache.save(path) == 1
    model.cache.clear()
    assert model.cache.load(path) == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "model", "missing"])
def test_a_damaged_cache_file_raises_and_loads_nothing(
    model: lcgen.Model, tmp_path: Path, damage: str
) -> None:
    model.generate("Saved prefix for the file test", max_tokens=2)
    path = tmp_path / "cache.lcc"
    assert model.cache.save(path) >= 1
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
        path.write_bytes(data)
    elif damage == "missing":
        path.unlink()
    model.cache.clear()
    if damage == "model":
        gemma = resolve("gemma3-270m", download=False)
        with (
            lcgen.Model(gemma, n_ctx=512) as other,
            pytest.raises(lcgen.StateFileError, match="another model"),
        ):
            other.cache.load(path)
        return
    with pytest.raises(lcgen.StateFileError):
        model.cache.load(path)
    assert model.cache.stats.entries == 0


@pytest.mark.parametrize(
    ("forgery", "message"),
    [
        ("long entry", "more than the context's 256"),
        ("far cell", "not at consecutive positions"),
        ("short logits", "logits are 16 bytes, not 49152 float32 values"),
        ("logits past the tokens", "logits follow 99 of its tokens"),
        ("nan logits", "logits are not all finite"),  # (every call on it raised DecodeError)
    ],
)
def test_a_forged_cache_file_with_a_valid_checksum_loads_nothing(
    model_path: Path, tmp_path: Path, forgery: str, message: str
) -> None:
    """An entry of 5,000 tokens whose last cell claimed position 4,999 loaded into a 256-cell
    context: the cache then held more cells than its budget and evicted everything at once."""
    import struct

    from lcgen.runtime import statefile

    with lcgen.Model(model_path, n_ctx=256, n_seq_max=4) as small:
        tokens = small.tokenize("A pinned prefix for the forged cache file")
        small.cache.pin(tokens)
        path = tmp_path / "cache.lcc"
        small.cache.save(path)
        small.cache.clear(pinned=True)
        header, kv = statefile.decode(path.read_bytes(), statefile.CACHE)
        (size,) = struct.unpack_from("<Q", kv, 0)
        blob = bytearray(kv[8 : 8 + size])
        logits = bytes(kv[8 + size :])  # the row kept after the pinned tokens
        n = len(tokens)
        if forgery == "long entry":
            header["entries"][0]["tokens"] = tokens * 40
        elif forgery == "far cell":
            struct.pack_into("<i", blob, 16 + 12 * (n - 1), 4999)  # the last cell's position
        elif forgery == "short logits":
            logits = struct.pack("<Q", 16) + bytes(16)
        elif forgery == "nan logits":
            row = np.full(small.n_vocab, np.nan, dtype="<f4").tobytes()
            logits = struct.pack("<Q", len(row)) + row
        else:
            header["entries"][0]["logits"] = 99
        forged = struct.pack("<Q", len(blob)) + bytes(blob) + logits

        def write(out: bytearray, at: int, size: int) -> int:
            out[at : at + size] = forged
            return size

        path.write_bytes(statefile.encode(header, len(forged), write, statefile.CACHE))
        with pytest.raises(lcgen.StateFileError, match=message):
            small.cache.load(path)
        stats = small.cache.stats
        assert stats.entries == 0 and stats.cells_held == 0 and small.cache.free_cells() > 0


def test_a_sequence_file_is_not_a_cache_file(model: lcgen.Model, tmp_path: Path) -> None:
    with model.sequence("A sequence") as seq:
        seq.generate(max_tokens=2)
        seq.save(tmp_path / "seq.lcs")
    with pytest.raises(lcgen.StateFileError, match="not an lcgen cache file"):
        model.cache.load(tmp_path / "seq.lcs")


# short batches padded to llama.cpp's tiled attention -------------------------------------------
QUESTION = " ".join(f"item {i}," for i in range(6)) + " Q: What is 2 plus 2?\nA:"


def test_a_long_suffix_after_a_cached_prefix_is_padded_and_changes_only_speed(
    model: lcgen.Model, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of a few dozen tokens after a long cached prefix is padded to 64 tokens of a
    spare sequence (llama.cpp's CPU flash attention then works in tiles of rows) where that is
    predicted cheaper (the prior's prediction here): the padding is decoded and removed, no
    counter or cell ledger sees it, and the tokens are the unpadded run's wherever the top-2
    margin is clear."""
    assert model.context.pad_batches  # the CPU, flash attention as llama.cpp chooses
    monkeypatch.setattr(model.context, "costs", PriorCosts())
    prefix = FEW_SHOT * 12  # about 900 tokens
    model.generate(prefix, max_tokens=1)
    tokens = model.tokenize(prefix + QUESTION)
    n_new = len(tokens) - model.cache.cached(tokens)
    assert 30 < n_new < 64
    decoded, padded = model.context.n_decoded, model.context.n_padded
    ours, _ = steps_of(model, prefix + QUESTION, 8)
    assert model.context.n_padded - padded == 64 - n_new
    assert model.context.n_decoded - decoded == n_new + 7
    assert model.context.pos_range(model.context.n_seq_max) == (-1, -1)  # the spare: empty
    with lcgen.Model(model_path, pad_batches=False) as plain:
        assert not plain.context.pad_batches
        plain.context.costs = PriorCosts()  # what padded above: off, it pads nothing
        plain.generate(prefix, max_tokens=1)
        theirs, rows = steps_of(plain, prefix + QUESTION, 8)
        assert plain.context.n_padded == 0
    assert_same_where_clear(ours, theirs, rows, "padded")


def test_padding_needs_a_spare_sequence_id_and_room(model_path: Path) -> None:
    with lcgen.Model(model_path, n_batch=64, n_seq_max=64) as full:
        assert not full.context.pad_batches  # every id is a slot
    with pytest.raises(TypeError, match="pad_batches"):
        lcgen.Model(model_path, pad_batches="no")  # type: ignore[arg-type]
    with lcgen.Model(model_path, n_ctx=1024, n_seq_max=2) as small:
        small.context.costs = PriorCosts()  # padding predicted cheaper where there is room
        prefix = ""
        while len(small.tokenize(prefix + "Q: 1?\nA: 1.\n\n" + QUESTION)) <= 1024 - 12:
            prefix += "Q: 1?\nA: 1.\n\n"
        small.generate(prefix, max_tokens=1)
        small.generate(prefix + QUESTION, max_tokens=2)  # its padding would not fit: none
        assert small.context.n_padded == 0
        small.cache.clear()
        small.generate(prefix[: len(prefix) // 2], max_tokens=1)
        small.generate(prefix[: len(prefix) // 2] + QUESTION, max_tokens=2)  # room: padded
        assert small.context.n_padded > 0


def test_pinning_or_prefilling_what_cannot_fit_fails_before_decoding(model: lcgen.Model) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        model.cache.pin("")  # it made an entry that a saved cache file could not hold
    too_long = [model.vocab.bos] + [1000] * model.n_ctx
    decoded, pinned = model.context.n_decoded, model.cache.stats.pinned
    with pytest.raises(lcgen.ContextFullError, match=f"exceeds the context of {model.n_ctx}"):
        model.cache.pin(too_long)
    with pytest.raises(lcgen.ContextFullError), model.sequence(too_long) as seq:
        seq.prefill()
    assert model.context.n_decoded == decoded  # refused before a token was decoded
    assert model.cache.stats.pinned == pinned


def test_saving_to_a_folder_or_a_missing_one_raises_a_state_file_error(
    model: lcgen.Model, tmp_path: Path
) -> None:
    (tmp_path / "files").mkdir()
    model.generate("Saved to a folder", max_tokens=2)
    with model.sequence("A sequence to save") as seq:
        for target, reason in [
            (tmp_path / "files", "it is a directory"),
            (tmp_path / "missing" / "s.lcs", "No such file or directory"),
            ("", "the path is empty"),  # (it said "it is a directory")
        ]:
            with pytest.raises(lcgen.StateFileError, match=reason) as err:
                seq.save(target)
            assert f"cannot write sequence file {str(target)!r}" in str(err.value)
            with pytest.raises(lcgen.StateFileError, match=reason) as err:
                model.cache.save(target)
            assert f"cannot write cache file {str(target)!r}" in str(err.value)
            assert ".tmp" not in str(err.value)
        # a bytes path is a path (it raised "a bytes-like object is required, not 'str'")
        seq.save(bytes(tmp_path / "b.lcs"))
        lcgen.Sequence.load(model, bytes(tmp_path / "b.lcs")).close()
        for bad in (None, 3):  # (os's message named no parameter)
            for call in (seq.save, model.cache.save, model.cache.load):
                with pytest.raises(TypeError, match=r"file's path is a str or os\.PathLike, got"):
                    call(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"sequence file's path is a str or os\.PathLike"):
                lcgen.Sequence.load(model, bad)  # type: ignore[arg-type]
    (tmp_path / "b.lcs").unlink()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["files"]  # no temp file left


def test_loading_a_sequence_into_something_else_than_a_model_is_a_type_error(
    model: lcgen.Model, tmp_path: Path
) -> None:
    with model.sequence("A sequence") as seq:
        seq.save(tmp_path / "s.lcs")
    with pytest.raises(TypeError, match=r"expects the lcgen\.Model .* got NoneType"):
        lcgen.Sequence.load(None, tmp_path / "s.lcs")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got PosixPath"):
        lcgen.Sequence.load(tmp_path / "s.lcs", model)  # type: ignore[arg-type]


def test_loading_more_entries_than_slots_returns_how_many_are_held(
    model: lcgen.Model, model_path: Path, tmp_path: Path
) -> None:
    for p in ["A cat", "A dog", "A cow"]:
        model.generate(p + " is an animal that", max_tokens=2)
    path = tmp_path / "three.lcc"
    assert model.cache.save(path) == 3
    with lcgen.Model(model_path, n_seq_max=2, n_ctx=1024) as small:
        assert small.cache.load(path) == 2
        stats = small.cache.stats
        assert stats.entries == 2 and stats.evictions == 1
        assert small.cache.load(path) == 2 and small.cache.stats.entries == 2  # again


def test_loading_waits_for_slots_other_threads_hold(model_path: Path, tmp_path: Path) -> None:
    """It refused at once, as if those slots would never come back; pinned entries that no
    slot can take are still refused before anything loads, saying so."""
    path, pins = tmp_path / "one.lcc", tmp_path / "pins.lcc"
    with lcgen.Model(model_path, n_seq_max=2, n_ctx=1024, slot_timeout=60) as small:
        small.generate("Q: 2 plus 3?\nA:", max_tokens=2)
        assert small.cache.save(path) == 1
        small.cache.clear()
        opened, release = threading.Barrier(3), threading.Event()

        def hold() -> None:
            with small.sequence("Some other text"):
                opened.wait()
                release.wait()

        holders = [threading.Thread(target=hold) for _ in range(2)]
        for holder in holders:
            holder.start()
        opened.wait()  # both slots are held now
        threading.Timer(0.5, release.set).start()
        assert small.cache.load(path) == 1  # after the holders closed theirs
        for holder in holders:
            holder.join()
        small.cache.clear(pinned=True)
        small.cache.pin("Doc 0: the first")
        small.cache.pin("Doc 1: the second")
        assert small.cache.save(pins, pinned_only=True) == 2
    with lcgen.Model(model_path, n_seq_max=2, n_ctx=1024) as other:
        other.cache.pin("Doc 2: the third")
        with pytest.raises(lcgen.SlotsExhaustedError, match="2 of them pinned, and 1 of the 2"):
            other.cache.load(pins)
        assert other.cache.stats.entries == 1  # nothing loaded


def test_a_file_whose_pinned_entries_take_every_slot_loads_them_without_its_parked(
    model_path: Path, tmp_path: Path
) -> None:
    """One pinned and one parked entry into one slot: refused, saying "1 of them pinned, and
    1 of the 1 slots can take them", though pinning it by hand fit. The parked entry, which
    the pinned one would evict at once, is skipped."""
    path = tmp_path / "both.lcc"
    with lcgen.Model(model_path, n_ctx=256, n_threads=1) as saving:
        saving.generate("The quick brown fox", max_tokens=4)
        saving.cache.pin("pinned doc")
        assert saving.cache.save(path) == 2
    with lcgen.Model(model_path, n_ctx=256, n_threads=1, n_seq_max=1) as one:
        assert one.cache.load(path) == 1
        stats = one.cache.stats
        assert stats.pinned == stats.entries == 1
        doc = one.tokenize("pinned doc")
        assert one.cache.cached(doc) >= len(doc) - 1  # (the last, for its logits, at most)


def test_loading_waits_slot_timeout_once_for_the_whole_file(
    model_path: Path, tmp_path: Path
) -> None:
    """Each entry waited up to slot_timeout afresh: a file of k entries up to k times as long.
    Two pinned entries, both slots held by other threads, given back at 0.8 s and 1.6 s: the
    second is not free by the 1.2 s slot_timeout (it was by 0.8 + 1.2 s)."""
    pins = tmp_path / "pins.lcc"
    with lcgen.Model(model_path, n_seq_max=2, n_ctx=1024, slot_timeout=1.2) as small:
        small.cache.pin("Doc 0: the first")
        small.cache.pin("Doc 1: the second")
        assert small.cache.save(pins, pinned_only=True) == 2
        small.cache.clear(pinned=True)
        opened = threading.Barrier(3)
        releases = [threading.Event(), threading.Event()]

        def hold(release: threading.Event) -> None:
            with small.sequence("Some other text"):
                opened.wait()
                release.wait()

        holders = [threading.Thread(target=hold, args=(r,)) for r in releases]
        for holder in holders:
            holder.start()
        opened.wait()  # both slots are held now
        timers = [threading.Timer(t, r.set) for t, r in zip((0.8, 1.6), releases, strict=True)]
        for timer in timers:
            timer.start()
        with pytest.raises(lcgen.SlotsExhaustedError, match=r"slot_timeout=1\.2"):
            small.cache.load(pins)
        for holder in holders:
            holder.join()
        assert small.cache.stats.entries == 0  # nothing of the file stays loaded


def test_the_cache_off_loads_only_the_pinned_entries_of_a_file(
    model: lcgen.Model, cold_model: lcgen.Model, tmp_path: Path
) -> None:
    parked = "A parked prompt that a model without a cache must not reuse"
    model.cache.pin(FEW_SHOT)
    try:
        model.generate(parked, max_tokens=2)
        path = tmp_path / "mixed.lcc"
        assert model.cache.save(path) == 2
        assert cold_model.cache.load(path) == 1
        stats = cold_model.cache.stats
        assert stats.entries == 1 and stats.pinned == 1
        before, hits = cold_model.context.n_decoded, cold_model.cache.stats.hits
        cold_model.generate(parked, max_tokens=2)
        assert cold_model.context.n_decoded - before == len(cold_model.tokenize(parked)) + 1
        assert cold_model.cache.stats.hits == hits
        before = cold_model.context.n_decoded
        cold_model.generate(FEW_SHOT + "Q: What is 1 plus 1?\nA:", max_tokens=2)
        assert cold_model.context.n_decoded - before < 20  # the pinned prefix is reused
    finally:
        model.cache.unpin(FEW_SHOT)
        cold_model.cache.unpin(FEW_SHOT)


def test_loading_what_the_cache_holds_already_loses_nothing(
    model_path: Path, tmp_path: Path
) -> None:
    # Its pinned entry was loaded again into the slot of the parked one (evicted), which
    # then had no slot: SlotsExhaustedError, and the parked entry lost.
    with lcgen.Model(model_path, n_seq_max=2, n_ctx=1024) as small:
        small.cache.pin("You are a helpful assistant.")
        small.generate("Hello there", max_tokens=3)
        path = tmp_path / "two.lcc"
        assert small.cache.save(path) == 2
        before = small.cache.stats
        assert small.cache.load(path) == 2
        after = small.cache.stats
        assert (after.entries, after.pinned, after.evictions) == (2, 1, before.evictions)
        before_decoded = small.context.n_decoded
        small.generate("Hello there", max_tokens=3)
        assert small.context.n_decoded - before_decoded <= 3  # still cached


def test_pin_names_a_prompt_that_is_neither_text_nor_token_ids(model: lcgen.Model) -> None:
    for bad, shown in [(123, "got int 123"), (None, "got NoneType"), ([True, 2], r"\[True, 2\]")]:
        with pytest.raises(TypeError, match=shown):
            model.cache.pin(bad)  # type: ignore[arg-type]


def test_a_loaded_cache_shares_prefix_cells_as_the_saved_one_did(
    model: lcgen.Model, cold_model: lcgen.Model, model_path: Path, tmp_path: Path
) -> None:
    """llama.cpp restores each entry into cells of its own: the load gives an entry the cells
    of the longest prefix another entry holds, so a shared prefix takes its cells once (a
    pool too small for three copies of it takes the file without evicting)."""
    prefix = FEW_SHOT * 4  # about 330 tokens
    prompts = [f"{prefix}Q: What is {a} plus {b}?\nA:" for a, b in [(3, 4), (8, 1), (5, 9)]]
    model.cache.pin(prefix)
    try:
        for prompt in prompts[:2]:
            model.generate(prompt, max_tokens=4)
        model.generate(prompts[2], max_tokens=4, stop=["\n"])
        held = model.cache.stats.cells_held
        assert held < len(model.tokenize(prefix)) + 3 * 20  # shared in the source
        path = tmp_path / "shared.lcc"
        assert model.cache.save(path) == 4
    finally:
        model.cache.unpin(prefix)
    with lcgen.Model(model_path, n_ctx=768) as other:  # the entries unshared: about 1,350 cells
        assert other.cache.load(path) == 4
        stats = other.cache.stats
        assert (stats.cells_held, stats.entries, stats.evictions) == (held, 4, 0)
        for prompt in prompts:
            before = other.context.n_decoded
            ours, _ = steps_of(other, prompt, 6)
            # 5 new tokens: the logits after each prompt came with the file (each entry kept
            # the logits after its prompt), so no prompt token is decoded
            assert other.context.n_decoded - before == 5
            cold, cold_rows = steps_of(cold_model, prompt, 6)
            assert_same_where_clear(ours, cold, cold_rows, prompt[-20:])


@pytest.mark.parametrize("swa_full", [True, False])
def test_a_loaded_sliding_window_cache_shares_prefix_cells(tmp_path: Path, swa_full: bool) -> None:
    """Gemma 3: a restored state holds only its window's last positions; entries load
    shortest first, so each one's window starts no earlier than its holder's and the shared
    prefix's cells (in the window's cache too) are shared as in the saving cache."""
    gemma = resolve("gemma3-270m", download=False)
    prefix = FEW_SHOT * 7  # past the 512-position window
    prompts = [prefix + f"Q: {q}?\nA:" for q in ["What is 10 plus 14", "3 plus 4", "Is 8 one"]]
    path = tmp_path / "gemma.lcc"
    with lcgen.Model(gemma, n_ctx=2048, swa_full=swa_full) as source:
        for prompt in prompts:
            source.generate(prompt, max_tokens=1)
        held = source.cache.stats.cells_held
        assert source.cache.save(path) == 3
        expected = [steps_of(source, prompt + " Yes", 4) for prompt in prompts]
    with lcgen.Model(gemma, n_ctx=2048, swa_full=swa_full) as other:
        assert other.cache.load(path) == 3
        assert other.cache.stats.cells_held == held
        for prompt, (theirs, rows) in zip(prompts, expected, strict=True):
            n_new = len(other.tokenize(prompt + " Yes")) - len(other.tokenize(prompt))
            before = other.context.n_decoded
            ours, _ = steps_of(other, prompt + " Yes", 4)
            assert other.context.n_decoded - before == n_new + 3  # the entry is reused
            assert_same_where_clear(ours, theirs, rows, prompt[-20:])


class _LockChecked:
    """A cell ledger whose every method asserts that the calling thread holds the context's
    lock (other threads' decodes and slot changes change it under that lock)."""

    def __init__(self, ledger: Any, lock: Any) -> None:
        self._ledger, self._lock = ledger, lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._ledger, name)
        if not callable(attr):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            assert self._lock._is_owned(), f"CellLedger.{name} called without the context lock"
            return attr(*args, **kwargs)

        return checked


def test_the_cell_ledger_is_read_and_changed_under_the_context_lock(model_path: Path) -> None:
    """The batch padding and a paused generation's drop_cells read the ledger outside the
    lock: another thread opening or closing a slot meanwhile failed the decode with
    'dictionary changed size during iteration'."""
    with lcgen.load(model_path, n_threads=2, pad_batches=True) as model:
        ctx = model.context
        ctx.costs = PriorCosts()  # padding predicted cheaper after a long cached prefix
        prefix = FEW_SHOT * 12  # about 900 tokens
        model.generate(prefix, max_tokens=1)
        ctx.ledger = _LockChecked(ctx.ledger, ctx.lock)  # type: ignore[assignment]
        before = ctx.n_padded
        model.generate([prefix + QUESTION, prefix + "Q: 3?\nA:"], max_tokens=2)
        with model.sequence(model.tokenize("A prompt of a few words, then more: " * 3)) as seq:
            seq.generate(max_tokens=4)
            with seq.fork() as child:
                child.generate(max_tokens=2)
                assert child.drop_cells() > 0
            seq.generate(max_tokens=2)
        assert model.cache.stats.cells_held > 0 and model.cache.free_cells() > 0
        assert ctx.n_padded > before  # the padded path ran
