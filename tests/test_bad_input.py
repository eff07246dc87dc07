"""Bad input gets a clear error, never a dead process or a hang: each case runs in a child
process (a crash there cannot take the test run with it) with a time limit, and passes only if
the child prints PASS and exits normally.

These are the cases that used to end the process (a segfault or abort in llama.cpp), hang, or
leave a sequence broken.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PRELUDE = """
import sys, threading, time, os, signal
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
            lambda: m.sequence("again"),
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


def test_sizes_llama_cpp_would_abort_on_are_refused() -> None:
    assert_passes(
        run_case("""
        expect(ValueError, lambda: lcgen.load(n_batch=1, n_seq_max=8), "n_batch=1 is below")
        for n_ctx in range(1, 8):
            expect(ValueError, lambda: lcgen.load(n_ctx=n_ctx, n_seq_max=8), "below n_seq_max")
        expect(ValueError, lambda: lcgen.load(n_batch=2**32 + 1), "n_batch must be in")
        expect(ValueError, lambda: lcgen.load(n_threads=10**6), "n_threads must be in")
        expect(ValueError, lambda: lcgen.load(n_seq_max=1000), "n_seq_max must be in")
        with lcgen.load(n_ctx=8, n_batch=4) as small:  # small sizes work (slots follow them)
            assert small.context.n_seq_max == 4
            assert small.generate("a b c d e f g", max_tokens=4).stats.tokens == 4
        """)
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--threads", "1000000"], "n_threads must be in"), (["--n-ctx", "1"], "exceeds the context")],
)
def test_the_command_line_reports_bad_sizes(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lcgen.cli", "generate", "smollm2-135m", "hello", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1 and message in done.stderr, (done.returncode, done.stderr)


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
