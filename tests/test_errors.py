"""Every error a user can provoke is an lcgen error (or ValueError) with the value named."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest

import lcgen
from lcgen import SamplerConfig
from lcgen.decoding.results import parse_structured


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(lcgen.ModelLoadError, match="does not exist"):
        lcgen.Model(tmp_path / "nope.gguf")
    # a folder (an hf: reference whose cache entry is one resolves to it) said "does not exist"
    with pytest.raises(lcgen.ModelLoadError, match="is a folder, not a model file"):
        lcgen.Model(tmp_path)
    with pytest.raises(lcgen.ModelLoadError, match="is not a regular file"):
        lcgen.Model("/dev/null")
    with pytest.raises(lcgen.ModelNotFoundError, match=r"nope\.gguf"):
        lcgen.load(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(lcgen.ModelLoadError, match="not a GGUF file"):
        lcgen.Model(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(lcgen.ModelLoadError, match="not a GGUF file"):
        lcgen.Model(empty)


@pytest.mark.parametrize("keep", [64, 4096, 1_000_000, 0.9])
def test_truncated_gguf(tmp_path: Path, model_path: Path, keep: float) -> None:
    size = model_path.stat().st_size
    n = int(size * keep) if isinstance(keep, float) else keep
    cut = tmp_path / "cut.gguf"
    with model_path.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(n))
    with pytest.raises(lcgen.ModelLoadError, match=r"could not load|is truncated"):
        lcgen.Model(cut)


def test_context_full_up_front(model: lcgen.Model) -> None:
    with pytest.raises(lcgen.ContextFullError, match=r"max_tokens=5000 = 50\d\d tokens exceeds"):
        model.generate("Hello there", max_tokens=5000)
    with pytest.raises(lcgen.ContextFullError, match="4096"):
        model.generate("word " * 5000, max_tokens=1)


def test_kv_cells_exhausted(model_path: Path) -> None:
    with lcgen.Model(model_path, n_ctx=256, n_seq_max=4) as small:
        seqs = [small.sequence("word " * 100) for _ in range(3)]
        seqs[0].generate(max_tokens=1)
        seqs[1].generate(max_tokens=1)
        with pytest.raises(lcgen.ContextFullError, match="no free cells"):
            seqs[2].generate(max_tokens=1)
        seqs[0].close()
        assert seqs[2].generate(max_tokens=1) is not None
        for s in seqs:
            s.close()


def test_slots_exhausted(model_path: Path) -> None:
    with lcgen.Model(model_path, n_seq_max=2, n_ctx=512) as small:
        a, b = small.sequence("a"), small.sequence("b")
        with pytest.raises(lcgen.SlotsExhaustedError, match="all 2 sequence slots"):
            small.sequence("c")
        a.close()
        a.close()  # idempotent
        small.sequence("c").close()
        b.close()


def test_closed_sequence(model: lcgen.Model) -> None:
    seq = model.sequence("Hello")
    seq.close()
    with pytest.raises(lcgen.SequenceClosedError):
        seq.generate(max_tokens=2)
    with pytest.raises(lcgen.SequenceClosedError):
        seq.append("more")


def test_empty_sequence(model: lcgen.Model) -> None:
    with model.sequence() as seq, pytest.raises(ValueError, match="empty"):
        seq.generate(max_tokens=2)


def test_bad_token_ids(model: lcgen.Model) -> None:
    with pytest.raises(ValueError, match="token id 49152"):
        model.sequence([1, 2, 49152])
    with pytest.raises(ValueError, match="token id -1"):
        model.detokenize([-1])
    with pytest.raises(ValueError, match="token id 99999999"):
        model.generate("x", max_tokens=1, logit_bias={99999999: 1.0})
    gen = lcgen.Generator(model, max_tokens=2)
    for bad in (-1, model.n_vocab):
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            gen.accept(bad)
    assert gen.tokens == []
    with pytest.raises(ValueError, match=r"a finish reason is one of .* got 'bogus'"):
        gen.end("bogus")  # type: ignore[arg-type]
    assert not gen.is_done and gen.end("retries").finish_reason == "retries"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("repeat_penalty", 0.0),
        ("repeat_last_n", -1),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", float("inf")),
    ],
)
def test_bad_sampler_settings(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{field} must be"):
        SamplerConfig(**{field: value})  # type: ignore[arg-type]


def test_bad_generation_options(model: lcgen.Model) -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 0, got -3"):
        model.generate("x", max_tokens=-3)
    with pytest.raises(ValueError, match="empty"):
        model.generate("x", max_tokens=3, stop=[""])
    with pytest.raises(TypeError, match="bogus"):
        model.generate("x", bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"n_seq_max must be in \[1, 256\], got 0"):
        lcgen.Model("unused.gguf", n_seq_max=0)


def test_errors_share_one_base() -> None:
    for err in (
        lcgen.ModelLoadError,
        lcgen.ModelNotFoundError,
        lcgen.ContextFullError,
        lcgen.SlotsExhaustedError,
        lcgen.SlotBusyError,
        lcgen.SequenceClosedError,
        lcgen.DecodeError,
        lcgen.SchemaValidationError,
    ):
        assert issubclass(err, lcgen.LcgenError)


def test_model_closed_twice(model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m.gguf"
    shutil.copy(model_path, copy)
    m = lcgen.Model(copy, n_ctx=256)
    seq = m.sequence("hi")
    m.close()
    m.close()
    seq.close()


def _mappings_of(path: Path) -> int:
    """How many of this process's memory mappings are of the file ``path`` (Linux)."""
    return sum(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="counts mappings in /proc")
def test_a_failed_load_and_a_dropped_model_free_the_weights(
    model_path: Path, tmp_path: Path
) -> None:
    """A load whose context failed kept the weights it had loaded (each retry with a smaller
    n_ctx, as the error advises, leaked a whole model); a model dropped unclosed, too."""
    import gc

    copy = tmp_path / "m.gguf"
    shutil.copy(model_path, copy)
    for _ in range(3):
        with pytest.raises(lcgen.ModelLoadError):
            lcgen.Model(copy, n_ctx=2**31 - 1)  # over the memory check
    gc.collect()
    assert _mappings_of(copy) == 0
    dropped = lcgen.Model(copy, n_ctx=256)
    dropped.generate("Hi", max_tokens=2)
    assert _mappings_of(copy) > 0
    del dropped
    gc.collect()
    assert _mappings_of(copy) == 0


def test_a_training_context_past_int32_is_refused_naming_it(
    model_path: Path, tmp_path: Path
) -> None:
    """llama.cpp reads a context_length of 2**32 - 1 as -1: it tried to allocate a context of
    n_ctx=-1 and failed on the memory."""
    data = bytearray(model_path.read_bytes())
    key = b"llama.context_length"
    at = data.index(key) + len(key)
    assert data[at : at + 4] == (4).to_bytes(4, "little")  # a uint32
    data[at + 4 : at + 8] = (2**32 - 1).to_bytes(4, "little")
    forged = tmp_path / "huge_ctx.gguf"
    forged.write_bytes(data)
    with pytest.raises(lcgen.ModelLoadError, match=r"training context of -1 tokens.*give n_ctx"):
        lcgen.Model(forged, n_ctx=0)  # 0: the training context
    with lcgen.Model(forged, n_ctx=256) as given:  # a given n_ctx loads it
        assert given.n_ctx == 256


def test_a_model_file_whose_name_is_not_utf8_loads(model_path: Path, tmp_path: Path) -> None:
    # (UnicodeEncodeError: the name went to llama.cpp as UTF-8, which has no form of it)
    import os

    link = os.path.join(os.fsencode(tmp_path), b"bad\xffname.gguf")
    os.symlink(os.fsencode(model_path), link)
    with lcgen.load(os.fsdecode(link), n_ctx=256) as odd:
        assert odd.generate("Hi", max_tokens=2, temperature=0).stats.tokens == 2


def test_llama_cpp_s_log_shows_while_a_verbose_model_is_open_only(
    model_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # (once one model asked for it, every later model's log went to stderr too)
    capfd.readouterr()
    with lcgen.Model(model_path, n_ctx=256, verbose=True) as loud:
        loud.generate("Hi", max_tokens=1)
    assert "llama_" in capfd.readouterr().err
    with lcgen.Model(model_path, n_ctx=256) as quiet:
        quiet.generate("Hi", max_tokens=1)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("ref", ["~no-such-user-here/m.gguf", "a" * 300, "a" * 300 + ".gguf"])
def test_references_no_file_can_have_are_model_not_found(ref: str) -> None:
    # RuntimeError (no such user's home) and OSError (a name too long) escaped
    with pytest.raises(lcgen.ModelNotFoundError) as raised:
        lcgen.load(ref)
    assert len(str(raised.value)) < 600  # the long name shortened


@pytest.mark.parametrize(
    ("cache", "error", "match"),
    [
        (1.5, TypeError, "cache must be True, False or a number of cells, got 1.5"),
        ("yes", TypeError, "cache must be True, False or a number of cells, got 'yes'"),
        (-1, ValueError, r"cache must be in \[0, 2147483647\], got -1"),
    ],
)
def test_a_bad_cache_budget_is_named_before_loading(
    cache: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        lcgen.Model("no-such-file.gguf", cache=cache)  # checked before the file is looked at


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("swa_full", "x", "swa_full must be True or False, got 'x'"),  # was taken as true
        ("flash_attn", "no", "flash_attn must be True, False or None, got 'no'"),
        ("verbose", 1, "verbose must be True or False, got 1"),
    ],
)
def test_a_bad_load_flag_is_named_before_loading(
    model_path: Path, flag: str, value: Any, match: str
) -> None:
    with pytest.raises(TypeError, match=re.escape(match)):
        lcgen.load(model_path, **{flag: value})  # the file exists: refused before it loads


def test_bad_cache_flags_and_timeouts_are_named(model: lcgen.Model, tmp_path: Path) -> None:
    # "no" was taken as true (clear dropped the pinned entries); "1" met a bare TypeError.
    with pytest.raises(TypeError, match="pinned must be True or False, got 'no'"):
        model.cache.clear(pinned="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pinned_only must be True or False, got 'no'"):
        model.cache.save(tmp_path / "c.lcc", pinned_only="no")  # type: ignore[arg-type]
    assert not (tmp_path / "c.lcc").exists()
    with pytest.raises(TypeError, match="slot_timeout must be a number of seconds or None"):
        lcgen.Model("no-such-file.gguf", slot_timeout="1")  # type: ignore[arg-type]


def test_options_that_take_lists_refuse_a_lone_value(model: lcgen.Model) -> None:
    with pytest.raises(TypeError, match=r"use banned=\['Paris'\]"):
        model.generate("x", banned="Paris")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hooks takes a list of callables"):
        model.generate("x", hooks=print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decode them first"):
        model.generate("x", stop=b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="did you mean 'max_tokens'"):
        model.generate("x", max_new_tokens=5)  # type: ignore[call-arg]


def test_unclear_errors_now_name_the_value(model: lcgen.Model) -> None:
    """Each of these used to fail with an error that named nothing (TypeError from inside,
    AttributeError, jinja2's, decimal's, RecursionError)."""
    cases: list[tuple[type[Exception], str, Any]] = [
        (TypeError, "temperature must be a number", lambda: model.generate("x", temperature="0.5")),
        (TypeError, "top_k must be an int", lambda: model.generate("x", top_k=2.5)),
        (ValueError, "seed must be an int >= 0", lambda: model.generate("x", seed=-1)),
        (TypeError, "logprobs must be an int", lambda: model.generate("x", logprobs=2.5)),
        (TypeError, "max_tokens must be an int", lambda: model.generate("x", max_tokens="5")),
        (
            TypeError,
            "logit_bias keys are token ids",
            lambda: model.generate("x", logit_bias={"5": 1}),
        ),
        (TypeError, "lcgen.SamplerConfig", lambda: model.generate("x", sampler="greedy")),
        (TypeError, "lcgen.Grammar(text)", lambda: model.generate("x", grammar='root ::= "a"')),
        (TypeError, "Override takes a token id", lambda: lcgen.Override("x")),
        (TypeError, "metadata takes a key as a str", lambda: model.metadata(None)),
        (ValueError, "holds no NUL character", lambda: model.metadata("general.name\0x")),
        (
            TypeError,
            "tokens_extending takes bytes, got the str 'ab': use b'ab'",
            lambda: model.tokens_extending("ab"),
        ),
        (TypeError, "tokens_extending takes bytes, got int 5", lambda: model.tokens_extending(5)),
        (TypeError, "a prompt is a str or a list", lambda: model.generate(None)),
        (TypeError, "a prompt is a str or a list of token ids", lambda: model.sequence(123)),
        (TypeError, "token ids must be ints", lambda: model.sequence(["a", "b"])),
        (
            TypeError,
            "restore takes a GeneratorState (from generator.state), got str 'x'",
            lambda: lcgen.Generator(model).restore("x"),  # type: ignore[arg-type]
        ),
        (
            TypeError,
            "stream takes one prompt, got ['a', 'b']: generate() takes a list",
            lambda: next(model.stream(["a", "b"])),
        ),
        (TypeError, "chat takes a list of messages", lambda: model.chat("Hello")),
        (ValueError, "needs a str 'content'", lambda: model.chat([{"role": "user"}])),
        (ValueError, "at least one message, got []", lambda: model.chat([])),
        (
            TypeError,
            "schema takes a JSON Schema (a dict, JSON text, True or False) or a pydantic model "
            "class, got list [1, 2]",
            lambda: model.generate("x", schema=[1, 2]),
        ),
        (TypeError, "n_ctx must be an int", lambda: lcgen.Model("x.gguf", n_ctx="512")),
        (TypeError, "n_threads must be an int", lambda: lcgen.Model("x.gguf", n_threads=2.5)),
        (
            lcgen.GrammarError,
            "nests too deeply",
            lambda: lcgen.Grammar.regex("(" * 400 + "a" + ")" * 400),
        ),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()


def test_schemas_that_used_to_break_the_converter(model: lcgen.Model) -> None:
    big = {"type": "integer", "minimum": -1e30, "maximum": 1e30}
    assert lcgen.Grammar.from_json_schema(big).accepts(model, "123456789012345678901234567890")
    nested: dict[str, Any] = {"type": "integer"}
    for _ in range(60):  # the item rule is named once per level, not written out twice
        nested = {"type": "array", "items": nested}
    grammar = lcgen.Grammar.from_json_schema(nested)
    assert len(grammar.gbnf) < 20_000 and grammar.accepts(model, "[" * 60 + "1" + "]" * 60)
    for _ in range(200):
        nested = {"type": "array", "items": nested}
    with pytest.raises(lcgen.GrammarError, match="nests too deeply"):
        lcgen.Grammar.from_json_schema(nested)
    text = '{"type": "integer", "minimum": 0, "maximum": 99}'  # (8 tokens hold all of it)
    value = model.generate("A JSON number:", schema=text, max_tokens=8)
    assert isinstance(value, int)  # a JSON Schema given as JSON text


# a pydantic model that checks more than its JSON Schema says -------------------------------------
class Naive(pydantic.BaseModel):
    when: pydantic.NaiveDatetime


class Never(pydantic.BaseModel):
    n: int

    @pydantic.field_validator("n")
    @classmethod
    def refuse(cls, value: int) -> int:
        raise ValueError("no number is ever right")


@pytest.mark.parametrize(
    ("model_cls", "text", "field"),
    [(Never, '{"n": 3}', "n: Value error, no number is ever right")],
)
def test_output_a_model_refuses_raises_an_lcgen_error(
    model: lcgen.Model, model_cls: type[pydantic.BaseModel], text: str, field: str
) -> None:
    """The grammar allows it (the model's JSON Schema does), pydantic refuses it: an lcgen
    error with the JSON text and pydantic's error as its cause, not pydantic's own."""
    jsonschema.validate(json.loads(text), model_cls.model_json_schema())
    assert lcgen.Grammar.from_pydantic(model_cls).accepts(model, text)
    with pytest.raises(lcgen.SchemaValidationError) as info:
        parse_structured(text, model_cls)
    error = info.value
    assert isinstance(error, lcgen.LcgenError) and isinstance(error, ValueError)
    assert isinstance(error.__cause__, pydantic.ValidationError)
    assert error.text == text and error.errors
    message = str(error)
    assert f"matched the JSON Schema of {model_cls.__name__}" in message
    assert "own validation refused it" in message and field in message


def test_every_path_that_parses_raises_the_lcgen_error(model: lcgen.Model) -> None:
    """A validator the JSON Schema cannot say: one prompt, a batch, a sequence and chat all
    raise the lcgen error."""
    calls = [
        lambda: model.generate("JSON:", schema=Never, max_tokens=60),
        lambda: model.generate(["JSON:", "A number:"], schema=Never, max_tokens=60),
        lambda: model.sequence("JSON:").generate(schema=Never, max_tokens=60),
        lambda: model.chat([{"role": "user", "content": "A number"}], schema=Never, max_tokens=60),
    ]
    for call in calls:
        with pytest.raises(lcgen.SchemaValidationError, match="no number is ever right"):
            call()


def test_a_naive_datetime_is_written_without_an_offset(model: lcgen.Model) -> None:
    """pydantic's schema says only ``format: date-time`` (whose texts have an offset, which a
    NaiveDatetime refuses): lcgen's schema for it says there is none."""
    grammar = lcgen.Grammar.from_pydantic(Naive)
    assert not grammar.accepts(model, '{"when": "1000-10-10T00:00:00.000000-00:00"}')
    assert grammar.accepts(model, '{"when": "2024-02-29T23:59:59.5"}')
    for seed in range(3):
        value = model.generate("JSON:", schema=Naive, temperature=1.0, seed=seed, max_tokens=80)
        assert value.when.tzinfo is None


# schemas no value satisfies, and references ------------------------------------------------------
@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"allOf": [{"type": "string"}, {"type": "integer"}]},
            'no value satisfies the schema at #: the types "string" and "integer"',
        ),
        (
            {"type": "object", "required": ["a"],
             "properties": {"a": {"type": "string", "allOf": [{"type": "array"}]}}},
            "at #/properties/a: the types",
        ),
        ({"enum": []}, "enum at # is empty"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 / maxLength 2 at #"),
        ({"type": "object", "minProperties": 3, "maxProperties": 2}, "minProperties 3 / max"),
        (
            {"anyOf": [{"type": "string", "minLength": 3, "maxLength": 1}, {"enum": []}]},
            "no value satisfies the schema at # (no string satisfies minLength 3",
        ),
        (
            {"properties": {"x": {"$ref": "#bar"}}},
            "$ref '#bar' (at #/properties/x): no anchor 'bar' is defined",
        ),
        (
            {"$ref": "other.json#/a"},
            "$ref 'other.json#/a' (at #) refers to the document 'other.json', which lcgen was "
            "not given",
        ),
    ],
)  # fmt: skip
def test_refused_schemas_raise_a_plain_grammar_error_naming_where(
    schema: dict[str, Any], message: str
) -> None:
    with pytest.raises(lcgen.GrammarError) as info:
        lcgen.Grammar.from_json_schema(schema)
    # no internal subclass leaks (UnsupportedSchemaError is public: what cannot be enforced)
    assert type(info.value) in (lcgen.GrammarError, lcgen.UnsupportedSchemaError)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"a": {"$anchor": "foo", "type": "integer"}},
         "properties": {"x": {"$ref": "#foo"}}},
        {"$defs": {"a": {"$anchor": "foo", "type": "integer"}},
         "properties": {"x": {"$ref": "#foo", "minimum": 0}}},
        {"$schema": "http://json-schema.org/draft-07/schema#",
         "definitions": {"a": {"$id": "#foo", "type": "integer"}},
         "properties": {"x": {"$ref": "#foo"}}},
        {"$id": "https://example.com/root.json", "$defs": {"a": {"type": "integer"}},
         "properties": {"x": {"$ref": "root.json#/$defs/a"}}},
    ],
)  # fmt: skip
def test_anchors_and_the_root_id_resolve(model: lcgen.Model, schema: dict[str, Any]) -> None:
    grammar = lcgen.Grammar.from_json_schema(schema)
    assert grammar.accepts(model, '{"x": 3}')
    assert not grammar.accepts(model, '{"x": "3"}')
