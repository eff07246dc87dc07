"""Bad input gets a clear error, never a dead process or a hang: each case runs in a child
process (a crash there cannot take the test run with it) with a time limit, and passes only if
the child prints PASS and exits normally.

These are the cases that used to end the process (a segfault or abort in llama.cpp), hang, or
leave a sequence broken. After them, bad options and values that got another library's error
(or none): those run in this process.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lcgen

PRELUDE = """
import sys, threading, time, os, signal
import numpy as np
import lcgen

def expect(error, call, match=""):
    try:
        call()
    except error as exc:
        assert match in str(exc), (match, str(exc))
        return exc
    raise AssertionError(f"{call} did not raise {error.__name__}")
"""


def run_case(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    program = PRELUDE + textwrap.dedent(code) + "\nprint('PASS')\n"
    return subprocess.run(
        [sys.executable, "-c", program, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_passes(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "PASS" in done.stdout, done.stdout


def test_everything_after_close_raises_closed_error() -> None:
    assert_passes(
        run_case("""
        m = lcgen.load()
        seq = m.sequence("Hello there")
        seq.generate(max_tokens=2)
        fresh = m.sequence("Not decoded yet")
        state = lcgen.Grammar.choice(["yes", "no"]).state(m)
        text = lcgen.continuous(lcgen.generate.text(m, max_tokens=2))
        s = text("Hi")
        m.close()
        for call in [
            lambda: m.tokenize("hi"), lambda: m.detokenize([1, 2]), lambda: m.is_eog(5),
            lambda: m.generate("hi", max_tokens=2), lambda: list(m.stream("hi")),
            lambda: m.chat([{"role": "user", "content": "hi"}]), lambda: m.metadata("x"),
            lambda: m.cache.pin("x"), lambda: seq.generate(max_tokens=2), lambda: seq.fork(),
            lambda: seq.rewind(1), lambda: seq.to_bytes(), lambda: seq.text,
            lambda: state.allows(3), lambda: state.allowed(), lambda: text(s),
            lambda: m.sequence("again"), lambda: fresh.fork(), lambda: fresh.append(" x"),
            lambda: seq.append_tokens([5]), lambda: seq.checkpoint(), lambda: m.cache.clear(),
            lambda: m.cache.unpin([1, 2]), lambda: m.cache.cached([1, 2]), m.cache.free_cells,
            m.cache.available_slots, lambda: m.cache.save("/nonexistent-lcgen/c.lcc"),
        ]:
            expect(lcgen.ClosedError, call)
        assert "closed" in repr(m)
        seq.close(); m.close(); state.close()
        """)
    )


def test_closing_the_model_while_another_thread_generates() -> None:
    assert_passes(
        run_case("""
        m = lcgen.load()
        errors = []
        started = threading.Event()
        def work():
            try:
                with m.sequence("Once upon a time") as seq:
                    started.set()
                    for _ in range(200):
                        seq.generate(max_tokens=4)
            except lcgen.ClosedError as exc:
                errors.append(exc)
        t = threading.Thread(target=work)
        t.start()
        started.wait(30)
        time.sleep(0.3)
        m.close()
        t.join(60)
        assert not t.is_alive() and len(errors) == 1, errors
        """)
    )


def test_token_ids_llama_cpp_would_abort_on_are_refused() -> None:
    # token_piece(-1) aborted the process (std::out_of_range in llama_vocab_get_attr): -1
    # indexed the piece cache from its end and reached llama.cpp unchecked.
    assert_passes(
        run_case("""
        m = lcgen.load(n_threads=1)
        for call in (m.token_piece, m.vocab.special_piece, m.vocab.is_special, m.is_eog):
            for bad in (-1, m.n_vocab, 2**40):
                expect(ValueError, lambda: call(bad), f"token id {bad} is outside the vocabulary")
            expect(TypeError, lambda: call(True), "a token id is an int, got True")
            expect(TypeError, lambda: call(1.0), "a token id is an int, got 1.0")
        assert m.token_piece(np.int64(28)) == m.token_piece(28) and not m.is_eog(np.int32(28))
        """)
    )


def test_sizes_llama_cpp_would_abort_on_are_refused() -> None:
    assert_passes(
        run_case("""
        expect(ValueError, lambda: lcgen.load(n_batch=1, n_seq_max=8), "n_batch=1 is below")
        for n_ctx in range(1, 8):
            expect(ValueError, lambda: lcgen.load(n_ctx=n_ctx, n_seq_max=8), "below n_seq_max")
        expect(ValueError, lambda: lcgen.load(n_batch=2**32 + 1), "n_batch must be in")
        expect(ValueError, lambda: lcgen.load(n_threads=10**6), "n_threads must be in")
        expect(ValueError, lambda: lcgen.load(n_seq_max=1000), "n_seq_max must be in")
        # a C int: 2**32 reached llama.cpp as 0 while lcgen reported every layer offloaded
        expect(ValueError, lambda: lcgen.load(n_gpu_layers=2**32), "n_gpu_layers must be in")
        expect(ValueError, lambda: lcgen.load(n_gpu_layers=-2), "n_gpu_layers must be in")
        expect(TypeError, lambda: lcgen.load(n_gpu_layers=1.5), "n_gpu_layers must be an int")
        # A context this machine cannot hold is refused at once (llama.cpp spent 47 s
        # failing to allocate 10**9 cells; a few million could have the process killed).
        expect(lcgen.ModelLoadError, lambda: lcgen.load(n_ctx=10**9), "n_ctx=1000000000 needs")
        expect(lcgen.ModelLoadError, lambda: lcgen.load(n_ctx=2**31 - 1), "more than this")
        with lcgen.load(n_ctx=8, n_batch=4) as small:  # small sizes work (slots follow them)
            assert small.context.n_seq_max == 4
            assert small.generate("a b c d e f g", max_tokens=4).stats.tokens == 4
        """)
    )


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--threads", "1000000"], 2, "--threads: must be in [1, 512]"),  # a usage error
        (["--n-ctx", "1"], 1, "over the context of 256 tokens"),
    ],
)
def test_the_command_line_reports_bad_sizes(args: list[str], status: int, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lcgen.cli", "generate", "smollm2-135m", "hello", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == status and message in done.stderr, (done.returncode, done.stderr)


def test_deep_grammars_and_texts_are_refused_quickly() -> None:
    assert_passes(
        run_case("""
        deep = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000
        expect(lcgen.GrammarError, lambda: lcgen.Grammar(deep), "nests parentheses 20000 deep")
        lcgen.Grammar("root ::= " + "(" * 200 + '"a"' + ")" * 200)  # deep but fine
        m = lcgen.load()
        json = lcgen.Grammar.from_file("json")
        text = '{"a":' * 100000 + "1" + "}" * 100000
        start = time.perf_counter()
        expect(lcgen.GrammarError, lambda: json.accepts(m, text), "nests brackets 100000 deep")
        assert time.perf_counter() - start < 10
        assert json.accepts(m, '{"a":' * 50 + "1" + "}" * 50)
        """)
    )


def test_huge_stop_strings_and_banned_phrases_are_refused_quickly() -> None:
    assert_passes(
        run_case(
            """
        m = lcgen.load()
        start = time.perf_counter()
        expect(ValueError, lambda: m.generate("x", stop=["ab" * 4000]), "too long")
        expect(ValueError, lambda: m.generate("x", banned=["ab" * 10000]), "too long")
        expect(ValueError, lambda: m.generate("x", stop=["a" * 100000]), "too long")
        assert time.perf_counter() - start < 10
        assert m.generate("x", max_tokens=2, stop=["b" * 500], banned=["c" * 500]) is not None
        """,
            timeout=60,
        )
    )


def _patched_model(tmp_path: Path, key: bytes, value: bytes) -> Path:
    """A copy of the bundled model with the scalar value after ``key`` replaced."""
    from lcgen.registry import resolve

    source = resolve("smollm2-135m", download=False)
    with open(source, "rb") as f:
        head = f.read(1 << 20)
    at = head.index(key) + len(key)
    kind = struct.unpack_from("<I", head, at)[0]
    assert kind in (4, 6), kind  # uint32 or float32: 4 bytes
    target = tmp_path / "patched.gguf"
    shutil.copyfile(source, target)
    with open(target, "r+b") as f:
        f.seek(at + 4)
        f.write(value)
    return target


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (b"llama.block_count", struct.pack("<I", 0), "block_count = 0"),
        (b"llama.block_count", struct.pack("<I", 100000), "block_count = 100000"),
        (b"llama.attention.layer_norm_rms_epsilon", struct.pack("<f", float("nan")), "nan"),
    ],
)
def test_a_gguf_with_hyper_parameters_llama_cpp_asserts_on(
    tmp_path: Path, key: bytes, value: bytes, message: str
) -> None:
    path = _patched_model(tmp_path, key, value)
    done = run_case(
        """
        error = expect(lcgen.ModelLoadError, lambda: lcgen.load(sys.argv[1]))
        print(error)
        """,
        str(path),
    )
    assert_passes(done)
    assert message in done.stdout


def _gguf_with(tmp_path: Path, keys: dict[str, str | int | bytes]) -> Path:
    """A copy of the bundled model with header ``keys`` set (a str as a string, an int as a
    uint32, bytes as a raw type and value), added or in the place of the key of that name."""
    from lcgen._native.gguf import _Reader
    from lcgen.registry import resolve

    source = resolve("smollm2-135m", download=False)
    data = source.read_bytes()
    reader = _Reader(data, str(source))  # type: ignore[arg-type]
    reader.at = 8
    n_tensors, n_kv = reader.u64(), reader.u64()
    entries: dict[str, bytes] = {}
    for _ in range(n_kv):
        start = reader.at
        key = reader.string()
        reader.value(int(reader.take("<I", 4)))
        entries[key] = data[start : reader.at]
    infos_start = reader.at
    for _ in range(n_tensors):  # name, dims, type, offset
        reader.string()
        n_dims = int(reader.take("<I", 4))
        reader.at += 8 * n_dims + 4 + 8
    infos = data[infos_start : reader.at]
    tensors_at = -(-reader.at // 32) * 32  # the default alignment
    for key, value in keys.items():
        name = struct.pack("<Q", len(key)) + key.encode()
        if isinstance(value, bytes):  # its type and value, raw
            entries[key] = name + value
        elif isinstance(value, str):
            entries[key] = name + struct.pack("<IQ", 8, len(value)) + value.encode()
        else:
            entries[key] = name + struct.pack("<II", 4, value)
    head = data[:8] + struct.pack("<QQ", n_tensors, len(entries)) + b"".join(entries.values())
    head += infos
    target = tmp_path / "crafted.gguf"
    target.write_bytes(head + bytes(-len(head) % 32) + data[tensors_at:])
    return target


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"llama.rope.scaling.type": "bogus"}, "rope.scaling.type = 'bogus'"),
        ({"llama.expert_count": 2000}, "over llama.cpp's limit of 1024"),
        ({"llama.expert_used_count": 2}, "more than llama.expert_count (0)"),
        ({"llama.expert_count": 4}, "but expert_used_count is not"),
        ({"llama.nextn_predict_layers": 50}, "more than the model's layers"),
        ({"tokenizer.ggml.model": "no_vocab"}, "has no tokenizer"),
        ({"llama.rope.scaling.type": "linear", "llama.expert_count": 0}, None),  # well formed
        # a BOS token that is a lone byte: chat raised UnicodeDecodeError
        ({"tokenizer.ggml.bos_token_id": 111}, None),
        # arrays nested 2,000 deep: lcgen's reader recursed (RecursionError)
        (
            {"x.nested": struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2000 + bytes(12)},
            "of arrays",
        ),
    ],
)
def test_a_gguf_llama_cpp_would_abort_on_later_is_refused_at_load(
    tmp_path: Path, extra: dict[str, str | int | bytes], message: str | None
) -> None:
    """Each of these aborted the process: at load (a GGML_ASSERT on the hyper-parameters) or,
    without a tokenizer, at the first tokenize."""
    path = _gguf_with(tmp_path, extra)
    done = run_case(
        """
        try:
            m = lcgen.load(sys.argv[1])
            chat = m.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
            print("loaded:", m.generate("Hi", max_tokens=2), chat)
        except lcgen.ModelLoadError as error:
            print(error)
        """,
        str(path),
    )
    assert_passes(done)
    assert (message or "loaded:") in done.stdout, done.stdout


def test_ctrl_c_in_the_middle_of_a_generation_leaves_the_sequence_usable() -> None:
    assert_passes(
        run_case("""
        m = lcgen.load()
        # (a shell's background job inherits SIGINT ignored: take it back)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stopped = 0
        no_end = {t: float("-inf") for t in range(m.n_vocab) if m.is_eog(t)}  # runs 400 tokens
        for delay in (0.05, 0.15, 0.3, 0.5, 0.8):
            with m.sequence("Write a long story about the sea.") as seq:
                timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
                timer.start()
                try:
                    seq.generate(max_tokens=400, logit_bias=no_end)
                except KeyboardInterrupt:
                    stopped += 1
                timer.cancel()
                n = seq.n_tokens
                more = seq.generate(max_tokens=5)  # it goes on from where it stopped
                assert seq.n_tokens == n + len(more.tokens)
                assert seq.text == m.detokenize(seq.tokens)
        assert stopped == 5, f"{stopped} of 5 generations were interrupted"
        """)
    )


def test_ctrl_c_as_a_step_ends_while_another_thread_decodes_lets_the_model_close() -> None:
    """Ctrl-C while the main thread waited for the lock (another thread's decode held it) to
    leave a step left it counted inside one for good: close() from it raised ValueError, and
    from any other thread waited for ever."""
    assert_passes(
        run_case("""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        m = lcgen.load(n_ctx=256)
        held, entered = threading.Event(), threading.Event()

        def decode_elsewhere() -> None:  # holds the lock as a decode does, past the Ctrl-C
            entered.wait()
            with m.context.lock:
                held.set()
                time.sleep(0.5)

        threading.Thread(target=decode_elsewhere).start()
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            with m.context.in_use():
                entered.set()
                held.wait()
            raise AssertionError("no KeyboardInterrupt")
        except KeyboardInterrupt:
            pass
        assert not m.context._in_use, m.context._in_use
        closer = threading.Thread(target=m.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive() and not m.context.is_open
        """)
    )


def test_ctrl_c_while_a_model_loads_stops_the_load() -> None:
    """llama.cpp logs while it loads: Ctrl-C was raised in the log callback, where ctypes
    printed it and dropped it, and the load went on to the end."""
    done = run_case("""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from lcgen.registry import resolve
        path, loaded = resolve("smollm2-135m"), 0
        for delay in (0.02, 0.05, 0.1):
            timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT))
            timer.start()
            try:
                for _ in range(50):  # (the signal lands in a load, or between two)
                    lcgen.Model(path, n_ctx=256).close()
                    loaded += 1
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("50 loads went on after Ctrl-C")
            timer.cancel()
        lcgen.Model(path, n_ctx=256).close()  # a load after them is not interrupted
        """)
    assert_passes(done)
    assert "Exception ignored" not in done.stderr


def test_a_full_memory_in_the_middle_of_a_prefill_leaves_the_sequence_usable() -> None:
    assert_passes(
        run_case("""
        m = lcgen.load(n_ctx=256, n_batch=16, n_seq_max=2)
        assert m.context.n_cells == 256
        words = m.tokenize("one two three four five six seven eight nine ten " * 40)
        holder = m.sequence(words[:231])
        holder.prefill()  # 230 of the 256 cells, live: nothing can be evicted
        seq = m.sequence(words[300:360])
        expect(lcgen.ContextFullError, lambda: seq.generate(max_tokens=2), "no free cells")
        holder.close()
        m.cache.clear()
        out = seq.generate(max_tokens=3)  # goes on, decoding what was not
        assert out.stats.tokens == 3
        """)
    )


# Bad options and values: a clear error naming the option and the value (nothing here can end
# the process, so these run in it, on the shared model).


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"logit_bias": [(28, 5)]}, TypeError, "logit_bias takes a mapping of token id to number"),
        ({"logit_bias": 5}, TypeError, "logit_bias takes a mapping"),
        ({"logit_bias": {28: float("nan")}}, ValueError, "logit_bias values must not be NaN"),
        ({"logit_bias": {28: "5"}}, TypeError, "logit_bias values are numbers, got '5'"),
        ({"stop": 5}, TypeError, "stop takes a string or a list of strings, got 5"),
        ({"stop": [5]}, TypeError, "stop string 5 is a int"),
        ({"stop_tokens": 28}, TypeError, "use stop_tokens=[28]"),
        ({"stop_tokens": "ab"}, TypeError, "stop_tokens takes a list of token ids (int), got 'ab'"),
        ({"stop_tokens": [1.5]}, TypeError, "stop_tokens must be an int, got 1.5"),
        ({"seed": True}, ValueError, "seed must be an int >= 0 or None, got True"),
        # a Python error from inside lcgen, not naming the option (OverflowError, iteration)
        ({"repeat_last_n": 10**20}, ValueError, "repeat_last_n must be >= 0 and at most"),
        ({"hooks": 5}, TypeError, "hooks takes a list of callables, got 5"),
        ({"validators": 5}, TypeError, "validators takes a list of callables, got 5"),
        # flags that took any value as true or false
        ({"token_healing": "yes"}, TypeError, "token_healing must be True or False, got 'yes'"),
        ({"include_stop": "no"}, TypeError, "include_stop must be True or False, got 'no'"),
        (
            {"banned": ["x"], "banned_ignore_case": 1},
            TypeError,
            "banned_ignore_case must be True or False, got 1",
        ),
        # no generated text holds a lone surrogate: such a string could never match
        (
            {"stop": ["\ud800"]},
            ValueError,
            "stop string '\\ud800' contains the lone surrogate U+D800",
        ),
        (
            {"banned": ["a\udc80"]},
            ValueError,
            "phrase 'a\\udc80' contains the lone surrogate U+DC80",
        ),
        (
            {"choice": ["\ud800"]},
            lcgen.GrammarError,
            "a literal contains the lone surrogate U+D800",
        ),
    ],
)
def test_bad_generation_options_are_named(
    model: lcgen.Model, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        model.generate("Hi", max_tokens=2, **options)
    assert message in str(caught.value)


def test_flags_of_tokenize_pin_and_format_chat_are_booleans(model: lcgen.Model) -> None:
    """special="no" parsed the special tokens, add_generation_prompt="no" added the prompt:
    any value was true."""
    calls = [
        (lambda: model.tokenize("<|im_start|>", special="no"), "special"),  # type: ignore[arg-type]
        (lambda: model.tokenize("hi", add_bos="no"), "add_bos"),  # type: ignore[arg-type]
        (lambda: model.detokenize([1], special=1), "special"),  # type: ignore[arg-type]
        (lambda: model.cache.pin("<|im_start|>", special="no"), "special"),  # type: ignore[arg-type]
        (lambda: model.cache.unpin("<|im_start|>", special="no"), "special"),  # type: ignore[arg-type]
        (
            lambda: model.format_chat(
                [{"role": "user", "content": "hi"}],
                add_generation_prompt="no",  # type: ignore[arg-type]
            ),
            "add_generation_prompt",
        ),
    ]
    for call, name in calls:
        with pytest.raises(TypeError, match=f"{name} must be True"):
            call()
    assert model.cache.stats.pinned == 0


def test_small_errors_name_what_is_wrong(model: lcgen.Model, tmp_path: Path) -> None:
    """An empty model name read as the folder "."; beams past the most slots a model can have
    advised loading with as many; a lone surrogate in a metadata key was a codec's error; a
    NUL in a state file's path was "embedded null byte", naming no file."""
    with pytest.raises(lcgen.ModelNotFoundError, match="the model reference is empty"):
        lcgen.load("")
    with pytest.raises(ValueError, match="a model has 256 at most: use fewer beams"):
        lcgen.generate.text(model, max_tokens=3, beams=1000)
    with pytest.raises(ValueError, match="a metadata key holds no lone surrogate"):
        model.metadata("\ud800")
    bad = str(tmp_path / "a\0b.lcs")
    with (
        model.sequence("Hi") as seq,
        pytest.raises(lcgen.StateFileError, match="a path holds no NUL character"),
    ):
        seq.save(bad)
    with pytest.raises(lcgen.StateFileError, match="embedded null byte"):
        lcgen.Sequence.load(model, bad)
    with pytest.raises(lcgen.StateFileError, match="a path holds no NUL character"):
        model.cache.save(bad)


def test_infinite_logit_biases_ban_and_force(model: lcgen.Model) -> None:
    inf = float("inf")
    first = model.generate("Hi", max_tokens=1).tokens[0]
    assert first not in model.generate("Hi", max_tokens=4, logit_bias={first: -inf}).tokens
    assert model.generate("Hi", max_tokens=2, logit_bias={28: inf}).tokens == (28, 28)
    # A finite bias past float32's range is float32's largest logit, not +inf (it was, with
    # numpy's overflow warning).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        huge = model.generate("Hi", max_tokens=2, logit_bias={28: 1e308, 29: -1e308})
    assert huge.tokens == (28, 28)
    pairs: Any = [(28, -inf)]  # pairs, as a list: kept as a tuple of them
    assert lcgen.SamplerConfig(logit_bias=pairs).logit_bias == ((28, -inf),)
    # +inf on a token the grammar refuses: it stays refused (-inf + inf made NaN logits)
    for temperature in (0.0, 0.7):
        out = model.generate(
            "Say", max_tokens=3, logit_bias={28: inf}, choice=["yes", "no"], temperature=temperature
        )
        assert out in ("yes", "no")


@pytest.mark.parametrize("seed", [-1, 1.5, "x", True, [1, 2]])
def test_bad_seeds_are_refused_everywhere_as_generate_refuses_them(
    model: lcgen.Model, seed: Any
) -> None:
    message = f"seed must be an int >= 0 or None, got {seed!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        model.generate("Hi", max_tokens=1, seed=seed)
    with pytest.raises(ValueError, match=re.escape(message)):
        model.sequence("Hi", seed=seed)
    slots = model.cache.available_slots()
    with model.sequence("Hi", seed=3) as seq:
        with pytest.raises(ValueError, match=re.escape(message)):
            seq.fork(seed=seed)
        with pytest.raises(ValueError, match=re.escape(message)):
            seq.reseed(seed)
        seq.reseed(4)
        assert seq.generate(max_tokens=1) is not None  # the sequence goes on
    assert model.cache.available_slots() == slots  # no slot was taken by a refused seed


def test_generator_step_takes_a_list_and_refuses_what_is_not_logits(model: lcgen.Model) -> None:
    n = model.vocab.n_vocab
    logits = [0.0] * n
    logits[42] = 5.0
    assert lcgen.Generator(model, max_tokens=2).step(logits).tokens == (42,)
    for bad in (None, ["1.5"] * n, [[1.0], 2.0], np.zeros(n, dtype=bool)):
        with pytest.raises(TypeError, match="logits must be a numpy array"):
            lcgen.Generator(model, max_tokens=2).step(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"logits must have shape \({n},\), got \(3,\)"):
        lcgen.Generator(model, max_tokens=2).step([0.0] * 3)


def test_infinite_logits_raise_decode_error_and_minus_infinity_bans(model: lcgen.Model) -> None:
    n = model.vocab.n_vocab
    one = np.zeros(n, dtype=np.float32)
    one[5] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning, no NaN log-probability
        cases: list[tuple[np.ndarray, dict[str, Any]]] = [
            (one, {"logprobs": 2}),
            (one, {"temperature": 0.7, "seed": 1}),
            (one, {"logit_bias": {3: 1.0}}),
            (np.full(n, np.inf, dtype=np.float32), {}),
            # float64 beyond float32's range passed the check, then overflowed in sampling:
            # greedy picked token 0, several log-probabilities came out 0.0 at once
            (np.full(n, 1e300), {}),
            (np.where(np.arange(n) % 2, 1e300, -1e300), {"logprobs": 3, "temperature": 0.5}),
        ]
        for logits, options in cases:
            gen = lcgen.Generator(model, max_tokens=2, **options)
            with pytest.raises(lcgen.DecodeError, match="the logits hold \\+inf, which is not"):
                gen.step(logits)
        with pytest.raises(lcgen.DecodeError, match="hold \\+inf"):
            lcgen.Generator(model, max_tokens=2).step(one, exclude=[1])
        with pytest.raises(lcgen.DecodeError, match="hold \\+inf"):
            lcgen.Generator(model, max_tokens=2, logprobs=2).accept(5, one)
        banned = np.zeros(n, dtype=np.float32)
        banned[:7] = -np.inf
        chunk = lcgen.Generator(model, max_tokens=2, logprobs=2).step(banned)
        assert chunk.tokens == (7,) and chunk.logprob is not None and np.isfinite(chunk.logprob)
        with pytest.raises(lcgen.NoCandidatesError, match="or the logits given, ban them all"):
            lcgen.Generator(model, max_tokens=2).step(np.full(n, -1e300))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "number", "multipleOf": NAN}, "multipleOf at # is nan"),
        ({"type": "number", "minimum": NAN}, "minimum at # is nan"),
        ({"type": "integer", "maximum": INF}, "maximum at # is inf"),
        ({"type": "number", "exclusiveMinimum": -INF}, "exclusiveMinimum at # is -inf"),
        ({"type": "number", "exclusiveMaximum": NAN}, "exclusiveMaximum at # is nan"),
        ({"type": "number", "multipleOf": -INF}, "multipleOf at # is -inf"),
        ({"items": {"minimum": NAN}}, "minimum at #/items is nan"),
        ({"properties": {"x": {"maximum": INF}}}, "maximum at #/properties/x is inf"),
        ({"anyOf": [{"multipleOf": INF}]}, "multipleOf at #/anyOf/0 is inf"),
        ({"not": {"minimum": NAN}}, "minimum at #/not is nan"),
        ({"$defs": {"a": {"minimum": NAN}}, "$ref": "#/$defs/a"}, "minimum at #/$defs/a is nan"),
        ({"minLength": NAN}, "minLength at # is nan"),
        ({"maxItems": INF}, "maxItems at # is inf"),
        ({"const": NAN}, "const at # is nan"),
        ({"const": [1, {"a": INF}]}, "const at # holds inf"),
        ({"enum": [1, -INF]}, "enum at # holds -inf"),
        ('{"type": "number", "minimum": NaN}', "minimum at # is nan"),
    ],
)
def test_json_schema_numbers_that_are_not_finite_are_named(schema: Any, message: str) -> None:
    with pytest.raises(lcgen.GrammarError) as caught:
        lcgen.Grammar.from_json_schema(schema)
    text = str(caught.value)
    assert message in text and "not finite (JSON has no NaN or Infinity)" in text, text


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"minLength": 1.5}, "minLength at #: 1.5 is not of type 'integer'"),
        ({"properties": {"x": {"maxItems": -1}}}, "maxItems at #/properties/x: -1 is less"),
        ({"type": "number", "minimum": "1"}, "minimum at #: '1' is not of type 'number'"),
    ],
)
def test_json_schema_keywords_of_the_wrong_kind_are_named(schema: Any, message: str) -> None:
    with pytest.raises(lcgen.GrammarError, match=re.escape(f"invalid JSON Schema: {message}")):
        lcgen.Grammar.from_json_schema(schema)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "object", "properties": {1: {"type": "integer"}}},
            "properties at # has the key 1",
        ),
        (
            {"properties": {"a": {"patternProperties": {2: {}}}}},
            "patternProperties at #/properties/a",
        ),
        ({"dependentRequired": {(1,): ["a"]}}, "dependentRequired at # has the key (1,), a tuple"),
        ({"anyOf": [{"type": "object"}, {1: {}}]}, "the JSON Schema at #/anyOf/1 has the key 1"),
    ],
)
def test_json_schema_keys_that_are_not_strings_are_named(schema: Any, message: str) -> None:
    # a dict written in Python: 'int' object is not iterable, from inside the compiler
    with pytest.raises(lcgen.GrammarError, match=re.escape(message)):
        lcgen.Grammar.from_json_schema(schema)


def test_annotations_may_hold_what_json_cannot() -> None:
    # pydantic writes a default of inf as it is: annotations constrain nothing, so they pass
    lcgen.Grammar.from_json_schema({"type": "number", "default": INF, "examples": [NAN]})
    lcgen.Grammar.from_json_schema({"type": "string", "minLength": 2.0})  # a whole count


@pytest.mark.parametrize(
    ("length_penalty", "error", "message"),
    [
        (NAN, ValueError, "length_penalty must be a finite number in [-10, 10], got nan"),
        (INF, ValueError, "length_penalty must be a finite number in [-10, 10], got inf"),
        (1000, ValueError, "got 1000"),  # n ** 1000 overflowed when ranking
        (-1000, ValueError, "got -1000"),  # and n ** -1000 divided by zero
        (True, TypeError, "length_penalty must be a number, got True"),
        ("x", TypeError, "length_penalty must be a number, got 'x'"),
    ],
)
def test_bad_length_penalties_are_refused(
    model: lcgen.Model, length_penalty: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        lcgen.generate.text(model, beams=2, length_penalty=length_penalty)


def test_beam_settings_take_numpy_numbers(model: lcgen.Model) -> None:
    spec = lcgen.generate.text(model, beams=np.int64(2), length_penalty=np.float32(0.5))
    assert (spec.beams, spec.length_penalty) == (2, 0.5)
    assert type(spec.beams) is int and type(spec.length_penalty) is float


def test_beam_search_refuses_a_logit_bias_that_is_no_mapping(model: lcgen.Model) -> None:
    with pytest.raises(TypeError, match="logit_bias takes a mapping"):
        lcgen.generate.text(model, beams=2, logit_bias=[(1, 2.0)])  # type: ignore[arg-type]


def test_long_prompts_are_shortened_in_messages(model: lcgen.Model) -> None:
    with pytest.raises(TypeError) as caught:
        ids: Any = list(range(4096))
        model.generate(ids)
    text = str(caught.value)
    assert "a list of 4096 items [0, 1, 2, 3, ...]" in text and len(text) < 200, text
    assert "model.sequence(tokens)" in text
    with pytest.raises(TypeError) as caught:
        model.sequence({i: i for i in range(4096)})  # type: ignore[arg-type]
    assert len(str(caught.value)) < 200, str(caught.value)


def test_numpy_numbers_are_taken_where_numbers_are(model: lcgen.Model) -> None:
    """lcgen's own API returns numpy token ids (tokens_extending): every option takes numpy
    integers and floats as the numbers they hold, with the same result."""
    ids = model.tokens_extending(b" the")
    first, tokens = ids[0], np.array(model.tokenize("Once upon"))
    assert isinstance(first, np.integer)
    options: dict[str, Any] = {
        "max_tokens": 4,
        "temperature": 0.7,
        "top_k": 20,
        "seed": 3,
        "logprobs": 1,
        "logit_bias": {int(first): -5.0},
        "stop_tokens": [int(first) + 1],
    }
    as_numpy = {
        **options,
        "max_tokens": np.int64(4),
        "temperature": np.float32(0.7),
        "top_k": np.int32(20),
        "seed": np.uint8(3),
        "logprobs": np.int64(1),
        "logit_bias": {first: np.float32(-5.0)},
        "stop_tokens": np.array([first + 1]),
    }
    expected = model.sequence(tokens.tolist()).generate(**options)
    got = model.sequence(tokens).generate(**as_numpy)  # type: ignore[arg-type]
    assert got.tokens == expected.tokens
    assert lcgen.Override(first).token == int(first)  # type: ignore[arg-type]
    gen = lcgen.Generator(model, max_tokens=3)
    chunk = gen.accept(np.argmax(np.arange(model.n_vocab) == first))  # a numpy integer
    assert type(chunk.tokens[0]) is int and type(gen.tokens[0]) is int
    assert chunk.tokens == (int(first),)
    with model.sequence("Hi there") as seq:
        seq.generate(max_tokens=3)
        seq.rewind(np.int64(2))  # type: ignore[arg-type]
        assert len(seq) == len(model.tokenize("Hi there")) + 1
    state = lcgen.continuous(lcgen.generate.text(model, max_tokens=1, seed=1))(
        "Hi",
        num_samples=np.int64(2),  # type: ignore[arg-type]
    )
    assert state.shape == (1, 2)
    with pytest.raises(TypeError, match="Override takes a token id"):
        lcgen.Override(np.bool_(True))  # type: ignore[arg-type]


def test_wrong_arguments_are_named_not_internal_attribute_errors(model: lcgen.Model) -> None:
    """Each of these raised AttributeError from inside lcgen."""
    for bad in (None, "smollm2-135m"):
        with pytest.raises(TypeError, match="first argument is the model"):
            lcgen.generate.text(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="first argument is the model"):
            lcgen.generate.json(bad, {"type": "object"})  # type: ignore[arg-type]

    def add(x: int) -> int:
        """Add one."""
        return x + 1

    with pytest.raises(TypeError, match="invoke takes a ToolCall"):
        lcgen.Tool.of(add).invoke({"name": "add", "arguments": {"x": 1}})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Text\.of joins a generation's Chunks, got 5"):
        lcgen.Text.of([5])  # type: ignore[list-item]
    with model.sequence("Hi") as seq:
        with pytest.raises(TypeError, match="generator must be the Generator"):
            seq.checkpoint(5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="generator must be the Generator"):
            seq.rewind(0, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Scheduler takes the model's KV store"):
        lcgen.Scheduler(5)  # type: ignore[arg-type]
    scheduler = lcgen.Scheduler(model.cache)
    with pytest.raises(TypeError, match="start must be a callable"):
        scheduler.submit(5)  # type: ignore[arg-type]
    scheduler.submit(lambda: 5)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="a start must return a run"):
        list(scheduler)
    seq = model.sequence("Hi")
    seq.close()
    with pytest.raises(lcgen.ClosedError):
        seq.reseed(3)  # it did nothing, where every other method raises


def test_text_that_is_no_utf8_is_named(model: lcgen.Model, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lone surrogate U\+DC80 at index 2"):
        model.generate("ab\udc80", max_tokens=1)
    with pytest.raises(ValueError, match=r"lone surrogate U\+D800"):
        model.chat([{"role": "user", "content": "\ud800"}], max_tokens=1)
    latin1 = tmp_path / "latin1.gbnf"
    latin1.write_bytes(b'root ::= "caf\xe9"')
    with pytest.raises(lcgen.GrammarError, match="is not UTF-8 text"):
        lcgen.Grammar.from_file(latin1)
    with pytest.raises(lcgen.GrammarError, match="it is a directory"):
        lcgen.Grammar.from_file(tmp_path)
