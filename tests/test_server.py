"""``lcgen serve``: the OpenAI-compatible server, driven with the official ``openai`` client.

The server runs in a background thread of this process on a free port of 127.0.0.1, over the
session's model (one subprocess test starts ``python -m lcgen.server`` itself).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import http.client
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import openai
import pydantic
import pytest
from helpers import (
    SET_UNIT,
    SET_VOLUME,
    UNIQUE_DIGITS,
    assert_same_up_to_a_near_tie,
    many_words_grammar,
    running,
    validate,
)

import lcgen
import lcgen.server
import lcgen.tools
from lcgen.server.app import create_app
from lcgen.tools import parse_calls

NAME = "smollm2-135m"
KEY = "test-key"
USER = [{"role": "user", "content": "Name three colors."}]


# a server in a thread --------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(model: lcgen.Model) -> Iterator[str]:
    with running(create_app(model, model_name=NAME, api_key=KEY)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def request(
    url: str, path: str, body: bytes | None = None, key: str | None = KEY
) -> tuple[int, dict[str, Any]]:
    """A raw HTTP request: (status, JSON body)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def health(url: str) -> dict[str, Any]:
    status, body = request(url, "/health", key=None)
    assert status == 200
    return body


def chat(client: openai.OpenAI, **options: Any) -> Any:
    options.setdefault("messages", USER)
    options.setdefault("temperature", 0)
    return client.chat.completions.create(model=NAME, **options)


def streamed_texts(stream: Any, kind: str = "chat") -> tuple[dict[int, str], list[Any]]:
    """Each choice's joined text, and the chunks."""
    texts: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            part = (choice.delta.content if kind == "chat" else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + part
    return texts, chunks


# the scheduler's cancel ----------------------------------------------------------------------
def test_scheduler_cancel_drops_waiting_and_running_work(model: lcgen.Model) -> None:
    seqs = [model.sequence(p) for p in ("One", "Two", "Three")]
    scheduler = lcgen.Scheduler(model.cache)
    runs = [s.run(max_tokens=6) for s in seqs]
    tickets = [scheduler.submit(lambda run=run: run) for run in runs]  # type: ignore[misc]
    scheduler.step()  # all three admitted and stepped once
    assert scheduler.cancel(tickets[1]) is runs[1]
    assert scheduler.cancel(tickets[1]) is None  # no longer known
    waiting = scheduler.submit(lambda: runs[0])
    assert scheduler.cancel(waiting) is None  # never started
    seen = {event.ticket for event in scheduler}
    assert seen == {tickets[0], tickets[2]}
    assert len(runs[1].generator.tokens) == 1 and not runs[1].is_done
    for s in seqs:
        s.close()


# chat and completion ---------------------------------------------------------------------------
def test_chat_stream_joins_to_the_whole_reply(client: openai.OpenAI, model: lcgen.Model) -> None:
    whole = chat(client, max_tokens=24)
    stream = chat(client, max_tokens=24, stream=True, stream_options={"include_usage": True})
    texts, chunks = streamed_texts(stream)
    assert texts == {0: whole.choices[0].message.content}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens > 0
    assert whole.usage.prompt_tokens == len(model.chat_tokens(USER))
    # the second call found the prompt cached, with the logits after it
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens
    # the chunks before the usage chunk say "usage": null, as OpenAI's
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])
    # every object names the set-up that made it (what a seed's output depends on besides it)
    fingerprint = model.system_fingerprint
    assert fingerprint.startswith("fp_") and whole.system_fingerprint == fingerprint
    assert {c.system_fingerprint for c in chunks} == {fingerprint}
    options = {"include_usage": False, "include_obfuscation": False}  # accepted, nothing padded
    assert (
        streamed_texts(chat(client, max_tokens=24, stream=True, stream_options=options))[0] == texts
    )
    with pytest.raises(openai.BadRequestError, match="only allowed with stream: true"):
        chat(client, max_tokens=2, stream_options={"include_usage": True})


def test_completion_n3_seeded_stream_equals_whole(
    client: openai.OpenAI, model: lcgen.Model
) -> None:
    options: dict[str, Any] = {
        "model": NAME,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "n": 3,
        "temperature": 0.9,
        "seed": 11,
    }
    whole = client.completions.create(**options)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    texts, chunks = streamed_texts(client.completions.create(stream=True, **options), "text")
    assert texts == {c.index: c.text for c in whole.choices}
    fingerprints = {whole.system_fingerprint, *(c.system_fingerprint for c in chunks)}
    assert fingerprints == {model.system_fingerprint}
    assert whole.usage.prompt_tokens == len(model.tokenize("Once upon a time"))
    # Greedy choices are the same text wherever the two best tokens are not nearly tied (each
    # choice's cells sit elsewhere in the pool, which moves logits in their last bits).
    greedy = client.completions.create(**{**options, "temperature": 0, "logprobs": 2})
    first = greedy.choices[0].logprobs
    for choice in greedy.choices[1:]:
        at = next(
            (
                i
                for i, (a, b) in enumerate(zip(first.tokens, choice.logprobs.tokens, strict=False))
                if a != b
            ),
            None,
        )
        if at is None:
            assert choice.text == greedy.choices[0].text
        else:
            best = sorted(first.top_logprobs[at].values())[-2:]
            assert best[1] - best[0] < 0.4, f"choices differ at token {at} at a clear margin"


def test_n_choices_decode_their_prompt_once(client: openai.OpenAI, model: lcgen.Model) -> None:
    prompt = "The three primary colors are red, yellow and"
    model.cache.clear()  # nothing cached: the prompt is decoded here
    before = model.context.n_decoded
    reply = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=4, n=3, temperature=0.9, seed=5
    )
    decoded = model.context.n_decoded - before
    assert [c.finish_reason for c in reply.choices] == ["length"] * 3
    # The whole prompt once, then each choice's tokens but its last (the first of them is
    # sampled from the logits kept after the prompt): no choice decodes a prompt token again.
    assert decoded == reply.usage.prompt_tokens + reply.usage.completion_tokens - 3


def test_stop_cuts_the_greedy_text(client: openai.OpenAI) -> None:
    free = chat(client, max_tokens=24).choices[0].message.content
    assert "\n" in free
    stopped = chat(client, max_tokens=24, stop=["\n"]).choices[0]
    assert stopped.message.content == free.split("\n")[0]
    assert stopped.finish_reason == "stop"


def test_a_stop_that_cuts_a_constrained_reply_says_length(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    ask = {
        "messages": [{"role": "user", "content": "The largest city in France as JSON."}],
        "max_tokens": 40,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": schema, "strict": True},
        },
    }
    whole = chat(client, **ask).choices[0]
    assert whole.finish_reason == "stop"
    city = json.loads(whole.message.content)["city"]
    cut = chat(client, stop=[city], **ask).choices[0]
    assert cut.finish_reason == "length"  # not passed off as complete JSON
    assert cut.message.content == whole.message.content.split(city)[0]
    events = chat(client, stream=True, stop=[city], **ask)  # greedy, as the two above
    streamed = [
        (c.choices[0].delta.content, c.choices[0].finish_reason) for c in events if c.choices
    ]
    assert streamed[-1][1] == "length"
    assert "".join(text or "" for text, _ in streamed) == cut.message.content


def test_openai_s_negative_seeds_and_top_p_0_are_taken(client: openai.OpenAI) -> None:
    # Both were 400s: a seed is an int64 to OpenAI (clients send -1), and top_p may be 0.
    ask = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
    first = client.completions.create(**ask, seed=-1).choices[0].text  # type: ignore[call-overload]
    assert client.completions.create(**ask, seed=-1).choices[0].text == first  # type: ignore[call-overload]
    greedy = client.completions.create(**{**ask, "temperature": 0}).choices[0].text  # type: ignore[call-overload]
    assert client.completions.create(**ask, top_p=0).choices[0].text == greedy  # type: ignore[call-overload]


def test_a_stop_after_healed_text_that_completes_the_constraint_says_stop(
    client: openai.OpenAI,
) -> None:
    # Token healing re-creates the prompt's "2": with it, "3" completes the regex (without it,
    # the reply was told as cut short).
    extra = {"regex": "2[0-9]*", "token_healing": True}
    ask = {"model": NAME, "prompt": "My favourite number is 12", "max_tokens": 5, "temperature": 0}
    whole = client.completions.create(**ask, extra_body=extra).choices[0]  # type: ignore[call-overload]
    assert whole.text.startswith("34")  # measured
    cut = client.completions.create(**ask, stop=["4"], extra_body=extra).choices[0]  # type: ignore[call-overload]
    assert (cut.text, cut.finish_reason) == ("3", "stop")


def test_a_schema_lcgen_cannot_enforce_falls_back_to_its_type_unless_strict(
    client: openai.OpenAI,
) -> None:
    unsupported = {
        "type": "array",
        "items": {"type": "integer"},
        "allOf": [{"contains": {"const": 4}}, {"contains": {"const": 5}}],
    }
    ask = [{"role": "user", "content": "Three numbers as a JSON array, like [4, 5, 6]."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": unsupported}}
    reply = chat(client, messages=ask, max_tokens=30, response_format=fmt).choices[0]
    assert reply.message.content.lstrip().startswith("[")  # the type it names (not an object)
    fmt["json_schema"]["strict"] = True
    with pytest.raises(openai.BadRequestError, match="two contains"):
        chat(client, messages=ask, max_tokens=40, response_format=fmt)
    anything = {"type": "json_schema", "json_schema": {"name": "a", "schema": True}}
    reply = chat(client, messages=ask, max_tokens=30, response_format=anything).choices[0]
    assert reply.message.content.lstrip()[:1] in set('[{"-0123456789tfn')  # any JSON value


def test_a_strict_schema_with_unique_items_and_its_retries(client: openai.OpenAI) -> None:
    # uniqueItems was refused (400 with strict); max_retries was refused without banned.
    digits = {**UNIQUE_DIGITS, "minItems": 4, "maxItems": 4}
    ask = [{"role": "user", "content": "Four ones as a JSON array: [1, 1, 1, 1]. Again:"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": digits, "strict": True}}
    extra = {"max_retries": 200}
    reply = chat(client, messages=ask, max_tokens=40, response_format=fmt, extra_body=extra)
    value = json.loads(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop" and len(set(value)) == len(value) == 4


def test_a_completion_prompt_of_token_ids(client: openai.OpenAI, model: lcgen.Model) -> None:
    ids = model.tokenize("The sky is")
    ask = {"model": NAME, "max_tokens": 4, "temperature": 0}
    text = client.completions.create(prompt="The sky is", **ask).choices[0].text
    assert client.completions.create(prompt=ids, **ask).choices[0].text == text
    both = client.completions.create(prompt=[ids, ids[:2]], **ask).choices
    assert [c.index for c in both] == [0, 1] and both[0].text == text
    with pytest.raises(openai.BadRequestError, match="prompt") as info:
        client.completions.create(prompt=[1, model.n_vocab], **ask)
    assert str(model.n_vocab) in str(info.value)


def test_logprobs_end_with_the_text_a_stop_string_cut(client: openai.OpenAI) -> None:
    free = chat(client, max_tokens=24, logprobs=True).choices[0]
    tokens = [e.token for e in free.logprobs.content]
    stop = tokens[3].strip() or tokens[4].strip()  # a token part way through
    cut = chat(client, max_tokens=24, logprobs=True, stop=[stop]).choices[0]
    entries = [e.token for e in cut.logprobs.content]
    assert cut.message.content == free.message.content.split(stop)[0]
    # every entry starts inside the text; together they cover it
    assert "".join(entries).startswith(cut.message.content)
    assert len("".join(entries[:-1])) < len(cut.message.content) or not entries[:-1]
    text = client.completions.create(
        model=NAME, prompt="The sky is", max_tokens=8, temperature=0, logprobs=1, stop=[stop]
    ).choices[0]
    assert all(offset < len(text.text) for offset in text.logprobs.text_offset)
    # Streamed: the same entries. Those of tokens whose text was held back for the stop string
    # were sent, then the stop string cut their text.
    _, chunks = streamed_texts(chat(client, max_tokens=24, logprobs=True, stop=[stop], stream=True))
    streamed = [
        e.token for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content
    ]
    assert streamed == entries


def test_tokens_without_text_at_the_end_keep_their_logprobs(client: openai.OpenAI) -> None:
    """A special token (no text) forced by logit_bias: its entries were held for text that
    never came, then dropped at the end (3 tokens, no entries)."""
    ask = {"model": NAME, "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}}
    text = client.completions.create(prompt="Hi", logprobs=1, **ask).choices[0]
    assert text.text == "" and len(text.logprobs.tokens) == 3
    reply = chat(client, max_tokens=3, logprobs=True, logit_bias={"1": 100})
    assert reply.usage.completion_tokens == len(reply.choices[0].logprobs.content) == 3
    _, chunks = streamed_texts(
        chat(client, max_tokens=3, logprobs=True, logit_bias={"1": 100}, stream=True)
    )
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(streamed) == 3


def test_special_top_tokens_are_named_by_their_text(model: lcgen.Model) -> None:
    """Special tokens write no text: as top tokens they were all the key "", so a completion
    position's special alternatives fell into one. They are named by their text (as lcgen's
    own TopLogprob names them), in chat too; a sampled special token still adds no text."""
    from lcgen.server.responses import Output, Reply

    top = (lcgen.TopLogprob(1, "<|im_start|>", -0.5), lcgen.TopLogprob(3, "<repo_name>", -1.0))
    chunk = lcgen.Chunk("", (1,), "length", logprobs=(lcgen.TokenLogprob(1, "", -0.5, top),))
    text = Reply("text", NAME, model, True)
    entries = text.take(Output(0), chunk)
    (alternatives,) = text._logprobs_object(entries)["top_logprobs"]
    # the sampled token as the text it adds too: top_logprobs[i][tokens[i]] is its own
    assert alternatives == {"<|im_start|>": -0.5, "<repo_name>": -1.0, "": -0.5}
    assert [e["token"] for e in entries] == [""]
    chat = Reply("chat", NAME, model, True)
    (content,) = chat._logprobs_object(chat.take(Output(0), chunk))["content"]
    assert [t["token"] for t in content["top_logprobs"]] == ["<|im_start|>", "<repo_name>"]
    assert set(content) == {"token", "bytes", "logprob", "top_logprobs"}


def test_completion_logprobs_hold_the_sampled_token(client: openai.OpenAI) -> None:
    """OpenAI's API "will always return the logprob of the sampled token": a token sampled
    outside the top ones is among its top_logprobs too."""
    text = client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=12, temperature=1.5, seed=3, logprobs=1
    ).choices[0]
    lp = text.logprobs
    pairs = zip(lp.tokens, lp.top_logprobs, strict=True)
    assert all(tok in top and 1 <= len(top) <= 2 for tok, top in pairs)
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the top


def test_null_means_the_default_where_openai_allows_it(url: str) -> None:
    """Clients and proxies send unset options as null: n, stream, logprobs and echo are
    nullable in OpenAI's API."""
    chat_body = {"model": NAME, "messages": USER, "max_tokens": 2, "temperature": 0}
    for field in ("n", "stream", "logprobs"):
        status, reply = request(
            url, "/v1/chat/completions", json.dumps({**chat_body, field: None}).encode()
        )
        assert status == 200 and len(reply["choices"]) == 1, reply
    text_body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    for field in ("n", "stream", "echo"):
        status, reply = request(
            url, "/v1/completions", json.dumps({**text_body, field: None}).encode()
        )
        assert status == 200 and len(reply["choices"]) == 1, reply


def test_a_message_from_the_clients_parse_helpers_goes_back(
    client: openai.OpenAI,
) -> None:
    """The client's parse and stream helpers add ``parsed``, a call's ``index`` and its
    ``function.parsed_arguments`` to the message they return; an agent appends it to the
    next request as it is (400 before: extra inputs)."""
    call = {
        "id": "call_1",
        "type": "function",
        "index": 0,
        "function": {
            "name": "set_unit",
            "arguments": '{"unit": "celsius"}',
            "parsed_arguments": {"unit": "celsius"},
        },
    }
    messages = [
        {"role": "user", "content": "Switch to celsius."},
        {"role": "assistant", "content": None, "parsed": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    reply = chat(client, messages=messages, tools=[SET_UNIT], max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_schema_response_format_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = chat(
        client,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    ).choices[0]
    assert reply.finish_reason == "stop"
    validate(json.loads(reply.message.content), schema)
    sampled = chat(
        client,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        extra_body={"fast_forward": False},
    ).choices[0]
    assert sampled.message.content == reply.message.content  # forced tokens sampled instead
    ask = [{"role": "user", "content": 'Give {"color": ...} for the sky as JSON.'}]
    obj = chat(client, messages=ask, max_tokens=100, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_lcgen_extras(client: openai.OpenAI) -> None:
    options = ["red", "green", "blue"]
    picked = chat(client, max_tokens=8, extra_body={"choice": options})
    assert picked.choices[0].message.content in options
    digits = chat(client, max_tokens=8, extra_body={"regex": r"[0-9]{3}"})
    assert re.fullmatch(r"[0-9]{3}", digits.choices[0].message.content)
    gbnf = 'root ::= "yes" | "no"\n'
    assert chat(client, max_tokens=4, extra_body={"grammar": gbnf}).choices[0].message.content in {
        "yes",
        "no",
    }
    date = (
        chat(
            client,
            messages=[{"role": "user", "content": "When did the Berlin Wall fall?"}],
            max_tokens=12,
            extra_body={"grammar": "iso_date"},  # a bundled grammar, by name
        )
        .choices[0]
        .message.content
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)
    free = chat(client, max_tokens=24).choices[0].message.content
    word = max(re.findall(r"[A-Za-z]{3,}", free), key=len)
    banned = chat(client, max_tokens=24, extra_body={"banned": [word]}).choices[0].message.content
    assert word not in banned
    healed = client.completions.create(
        model=NAME,
        prompt="The capital of France is P",
        max_tokens=4,
        temperature=0,
        extra_body={"token_healing": True},
    )
    assert healed.choices[0].text.startswith("aris")
    copy = "Repeat exactly: the quick brown fox jumps over the lazy dog, twice over."
    ask = [{"role": "user", "content": copy}]
    plain = chat(client, messages=ask, max_tokens=24).choices[0].message.content
    fast = chat(client, messages=ask, max_tokens=24, extra_body={"speculate": "ngram"})
    assert fast.choices[0].message.content == plain


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The call's arguments, validated against the parameters of the function it names."""
    assert call.type == "function" and call.id.startswith("call_")
    (tool,) = [t for t in tools if t["function"]["name"] == call.function.name]
    arguments = json.loads(call.function.arguments)
    validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_calls_required_named_and_streamed(client: openai.OpenAI) -> None:
    tools = [WEATHER, TIME]
    reply = chat(client, messages=ASK, tools=tools, tool_choice="required", max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_call(call, tools)
    named = chat(
        client,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    ).choices[0]
    assert named.message.tool_calls[0].function.name == "get_time"
    _check_call(named.message.tool_calls[0], tools)
    # Sampled calls validate too.
    for seed in range(4):
        sampled = chat(
            client,
            messages=ASK,
            tools=tools,
            tool_choice="required",
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        ).choices[0]
        if sampled.finish_reason == "tool_calls":
            _check_call(sampled.message.tool_calls[0], tools)
        else:  # cut by max_tokens: text, never a broken call
            assert sampled.finish_reason == "length" and sampled.message.tool_calls is None
    stream = chat(
        client, messages=ASK, tools=tools, tool_choice="required", max_tokens=60, stream=True
    )
    texts, chunks = streamed_texts(stream)
    assert texts == {0: ""}  # the call comes whole at the end, not as content
    # its role comes with the call, content null, as OpenAI sends it (not a first "" content)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None and first.tool_calls
    # The call, then the finish reason alone, as OpenAI sends them (the client's stream helper
    # reports a call's end only from a later chunk).
    calls, last = chunks[-2].choices[0], chunks[-1].choices[0]
    assert calls.finish_reason is None and last.finish_reason == "tool_calls"
    assert not last.delta.tool_calls
    streamed = calls.delta.tool_calls[0]
    assert streamed.index == 0
    _check_call(streamed, tools)


def test_a_streamed_tool_call_carries_its_logprobs(client: openai.OpenAI) -> None:
    """A call is sent whole at its end: its tokens' log-probabilities were never sent (the
    reply not streamed had them)."""
    tools = [WEATHER, TIME]
    options: dict[str, Any] = {
        "messages": ASK,
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 60,
        "logprobs": True,
    }
    whole = chat(client, **options).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.logprobs.content
    chunks = list(chat(client, stream=True, **options))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]


def test_a_job_submitted_after_the_engine_closed_is_refused(model: lcgen.Model) -> None:
    """Ctrl-C while a request was still being made ready (a long echo scored, a grammar
    compiled): its job went to an engine that had stopped, and the server waited on it for
    ever. It is refused: the handler answers 503 shutting_down."""
    from lcgen.server.engine import Engine, Job

    engine = Engine(model, max_queue=4)
    engine.start()
    engine.close()
    loop = asyncio.new_event_loop()
    try:
        job = Job([model.tokenize("Hi")], [lcgen.make_plan(max_tokens=2)], loop)
        with pytest.raises(lcgen.ClosedError, match="shutting down"):
            engine.submit(job)
    finally:
        loop.close()


def test_a_stream_with_tools_opens_a_text_reply_with_its_role(model: lcgen.Model) -> None:
    """With tools, a choice's role waits for its first chunk: text gets the usual role chunk
    (content "") before it, a call carries the role itself, and an empty reply opens with the
    role before its finish reason."""
    from lcgen.server.responses import Reply

    reply = Reply("chat", NAME, model, False, tools=["get_weather"])
    assert not reply.role_first and Reply("chat", NAME, model, False).role_first
    text = {"choices": [{"index": 1, "delta": {"content": "Hi"}}]}
    role, same = reply.opening(text)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["choices"][0]["index"] == 1 and same is text
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}
    (merged,) = reply.opening(call)
    assert merged["choices"][0]["delta"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"index": 0}],
    }
    end = {"choices": [{"index": 2, "delta": {}, "finish_reason": "stop"}]}
    assert [c["choices"][0]["delta"] for c in reply.opening(end)] == [
        {"role": "assistant", "content": ""},
        {},
    ]


def test_parallel_tool_calls(client: openai.OpenAI, model: lcgen.Model) -> None:
    tools = [SET_UNIT, SET_VOLUME]
    ask = [{"role": "user", "content": "Switch to celsius and turn the volume to 3."}]
    # The functions take no free text, so the grammar allows "[" only where a reply opens a
    # JSON array of several calls: a bias on it makes the reply do so. Every call must
    # validate (the small model repeats calls up to the most, 16).
    (bracket,) = model.tokenize("[")
    options: dict[str, Any] = {
        "messages": ask,
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 600,
        "logit_bias": {str(bracket): 100},
    }
    whole = chat(client, **options).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = whole.message.tool_calls
    assert calls and 2 <= len(calls) <= 16
    for call in calls:
        _check_call(call, tools)
    assert len({call.id for call in calls}) == len(calls)
    texts, chunks = streamed_texts(chat(client, stream=True, **options))
    assert texts == {0: ""}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # (the calls themselves may differ from the reply above: its prompt came from the prefix
    # cache, and where "," and "]" are close the greedy path may part; see the exactness)
    streamed = chunks[-2].choices[0].delta.tool_calls
    assert len(streamed) >= 2 and [c.index for c in streamed] == list(range(len(streamed)))
    for call in streamed:
        _check_call(call, tools)
    # parallel_tool_calls false: the grammar has no array, the bias cannot open one
    single = chat(client, parallel_tool_calls=False, **options).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls) == 1
    _check_call(single.message.tool_calls[0], tools)


def test_every_finish_reason_is_told_as_openai_s() -> None:
    from typing import get_args

    from lcgen.decoding.results import FinishReason
    from lcgen.server.responses import FINISH_REASONS

    # a chunk that ends with "tool_calls" (a streamed chat reply's calls) has one too
    assert set(FINISH_REASONS) == set(get_args(FinishReason))
    assert FINISH_REASONS["tool_calls"] == "tool_calls"


def test_parallel_calls_grammar_and_parsing(model: lcgen.Model) -> None:
    from lcgen.server.requests import ChatRequest

    req = ChatRequest.model_validate({"model": NAME, "messages": ASK, "tools": [WEATHER, TIME]})
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    time_ = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    both = f"[{weather}, {time_}]"
    several = lcgen.tools.grammar(req.callable_tools(), required=True, parallel=True)
    assert several.accepts(model, weather) and several.accepts(model, both)
    assert not several.accepts(model, "[]")
    assert not several.accepts(model, '[{"name": "get_time", "arguments": {"city": "Oslo"}}]')
    one = lcgen.tools.grammar(req.callable_tools(), required=True, parallel=False)
    assert one.accepts(model, weather) and not one.accepts(model, both)
    auto = lcgen.tools.grammar(req.callable_tools(), required=False, parallel=True)
    assert auto.accepts(model, both) and auto.accepts(model, "Sunny.")
    assert not auto.accepts(model, "[not a call]")
    calls = lcgen.tools.parse_calls(both, parallel=True)
    assert calls is not None
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    # Without parallel calls a reply starting with "[" is text (the grammar allowed it as text).
    assert lcgen.tools.parse_calls(both, parallel=False) is None
    assert req.tool_parallel  # OpenAI's default
    # Earlier parallel calls go back into the prompt as the array the model is asked to write.
    turn = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(
                    [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')]
                )
            ],
        },
    ]
    req = ChatRequest.model_validate({"model": NAME, "messages": turn, "tools": [WEATHER, TIME]})
    messages = lcgen.tools.prompt_messages(
        [m.as_dict() for m in req.messages], req.callable_tools(), False, True
    )
    assert "To call several at once, reply with only a JSON array" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_time", "arguments": {"zone": "UTC"}},
    ]


def test_tool_choice_auto_and_none_and_a_whole_turn(client: openai.OpenAI) -> None:
    tools = [WEATHER]
    auto = chat(client, messages=ASK, tools=tools, max_tokens=60).choices[0]
    if auto.message.tool_calls:  # the model chose to call: a valid call
        assert auto.finish_reason == "tool_calls"
        _check_call(auto.message.tool_calls[0], tools)
    else:  # or text that does not start like a call
        assert not auto.message.content.startswith("{")
    for seed in range(4):
        sampled = chat(
            client, messages=ASK, tools=tools, max_tokens=80, temperature=1.0, seed=seed
        ).choices[0]
        if sampled.message.tool_calls:
            _check_call(sampled.message.tool_calls[0], tools)
        elif sampled.finish_reason != "length":
            assert not sampled.message.content.startswith("{")
    none = chat(client, messages=ASK, tools=tools, tool_choice="none", max_tokens=24)
    assert none.choices[0].message.tool_calls is None
    # "none" leaves the functions out of the prompt: the same prompt as without tools (found
    # whole in the cache, with the logits after it).
    plain = chat(client, messages=ASK, max_tokens=24)
    assert plain.usage.prompt_tokens == none.usage.prompt_tokens
    assert plain.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens
    # A whole turn: the call, its result, and the answer in text.
    call = chat(client, messages=ASK, tools=tools, tool_choice="required", max_tokens=60)
    message = call.choices[0].message
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [message.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C, sunny"},
    ]
    answer = chat(client, messages=turn, tools=tools, tool_choice="none", max_tokens=24)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_tool_prompt_tells_the_functions_and_writes_earlier_turns(model: lcgen.Model) -> None:
    from lcgen.server.requests import ChatRequest

    turn = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    req = ChatRequest.model_validate(
        {"model": NAME, "messages": turn, "tools": [WEATHER], "tool_choice": "auto"}
    )
    messages = lcgen.tools.prompt_messages(
        [m.as_dict() for m in req.messages], req.callable_tools(), req.tool_required
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these functions:")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert messages[3]["content"] == "The function get_weather returned: 18 C"
    model.chat_tokens(messages)  # the template takes them
    grammar = lcgen.tools.grammar(req.callable_tools(), required=False)
    assert grammar.accepts(model, "It is sunny.")
    assert grammar.accepts(
        model, '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    )
    assert not grammar.accepts(model, '{"name": "get_weather", "arguments": {"town": "Oslo"}}')
    assert not grammar.accepts(model, " {")


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


class _Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=20)
    city: str = pydantic.Field(max_length=20)


class _AddContact(pydantic.BaseModel):
    """Add a contact"""

    name: str = pydantic.Field(max_length=20)
    address: _Address


# Parameters whose refs are relative to their own root: a draft-7 schema with definitions,
# a root $id that a ref goes through, a pointer into its own properties, "#" (recursion),
# and an anchor.
DRAFT7 = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "$id": "https://example.com/shape.json",
    "type": "object",
    "properties": {
        "size": {"$ref": "#/definitions/size"},
        "other": {"$ref": "https://example.com/shape.json#/properties/size"},
        "inner": {"$ref": "#/definitions/named"},
    },
    "required": ["size"],
    "additionalProperties": False,
    "definitions": {
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
        "named": {"$id": "#named", "enum": ["a", "b"]},
    },
}
TREE = {
    "$id": "tree.json",
    "type": "object",
    "properties": {
        "label": {"$ref": "#/$defs/label"},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        "same": {"$ref": "tree.json#tag"},
    },
    "required": ["label"],
    "additionalProperties": False,
    "$defs": {"label": {"$anchor": "tag", "enum": ["x", "y"]}},
}


def test_tool_parameters_with_defs_refs_and_ids(client: openai.OpenAI, model: lcgen.Model) -> None:
    from lcgen.server.requests import ChatRequest

    tool = openai.pydantic_function_tool(_AddContact)
    assert "$defs" in tool["function"]["parameters"]
    ask = [{"role": "user", "content": "Add Bob, 1 Main St, Springfield"}]
    reply = chat(client, messages=ask, tools=[tool], tool_choice="required", max_tokens=80)
    assert reply.choices[0].finish_reason == "tool_calls", reply
    _check_call(reply.choices[0].message.tool_calls[0], [tool])  # the original parameters
    tools = [_tool("shape", DRAFT7), _tool("other_shape", DRAFT7)]
    reply = chat(client, messages=ask, tools=tools, tool_choice="required", max_tokens=60)
    _check_call(reply.choices[0].message.tool_calls[0], tools)

    # The grammar: exactly the arguments each function's own parameters take.
    def grammar_of(*tools: dict[str, Any]) -> lcgen.Grammar:
        req = ChatRequest.model_validate({"model": NAME, "messages": ask, "tools": list(tools)})
        return lcgen.tools.grammar(req.callable_tools(), required=True)

    grammar = grammar_of(_tool("tree", TREE), _tool("tree2", TREE))
    good = {"label": "x", "kids": [{"label": "y", "same": "x"}, {"label": "x", "kids": []}]}
    validate(good, TREE)
    assert grammar.accepts(model, json.dumps({"name": "tree", "arguments": good}))
    assert not grammar.accepts(model, '{"name": "tree", "arguments": {"label": "z"}}')
    assert not grammar.accepts(model, '{"name": "tree", "arguments": {"kids": [{}]}}')
    grammar = grammar_of(_tool("shape", DRAFT7))
    shape = {"size": 3, "other": 9, "inner": "b"}
    validate(shape, DRAFT7)
    assert grammar.accepts(model, json.dumps({"name": "shape", "arguments": shape}))
    assert not grammar.accepts(model, '{"name": "shape", "arguments": {"size": 0}}')
    assert not grammar.accepts(model, '{"name": "shape", "arguments": {"size": 1, "inner": "c"}}')
    # One wrapper schema holds all the functions: of one draft (none named: the latest).
    with pytest.raises(lcgen.GrammarError, match="drafts"):
        grammar_of(_tool("tree", TREE), _tool("shape", DRAFT7))


def test_tool_arguments_are_always_an_object(client: openai.OpenAI) -> None:
    # No parameters: none (OpenAI's meaning), arguments "{}".
    ask = [{"role": "user", "content": "Ring the bell."}]
    bell = _tool("ring_bell")
    reply = chat(client, messages=ask, tools=[bell], tool_choice="required", max_tokens=40)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.tool_calls[0].function.arguments == "{}"
    # Parameters that name no type: still an object.
    untyped = {
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    count = _tool("count", untyped)
    ask = [{"role": "user", "content": "Count to two."}]
    reply = chat(client, messages=ask, tools=[count], tool_choice="required", max_tokens=40)
    assert reply.choices[0].finish_reason == "tool_calls", reply
    arguments = _check_call(reply.choices[0].message.tool_calls[0], [count])
    assert isinstance(arguments, dict) and isinstance(arguments["a"], int)
    # Parameters of another type: refused, named.
    with pytest.raises(openai.BadRequestError, match="object") as info:
        chat(client, tools=[_tool("f", {"type": "string"})], tool_choice="required")
    assert info.value.body["param"] == "tools"  # type: ignore[index]


def test_tools_with_a_response_format(client: openai.OpenAI, model: lcgen.Model) -> None:
    """With tools, a response_format shapes the reply that is not calls (as OpenAI's)."""
    from lcgen.server.requests import ChatRequest

    words = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
    fmt = {"type": "json_schema", "json_schema": {"name": "words", "schema": words}}
    options: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Three words about the sea as a JSON array."}],
        "tools": [WEATHER],
        "response_format": fmt,
        "parallel_tool_calls": False,
        "max_tokens": 40,
    }
    # Without parallel calls only the format's array starts with "[": a bias makes the reply one.
    (bracket,) = model.tokenize("[")
    text = chat(client, logit_bias={str(bracket): 100}, **options).choices[0]
    assert text.finish_reason == "stop" and text.message.tool_calls is None, text
    validate(json.loads(text.message.content), words)
    call = chat(client, tool_choice="required", **options).choices[0]
    assert call.finish_reason == "tool_calls"
    _check_call(call.message.tool_calls[0], [WEATHER])
    # The grammar: calls, or JSON valid for the format (no other text); JSON that is not
    # calls of a known function is not read as calls.
    req = ChatRequest.model_validate({"model": NAME, "messages": ASK, "tools": [WEATHER]})
    grammar = lcgen.tools.grammar(req.callable_tools(), False, True, words)
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    assert grammar.accepts(model, weather) and grammar.accepts(model, '["salt", "wave"]')
    assert not grammar.accepts(model, "Sunny.") and not grammar.accepts(model, "[1]")
    assert lcgen.tools.parse_calls(weather, False, {"get_weather"}) is not None
    told = lcgen.tools.prompt_messages(ASK, req.callable_tools(), False, formatted=True)
    assert told[0]["content"].endswith("Otherwise reply with only JSON in the format asked for.")
    other = '{"name": "get_time", "arguments": {}}'
    assert lcgen.tools.parse_calls(other, False, {"get_weather"}) is None
    with pytest.raises(openai.BadRequestError, match="response_format"):
        chat(
            client,
            **{
                **options,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "foo"}},
                },
            },
        )


def test_completion_echo_scores_the_prompt(client: openai.OpenAI, model: lcgen.Model) -> None:
    prompt = "The capital of France is Paris, and the capital of Italy is"
    tokens = model.tokenize(prompt)
    # Scoring alone, as evaluation harnesses ask: the prompt back with its log-probabilities.
    scored = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(tokens) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    # the top token, and the prompt's own where it is not the top one (as OpenAI's API)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert all(tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
    reference = [e.logprob for e in model.prompt_logprobs(tokens)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], reference, strict=True)) < 0.35
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # With a completion: the prompt, then the completion (its tokens after the prompt's).
    echoed = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    text, elp = echoed.choices[0].text, echoed.choices[0].logprobs
    assert text.startswith(prompt) and len(text) > len(prompt)
    assert len(elp.tokens) == len(tokens) + echoed.usage.completion_tokens == len(tokens) + 4
    assert elp.text_offset[len(tokens)] == len(prompt)  # the completion's first token
    assert "".join(elp.tokens[len(tokens) :]) == text[len(prompt) :]
    texts, _ = streamed_texts(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True
        ),
        "text",
    )
    assert texts[0].startswith(prompt) and len(texts[0]) > len(prompt)
    only, _ = streamed_texts(
        client.completions.create(
            model=NAME, prompt=[prompt, "Hi"], max_tokens=0, echo=True, stream=True
        ),
        "text",
    )
    assert only == {0: prompt, 1: "Hi"}
    # Token healing re-creates the prompt's last token: the generated token that does is its
    # entry (it was echoed and scored too, and the joined tokens spelled its text twice).
    healing = {"token_healing": True}
    healed = client.completions.create(  # type: ignore[call-overload]
        model=NAME,
        prompt="The capital of Fra",
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=0,
        extra_body=healing,
    ).choices[0]
    lp = healed.logprobs
    assert healed.text.startswith("The capital of Fra") and "".join(lp.tokens) == healed.text
    assert all(
        healed.text[at:].startswith(t) for at, t in zip(lp.text_offset, lp.tokens, strict=True)
    )


def test_frequency_and_presence_penalties(client: openai.OpenAI, model: lcgen.Model) -> None:
    prompt = "one one one one one one"
    options = {"max_tokens": 12, "temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 1}
    text = client.completions.create(model=NAME, prompt=prompt, **options).choices[0].text
    assert text == model.generate(prompt, **options)  # type: ignore[call-overload]
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert plain.choices[0].text != text
    # a repeat penalty near 0 (float32 rounds it to 0): its limit, not NaN logits and a 500
    extreme = {"max_tokens": 4, "temperature": 0.7, "seed": 3, "presence_penalty": 1.3}
    tiny = {"repeat_penalty": 5e-324}
    text = client.completions.create(model=NAME, prompt=prompt, extra_body=tiny, **extreme)
    assert text.choices[0].text == model.generate(prompt, **extreme, **tiny)  # type: ignore[call-overload]
    constrained = {**tiny, "regex": "(a|b)+"}  # the grammar's bans stay bans under it
    text = client.completions.create(model=NAME, prompt=prompt, extra_body=constrained, **extreme)
    assert set(text.choices[0].text) <= {"a", "b"}


def test_logit_bias_and_logprobs(client: openai.OpenAI, model: lcgen.Model) -> None:
    reply = chat(client, max_tokens=6, logprobs=True, top_logprobs=3).choices[0]
    entries = reply.logprobs.content
    assert "".join(e.token for e in entries) == reply.message.content
    for e in entries:  # greedy: the token is the most likely one
        assert e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    first = model.tokenize(entries[0].token, add_bos=False)[0]
    biased = chat(client, max_tokens=6, logprobs=True, logit_bias={str(first): -100})
    assert model.tokenize(biased.choices[0].logprobs.content[0].token, add_bos=False)[0] != first
    text = client.completions.create(
        model=NAME, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2
    ).choices[0]
    assert "".join(text.logprobs.tokens) == text.text
    assert all(len(top) == 2 for top in text.logprobs.top_logprobs)
    # A banned phrase releases text several tokens at a time: still one entry per token.
    word = entries[0].token.strip()
    banned = chat(client, max_tokens=6, logprobs=True, extra_body={"banned": [word]})
    content = banned.choices[0].message.content
    assert word not in content and banned.usage.completion_tokens == 6
    assert "".join(e.token for e in banned.choices[0].logprobs.content) == content
    assert len(banned.choices[0].logprobs.content) == 6


# batching -----------------------------------------------------------------------------------
TOPICS = ["the sea", "a fox", "winter", "a robot", "bread", "the moon", "a city", "music"]


# Greedy replies are not bit-identical across runs: a token's logits depend on the batch it is
# decoded in and on which prompt cells came from the prefix cache (measured here, serial runs
# against each other and against 8 concurrent clients: log-probabilities of the same token at
# the same position differ by up to 0.19, and replies diverge only where the two best tokens
# are that close). The bound below is what the tests assert.
MAX_TIE_MARGIN = 0.5


def test_concurrent_clients_equal_serial_runs(
    client: openai.OpenAI, url: str, model: lcgen.Model
) -> None:
    """8 clients x 2 requests at once: every greedy reply equals the same request run alone,
    up to the first token where the two best candidates are within MAX_TIE_MARGIN (swapped
    by the numerical noise of batching); none is lost or mixed up with another."""
    jobs = [(topic, n) for topic in TOPICS for n in (12, 16)]

    def ask(job: tuple[str, int]) -> list[tuple[str, float, float]]:
        messages = [{"role": "user", "content": f"Write one sentence about {job[0]}."}]
        reply = chat(client, messages=messages, max_tokens=job[1], logprobs=True, top_logprobs=2)
        assert reply.choices[0].finish_reason in {"stop", "length"}
        return [
            (e.token, e.logprob, e.top_logprobs[0].logprob - e.top_logprobs[1].logprob)
            for e in reply.choices[0].logprobs.content
        ]

    serial = [ask(job) for job in jobs]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, jobs))
    for job, alone, batched in zip(jobs, serial, together, strict=True):
        same = 0
        while same < min(len(alone), len(batched)) and alone[same][0] == batched[same][0]:
            same += 1
        if same < min(len(alone), len(batched)):  # swapped a near-tie
            margin = min(alone[same][2], batched[same][2])
            assert margin <= MAX_TIE_MARGIN, (job, same, alone, batched)
        else:
            assert len(alone) == len(batched), job
    state = health(url)
    assert state["queue"] == {"waiting": 0, "running": 0, "max": 64}
    assert state["slots"]["live"] == 0
    threads = state["threads"]  # the suite's model has a fixed count (see conftest)
    assert threads == {
        "adaptive": model.adaptive_threads,
        "now": model.threads_now,
        "max": model.n_threads,
    }


def test_health_shows_an_adapting_thread_count(model_path: Path) -> None:
    adapting = lcgen.load(model_path, n_ctx=256, n_gpu_layers=0)
    with adapting, running(create_app(adapting, model_name=NAME)) as base:
        threads = health(base)["threads"]
    assert threads["adaptive"] and 1 <= threads["now"] <= threads["max"] == adapting.n_threads


def endless(model: lcgen.Model) -> dict[str, float]:
    """A logit_bias that bans every end-of-generation token: the reply runs to max_tokens."""
    return {str(token): -100.0 for token in model.vocab.eog_set}


def test_disconnect_mid_stream_frees_the_slot(url: str, model: lcgen.Model) -> None:
    body = json.dumps(
        {
            "model": NAME,
            "messages": USER,
            "max_tokens": 3000,
            "stream": True,
            "temperature": 1,
            "logit_bias": endless(model),
        }
    )
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    data = [resp.readline() for _ in range(12)]
    assert any(line.startswith(b"data: ") for line in data)
    assert health(url)["queue"]["running"] == 1
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 5
    while (state := health(url))["queue"]["running"] or state["slots"]["live"]:
        assert time.monotonic() < deadline, f"the slot was not freed: {state}"
        time.sleep(0.02)


def test_full_queue_answers_429(model_path: Path) -> None:
    """Two slots, room for one waiting choice: a fourth request is refused, never hangs."""
    with (
        lcgen.Model(model_path, n_seq_max=2, n_ctx=1024) as small,
        running(create_app(small, model_name=NAME, max_queue=1)) as base,
    ):
        tiny = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        long = {"model": NAME, "messages": USER, "max_tokens": 900, "stream": True}
        streams = []
        for running_now in (1, 2, 2):  # two take the slots, the third waits for one
            streams.append(
                tiny.chat.completions.create(temperature=1, logit_bias=endless(small), **long)
            )
            wait_for(base, lambda q, n=running_now: q["running"] == n and q["waiting"] <= 1)
        assert health(base)["queue"]["waiting"] == 1
        with pytest.raises(openai.RateLimitError) as info:
            tiny.chat.completions.create(messages=USER, model=NAME, max_tokens=2)
        assert info.value.status_code == 429 and info.value.code == "queue_full"
        assert "1 choices wait for a slot, and this request's 1 would make more than 1 wait" in (
            str(info.value)
        )
        assert info.value.response.headers["retry-after"] == "1"  # clients wait, then retry
        for stream in streams:
            stream.close()
        wait_for(base, lambda q: q["running"] == q["waiting"] == 0)
        # Idle, two choices take the slots and one waits: a burst that fits is taken (it was
        # a 429: every submitted choice counted as waiting).
        burst = tiny.chat.completions.create(messages=USER, model=NAME, max_tokens=2, n=3)
        assert len(burst.choices) == 3
        # more choices than the slots and the queue hold could never be admitted: 400, not
        # "retry later"
        with pytest.raises(openai.BadRequestError) as refused:
            tiny.chat.completions.create(messages=USER, model=NAME, max_tokens=2, n=4)
        assert refused.value.code == "too_many_choices" and "at most 1" in str(refused.value)


def test_n_up_to_openai_s_128(model_path: Path) -> None:
    """It was capped at 16; 128 choices of one prompt, on 32 slots and a queue of 96."""
    with (
        lcgen.Model(model_path, n_seq_max=32, n_ctx=2048) as small,
        running(create_app(small, model_name=NAME, max_queue=96)) as base,
    ):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.completions.create(
            model=NAME, prompt="Once upon a time", max_tokens=2, n=128, seed=7, temperature=1
        )
        assert sorted(c.index for c in reply.choices) == list(range(128))
        assert reply.usage is not None and 128 <= reply.usage.completion_tokens <= 2 * 128


def wait_for(url: str, ok: Callable[[dict[str, int]], bool], timeout: float = 10) -> None:
    """Wait until the server's /health queue satisfies ``ok``."""
    deadline = time.monotonic() + timeout
    while not ok(state := health(url)["queue"]):
        assert time.monotonic() < deadline, f"the queue stays {state}"
        time.sleep(0.01)


# errors ---------------------------------------------------------------------------------------
def _body(**fields: Any) -> bytes:
    return json.dumps({"model": NAME, "messages": USER, "max_tokens": 4, **fields}).encode()


BAD = [
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
    (json.dumps({"model": NAME, "max_tokens": 4}).encode(), "messages"),
    (_body(max_tokens="four"), "max_tokens"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(presence_penalty=2.5), "presence_penalty"),
    (_body(frequency_penalty="high"), "frequency_penalty"),
    (_body(temperature="hot"), "temperature"),
    (_body(temperature=9), "temperature"),
    (_body(n=0), "n"),
    (_body(n=129), "n"),  # over OpenAI's bound
    (_body(stop=[1, 2]), "stop"),
    (_body(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    (_body(messages="hello"), "messages"),
    (_body(logit_bias={"abc": 1}), "logit_bias"),
    (_body(logit_bias={"99999999": 1}), "logit_bias"),
    (_body(logit_bias={"\u00b2": 1}), "logit_bias"),  # a digit to str.isdigit, not to int()
    (_body(logit_bias={"\u0663": 1}), "logit_bias"),  # an Arabic-Indic 3: not token 3
    (_body(logit_bias={"1" * 5000: 1}), "logit_bias"),  # over int()'s 4,300 digits
    (_body(temperature=float("nan")), "temperature"),  # json.dumps writes NaN
    (_body(logit_bias={"1": float("-inf")}), "logit_bias.1"),
    (_body(grammar="root ::= (("), "grammar"),
    (_body(grammar="../../etc/passwd"), "grammar"),  # neither GBNF nor a bundled name
    (_body(grammar='root ::= "\\U00110000"'), "grammar"),  # beyond Unicode
    (_body(grammar='root ::= "a"\nroot ::= "b"'), "grammar"),  # a rule defined twice
    (_body(regex="(?<=a)b"), "regex"),
    (_body(regex="a{99999999999999999999}"), "regex"),  # an OverflowError was a 500
    (_body(choice=[]), "choice"),
    (_body(regex="a", choice=["b"]), "choice"),
    (_body(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (_body(response_format={"type": "xml"}), "response_format.type"),
    (_body(seed=2**64), "seed"),  # beyond OpenAI's int64 (and its unsigned reading)
    (_body(top_p=-0.1), "top_p"),
    (_body(min_p=1), "min_p"),
    (_body(top_logprobs=99, logprobs=True), "top_logprobs"),
    (_body(num_draft=4), "num_draft"),  # without speculate it would do nothing
    (_body(max_retries=3), "max_retries"),  # ... without banned phrases (it was ignored)
    (_body(max_retries=3, response_format={"type": "json_object"}), "max_retries"),  # (no schema)
    (_body(banned_ignore_case=True), "banned_ignore_case"),
    (_body(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools.0.function.name"),
    (_body(tools=[{"type": "code"}]), "tools.0.type"),
    (_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"), None),
    (
        _body(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        "tool_choice",
    ),
    (
        _body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
        "tools",
    ),
    (_body(tools=[{"type": "function", "function": {"name": "f"}}], regex="a"), None),
    (_body(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools"),  # one name
    (_body(messages=[{"role": "user"}]), "messages.0"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(messages=[{"role": "tool", "content": "1", "tool_calls": []}]), None),
    (_body(tool_choice="required"), "tool_choice"),  # tool_choice without tools
    (_body(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (_body(messages=[*USER, {"role": "tool", "content": "1"}]), "messages.1"),  # no tool_call_id
    (_body(messages=[*USER, {"role": "tool", "tool_call_id": "c", "content": "1"}]), "messages"),
    (
        _body(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}),
        "response_format",
    ),  # invalid, not only unsupported: no fallback
    # no value validates, or a $ref that resolves to nothing: no fallback (it wrote objects)
    *(
        (_body(response_format={"type": "json_schema", "json_schema": {"schema": bad}}), "resp")
        for bad in (
            {"type": "integer", "minimum": 5, "maximum": 3},
            False,
            {"enum": []},
            {"$ref": "#/$defs/nope"},
            {"$ref": "#"},
        )
    ),
    (_body(banned=[""]), "banned"),
    # constraints no token can meet: found while generating, still the request's error
    (_body(choice=["\u0000"]), None),  # no token spells it
    (_body(choice=["no"], token_healing=True), None),  # healing must re-create the prompt's end
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_malformed_requests_get_400_naming_the_field(
    url: str, body: bytes, param: str | None
) -> None:
    status, reply = request(url, "/v1/chat/completions", body)
    assert status == 400, reply
    assert health(url)["queue"]["running"] == 0
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


def test_a_constraint_no_token_can_start_is_unsatisfiable(url: str) -> None:
    """Found before the engine (a grammar no token spells) it came back with code null; the
    same found while generating was ``unsatisfiable_constraints``, as documented."""
    for extra in ({"choice": ["\u0000"]}, {"grammar": "root ::= [\\x00]"}):
        status, reply = request(url, "/v1/chat/completions", _body(**extra))
        assert status == 400 and reply["error"]["code"] == "unsatisfiable_constraints", reply
        assert reply["error"]["param"] == next(iter(extra))
    status, reply = request(url, "/v1/chat/completions", _body(grammar="root ::= x ::="))
    assert status == 400 and reply["error"]["code"] is None, reply  # invalid, not unsatisfiable


def test_error_messages_explain_the_input(url: str) -> None:
    """A field of several types (a string or a list...) is reported by the type the input
    is, not by the first type it could have been."""

    def error(body: bytes, path: str = "/v1/chat/completions") -> dict[str, Any]:
        status, reply = request(url, path, body)
        assert status == 400, reply
        return dict(reply["error"])

    stops = error(_body(stop=["x"] * 17))
    assert "at most 16 items" in stops["message"] and stops["param"] == "stop", stops
    image = {"type": "image_url", "image_url": {"url": "http://localhost/a.png"}}
    parts = error(_body(messages=[{"role": "user", "content": [image]}]))
    assert "unsupported content part type 'image_url'" in parts["message"], parts
    assert parts["param"] == "messages.0.content.0"
    empty = error(json.dumps({"model": NAME, "prompt": []}).encode(), "/v1/completions")
    assert "at least 1 item" in empty["message"] and empty["param"] == "prompt", empty
    assert "more)" not in empty["message"]  # the list types' same error, once
    tool = error(_body(messages=[*USER, {"role": "tool", "content": "1"}]))
    assert "tool_call_id" in tool["message"], tool
    choice = error(_body(tool_choice="auto"))
    assert choice["message"] == "tool_choice is only allowed when tools are specified", choice
    status, reply = request(url, "/v1/chat/completions", _body(tool_choice="none", max_tokens=2))
    assert status == 200, reply  # "none" without tools: fine, as OpenAI's
    huge = error(_body(logit_bias={"1" * 5000: 1}))  # was Python's "Exceeds the limit (4300..."
    assert huge["message"].endswith("is not a token id of this model (0 to 49151)"), huge
    assert huge["param"] == "logit_bias"
    padded = _body(logit_bias={"0" * 5000 + "1": 0}, max_tokens=1)  # token 1, zeros before it
    assert request(url, "/v1/chat/completions", padded)[0] == 200
    nan = error(_body(temperature=float("nan")))  # was "Input should be less than or equal to 2"
    assert nan["message"] == "temperature: Input should be a finite number", nan


def test_a_client_gone_while_sending_its_body_is_not_a_server_error(model: lcgen.Model) -> None:
    # Starlette's ClientDisconnect went out of the application: uvicorn logged its traceback
    app = create_app(model, model_name=NAME)
    received = iter(
        [
            {"type": "http.request", "body": b'{"model": "', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(received)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] != 500


def test_deeply_nested_call_arguments_are_read_as_text(url: str) -> None:
    # json.loads raises RecursionError (not JSONDecodeError) from about 1,000 levels: a 500
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    messages = [*USER, {"role": "assistant", "tool_calls": [call]}]
    status, reply = request(url, "/v1/chat/completions", _body(messages=messages, max_tokens=2))
    assert status == 200, reply
    assert parse_calls('{"name": "f", "arguments": ' + "[" * 5000, parallel=False) is None


def test_request_errors_have_their_status(url: str, model: lcgen.Model) -> None:
    long = "word " * (model.n_ctx + 10)
    status, reply = request(
        url,
        "/v1/completions",
        json.dumps({"model": NAME, "prompt": long, "max_tokens": 8}).encode(),
    )
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert str(model.n_ctx) in reply["error"]["message"]
    several = {"model": NAME, "prompt": ["Hi", long], "max_tokens": 8}
    status, reply = request(url, "/v1/completions", json.dumps(several).encode())
    assert status == 400 and "(prompt 1 of 2)" in reply["error"]["message"], reply
    # a chat without max_tokens generates to the end of the context: no negative count
    chat_long = {"model": NAME, "messages": [{"role": "user", "content": long}]}
    status, reply = request(url, "/v1/chat/completions", json.dumps(chat_long).encode())
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert "max_tokens" not in reply["error"]["message"], reply
    scoring = {"model": NAME, "prompt": long, "max_tokens": 0, "echo": True, "logprobs": 1}
    status, reply = request(url, "/v1/completions", json.dumps(scoring).encode())
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert str(model.n_ctx) in reply["error"]["message"]
    status, reply = request(url, "/v1/chat/completions", _body(model="gpt-4"))
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    status, reply = request(url, "/v1/chat/completions", _body(), key=None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    status, reply = request(url, "/v1/models", key="wrong")
    assert status == 401
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")  # a body over the limit is never read
    for name, value in (("Authorization", f"Bearer {KEY}"), ("Content-Length", str(2 << 20))):
        conn.putheader(name, value)
    conn.endheaders()
    too_big = conn.getresponse()
    assert too_big.status == 413 and json.load(too_big)["error"]["code"] == "body_too_large"
    conn.close()
    status, reply = request(url, "/v1/nothing")
    assert status == 404 and reply["error"]["code"] is None
    assert reply["error"]["message"] == "Invalid URL (GET /v1/nothing)"
    status, reply = request(url, "/v1/models", b"{}")  # a route that takes GET only
    assert status == 405 and reply["error"]["message"] == "Invalid URL (POST /v1/models)"
    status, reply = request(url, "/v1/models")
    assert status == 200 and [m["id"] for m in reply["data"]] == [NAME]
    status, reply = request(url, f"/v1/models/{NAME}")
    assert status == 200 and reply["id"] == NAME and reply["object"] == "model"
    status, reply = request(url, "/v1/models/gpt-4")
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    no_logprobs = _body(top_logprobs=2)
    status, reply = request(url, "/v1/chat/completions", no_logprobs)
    assert status == 400 and reply["error"]["param"] == "top_logprobs", reply


def test_a_server_with_a_draft_model(
    url: str, client: openai.OpenAI, model: lcgen.Model, model_path: Path
) -> None:
    """``--draft``: requests asking for ``speculate: "draft"`` get the same reply as without;
    a server without a draft model answers 400 naming the field; a draft model of another
    vocabulary is refused when the app is made."""
    status, reply = request(url, "/v1/chat/completions", _body(speculate="draft"))
    assert status == 400 and reply["error"]["param"] == "speculate", reply
    ask = [{"role": "user", "content": "Count from one to twelve in words."}]
    plain = chat(client, messages=ask, max_tokens=30).choices[0].message.content
    with lcgen.Model(model_path, n_ctx=1024, n_seq_max=4) as draft:
        app = create_app(model, model_name=NAME, api_key=KEY, draft_model=draft)
        with running(app) as base:
            drafted = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
            reply = chat(drafted, messages=ask, max_tokens=30, extra_body={"speculate": "draft"})
            assert reply.choices[0].message.content == plain
        assert draft.cache.stats.live == 0
    with (
        lcgen.load("gemma3-270m", n_ctx=256, n_seq_max=1) as other,
        pytest.raises(ValueError, match="vocabulary"),
    ):
        create_app(model, draft_model=other)


def test_a_bad_request_leaves_the_server_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=4, extra_body={"grammar": "root ::= (("})
    assert chat(client, max_tokens=4).choices[0].message.content


def test_a_grammar_too_slow_to_mask_is_a_400_before_it_reaches_the_engine(
    client: openai.OpenAI, url: str
) -> None:
    # llguidance refuses this grammar; llama.cpp's masks would take minutes a token, and the
    # engine serves every client in one thread. The request is checked beside the engine: a
    # 400 that says why, and the engine never saw it (no prompt token decoded, no lookup).
    before = health(url)["cache"]
    with pytest.raises(openai.BadRequestError, match="over the bound") as raised:
        chat(client, max_tokens=4, extra_body={"grammar": many_words_grammar(40_000)})
    assert raised.value.body["param"] == "grammar"  # type: ignore[index]
    assert raised.value.code == "grammar_too_slow"
    after = health(url)["cache"]
    assert [after[k] - before[k] for k in ("tokens_decoded", "hits", "misses")] == [0, 0, 0]
    assert chat(client, max_tokens=4).choices[0].message.content


# memory ---------------------------------------------------------------------------------------
RSS_BOUND_MB = 25
N_TINY = 200


def _rss_mb() -> float:
    status = Path("/proc/self/status")
    if status.exists():
        line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # macOS: bytes, peak


def test_many_tiny_requests_do_not_grow_memory(client: openai.OpenAI, url: str) -> None:
    def tiny(i: int) -> None:
        client.completions.create(model=NAME, prompt=f"Number {i % 50}:", max_tokens=1)

    for i in range(40):  # warm up: allocators, caches, the prompts' prefixes
        tiny(i)
    before = _rss_mb()
    for i in range(N_TINY):
        tiny(i)
    grown = _rss_mb() - before
    assert grown < RSS_BOUND_MB, f"RSS grew {grown:.1f} MB over {N_TINY} requests"
    assert health(url)["queue"]["running"] == 0


# entry points ---------------------------------------------------------------------------------
def test_add_parser_and_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    lcgen.server.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", NAME, "--port", "9", "--api-key", "k", "--n-seq-max", "4"])
    assert args.func is lcgen.server.command
    assert (args.host, args.port, args.api_key, args.n_seq_max) == ("127.0.0.1", 9, "k", 4)
    assert args.draft is None
    assert (args.cache_type_k, args.cache_type_v) == ("f16", "f16")  # llama.cpp's default
    assert parser.parse_args(["serve", NAME, "--draft", "small.gguf"]).draft == "small.gguf"
    # the key from the environment; set but empty is no key (a blank key would let anyone in)
    monkeypatch.setenv("LCGEN_API_KEY", "from-env")
    env_parser = argparse.ArgumentParser()
    lcgen.server.add_parser(env_parser.add_subparsers(dest="command"))
    assert env_parser.parse_args(["serve", NAME]).api_key == "from-env"
    monkeypatch.setenv("LCGEN_API_KEY", "")
    empty_parser = argparse.ArgumentParser()
    lcgen.server.add_parser(empty_parser.add_subparsers(dest="command"))
    assert empty_parser.parse_args(["serve", NAME]).api_key is None
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(lcgen.server.ServerExtraMissingError, match=r"lcgen\[server\]"):
        lcgen.server.serve(NAME)


def _with_origin(
    url: str, path: str, origin: str, method: str = "GET", key: str | None = KEY
) -> Any:
    """A raw request from a browser page of ``origin`` (an OPTIONS: the preflight of a
    POST with a key); the response, read."""
    headers = {"Origin": origin}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if method == "OPTIONS":
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
    req = urllib.request.Request(url + path, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return resp
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc


def test_browser_pages_of_the_given_origins_only_may_call_the_api(
    model: lcgen.Model, url: str
) -> None:
    """CORS: none by default (a page of another site the user visits cannot read replies);
    with --cors-origin, pages of that origin pass the preflight and read replies."""
    page = "http://localhost:3000"
    assert _with_origin(url, "/v1/models", page).headers["access-control-allow-origin"] is None
    app = create_app(model, model_name=NAME, api_key=KEY, cors_origins=[page])
    with running(app) as base:
        pre = _with_origin(base, "/v1/chat/completions", page, "OPTIONS")
        assert pre.status == 200 and pre.headers["access-control-allow-origin"] == page
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        got = _with_origin(base, "/v1/models", page)
        assert got.status == 200 and got.headers["access-control-allow-origin"] == page
        other = _with_origin(base, "/v1/chat/completions", "http://evil.example", "OPTIONS")
        assert other.status == 400 and other.headers["access-control-allow-origin"] is None
        keyless = _with_origin(base, "/v1/models", page, key=None)  # the key is still needed
        assert keyless.status == 401
    for bad in ("localhost:3000", "http://localhost:3000/", "https://a.example/path", ""):
        with pytest.raises(ValueError, match="is not '\\*' or a web origin"):
            create_app(model, cors_origins=[bad])
    parser = argparse.ArgumentParser()
    lcgen.server.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", NAME, "--cors-origin", page, "--cors-origin", "*"])
    assert args.cors_origin == [page, "*"]


def test_a_blank_api_key_is_refused(model: lcgen.Model) -> None:
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="is blank"):
            create_app(model, api_key=blank)


def test_python_m_lcgen_server(model_path: Path, model: lcgen.Model) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "lcgen.server", str(model_path), "--port", str(port)]
    cmd += ["--api-key", KEY, "--n-ctx", "512", "--n-seq-max", "2", "--threads", "1"]
    cmd += ["--draft", str(model_path)]  # the same file, loaded again as the draft model
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(OSError):
                if health(base)["slots"]["total"] == 2:
                    break
            time.sleep(0.1)
        assert request(base, "/v1/models", key=None)[0] == 401
        status, models = request(base, "/v1/models")
        assert status == 200 and models["data"][0]["id"] == model_path.name
        body = json.dumps({"model": model_path.stem, "prompt": "Hi", "max_tokens": 2})
        assert request(base, "/v1/completions", body.encode())[0] == 200
        fields = {"model": model_path.stem, "prompt": "1, 2, 3,", "max_tokens": 6}
        body = json.dumps({**fields, "temperature": 0, "speculate": "draft"})
        assert request(base, "/v1/completions", body.encode())[0] == 200
        # a client that gives up on a whole (not streamed) reply: its choice is cancelled and
        # its handler returns (one left waiting kept the server from stopping on SIGTERM)
        long = {"model": model_path.stem, "prompt": "Hi", "max_tokens": 400}
        body = json.dumps({**long, "logit_bias": endless(model)})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
        wait_for(base, lambda q: q["running"] == 1)
        conn.close()
        wait_for(base, lambda q: q["running"] == 0)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) in (0, -15)


# from a tester's pass through the README ------------------------------------------------------
def test_chat_with_a_base_model_says_to_use_completions() -> None:
    # the bundled Gemma 3 270M has no chat template: the 400 said "use generate() instead"
    with (
        lcgen.load("gemma3-270m", n_ctx=512, n_seq_max=2, n_threads=1) as base,
        running(create_app(base, model_name="gemma3-270m")) as base_url,
    ):
        status, body = request(base_url, "/v1/chat/completions", _body(model="gemma3-270m"))
        assert status == 400 and body["error"]["param"] == "messages"
        message = body["error"]["message"]
        assert "has no chat template" in message and "/v1/completions" in message, message
        assert "generate()" not in message
        fields = {"model": "gemma3-270m", "prompt": "The sky is", "max_tokens": 2}
        assert request(base_url, "/v1/completions", json.dumps(fields).encode())[0] == 200


def test_a_reply_message_dumped_by_the_client_goes_back_as_history(client: openai.OpenAI) -> None:
    # `message.model_dump()` carries refusal, annotations, audio and function_call as null:
    # the server refused its own reply ("messages.1.refusal: Extra inputs are not permitted")
    for options in ({}, {"tools": [WEATHER], "tool_choice": "required"}):
        reply = chat(client, messages=ASK, max_tokens=30, **options).choices[0].message
        dumped = reply.model_dump()
        assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
        turn: list[Any] = [*ASK, dumped]
        if reply.tool_calls:
            turn.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "sun"})
        else:
            turn.append({"role": "user", "content": "Thanks."})
        assert chat(client, messages=turn, max_tokens=4).choices[0].message.content
    # a value lcgen cannot take into the prompt is still refused, and named
    for field, value in (("audio", {"id": "a1"}), ("function_call", {"name": "f"})):
        message = {"role": "assistant", "content": "Hi.", field: value}
        with pytest.raises(openai.BadRequestError, match=rf"messages\.1\.{field}"):
            chat(client, messages=[*ASK, message, *ASK], max_tokens=4)


def test_choices_that_fill_the_context_together_take_turns(model_path: Path) -> None:
    # n=2 without max_tokens: each choice may take the rest of the context, together more than
    # it has. Both needed a cell with none free and the request failed (503); now the younger
    # choice is paused (its cells dropped, its tokens kept) and goes on once the first is done.
    with (
        lcgen.Model(model_path, n_ctx=256, n_threads=1) as small,
        running(create_app(small, model_name=NAME)) as small_url,
    ):
        body = _body(max_tokens=None, n=2, logit_bias=endless(small))
        status, reply = request(small_url, "/v1/chat/completions", body, key=None)
        assert status == 200, reply
        assert [c["finish_reason"] for c in reply["choices"]] == ["length", "length"]
        prompt = reply["usage"]["prompt_tokens"]
        assert reply["usage"]["completion_tokens"] == 2 * (small.n_ctx - prompt)
        assert health(small_url)["queue"]["running"] == 0


def test_prompts_that_outgrow_the_context_together_queue(model_path: Path) -> None:
    # Four prompts that each fit the context, not all together: each choice's prompt waits
    # until its cells fit beside the running ones'. They were admitted at once and the ones
    # that found no cell for their prompt failed (503 context_full).
    with (
        lcgen.Model(model_path, n_ctx=256, n_threads=1) as small,
        running(create_app(small, model_name=NAME)) as small_url,
    ):
        story = "Once upon a time there was a little fox who lived in a deep forest. " * 5
        prompts = [f"Story {i}: {story}" for i in range(4)]
        n_prompt = len(small.tokenize(prompts[0]))
        assert n_prompt < small.n_ctx < 4 * n_prompt
        body = json.dumps({"model": NAME, "prompt": prompts, "max_tokens": 8, "temperature": 0})
        status, reply = request(small_url, "/v1/completions", body.encode(), key=None)
        assert status == 200, reply
        assert [c["finish_reason"] for c in reply["choices"]] == ["length"] * 4
        for choice in reply["choices"]:  # the same as alone, up to a near-tie
            alone = small.generate(prompts[choice["index"]], max_tokens=8, logprobs=2)
            assert_same_up_to_a_near_tie(choice["text"], alone, MAX_TIE_MARGIN)
        assert health(small_url)["queue"]["running"] == 0


def _stream_lines(base: str, body: dict[str, Any]) -> list[str]:
    """The data lines of a streamed reply, until the server ends it."""
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as response:
        return [line.decode().strip() for line in response if line.startswith(b"data: ")]


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_the_server_with_requests_running(model: lcgen.Model, presses: int) -> None:
    # uvicorn waited for a running request to finish (here 4,000 tokens, a minute), silently,
    # before the server stopped, and cut a stream short ("ERROR: ASGI callable returned without
    # completing response"); both now end at once, with 503 shutting_down. Pressed twice,
    # uvicorn skipped the app's shutdown, and its task died with a traceback logged as ERROR.
    import signal

    cmd = [sys.executable, "-m", "lcgen.cli", "serve", NAME, "--port", "0", "--threads", "1"]
    with _server_process(cmd) as (proc, base):
        body = {"model": NAME, "prompt": "Once", "max_tokens": 4000, "logit_bias": endless(model)}
        with ThreadPoolExecutor(2) as pool:
            whole = pool.submit(request, base, "/v1/completions", json.dumps(body).encode(), None)
            stream = pool.submit(_stream_lines, base, body)
            wait_for(base, lambda queue: queue["running"] == 2)
            time.sleep(0.5)  # a few tokens into the replies
            start = time.monotonic()
            for _ in range(presses):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.05)
            assert proc.wait(timeout=20) == 0
            assert time.monotonic() - start < 10
            status, answer = whole.result(timeout=10)
            lines = stream.result(timeout=10)
        assert status == 503 and answer["error"]["code"] == "shutting_down", answer
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
        errors = _stderr(proc).read()
        assert "ERROR" not in errors and "Traceback" not in errors, errors


def test_python_m_lcgen_server_writes_warnings_as_one_line(model_path: Path) -> None:
    # `lcgen serve` wrote "lcgen: warning: ..." but `python -m lcgen.server` (the same
    # command) Python's warning with a line of lcgen's source
    cmd = [sys.executable, "-m", "lcgen.server", str(model_path), "--port", "0", "--threads", "1"]
    with _server_process(cmd) as (proc, base):
        schema = {"type": "object", "proprties": {}}
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        body = _body(model=model_path.name, response_format=response_format)
        assert request(base, "/v1/chat/completions", body, key=None)[0] == 200
        proc.terminate()
        assert proc.wait(timeout=30) in (0, -15)  # uvicorn raises SIGTERM again once stopped
        assert _stderr(proc).read() == (
            "lcgen serve: warning: unknown JSON Schema keyword 'proprties' at # is ignored "
            "(did you mean 'properties'?)\n"
        )


@contextlib.contextmanager
def _server_process(cmd: list[str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A server started by ``cmd`` (its stderr piped) and its address once it says it is
    ready; killed at the end if it still runs."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        found = re.search(r"(http://\S+) \(OpenAI API", _stderr(proc).readline())
        assert found, "the server did not start"
        yield proc, found[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        _stderr(proc).close()


def _stderr(proc: subprocess.Popen[str]) -> IO[str]:
    assert proc.stderr is not None
    return proc.stderr


def test_a_message_name_reaches_the_chat_template() -> None:
    """It was accepted and dropped: two users' messages could not be told apart even by a
    template that writes names."""
    from lcgen.server.requests import Message

    message = Message(role="user", content="Hi", name="alice")
    assert message.as_dict() == {"role": "user", "content": "Hi", "name": "alice"}
    assert "name" not in Message(role="user", content="Hi").as_dict()


def test_a_completion_prompt_s_special_token_text_is_those_tokens(
    client: openai.OpenAI, model: lcgen.Model
) -> None:
    """A client that applies the chat template itself sends its control tokens as text:
    they were tokenized letter by letter ('<', '|', 'im', ...) and the model wrote template
    markup back; llama.cpp's server reads them as the tokens."""
    prompt = model.format_chat(USER)
    ask = {"model": NAME, "max_tokens": 8, "temperature": 0}
    text = client.completions.create(prompt=prompt, **ask).choices[0].text
    assert text == chat(client, max_tokens=8).choices[0].message.content
    # Echoed, scored: each token once, the special ones as their text, offsets into the text.
    lp = (
        client.completions.create(prompt=prompt, echo=True, logprobs=0, **{**ask, "max_tokens": 0})
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == len(model.chat_tokens(USER)) and lp.tokens[0] == "<|im_start|>"
    assert "".join(lp.tokens) == prompt
    assert all(prompt[at:].startswith(t) for at, t in zip(lp.text_offset, lp.tokens, strict=True))
    # Its top tokens name a special token as the prompt's entry does (one key per token).
    top = (
        client.completions.create(prompt=prompt, echo=True, logprobs=3, **{**ask, "max_tokens": 0})
        .choices[0]
        .logprobs.top_logprobs
    )
    assert all("" not in alternatives for alternatives in top[1:])
    # A prompt of ids holding special tokens echoes the text without them: their entries have
    # none, and every offset is a token's place in the text (they ran past its end).
    ids = model.chat_tokens(USER)
    echoed = client.completions.create(prompt=ids, echo=True, logprobs=0, **ask).choices[0]
    text, lp = echoed.text, echoed.logprobs
    assert all(at <= len(text) for at in lp.text_offset)
    assert all(text[at:].startswith(t) for at, t in zip(lp.text_offset, lp.tokens, strict=True))


def test_completion_tokens_part_way_through_a_character_are_told_apart(
    client: openai.OpenAI, model: lcgen.Model
) -> None:
    """A completion's tokens are strings without bytes beside them: each part of a UTF-8
    character was U+FFFD, so a position's top tokens fell into one key. They are written
    'bytes:\\xf0\\x9f' as OpenAI's API writes them."""
    fish = model.tokenize("🐟", add_bos=False)[0]  # part of the character
    bias = {str(fish): 100}
    choice = client.completions.create(
        model=NAME, prompt="Fish:", max_tokens=2, temperature=0, logprobs=5, logit_bias=bias
    ).choices[0]
    lp = choice.logprobs
    piece = model.token_piece(fish)
    assert lp.tokens[0] == "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
    assert all(len(top) in (5, 6) for top in lp.top_logprobs)  # none fell together
    assert lp.top_logprobs[0][lp.tokens[0]] == lp.token_logprobs[0]


def test_an_echoed_prompt_whose_first_character_spans_tokens_keeps_its_offsets(
    client: openai.OpenAI, model: lcgen.Model
) -> None:
    """The first token begins a character the second ends: the offsets ran one past each
    character after it (the first token counted as one character)."""
    prompt = "日本語のテキスト"
    with pytest.raises(UnicodeDecodeError):
        model.token_piece(model.tokenize(prompt)[0]).decode()
    lp = (
        client.completions.create(
            model=NAME, prompt=prompt, echo=True, logprobs=0, max_tokens=0, temperature=0
        )
        .choices[0]
        .logprobs
    )
    whole = [(at, t) for at, t in zip(lp.text_offset, lp.tokens, strict=True) if "bytes:" not in t]
    assert len(whole) >= 2 and all(prompt[at:].startswith(t) for at, t in whole), lp
    # Each offset: the characters the tokens before it complete.
    decoder, offsets, at = codecs.getincrementaldecoder("utf-8")(), [], 0
    for token in model.tokenize(prompt):
        offsets.append(at)
        at += len(decoder.decode(model.token_piece(token)))
    assert lp.text_offset == offsets


def test_openai_s_odd_but_valid_requests(url: str, model_path: Path) -> None:
    """best_of as n, include_usage null, a slash at the end, a lone surrogate's escape."""
    text_body = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    status, reply = request(
        url, "/v1/completions", json.dumps({**text_body, "best_of": 1}).encode()
    )
    assert status == 200, reply
    body = {**text_body, "best_of": 3, "n": 1}
    status, reply = request(url, "/v1/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == "best_of", reply
    body = {**text_body, "stream": True, "stream_options": {"include_usage": None}}
    assert request_stream_ok(url, body)
    status, reply = request(url, "/v1/chat/completions/", _body())
    assert status == 404 and reply["error"]["message"], reply  # OpenAI's shape, no redirect
    status, reply = request(url, "/v1/models/")
    assert status == 200 and reply["data"][0]["id"] == NAME
    lone = _body().replace(b'"Name three', b'"\\ud800 Name three')
    status, reply = request(url, "/v1/chat/completions", lone)
    assert status == 400 and "surrogate" in reply["error"]["message"], reply
    # Scoring a prompt as long as the context: nothing is generated, so it fits.
    with (
        lcgen.Model(model_path, n_ctx=256, n_threads=1) as small,
        running(create_app(small, model_name=NAME)) as small_url,
    ):
        ids = [small.bos, *small.tokenize("word " * 400, add_bos=False)][: small.n_ctx]
        scoring = {"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
        status, reply = request(small_url, "/v1/completions", json.dumps(scoring).encode())
        assert status == 200 and len(reply["choices"][0]["logprobs"]["tokens"]) == small.n_ctx
        status, reply = request(
            small_url, "/v1/completions", json.dumps({**scoring, "max_tokens": 1}).encode()
        )
        assert status == 400 and "room for a token" in reply["error"]["message"], reply


def request_stream_ok(url: str, body: dict[str, Any]) -> bool:
    """Whether a streamed completion ends with [DONE]."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=60) as response:
        lines = [line.decode().strip() for line in response if line.startswith(b"data: ")]
    return lines[-1] == "data: [DONE]"


def test_an_echoed_prompt_s_added_bos_has_no_text() -> None:
    """Gemma adds a BOS that the prompt's text does not hold: it was written '<bos>' and
    every offset after it was 5 too far."""
    with (
        lcgen.load("gemma3-270m", n_ctx=256, n_seq_max=2, n_threads=1) as gemma,
        running(create_app(gemma, model_name=NAME)) as base,
    ):
        prompt = "Hello world, this is"
        body = {"model": NAME, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 0}
        status, reply = request(base, "/v1/completions", json.dumps(body).encode(), key=None)
        assert status == 200, reply
        text, lp = reply["choices"][0]["text"], reply["choices"][0]["logprobs"]
        assert lp["tokens"][0] == "" and lp["text_offset"][:2] == [0, 0]
        pairs = zip(lp["text_offset"], lp["tokens"], strict=True)
        assert all(text[at:].startswith(t) for at, t in pairs)
