"""Function calling in the library: ``model.chat(messages, tools=...)`` and ``chat_stream``.

Tools made from a function, a pydantic model, OpenAI's dict or a Tool agree; every call a
reply makes validates against its function's parameters, and ``Tool.invoke`` runs it with
them validated; a streamed reply joins to the whole one, its calls in the last chunk and never
as text; earlier tool turns go back into the prompt; a chat loop reuses its prefix from the KV
cache. Bad input is refused, named.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import pytest
from helpers import SET_UNIT, SET_VOLUME, validate
from pydantic import Field

import lcgen
import lcgen.tools
from lcgen import Chunk, Tool, ToolCall
from lcgen.decoding.results import parse_structured


def get_weather(
    city: Annotated[str, Field(description="The city's name", max_length=20)],
    unit: Literal["celsius", "fahrenheit"] = "celsius",
) -> str:
    """The weather in a city now.

    Args:
        city: the city.
        unit: the temperature's unit.
    """
    return f"18 {'C' if unit == 'celsius' else 'F'}, sunny in {city}"


def get_time(zone: Annotated[str, Field(max_length=12)]) -> str:
    """The time in a time zone."""
    return f"12:00 in {zone}"


class GetWeather(pydantic.BaseModel):
    """The weather in a city now."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: Annotated[str, Field(description="The city's name", max_length=20)]
    unit: Literal["celsius", "fahrenheit"] = "celsius"


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SWITCH = [{"role": "user", "content": "Switch to celsius and turn the volume to 3."}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@pytest.fixture(scope="module")
def chat_model(model_path: Path) -> Iterator[lcgen.Model]:
    with lcgen.Model(model_path, n_threads=1) as m:
        yield m


def check_calls(reply: lcgen.Text, tools: list[Any]) -> list[ToolCall]:
    """The reply's calls, each checked: a fresh id, a known function, arguments valid for its
    parameters; the reply's text is then empty."""
    by_name = {t.name: t for t in map(Tool.of, tools)}
    calls = list(reply.tool_calls)
    assert calls and str(reply) == ""
    for call in calls:
        assert CALL_ID.fullmatch(call.id), call
        validate(call.arguments, by_name[call.name].parameters)
    assert len({call.id for call in calls}) == len(calls)
    return calls


# tools as values ------------------------------------------------------------------------------
def test_a_function_a_model_a_dict_and_a_tool_agree() -> None:
    function = Tool.of(get_weather)
    assert function.name == "get_weather"
    assert function.description == "The weather in a city now."  # the first paragraph
    params = function.parameters
    assert params is not None and params["required"] == ["city"]
    assert params["properties"]["unit"]["default"] == "celsius"
    assert params["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert params["properties"]["city"]["description"] == "The city's name"
    validate({"city": "Oslo"}, params)
    with pytest.raises(Exception, match="kelvin"):
        validate({"city": "Oslo", "unit": "kelvin"}, params)
    model = Tool.of(GetWeather)
    assert (model.name, model.description) == ("GetWeather", function.description)
    assert model.parameters == params  # the title and description moved to the tool
    as_dict = {"type": "function", "function": {"name": "get_weather", **_fields(function)}}
    assert Tool.of(as_dict) == function == Tool.of(function.as_openai())
    assert Tool.of(function) is function
    grammars = {
        lcgen.tools.grammar([Tool.of(t)], required=True).gbnf
        for t in (get_weather, as_dict, Tool("get_weather", params, "other words"))
    }
    assert len(grammars) == 1


def _fields(tool: Tool) -> dict[str, Any]:
    return {"description": tool.description, "parameters": tool.parameters}


def test_text_annotations_are_read_in_the_functions_own_globals() -> None:
    # Code run by exec (a notebook cell, a pasted snippet) under `from __future__ import
    # annotations`: its module is not importable, so pydantic alone cannot read "Literal".
    namespace: dict[str, Any] = {"__name__": "pasted"}
    code = (
        "from __future__ import annotations\nfrom typing import Literal\n"
        "def pick(unit: Literal['c', 'f'] = 'c') -> str:\n    return unit\n"
    )
    exec(compile(code, "snippet", "exec", dont_inherit=True), namespace)
    tool = Tool.of(namespace["pick"])
    assert tool.parameters is not None
    assert tool.parameters["properties"]["unit"]["enum"] == ["c", "f"]


def test_a_function_without_parameters_or_docstring() -> None:
    def ring() -> None:
        pass

    tool = Tool.of(ring)
    assert tool.description is None
    assert tool.parameters == {"type": "object", "properties": {}, "additionalProperties": False}


def _starred(*numbers: int) -> int:
    return sum(numbers)


def _keywords(**options: str) -> None:
    pass


def _positional(a: int, /) -> None:
    pass


class _Opaque:
    """A type pydantic has no JSON Schema for."""


def _unknown_type(thing: _Opaque) -> None:
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tools": [_starred]}, TypeError, r"'_starred' takes \*numbers"),
        ({"tools": [_keywords]}, TypeError, r"'_keywords' takes \*\*options"),
        ({"tools": [_positional]}, TypeError, r"'_positional' has the positional-only .*'a'"),
        ({"tools": [_unknown_type]}, TypeError, "'_unknown_type'"),
        ({"tools": [lambda city: city]}, ValueError, "'<lambda>'"),
        ({"tools": [Tool("get_weather"), get_weather]}, ValueError, "two tools .*'get_weather'"),
        ({"tools": [42]}, TypeError, "got 42"),
        ({"tools": [int]}, TypeError, "int"),
        ({"tools": [{"name": "f"}]}, TypeError, "'name': 'f'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]},
            TypeError,
            "args",
        ),
        ({"tools": get_weather}, TypeError, r"tools=\[it\]"),
        (
            {"tools": [get_weather], "tool_choice": "get_time"},
            ValueError,
            r"'get_time'.*\['get_weather'\]",
        ),
        ({"tools": [get_weather], "tool_choice": 3}, TypeError, "got 3"),
        ({"tool_choice": "required"}, ValueError, "'required' needs tools"),
        ({"tools": [get_weather], "parallel_tool_calls": "yes"}, TypeError, "'yes'"),
        ({"tools": [get_weather], "schema": GetWeather}, ValueError, "schema in Model.chat"),
        ({"tools": [get_weather], "regex": "a"}, ValueError, "regex in Model.chat"),
        ({"tools": [get_weather], "choice": ["a"]}, ValueError, "choice in Model.chat"),
        ({"tools": [get_weather], "grammar": lcgen.Grammar('root ::= "a"')}, ValueError, "grammar"),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_bad_tool_options_are_refused_and_named(
    chat_model: lcgen.Model,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
    streamed: bool,
) -> None:
    with pytest.raises(error, match=match):
        if streamed:
            list(chat_model.chat_stream(ASK, max_tokens=1, **kwargs))
        else:
            chat_model.chat(ASK, max_tokens=1, **kwargs)


@pytest.mark.parametrize(
    ("name", "error"),
    [("a b", ValueError), ("", ValueError), ("x" * 65, ValueError), (5, TypeError)],
)
def test_a_tool_name_is_checked(name: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=re.escape(repr(name)[:20])):
        Tool(name)


# history ------------------------------------------------------------------------------------
def test_earlier_tool_turns_are_written_into_the_prompt(chat_model: lcgen.Model) -> None:
    call = ToolCall("call_1", "get_weather", {"city": "Paris"})
    turn: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    as_dicts: list[dict[str, Any]] = [
        *ASK,
        {**turn[1], "content": "", "tool_calls": [call.as_openai()]},
        turn[2],
    ]
    prompt = chat_model.format_chat(turn)
    assert prompt == chat_model.format_chat(as_dicts)  # a ToolCall or OpenAI's dict
    assert json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}) in prompt
    assert "The function get_weather returned: 18 C" in prompt
    told = chat_model.format_chat(turn, tools=[get_weather])
    assert told.endswith(prompt.split("<|im_start|>user", 1)[1])  # the same turns after it
    assert "You can call these functions:" in told and "You can call" not in prompt
    assert chat_model.format_chat(turn, tools=[get_weather], tool_choice="none") == prompt


def test_a_result_names_its_call_where_a_function_was_called_twice(
    chat_model: lcgen.Model,
) -> None:
    """Results of two calls of one function came back as 'The function get_weather returned'
    twice: sent in another order, the model read Rome's weather as Oslo's."""
    oslo = ToolCall("call_1", "get_weather", {"city": "Oslo"})
    rome = ToolCall("call_2", "get_weather", {"city": "Rome"})
    turn: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [oslo, rome]},
        {"role": "tool", "tool_call_id": "call_2", "content": "30 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "-5 C"},
    ]
    prompt = chat_model.format_chat(turn)
    assert 'get_weather (called with {"city": "Rome"}) returned: 30 C' in prompt
    assert 'get_weather (called with {"city": "Oslo"}) returned: -5 C' in prompt


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        ({"role": "tool", "content": "18 C"}, ValueError, "tool_call_id"),
        (
            {"role": "tool", "tool_call_id": "call_X", "content": "18 C"},
            ValueError,
            "message 1 answers the call 'call_X', which no assistant message before it made",
        ),
        ({"role": "user", "content": "hi", "tool_calls": []}, ValueError, "only an assistant"),
        ({"role": "assistant", "content": None, "tool_calls": "f"}, TypeError, "'f'"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}, TypeError, "'id': 1"),
        ({"role": "assistant", "content": None}, ValueError, "'content'"),
    ],
)
def test_bad_tool_turns_are_refused_and_named(
    chat_model: lcgen.Model, message: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        chat_model.chat_tokens([*ASK, message])


# replies ------------------------------------------------------------------------------------
def test_required_and_named_calls_validate(chat_model: lcgen.Model) -> None:
    tools: list[Any] = [get_weather, get_time]
    reply = chat_model.chat(ASK, tools=tools, tool_choice="required", max_tokens=60)
    check_calls(reply, tools)
    assert reply.finish_reason == "tool_calls" and reply.tokens  # its tokens kept
    for choice in ("get_time", {"type": "function", "function": {"name": "get_time"}}):
        named = chat_model.chat(ASK, tools=tools, tool_choice=choice, max_tokens=60)
        assert {call.name for call in check_calls(named, tools)} == {"get_time"}


def test_auto_replies_in_text_or_calls(chat_model: lcgen.Model) -> None:
    hello = [{"role": "user", "content": "Say hello."}]
    text = chat_model.chat(hello, tools=[get_weather], max_tokens=12)
    assert text and text.tool_calls == () and not text.startswith(("{", "["))
    assert text.finish_reason in ("stop", "length")
    # A bias on "{" makes the reply open a call: the grammar then holds it to a valid one.
    (brace,) = chat_model.tokenize("{")
    called = chat_model.chat(ASK, tools=[get_weather], max_tokens=60, logit_bias={brace: 100})
    check_calls(called, [get_weather])
    # tool_choice "none": a plain reply, which may then take its own constraint.
    plain = chat_model.chat(ASK, tools=[get_weather], tool_choice="none", choice=["yes", "no"])
    assert plain in ("yes", "no") and plain.tool_calls == ()


def test_parallel_calls_and_one_call(chat_model: lcgen.Model) -> None:
    tools = [SET_UNIT, SET_VOLUME]
    # "[" opens only an array of calls here (the arguments take no arrays): a bias on it
    # makes the reply several calls, each valid (the small model may repeat them).
    (bracket,) = chat_model.tokenize("[")
    options: dict[str, Any] = {"tool_choice": "required", "logit_bias": {bracket: 100}}
    several = chat_model.chat(SWITCH, tools=tools, max_tokens=400, **options)
    assert 2 <= len(check_calls(several, tools)) <= lcgen.tools.MAX_PARALLEL
    one = chat_model.chat(SWITCH, tools=tools, parallel_tool_calls=False, max_tokens=60, **options)
    assert len(check_calls(one, tools)) == 1


def test_a_tool_loop_reuses_the_prefix(chat_model: lcgen.Model) -> None:
    """The typical loop: the call, its result, the next reply; the functions are told in the
    system message, so the second call decodes only the new turn."""
    chat_model.cache.clear()
    messages: list[dict[str, Any]] = list(ASK)
    first_prompt = chat_model.chat_tokens(messages, tools=[get_weather])
    (brace,) = chat_model.tokenize("{")
    reply = chat_model.chat(messages, tools=[get_weather], max_tokens=60, logit_bias={brace: 100})
    check_calls(reply, [get_weather])
    messages.append({"role": "assistant", "content": reply, "tool_calls": reply.tool_calls})
    for call in reply.tool_calls:
        result = get_weather(**call.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    prompt = chat_model.chat_tokens(messages, tools=[get_weather])
    assert "The function get_weather returned: 18 C, sunny in" in chat_model.detokenize(prompt)
    positions: list[int] = []

    def first_position(step: lcgen.Step) -> None:
        positions.append(step.position)

    before = chat_model.cache.stats
    answer = chat_model.chat(messages, tools=[get_weather], max_tokens=60, hooks=[first_position])
    if answer.tool_calls:
        check_calls(answer, [get_weather])
    assert positions[0] == len(prompt)  # the reply followed exactly that prompt
    reused = chat_model.cache.stats.tokens_reused - before.tokens_reused
    assert len(first_prompt) - 1 <= reused < len(prompt)
    assert answer.stats.decoded <= len(prompt) - reused + len(answer.tokens)


# streamed replies ---------------------------------------------------------------------------
# tools, options, a character the reply is biased to open with ("{": a call, "[": several),
# whether the reply calls them
STREAMED = [
    pytest.param([get_weather, get_time], {"tool_choice": "required"}, None, True, id="required"),
    pytest.param([GetWeather], {"tool_choice": "GetWeather"}, None, True, id="named-model"),
    pytest.param([get_weather], {}, "{", True, id="auto-calls"),
    pytest.param([get_weather], {}, None, False, id="auto-text"),
    pytest.param([get_weather], {"tool_choice": "none"}, None, False, id="none"),
    pytest.param(
        [SET_UNIT, SET_VOLUME],
        {"tool_choice": "required", "max_tokens": 400},
        "[",
        True,
        id="several",
    ),
]


@pytest.mark.parametrize(("tools", "options", "opens", "calls"), STREAMED)
def test_a_streamed_reply_joins_to_the_whole_reply(
    chat_model: lcgen.Model,
    tools: list[Any],
    options: dict[str, Any],
    opens: str | None,
    calls: bool,
) -> None:
    kwargs = {"tools": tools, "max_tokens": 120, "logprobs": 1, **options}
    if opens is not None:
        (token,) = chat_model.tokenize(opens)
        kwargs["logit_bias"] = {token: 100}
    ask = SWITCH if SET_UNIT in tools else ASK
    chat_model.cache.clear()  # both decode the prompt alike: the same logits, bit for bit
    chunks = list(chat_model.chat_stream(ask, **kwargs))
    chat_model.cache.clear()
    whole = chat_model.chat(ask, **kwargs)
    joined = lcgen.Text.of(chunks)
    assert (str(joined), joined.tokens, joined.finish_reason) == (
        str(whole),
        whole.tokens,
        whole.finish_reason,
    )
    assert joined.logprobs == whole.logprobs  # a call's tokens and log-probabilities kept
    assert [(c.name, c.arguments) for c in joined.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    *body, last = chunks
    assert all(c.finish_reason is None and c.tool_calls == () for c in body)
    if calls:  # no chunk streams the calls' JSON as text
        check_calls(joined, tools)
        assert all(c.text == "" for c in chunks) and last.finish_reason == "tool_calls"
        assert last.tool_calls == joined.tool_calls
    else:  # text streams as it comes
        assert whole.tool_calls == () and sum(bool(c.text) for c in chunks) > 1
        assert last.finish_reason in ("stop", "length")


def test_a_streamed_call_cut_short_raises_as_chat_does(chat_model: lcgen.Model) -> None:
    kwargs: dict[str, Any] = {"tools": [get_weather], "tool_choice": "required", "max_tokens": 5}
    seen: list[Chunk] = []
    with pytest.raises(lcgen.IncompleteOutputError, match="raise max_tokens") as streamed:
        for chunk in chat_model.chat_stream(ASK, **kwargs):
            seen.append(chunk)
    with pytest.raises(lcgen.IncompleteOutputError) as whole:
        chat_model.chat(ASK, **kwargs)
    assert streamed.value.text == whole.value.text and streamed.value.text.startswith('{"')
    assert seen and all(c.text == "" for c in seen)  # the JSON was never streamed


def _chunk(text: str, end: lcgen.decoding.results.FinishReason | None = None) -> Chunk:
    return Chunk(text, (len(text),), end)


CALL = '{"name": "f", "arguments": {"a": 1}}'


@pytest.mark.parametrize(
    ("pieces", "parallel", "texts", "calls"),
    [
        (["", "Hel", "lo {"], True, ["", "Hel", "lo {"], 0),  # text as it comes
        (["", CALL[:3], CALL[3:20], CALL[20:]], False, ["", "", "", ""], 1),  # a call split
        ([f"[{CALL}, ", f"{CALL}]"], True, ["", ""], 2),  # several
        (["[1]"], False, ["[1]"], 0),  # "[" opens text where calls are one at most
        ([""], True, [""], 0),  # nothing
    ],
)
def test_a_tool_plan_streams_text_and_holds_calls(
    pieces: list[str], parallel: bool, texts: list[str], calls: int
) -> None:
    plan = lcgen.tools.ToolPlan((Tool("f"),), parallel=parallel)
    chunks = [_chunk(p) for p in pieces[:-1]] + [_chunk(pieces[-1], "stop")]
    out = list(plan.stream(chunks))
    assert [c.text for c in out] == texts and [c.tokens for c in out] == [c.tokens for c in chunks]
    assert len(out[-1].tool_calls) == calls
    assert out[-1].finish_reason == ("tool_calls" if calls else "stop")
    if not calls:
        assert out == chunks  # a text reply's chunks, as they were


def test_a_tool_plan_releases_json_of_its_format_and_refuses_a_cut_call() -> None:
    json_text = [_chunk('{"answer": '), _chunk("42}", "stop")]
    formatted = lcgen.tools.ToolPlan((Tool("f"),), reply_format={"type": "object"})
    assert [c.text for c in formatted.stream(json_text)] == ["", '{"answer": 42}']
    plain = lcgen.tools.ToolPlan((Tool("f"),))
    with pytest.raises(lcgen.IncompleteOutputError, match="stop string '}' cut it") as cut:
        list(plain.stream([_chunk(CALL[:10]), replace(_chunk(CALL[10:-1], "stop"), stop="}")]))
    assert cut.value.text == CALL[:-1]


# invoking a call ----------------------------------------------------------------------------
class Trip(pydantic.BaseModel):
    city: str
    day: datetime.date


def plan_trip(trip: Trip, nights: int = 1) -> str:
    """Plan a trip."""
    assert isinstance(trip, Trip) and isinstance(trip.day, datetime.date)  # validated
    return f"{nights} nights in {trip.city} from {trip.day:%d %b}"


class Loud(pydantic.BaseModel):
    word: str

    @pydantic.field_validator("word")
    @classmethod
    def _upper(cls, word: str) -> str:
        if word != word.upper():
            raise ValueError("say it in capitals")
        return word


def test_a_reply_s_calls_are_invoked_with_validated_arguments(chat_model: lcgen.Model) -> None:
    weather, of_model = Tool.of(get_weather), Tool.of(GetWeather)
    tools = [weather, of_model]
    for tool in tools:
        reply = chat_model.chat(ASK, tools=tools, tool_choice=tool.name, max_tokens=60)
        (call,) = check_calls(reply, tools)
        result = tool.invoke(call)
        if tool is of_model:  # the validated instance
            assert isinstance(result, GetWeather) and result.model_dump() == {
                "unit": "celsius",
                **call.arguments,
            }
        else:
            assert result == get_weather(**call.arguments)
    trip = Tool.of(plan_trip)
    arguments = {"trip": {"city": "Rome", "day": "2025-05-01"}}
    assert trip.invoke(ToolCall.new("plan_trip", arguments)) == "1 nights in Rome from 01 May"


def test_invoking_refuses_and_names_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="'get_time', not 'get_weather'"):
        Tool.of(get_weather).invoke(ToolCall.new("get_time", {"zone": "UTC"}))
    with pytest.raises(TypeError, match="'set_unit' has no function"):
        Tool.of(SET_UNIT).invoke(ToolCall.new("set_unit", {"unit": "celsius"}))
    with pytest.raises(lcgen.SchemaValidationError, match="capitals") as refused:
        Tool.of(Loud).invoke(ToolCall.new("Loud", {"word": "hi"}))
    assert json.loads(refused.value.text) == {"word": "hi"}
    # A call made by hand may not match the schema at all: not said to have matched it.
    hand = ToolCall("call_7", "get_weather", {})
    with pytest.raises(lcgen.SchemaValidationError, match="the call call_7") as refused:
        Tool.of(get_weather).invoke(hand)
    assert "matched the JSON Schema" not in str(refused.value)
    with pytest.raises(TypeError, match="callable, got 3"):
        Tool("f", function=3)  # type: ignore[arg-type]
    assert Tool("f", function=len) == Tool("f")  # the function is not what the model is told


def test_a_pasted_function_is_invoked_with_its_own_types() -> None:
    namespace: dict[str, Any] = {"__name__": "pasted"}
    code = (
        "from __future__ import annotations\nimport datetime\n"
        "def days(since: datetime.date) -> int:\n"
        "    return (datetime.date(2025, 1, 2) - since).days\n"
    )
    exec(compile(code, "snippet", "exec", dont_inherit=True), namespace)
    call = ToolCall.new("days", {"since": "2025-01-01"})
    assert Tool.of(namespace["days"]).invoke(call) == 1


class StrictEvent(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True)
    day: datetime.date


def test_a_strict_model_takes_its_json_as_pydantic_reads_json() -> None:
    # validated as Python values, a strict model refused "2025-01-01" for a date: always
    call = ToolCall.new("StrictEvent", {"day": "2025-01-01"})
    assert Tool.of(StrictEvent).invoke(call) == StrictEvent(day=datetime.date(2025, 1, 1))
    parsed = parse_structured('{"day": "2025-01-01"}', StrictEvent)
    assert parsed == StrictEvent(day=datetime.date(2025, 1, 1))


class Search(pydantic.BaseModel):
    """Search the web."""

    query: str


class Address(pydantic.BaseModel):
    street: str
    properties: dict[str, int] = pydantic.Field(default={"properties": 1})


class Loose(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    note: str


def book(where: Address, loose: Loose) -> str:
    """Book a room."""
    return str(where)


def test_pydantic_objects_in_tools_take_no_other_keys_unless_they_allow_them() -> None:
    # As schema= reads a pydantic model: extra="ignore" (the default) and "forbid" admit no
    # other keys, extra="allow" does; a dict field and data values stay as they are.
    assert Tool.of(Search).parameters == {
        "type": "object",
        "properties": {"query": {"title": "Query", "type": "string"}},
        "required": ["query"],
        "additionalProperties": False,
    }
    params = Tool.of(book).parameters
    assert params is not None
    address, loose = params["$defs"]["Address"], params["$defs"]["Loose"]
    assert address["additionalProperties"] is False
    assert address["properties"]["properties"]["additionalProperties"] == {"type": "integer"}
    assert address["properties"]["properties"]["default"] == {"properties": 1}
    assert "additionalProperties" not in address["properties"]  # a field, not a keyword
    assert loose["additionalProperties"] is True
    validate({"where": {"street": "Main"}, "loose": {"note": "x", "more": 1}}, params)
    with pytest.raises(Exception, match="extra"):
        validate({"where": {"street": "Main", "extra": 1}, "loose": {"note": "x"}}, params)


def test_a_pydantic_tool_s_call_has_only_its_fields(chat_model: lcgen.Model) -> None:
    ask = [{"role": "user", "content": "Search for cats"}]
    reply = chat_model.chat(ask, tools=[Search], tool_choice="required", max_tokens=60)
    (call,) = check_calls(reply, [Search])
    assert set(call.arguments) == {"query"}


class Priced(pydantic.BaseModel):
    """Price an item."""

    amount: decimal.Decimal = Field(max_digits=4, decimal_places=2)


class Booking(pydantic.BaseModel):
    """Book a table."""

    when: pydantic.FutureDate


def lookup(ids: dict[int, str]) -> str:
    """Look up users by numeric id."""
    return repr(ids)


def _call(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "arguments": {arguments}}}'


@pytest.mark.parametrize(
    ("tool", "arguments", "accepted"),
    [
        (Priced, '{"amount": 12.5}', True),
        (Priced, '{"amount": "12.50"}', True),
        (Priced, '{"amount": 12.345}', False),  # decimal_places=2
        (Priced, '{"amount": 123.4}', False),  # max_digits=4
        (Priced, '{"amount": "x"}', False),
        (lookup, '{"ids": {"12": "ann"}}', True),
        (lookup, '{"ids": {"ids": "123"}}', False),  # pydantic reads the keys as ints
    ],
)
def test_a_pydantic_tool_s_grammar_keeps_to_what_pydantic_checks(
    chat_model: lcgen.Model, tool: Any, arguments: str, accepted: bool
) -> None:
    # As schema= reads a model: the model is told pydantic's schema, the grammar holds the
    # arguments to what pydantic's validation takes, so invoking a call never refuses it.
    made = Tool.of(tool)
    validate(json.loads(arguments), made.parameters)  # pydantic's schema takes them all
    grammar = lcgen.tools.grammar([made], required=True)
    assert grammar.accepts(chat_model, _call(made.name, arguments)) is accepted
    if accepted:
        made.invoke(ToolCall.new(made.name, json.loads(arguments)))
    # The tool equals its dict form given the function back; other parameters are held to
    # as they are (the stricter schema holds only for pydantic's own).
    assert dataclasses.replace(Tool.of(made.as_openai()), function=tool) == made
    other = {"type": "object", "properties": {"n": {"type": "integer"}}}
    changed = dataclasses.replace(made, parameters=other)
    changed_grammar = lcgen.tools.grammar([changed], required=True)
    assert changed_grammar.accepts(chat_model, _call(made.name, '{"n": 1}'))


def test_a_tool_of_a_type_no_grammar_holds_to_is_refused_as_schema_does(
    chat_model: lcgen.Model,
) -> None:
    with pytest.raises(lcgen.GrammarError, match="FutureDate"):
        chat_model.chat(ASK, schema=Booking, max_tokens=1)
    with pytest.raises(lcgen.GrammarError, match="FutureDate"):
        chat_model.chat(ASK, tools=[Booking], max_tokens=1)


class Inner(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True)
    when: datetime.date


class Color(enum.Enum):
    RED = "red"


def strict_plan(
    inner: Inner,
    day: Annotated[datetime.date, pydantic.Strict()],
    color: Annotated[Color, pydantic.Strict()],
    code: Annotated[uuid.UUID, pydantic.Strict()],
    pair: Annotated[tuple[int, int], pydantic.Strict()],
) -> tuple[Any, ...]:
    """Plan with strict parameters."""
    return inner, day, color, code, pair


def test_a_function_s_strict_parameters_take_their_json_forms() -> None:
    # validated as Python values, every strict parameter refused the JSON the grammar wrote
    code = "123e4567-e89b-12d3-a456-426614174000"
    arguments = {
        "inner": {"when": "2024-01-02"},
        "day": "2025-03-04",
        "color": "red",
        "code": code,
        "pair": [1, 2],
    }
    tool = Tool.of(strict_plan)
    validate(arguments, tool.parameters)
    assert tool.invoke(ToolCall.new("strict_plan", arguments)) == (
        Inner(when=datetime.date(2024, 1, 2)),
        datetime.date(2025, 3, 4),
        Color.RED,
        uuid.UUID(code),
        (1, 2),
    )
    with pytest.raises(lcgen.SchemaValidationError, match="pair"):
        tool.invoke(ToolCall.new("strict_plan", {**arguments, "pair": [1, 2, 3]}))


@pytest.mark.parametrize(("whitespace", "pretty"), [("flexible", True), ("compact", False)])
def test_a_tool_plan_s_calls_take_the_json_whitespace(
    chat_model: lcgen.Model, whitespace: Literal["flexible", "compact"], pretty: bool
) -> None:
    call = {"name": "get_weather", "arguments": {"city": "Rome"}}
    plan = lcgen.tools.ToolPlan((Tool.of(get_weather),), required=True)
    grammar = plan.grammar(whitespace)
    assert grammar.accepts(chat_model, json.dumps(call, separators=(",", ":")))
    assert grammar.accepts(chat_model, json.dumps(call, indent=2)) is pretty
    with pytest.raises(ValueError, match="'tight'"):
        plan.grammar("tight")  # type: ignore[arg-type]


def test_compact_json_whitespace_writes_the_calls_without_whitespace(
    chat_model: lcgen.Model,
) -> None:
    options: dict[str, Any] = {"tools": [get_weather], "tool_choice": "required", "max_tokens": 60}
    reply = chat_model.chat(ASK, json_whitespace="compact", **options)
    (call,) = reply.tool_calls
    text = chat_model.detokenize(reply.tokens)
    compact = json.dumps({"name": call.name, "arguments": call.arguments}, separators=(",", ":"))
    assert text == compact
    streamed = lcgen.Text.of(chat_model.chat_stream(ASK, json_whitespace="compact", **options))
    assert chat_model.detokenize(streamed.tokens) == text


def test_results_and_a_question_after_them_make_one_user_turn() -> None:
    # Templates such as Gemma's, Mistral's and Llama 2's refuse two user turns in a row: the
    # results of parallel calls, and a question after a result, each made one more.
    def call(call_id: str, q: str) -> dict[str, Any]:
        arguments = json.dumps({"q": q})
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": "f", "arguments": arguments},
        }

    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Look up cats and dogs"},
        {"role": "assistant", "content": None, "tool_calls": [call("a", "cats"), call("b", "dog")]},
        {"role": "tool", "tool_call_id": "a", "content": "meow"},
        {"role": "tool", "tool_call_id": "b", "content": "woof"},
        {"role": "user", "content": "And birds?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c", "birds")]},
        {"role": "tool", "tool_call_id": "c", "content": "tweet"},
    ]
    out = lcgen.tools.prompt_messages(messages)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant", "user"]
    assert out[2]["content"] == (
        'The function f (called with {"q": "cats"}) returned: meow\n\n'
        'The function f (called with {"q": "dog"}) returned: woof\n\nAnd birds?'
    )
    assert out[4]["content"] == "The function f returned: tweet"
    # A user turn of content parts stays a turn of its own (nothing to join it to as text).
    parts = [{"type": "text", "text": "And birds?"}]
    out = lcgen.tools.prompt_messages([*messages[:4], {"role": "user", "content": parts}])
    assert [m["role"] for m in out] == ["user", "assistant", "user", "user"]
