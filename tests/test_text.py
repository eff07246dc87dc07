"""Tables and invariants for lcgen.decoding.text: incremental UTF-8 decoding and stop strings."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from typing import AnyStr

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lcgen.decoding.text import (
    NO_STOPS,
    Stops,
    TextState,
    decode_flush,
    decode_step,
    stop_flush,
    stop_step,
    text_flush,
    text_step,
)

REPLACEMENT = "\ufffd"


def decode_all(pieces: list[bytes]) -> tuple[list[str], str]:
    """Run the decoder over ``pieces``; return every step's text and the flushed text."""
    held, texts = b"", []
    for piece in pieces:
        held, text = decode_step(held, piece)
        assert len(held) <= 3
        texts.append(text)
    return texts, decode_flush(held)


def stop_all(pieces: list[str], stops: Stops) -> tuple[list[str], str | None]:
    """Run the stop matcher over ``pieces``; return the emits (flush appended) and the hit."""
    held, emits = "", []
    for piece in pieces:
        held, emit, hit = stop_step(held, piece, stops)
        emits.append(emit)
        if hit is not None:
            return emits, hit
    return [*emits, stop_flush(held)], None


def text_all(pieces: list[bytes], stops: Stops) -> tuple[str, str | None]:
    """Run ``text_step`` over ``pieces``; return the joined stream and the hit."""
    state, emits = TextState(), []
    for piece in pieces:
        state, emit, hit = text_step(state, piece, stops)
        emits.append(emit)
        if hit is not None:
            return "".join(emits), hit
    emit, hit = text_flush(state, stops)
    return "".join(emits) + emit, hit


def reference_cut(
    text: str, strings: tuple[str, ...], include_stop: bool
) -> tuple[str, str | None]:
    """Brute force: the stop that ends first (longest on a tie) and the text cut at it."""
    for end in range(1, len(text) + 1):
        hits = [stop for stop in strings if text[:end].endswith(stop)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include_stop else end - len(stop)], stop
    return text, None


def split_at(data: AnyStr, cuts: list[int]) -> list[AnyStr]:
    """Split ``data`` at the given indices (clamped, sorted, repeats give empty pieces)."""
    bounds = [0, *sorted(min(cut, len(data)) for cut in cuts), len(data)]
    return [data[start:end] for start, end in itertools.pairwise(bounds)]


# --- decoder tables -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("char", "pieces"),
    [
        ("é", [b"\xc3", b"\xa9"]),
        ("日", [b"\xe6", b"\x97\xa5"]),
        ("日", [b"\xe6\x97", b"\xa5"]),
        ("日", [b"\xe6", b"\x97", b"\xa5"]),
        ("😀", [b"\xf0", b"\x9f\x98\x80"]),
        ("😀", [b"\xf0\x9f\x98", b"\x80"]),
        ("😀", [b"\xf0\x9f", b"\x98", b"\x80"]),
        ("😀", [b"\xf0", b"\x9f", b"\x98", b"\x80"]),
    ],
)
def test_character_split_is_held_until_complete(char: str, pieces: list[bytes]) -> None:
    texts, flushed = decode_all(pieces)
    assert texts == [""] * (len(pieces) - 1) + [char]
    assert flushed == ""


def test_token_pieces_of_space_cjk() -> None:
    held, text = decode_step(b"", b" \xe6")
    assert (held, text) == (b"\xe6", " ")
    held, text = decode_step(held, b"\x97")
    assert (held, text) == (b"\xe6\x97", "")
    assert decode_step(held, b"\xa5") == (b"", "日")


@pytest.mark.parametrize(
    "text",
    ["日本語のテキスト", "😀👍🏽🇯🇵 family: 👨‍👩‍👧", "mixed é 日 😀 ascii", "中文\uff0c标点\u3002"],
)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_emoji_and_cjk_in_fixed_chunks(text: str, chunk: int) -> None:
    data = text.encode()
    texts, flushed = decode_all([data[i : i + chunk] for i in range(0, len(data), chunk)])
    assert "".join(texts) == text
    assert REPLACEMENT not in "".join(texts)
    assert flushed == ""


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\xff", REPLACEMENT),
        (b"a\x80b", f"a{REPLACEMENT}b"),
        (b"\xe6\x97A", f"{REPLACEMENT}A"),
        (b"\xf0\x9f\x98 ", f"{REPLACEMENT} "),
        (b"\xc3\xc3\xa9", f"{REPLACEMENT}é"),
    ],
)
@pytest.mark.parametrize("bytewise", [False, True])
def test_invalid_bytes_give_one_replacement(data: bytes, expected: str, bytewise: bool) -> None:
    pieces = [data[i : i + 1] for i in range(len(data))] if bytewise else [data]
    texts, flushed = decode_all(pieces)
    assert "".join(texts) + flushed == expected == data.decode("utf-8", "replace")
    assert expected.count(REPLACEMENT) == 1


@pytest.mark.parametrize(
    "data",
    [
        b"\xe0\x80\x80",  # overlong
        b"\xed\xa0\x80",  # surrogate
        b"\xf4\x90\x80\x80",  # above U+10FFFF
        b"\xc0\xaf",  # never a lead byte
        b"\xf8\x88\x80\x80\x80",  # five-byte form
        b"ok\xf0\x9f\x98",  # truncated at the end: flushed
        b"\xe6\x97\xe6\x97\xa5",
    ],
)
@pytest.mark.parametrize("bytewise", [False, True])
def test_invalid_sequences_match_bytes_decode(data: bytes, bytewise: bool) -> None:
    pieces = [data[i : i + 1] for i in range(len(data))] if bytewise else [data]
    texts, flushed = decode_all(pieces)
    assert "".join(texts) + flushed == data.decode("utf-8", "replace")


@pytest.mark.parametrize(
    ("piece", "held", "text"),
    [
        (b"\xff", b"", REPLACEMENT),
        (b"\x80", b"", REPLACEMENT),
        (b"\xe0\x80", b"", REPLACEMENT * 2),
        (b"\xe0\xa0", b"\xe0\xa0", ""),
        (b"\xf4\x90", b"", REPLACEMENT * 2),
        (b"x\xf4\x8f", b"\xf4\x8f", "x"),
        (b"", b"", ""),
    ],
)
def test_only_valid_unfinished_sequences_are_held(piece: bytes, held: bytes, text: str) -> None:
    assert decode_step(b"", piece) == (held, text)


def test_flush_turns_unfinished_character_into_one_replacement() -> None:
    assert decode_flush(b"\xf0\x9f\x98") == REPLACEMENT
    assert decode_flush(b"") == ""


# --- stop tables ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strings", "pieces", "emits", "hit"),
    [
        # a stop split across 3 pieces
        (("</s>",), ["hello <", "/", "s> ignored"], ["hello ", "", ""], "</s>"),
        # a held prefix that turns out not to be a stop is released
        (("\n\n",), ["a\n", "b"], ["a", "\nb", ""], None),
        (("END",), ["x EN", "D", "!"], ["x ", ""], "END"),
        (("END",), ["x EN", "d"], ["x ", "ENd", ""], None),
        # overlapping stops: "ab" and "b" end together, the longest wins
        (("ab", "b"), ["xa", "b"], ["x", ""], "ab"),
        (("b", "ab"), ["x", "a", "b"], ["x", "", ""], "ab"),
        (("abc", "bcd"), ["za", "bc", "d"], ["z", ""], "abc"),
        (("bcd", "abc"), ["zab", "cd"], ["z", ""], "abc"),
        (("abc", "bcd"), ["zab", "x", "bcd"], ["z", "abx", ""], "bcd"),
        # earliest wins regardless of list order
        (("world", "hello"), ["say hello world"], ["say "], "hello"),
        (("hello", "world"), ["say hello world"], ["say "], "hello"),
        # tie rule: the stop that ends first wins, even when a longer one starts at the same
        # place or around it (generation never runs past a completed stop)
        (("\n\n", "\n"), ["a\n", "\nb"], ["a"], "\n"),
        (("abcd", "bc"), ["ab", "cd"], ["", "a"], "bc"),
        # regex metacharacters are plain text
        (("a.b",), ["axb a.", "b"], ["axb ", ""], "a.b"),
        (("|", "(x"), ["a(", "y|z"], ["a", "(y"], "|"),
        # a stop at the very start, and one spanning many steps
        (("##",), ["##x"], [""], "##"),
        (("<|im_end|>",), ["<", "|", "im", "_", "end", "|", ">"], [""] * 7, "<|im_end|>"),
    ],
)
def test_stop_table(
    strings: tuple[str, ...], pieces: list[str], emits: list[str], hit: str | None
) -> None:
    assert stop_all(pieces, Stops(strings)) == (emits, hit)


@pytest.mark.parametrize(
    ("strings", "pieces", "emitted"),
    [
        (("</s>",), ["hello <", "/", "s> ignored"], "hello </s>"),
        (("ab", "b"), ["xa", "b"], "xab"),
        (("\n\n", "\n"), ["a\n", "\nb"], "a\n"),
        (("abcd", "bc"), ["abcd"], "abc"),
    ],
)
def test_include_stop_emits_the_stop(
    strings: tuple[str, ...], pieces: list[str], emitted: str
) -> None:
    emits, hit = stop_all(pieces, Stops(strings, include_stop=True))
    assert hit is not None
    assert "".join(emits) == emitted
    assert emitted.endswith(hit)


def test_flush_releases_held_prefix_at_end() -> None:
    stops = Stops(("###",))
    held, emit, hit = stop_step("", "x#", stops)
    assert (held, emit, hit) == ("#", "x", None)
    held, emit, hit = stop_step(held, "#", stops)
    assert (held, emit, hit) == ("##", "", None)
    assert stop_flush(held) == "##"


def test_without_stops_everything_passes_through() -> None:
    assert stop_step("", "any text", NO_STOPS) == ("", "any text", None)
    assert stop_step("", "", NO_STOPS) == ("", "", None)


@pytest.mark.parametrize("strings", [("",), ("ok", ""), ("", "")])
def test_empty_stop_raises(strings: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="empty"):
        Stops(strings)


def test_stop_strings_must_not_be_a_bare_str() -> None:
    with pytest.raises(TypeError, match="'stop'"):
        Stops("stop")  # type: ignore[arg-type]


def test_stops_is_a_value() -> None:
    assert Stops(["a", "b"]) == Stops(("a", "b"))  # type: ignore[arg-type]
    assert Stops(("a",)).max_len == 1
    assert hash(Stops(("a",))) == hash(Stops(("a",)))
    variant = dataclasses.replace(Stops(("ab",)), include_stop=True)
    assert stop_step("", "xab", variant) == ("", "xab", "ab")
    assert pickle.loads(pickle.dumps(variant)) == variant


# --- combined text_step ---------------------------------------------------------------------


def test_stop_on_a_character_split_across_pieces() -> None:
    stops = Stops(("日",))
    state, emits = TextState(), []
    for piece in [b" \xe6", b"\x97", b"\xa5", b"ignored"]:
        state, emit, hit = text_step(state, piece, stops)
        emits.append(emit)
        if hit is not None:
            break
    assert (emits, hit, state) == ([" ", "", ""], "日", TextState())


def test_text_state_is_restored_by_reassignment() -> None:
    stops = Stops(("END",))
    state, _, _ = text_step(TextState(), b"ab E\xe6", stops)
    checkpoint = state
    first = text_step(state, b"\x97\xa5N", stops)
    assert text_step(checkpoint, b"\x97\xa5N", stops) == first
    assert checkpoint == TextState(b"\xe6", "E")


def test_text_flush_releases_bytes_and_text() -> None:
    state, emit, _ = text_step(TextState(), b"a#\xe6", Stops(("#!",)))
    assert (state, emit) == (TextState(b"\xe6", "#"), "a")
    assert text_flush(state, Stops(("#!",))) == (f"#{REPLACEMENT}", None)


def test_text_flush_can_hit_a_stop_on_the_replacement_character() -> None:
    stops = Stops((f"#{REPLACEMENT}",))
    state, emit, _ = text_step(TextState(), b"a#\xe6", stops)
    assert emit == "a"
    assert text_flush(state, stops) == ("", f"#{REPLACEMENT}")


# --- invariants -----------------------------------------------------------------------------

byte_strings = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20).map(str.encode),
    st.lists(st.one_of(st.binary(max_size=3), st.text(max_size=3).map(str.encode))).map(b"".join),
)
cut_lists = st.lists(st.integers(min_value=0, max_value=60), max_size=12)


@given(byte_strings, cut_lists)
def test_decoding_does_not_depend_on_the_split(data: bytes, cuts: list[int]) -> None:
    texts, flushed = decode_all(split_at(data, cuts))
    assert "".join(texts) + flushed == data.decode("utf-8", "replace")


ALPHABET = "a.|\n日"
stop_sets = st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4).map(tuple)


@given(st.text(ALPHABET, max_size=30), cut_lists, stop_sets, st.booleans())
def test_stops_do_not_depend_on_the_split(
    text: str, cuts: list[int], strings: tuple[str, ...], include_stop: bool
) -> None:
    emits, hit = stop_all(split_at(text, cuts), Stops(strings, include_stop))
    assert ("".join(emits), hit) == reference_cut(text, strings, include_stop)


@given(st.text(ALPHABET, max_size=30), cut_lists, stop_sets)
def test_held_text_is_minimal_and_nothing_is_retracted(
    text: str, cuts: list[int], strings: tuple[str, ...]
) -> None:
    stops = Stops(strings)
    expected, _ = reference_cut(text, strings, include_stop=False)
    held, emitted, consumed = "", "", ""
    for piece in split_at(text, cuts):
        held, emit, hit = stop_step(held, piece, stops)
        emitted, consumed = emitted + emit, consumed + piece
        assert expected.startswith(emitted)
        if hit is not None:
            return
        prefixes = [s[:k] for s in strings for k in range(1, len(s))]
        longest = max((p for p in prefixes if consumed.endswith(p)), key=len, default="")
        assert held == longest
        assert len(held) <= max(map(len, strings)) - 1
        assert emitted + held == consumed


def is_inside_another(stop: str, strings: tuple[str, ...]) -> bool:
    """Whether ``stop`` occurs in another stop somewhere other than at its end."""
    return any(other != stop and stop in other[:-1] for other in strings)


@given(st.text(ALPHABET, max_size=30), cut_lists, stop_sets)
def test_cut_is_at_the_earliest_start_unless_a_stop_nests_in_another(
    text: str, cuts: list[int], strings: tuple[str, ...]
) -> None:
    emits, _ = stop_all(split_at(text, cuts), Stops(strings))
    if not any(is_inside_another(stop, strings) for stop in strings):
        starts = [text.find(stop) for stop in strings if stop in text]
        assert "".join(emits) == text[: min(starts, default=len(text))]


text_bytes = st.lists(
    st.one_of(st.text("ab日😀é\n", max_size=4).map(str.encode), st.binary(max_size=2))
).map(b"".join)


@given(text_bytes, cut_lists, stop_sets, st.booleans())
def test_text_step_equals_decode_then_cut(
    data: bytes, cuts: list[int], strings: tuple[str, ...], include_stop: bool
) -> None:
    result = text_all(split_at(data, cuts), Stops(strings, include_stop))
    assert result == reference_cut(data.decode("utf-8", "replace"), strings, include_stop)
