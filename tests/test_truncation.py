"""The truncation contract: a constrained output cut before it matched its constraint never
comes back as if it were complete. Calls that return a value raise ``IncompleteOutputError``
with the partial text; streams end with ``finish_reason="length"``."""

from __future__ import annotations

import re

import pydantic
import pytest

import lcgen

OPTIONS = ["a very long first option about the weather", "another long option about the sea"]


class Cat(pydantic.BaseModel):
    name: str
    age: int


def test_a_cut_choice_raises_with_the_partial_text(model: lcgen.Model) -> None:
    with pytest.raises(lcgen.IncompleteOutputError) as info:
        model.generate("Pick one:", choice=OPTIONS, max_tokens=2)
    assert info.value.text not in OPTIONS
    assert any(option.startswith(info.value.text) for option in OPTIONS)


def test_cut_regex_and_grammar_raise(model: lcgen.Model) -> None:
    with pytest.raises(lcgen.IncompleteOutputError, match="max_tokens"):
        model.generate("Call us at", regex=r" \(\d{3}\) \d{3}-\d{4}", max_tokens=2)
    grammar = lcgen.Grammar('root ::= "[" [a-z]+ ("," [a-z]+)* "]"')
    with pytest.raises(lcgen.IncompleteOutputError):
        model.generate("A list:", grammar=grammar, max_tokens=2)


def test_an_output_complete_at_the_limit_is_returned(model: lcgen.Model) -> None:
    text = model.generate("Answer a or b:", choice=["a", "b"], max_tokens=1)
    assert str(text) in ("a", "b")


def test_batches_and_chat_keep_the_contract(model: lcgen.Model) -> None:
    with pytest.raises(lcgen.IncompleteOutputError):
        model.generate(["Pick:", "Choose:"], choice=OPTIONS, max_tokens=2)
    messages = [{"role": "user", "content": "Describe a cat as JSON with a name and an age."}]
    cat = model.chat(messages, schema=Cat, max_tokens=60)
    assert isinstance(cat, Cat)
    with pytest.raises(lcgen.IncompleteOutputError):
        model.chat(messages, schema=Cat, max_tokens=3)


def test_a_cut_stream_ends_with_length(model: lcgen.Model) -> None:
    chunks = list(model.stream("Describe a cat as JSON:", schema=Cat, max_tokens=3))
    assert chunks[-1].finish_reason == "length"
    text = "".join(c.text for c in chunks)
    assert lcgen.Grammar.from_pydantic(Cat).state(model).accepts_text(text, complete=False)


def test_a_stop_token_or_string_that_cuts_a_constrained_output_raises(model: lcgen.Model) -> None:
    grammar = lcgen.Grammar('root ::= " 1 2 3 4 5 6"')
    four = model.tokenize("4", add_bos=False)[0]
    with pytest.raises(lcgen.IncompleteOutputError, match=f"the stop token {four} ") as info:
        model.generate("Count:", grammar=grammar, stop_tokens=[four], fast_forward=False)
    assert info.value.text == " 1 2 3 "
    with pytest.raises(lcgen.IncompleteOutputError, match="the stop string ' 4'"):
        model.generate("Count:", grammar=grammar, stop=" 4", fast_forward=False)
    # cut where the output is complete, or ended by an end token: returned whole
    optional = lcgen.Grammar('root ::= " 1 2 3 " ("4 5 6")?')
    text = model.generate("Count:", grammar=optional, stop_tokens=[four], fast_forward=False)
    assert text == " 1 2 3 " and text.finish_reason == "stop"
    assert model.generate("Yes or no?", choice=["yes", "no"]) in ("yes", "no")


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_an_output_complete_after_healed_text_is_returned(
    model: lcgen.Model, max_tokens: int
) -> None:
    # Token healing backs the prompt off its "2", which the output re-creates: the constraint
    # matches that text first. The check read the output without it, and raised.
    prompt, regex = "My favourite number is 12", r"2[0-9]*"
    options = {"regex": regex, "token_healing": True, "max_tokens": max_tokens}
    chunks = list(model.stream(prompt, **options))  # type: ignore[arg-type]
    streamed = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "length" and re.fullmatch(regex, "2" + streamed)
    assert model.generate(prompt, **options) == streamed  # type: ignore[arg-type]
    assert model.generate([prompt], **options) == [streamed]  # type: ignore[arg-type]
    with model.sequence(model.tokenize(prompt)) as seq:
        assert seq.generate(**options) == streamed  # type: ignore[arg-type]


def test_a_value_max_tokens_cut_where_more_could_follow_raises(model: lcgen.Model) -> None:
    """-1 of -10000, "yes" of "yes please": it matches, but max_tokens cut it, and was
    returned as the value."""
    with pytest.raises(lcgen.IncompleteOutputError, match="may be incomplete") as info:
        model.generate("Do you want it? Answer: ", choice=["yes", "yes please"], max_tokens=1)
    assert info.value.text == "yes"
    with pytest.raises(lcgen.IncompleteOutputError, match="raise max_tokens"):
        model.generate("JSON:\n", schema={"type": "integer"}, max_tokens=2)
    # What cannot go on is whole, and a grammar or regex's text is not a value (the text
    # of a cut one comes back with finish_reason "length", as without a constraint).
    assert model.generate("Answer a or b:", choice=["a", "b"], max_tokens=1) in ("a", "b")
    digits = model.generate("Numbers: 1, 2, ", regex="[0-9]+", max_tokens=1)
    assert digits.finish_reason == "length" and re.fullmatch("[0-9]+", digits)
