"""Small helpers shared by the model tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

import lcgen
from bench.runners import extra_cpu_buffers
from lcgen.runtime.costs import DecodeCosts


class PriorCosts(DecodeCosts):
    """A cost model that learns nothing: the prior shape's predictions, whatever the machine
    (tests of what padding does, not of whether this machine should pad)."""

    def observe(self, n: int, cells: int, seconds: float) -> None:
        pass


def first_logits(model: lcgen.Model, prompt: str | list[int]) -> np.ndarray:
    """The logits after ``prompt`` (the first step's, seen by a hook that accepts)."""
    rows: list[np.ndarray] = []

    def record(step: lcgen.Step) -> None:
        rows.append(step.logits)

    with model.sequence(prompt) as seq:
        seq.generate(max_tokens=1, hooks=[record])
    return np.array(rows[0])


def many_words_grammar(n: int) -> str:
    """GBNF for a comma-separated list of words from a rule of about ``n`` alternatives (each
    a distinct string of 3 to 9 letters): llguidance refuses 37,000 of them (a limit on its
    grammar's symbols), where llama.cpp's check takes about 20 ms a token."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnop"))
    words = sorted({"".join(rng.choice(letters, rng.integers(3, 10))) for _ in range(n)})
    return 'root ::= item ("," item)*\nitem ::= ' + " | ".join(f'"{w}"' for w in words) + "\n"


def llama_cpp_python(model: lcgen.Model, path: Path, **options: Any) -> Any:
    """llama-cpp-python's ``Llama`` on ``path``, with the CPU buffers ``model`` uses (lcgen
    turns llama.cpp's extra buffers off where AMX crashes; the other side must too)."""
    import llama_cpp

    with extra_cpu_buffers(model.extra_cpu_buffers):
        return llama_cpp.Llama(model_path=str(path), verbose=False, **options)


def gguf_with_keys(source: Path, target: Path, keys: dict[str, int]) -> Path:
    """A copy of the GGUF ``source`` at ``target`` with uint32 header keys added (say, token
    ids the file does not declare); the tensor data moves by whole alignment units."""
    import mmap
    import struct

    from lcgen._native.gguf import _Reader

    with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        reader = _Reader(data, str(source))
        reader.at = 8  # magic, version
        n_tensors, n_kv = reader.u64(), reader.u64()
        kv_start, alignment = reader.at, 32
        for _ in range(n_kv):
            key = reader.string()
            value = reader.value(int(reader.take("<I", 4)))
            if key == "general.alignment":
                alignment = int(value)  # type: ignore[arg-type]
        kv_end = reader.at
        for _ in range(n_tensors):  # name, n_dims, dims, type, offset (into the data)
            reader.string()
            n_dims = int(reader.take("<I", 4))
            reader.at += 8 * n_dims + 4 + 8
        infos_end = reader.at
        added = b"".join(
            struct.pack("<Q", len(k)) + k.encode() + struct.pack("<II", 4, v)
            for k, v in keys.items()
        )
        head = b"".join(
            [
                data[:8],
                struct.pack("<QQ", n_tensors, n_kv + len(keys)),
                data[kv_start:kv_end],
                added,
                data[kv_end:infos_end],
            ]
        )
        with open(target, "wb") as out:
            out.write(head + b"\0" * (-len(head) % alignment))
            out.write(data[-(-infos_end // alignment) * alignment :])
    return target


@contextlib.contextmanager
def running(app: Any) -> Iterator[str]:
    """Serve the ASGI ``app`` on a free port of 127.0.0.1 (uvicorn in a thread) until the
    block ends; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _exact_multiple_of(
    validator: Any, step: float, instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    if validator.is_type(instance, "number") and Fraction(repr(instance)) % Fraction(repr(step)):
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {step!r}")


def validator(schema: Any, format_checker: jsonschema.FormatChecker | None = None) -> Any:
    """``jsonschema``'s validator of ``schema`` with ``multipleOf`` in decimal arithmetic, as
    the specification says (``jsonschema`` divides in floating point: 19.99 / 0.01 is
    1998.9999999999998 there)."""
    cls = jsonschema.validators.validator_for(schema if isinstance(schema, dict) else {})
    exact = jsonschema.validators.extend(cls, {"multipleOf": _exact_multiple_of})
    return exact(schema, format_checker=format_checker)


def validate(
    instance: Any, schema: Any, format_checker: jsonschema.FormatChecker | None = None
) -> None:
    """``jsonschema.validate`` with :func:`validator`'s ``multipleOf``."""
    error = jsonschema.exceptions.best_match(
        validator(schema, format_checker).iter_errors(instance)
    )
    if error is not None:
        raise error


# Two functions in OpenAI's tool shape, for the function-calling tests.
SET_UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
SET_VOLUME = {
    "type": "function",
    "function": {
        "name": "set_volume",
        "parameters": {
            "type": "object",
            "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 10}},
            "required": ["level"],
            "additionalProperties": False,
        },
    },
}


def assert_same_up_to_a_near_tie(text: str, reference: lcgen.Text, margin: float) -> None:
    """``text`` is ``reference`` (greedy, generated with ``logprobs=2``) up to the first token
    where the reference's two best candidates are within ``margin``: logits move in their
    last bits with the batch shapes and the cells' places, and so can swap such a tie."""
    at = 0
    for entry in reference.logprobs or []:
        if text[at : at + len(entry.text)] != entry.text:
            best, second = entry.top[:2]
            assert best.logprob - second.logprob <= margin, (text, str(reference), entry)
            return
        at += len(entry.text)
    assert text == str(reference)


# Six different digits (a schema test_unique_items and test_server generate with).
UNIQUE_DIGITS: dict[str, Any] = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 6,
    "maxItems": 6,
    "uniqueItems": True,
}
