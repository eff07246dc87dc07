"""Rewind on a sliding-window model (Gemma 3 270M): in place when the memory allows, else a
transparent, counted fallback that re-decodes the kept tokens."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import assert_same_up_to_a_near_tie

import lcgen
from lcgen.registry import resolve
from lcgen.runtime import statefile
from lcgen.runtime.context import _check_table

# The most two best candidates' log-probabilities may part by where a rounding difference
# swapped them (see the README's Exactness).
NEAR_TIE = 0.5
TEXT = " ".join(f"Sentence number {i} is about the sea and the sky." for i in range(110))


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return resolve("gemma3-270m", download=False)


@pytest.fixture(scope="module")
def small_swa(gemma_path: Path) -> Iterator[lcgen.Model]:
    # One slot and swa_full=False: the sliding-window cache keeps ~window + batch positions.
    with lcgen.Model(gemma_path, n_ctx=2048, n_seq_max=1, swa_full=False) as m:
        yield m


def test_the_window_cache_really_drops_old_positions(small_swa: lcgen.Model) -> None:
    with small_swa.sequence(TEXT) as seq:
        seq.generate(max_tokens=4)
        pos_min, _ = small_swa.context.pos_range(seq.slot)
        assert pos_min > 0 and seq.n_tokens > 1024


def test_short_rewind_is_in_place_long_rewind_falls_back(
    small_swa: lcgen.Model, gemma_path: Path
) -> None:
    with small_swa.sequence(TEXT) as seq:
        first = seq.generate(max_tokens=6)
        seq.rewind(6)
        assert seq.generate(max_tokens=6) == first
        assert seq.stats.fallbacks == 0 and seq.stats.rewinds == 1
        seq.rewind(seq.n_tokens - 100)
        assert seq.stats.fallbacks == 1 and seq.stats.tokens_redecoded == 99
        after = seq.generate(max_tokens=10)
        kept = seq.tokens[:100]
    # The fallback re-decodes the kept tokens in one batch, exactly as a fresh prompt would.
    with (
        lcgen.Model(gemma_path, n_ctx=2048, n_seq_max=1, swa_full=False) as other,
        other.sequence(kept) as fresh,
    ):
        assert fresh.generate(max_tokens=10) == after


def test_full_window_cache_rewinds_in_place(gemma_path: Path) -> None:
    with lcgen.Model(gemma_path, n_ctx=2048, n_seq_max=1) as full, full.sequence(TEXT) as seq:
        first = seq.generate(max_tokens=8)
        seq.rewind(seq.n_tokens - 100)
        seq.rewind(0)
        assert seq.stats.fallbacks == 0
        seq.append_tokens(full.tokenize(TEXT)[100:])
        assert seq.generate(max_tokens=8) == first


def test_the_cache_reuses_only_what_the_window_still_holds(
    small_swa: lcgen.Model, gemma_path: Path
) -> None:
    small_swa.cache.clear()
    first = small_swa.generate(TEXT, max_tokens=4)
    before = small_swa.context.n_decoded
    again = small_swa.generate(TEXT, max_tokens=4)  # the window holds the end of TEXT
    assert small_swa.context.n_decoded - before == again.stats.decoded == 3  # and its logits
    assert again == first
    # A prompt that shares only the start of TEXT: the window dropped those cells, so nothing
    # is reused (the store checks what the memory holds) and the result is a fresh run's.
    head = small_swa.detokenize(small_swa.tokenize(TEXT)[:100]) + " Then the wind"
    before = small_swa.context.n_decoded
    out = small_swa.generate(head, max_tokens=8)
    assert small_swa.context.n_decoded - before == len(small_swa.tokenize(head)) + 7
    with lcgen.Model(gemma_path, n_ctx=2048, n_seq_max=1, swa_full=False, cache=False) as other:
        assert other.generate(head, max_tokens=8) == out


def test_a_pinned_prefix_serves_where_a_longer_entry_lost_its_window(gemma_path: Path) -> None:
    # The entry sharing the longest prefix had moved its window past it: the prompt was
    # decoded whole (and that entry wiped), though a pinned prefix held what was needed.
    words = [
        "alpha",
        "river",
        "stone",
        "quiet",
        "market",
        "lantern",
        "harbor",
        "violet",
        "engine",
        "meadow",
    ]
    notes = " ".join(words[(7 * i) % len(words)] for i in range(250))
    long_question = " ".join(words[(3 * i + 1) % len(words)] for i in range(1100))
    system = f"System: you answer questions about notes. {notes}\n"
    with lcgen.Model(gemma_path, n_ctx=2048, n_seq_max=2, n_batch=64, swa_full=False) as m:
        m.cache.pin(system)
        m.generate(system + f"Q: {long_question}\nA:", max_tokens=3)
        prompt = system + "Q: what is second?\nA:"
        before = m.context.n_decoded
        m.generate(prompt, max_tokens=3)
        new = len(m.tokenize(prompt)) - len(m.tokenize(system))
        assert m.context.n_decoded - before <= new + 3


def test_a_restored_window_serves_its_end(gemma_path: Path, tmp_path: Path) -> None:
    # llama.cpp saves only the last window of a sliding-window layer's cells: a cache file of
    # a prefix longer than the window, loaded into a full-size (default) cache, must still
    # serve that prefix (it was passed over: every later prompt was decoded whole).
    system = f"System: {TEXT[:2400]}\n"
    prompt = system + "Q: what is above the sea?\nA:"
    with lcgen.Model(gemma_path, n_ctx=2048, n_seq_max=2, cache=False) as m:
        n_system, n_prompt = len(m.tokenize(system)), len(m.tokenize(prompt))
        assert n_system > 512  # longer than the window
        cold = m.generate(prompt, max_tokens=6, logprobs=2)
        m.cache.pin(system)
        m.cache.save(tmp_path / "system.lcc", pinned_only=True)
    with lcgen.Model(gemma_path, n_ctx=2048, n_seq_max=2) as m:
        assert m.cache.load(tmp_path / "system.lcc") == 1
        out = m.generate(prompt, max_tokens=6)
        assert out.stats.decoded == n_prompt - n_system + 5
        # (its end decoded apart from the restored prefix: the last bits of logits move)
        assert_same_up_to_a_near_tie(out, cold, NEAR_TIE)
        # A rewind into what the file did not hold falls back to decoding all again.
        with m.sequence(prompt) as seq:
            assert_same_up_to_a_near_tie(seq.generate(max_tokens=6), cold, NEAR_TIE)
            seq.rewind(seq.n_tokens - n_system + 20)
            assert seq.stats.fallbacks == 1
            seq.append_tokens(m.tokenize(prompt)[n_system - 20 :])
            before = m.context.n_decoded
            seq.generate(max_tokens=1)
            assert m.context.n_decoded - before == n_prompt


def test_an_entry_whose_window_moved_past_a_prompt_does_not_stand_in_for_one_that_serves_it(
    gemma_path: Path, tmp_path: Path
) -> None:
    # A restored entry of the prompt and 40 more tokens holds the prompt's tokens, but its
    # window starts past what the prompt's next token needs. It was counted as holding them:
    # the entry each call parked was dropped as covered by it (every call decoded the whole
    # prompt), and a file of the prompt alone was skipped on load as held already.
    prompt = f"System: {TEXT[:2400]}\nQ: what is above the sea?\nA:"
    with lcgen.Model(gemma_path) as m:
        n_prompt = len(m.tokenize(prompt))
        assert n_prompt > 512 + 40  # longer than the window
        m.generate(prompt, max_tokens=1)
        m.cache.save(tmp_path / "prompt.lcc")
        m.cache.clear()
        longer = m.tokenize(prompt) + list(m.generate(prompt, max_tokens=40).tokens)
        m.cache.save(tmp_path / "longer.lcc")
    with lcgen.Model(gemma_path) as m:
        assert m.cache.load(tmp_path / "longer.lcc") == 1
        with m.sequence(longer[: n_prompt + 5]) as seq:  # (the restored entry cannot serve)
            assert seq.generate(max_tokens=1).stats.decoded == n_prompt + 5
        assert m.cache.stats.entries == 2  # parked, not dropped as covered
        with m.sequence(longer[: n_prompt + 5]) as seq:
            assert seq.generate(max_tokens=1).stats.decoded <= 1
    with lcgen.Model(gemma_path) as m:
        assert m.cache.load(tmp_path / "longer.lcc") == 1
        assert m.cache.load(tmp_path / "prompt.lcc") == 1
        assert m.cache.stats.entries == 2
        assert m.generate(prompt, max_tokens=5).stats.decoded <= 5


def test_pausing_a_fork_counts_each_token_that_lost_its_cells_once(gemma_path: Path) -> None:
    """drop_cells (how the scheduler pauses a generation) on a fork whose window lost the
    shared prefix: the trim falls back, and its shared prefix was counted twice."""
    with lcgen.Model(gemma_path, n_ctx=4096, n_seq_max=2, n_batch=64, swa_full=False) as m:
        parent = m.sequence("A short shared prompt about the sea and the sky. " * 8)
        parent.prefill()
        fork = parent.fork()
        fork.append("Then a long text about mountains and rivers. " * 160)
        fork.generate(max_tokens=2)
        decoded, counted = fork.n_decoded, fork.stats.tokens_redecoded
        lost = fork.drop_cells()
        assert fork.stats.fallbacks == 1  # the window no longer held the shared prefix
        assert lost == decoded - fork.n_decoded
        assert fork.stats.tokens_redecoded - counted == lost


@pytest.mark.parametrize("position", [-1000, 10_000])
def test_a_forged_position_in_the_window_s_own_table_is_refused(
    small_swa: lcgen.Model, position: int
) -> None:
    """Gemma 3's state holds two KV tables, the full-attention layers' and the window's; only
    the first was checked, so a window cell at -1000 loaded (and stayed in the slot)."""
    with small_swa.sequence(TEXT) as seq:
        seq.prefill()
        data = seq.to_bytes()
    header, kv = statefile.decode(data)
    first_end = _check_table(memoryview(kv).cast("B"), 8, True)
    assert first_end is not None and first_end < len(kv)  # a second table follows
    _, count = struct.unpack_from("<II", kv, first_end)
    assert count < seq.n_tokens  # the window's: fewer cells than positions
    forged = bytearray(kv)
    struct.pack_into("<i", forged, first_end + 8, position)  # its first cell's position
    with pytest.raises(lcgen.StateFileError, match="not at consecutive positions"):
        lcgen.Sequence.from_bytes(small_swa, _encoded(header, forged))
    with lcgen.Sequence.from_bytes(small_swa, data) as loaded:  # the state as written loads
        assert loaded.n_tokens == seq.n_tokens


def _encoded(header: dict[str, object], kv: bytearray) -> bytearray:
    def write_kv(out: bytearray, at: int, size: int) -> int:
        out[at : at + size] = kv
        return size

    return statefile.encode(header, len(kv), write_kv)


def test_an_empty_prompt_of_a_batch_is_refused_with_a_bos_token_too(
    small_swa: lcgen.Model,
) -> None:
    """Tokenized, it is the BOS token alone: the batch generated from it where
    ``generate("")`` refuses."""
    assert small_swa.add_bos and small_swa.tokenize("") == [small_swa.bos]
    with pytest.raises(ValueError, match="the sequence is empty"):
        small_swa.generate("", max_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 of the batch is empty"):
        small_swa.generate(["Hi", ""], max_tokens=2)
