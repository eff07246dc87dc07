"""The ``lcgen`` command end to end, in subprocesses, on the bundled model."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

import lcgen
from lcgen import cli
from lcgen._files import MAX_FILE_BYTES

ARGS = ["--max-tokens", "12"]


# One thread: where other processes keep the cores busy, more threads than free cores slow
# llama.cpp many times over (measured here: 3 s against 72 s for one chat test).
THREADS = ["--threads", "1"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    threads = THREADS if args[0] in {"generate", "chat", "info", "demo"} else []
    return subprocess.run(
        [sys.executable, "-m", "lcgen", *args, *threads],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_generate_streams_the_same_text_as_the_api(model: lcgen.Model) -> None:
    out = run("generate", "smollm2-135m", "The capital of France is", *ARGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout == model.generate("The capital of France is", max_tokens=12) + "\n"


def test_generate_with_stop_and_seed(model: lcgen.Model) -> None:
    args = ["--temperature", "0.8", "--seed", "3", "--stop", "\n"]
    out = run("generate", "smollm2-135m", "Write a haiku:", *ARGS, *args)
    assert out.returncode == 0, out.stderr
    expected = model.generate("Write a haiku:", max_tokens=12, temperature=0.8, seed=3, stop="\n")
    assert out.stdout == expected + "\n"


def test_generate_with_banned_phrases(model: lcgen.Model) -> None:
    prompt = "The history of Rome is a rich"
    assert "tapestry" in model.generate(prompt, max_tokens=12)  # measured
    args = ["--ban", "tapestry", "--ban-regex", r"\bmosaic\b", "--ban-ignore-case"]
    out = run("generate", "smollm2-135m", prompt, *ARGS, *args)
    assert out.returncode == 0, out.stderr
    expected = model.generate(
        prompt,
        max_tokens=12,
        banned=["tapestry", re.compile(r"\bmosaic\b", re.IGNORECASE)],
        banned_ignore_case=True,
    )
    assert out.stdout == expected + "\n" and "tapestry" not in out.stdout
    bad = run("generate", "smollm2-135m", prompt, *ARGS, "--ban-regex", "(")
    assert bad.returncode != 0 and "--ban-regex '('" in bad.stderr


def test_generate_with_speculation(model: lcgen.Model) -> None:
    prompt = "Repeat: red, green, blue, red, green, blue, red, green,"
    expected = model.generate(prompt, max_tokens=12) + "\n"
    for flags in (["--speculate"], ["--draft", "smollm2-135m"]):
        out = run("generate", "smollm2-135m", prompt, *ARGS, *flags)
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected, flags
    both = run("generate", "smollm2-135m", prompt, *ARGS, "--speculate", "--draft", "x.gguf")
    assert both.returncode != 0 and "not both" in both.stderr


def test_chat_reads_turns_from_stdin(model: lcgen.Model) -> None:
    out = run("chat", "smollm2-135m", *ARGS, stdin="Name three colors.\n/exit\n")
    assert out.returncode == 0, out.stderr
    expected = model.chat([{"role": "user", "content": "Name three colors."}], max_tokens=12)
    assert out.stdout == expected + "\n"


def test_models_lists_the_registry() -> None:
    out = run("models")
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout and "qwen2.5-0.5b" in out.stdout
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out.stdout


def test_demo_runs() -> None:
    out = run("demo")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "decoded together" in out.stdout
    banned = next(line for line in out.stdout.splitlines() if line.startswith("  banned: "))
    assert "tapestry" not in banned and "cradle" not in banned
    assert out.stdout.count("Is it a mammal? Answer:") == 3


@pytest.mark.parametrize("command", ["generate", "chat", "models", "info", "demo"])
def test_help(command: str) -> None:
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_errors_are_one_line_not_tracebacks() -> None:
    out = run("generate", "no-such-model", "hi")
    assert out.returncode == 1
    assert out.stderr.startswith("lcgen: error: unknown model 'no-such-model'")
    assert "Traceback" not in out.stderr
    out = run("generate", "smollm2-135m", "hi", "--temperature", "-1")
    assert out.returncode == 2 and "--temperature must be >= 0 and finite, got -1.0" in out.stderr


def test_generate_with_token_healing(model: lcgen.Model) -> None:
    out = run("generate", "smollm2-135m", '<a href="http:', *ARGS, "--token-healing")
    assert out.returncode == 0, out.stderr
    expected = model.generate('<a href="http:', max_tokens=12, token_healing=True)
    assert out.stdout == expected + "\n" and expected.startswith("//")
    # Complete once the healed "2" counts (the truncation check read the output without it),
    # and printed with it: the constrained text whole.
    prompt = "My favourite number is 12"
    argv = ["--regex", "2[0-9]*", "--token-healing", "--max-tokens", "2"]
    out = run("generate", "smollm2-135m", prompt, *argv)
    assert out.returncode == 0, out.stderr
    expected = model.generate(prompt, regex="2[0-9]*", token_healing=True, max_tokens=2)
    assert out.stdout == "2" + expected + "\n"
    # Healing that cannot start (the grammar allows no token that re-creates " n"): no
    # value, so nothing on stdout (the healed text was written before the step failed).
    argv = ["--grammar", "yes_no", "--token-healing"]
    out = run("generate", "smollm2-135m", "Is it? Answer n", *argv)
    assert out.returncode == 1 and "token healing must re-create" in out.stderr
    assert out.stdout == ""


def test_generate_with_constraints(model: lcgen.Model, tmp_path: Path) -> None:
    out = run("generate", "smollm2-135m", "Is water wet? Answer:", "--choice", "yes,no")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in {"yes", "no"}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(schema))
    out = run(
        "generate",
        "smollm2-135m",
        "The capital of France as JSON:",
        "--json-schema",
        str(tmp_path / "s.json"),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == model.generate("The capital of France as JSON:", schema=schema)
    # Healing takes the prompt's "{" away: it is printed, so stdout is the JSON whole.
    healed = "The capital of France as JSON:\n{"
    out = run("generate", "smollm2-135m", healed, "--json-schema", str(tmp_path / "s.json"),
              "--token-healing")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == model.generate(healed, schema=schema, token_healing=True)
    out = run("generate", "smollm2-135m", "Date:", "--grammar", "iso_date", "--max-tokens", "16")
    assert out.returncode == 0 and re.fullmatch(r"\d{4}-\d{2}-\d{2}\n", out.stdout), out.stdout
    out = run("generate", "smollm2-135m", "x", "--grammar", "nope")
    assert out.returncode == 2 and "no bundled grammar" in out.stderr
    out = run("generate", "smollm2-135m", "x", "--choice", "a", "--regex", "b")
    assert out.returncode == 2 and "at most one of" in out.stderr


@pytest.mark.parametrize("flag", ["--grammar", "--choice", "--regex", "--json-schema"])
def test_an_empty_constraint_is_an_error_not_unconstrained(flag: str) -> None:
    out = run("generate", "smollm2-135m", "x", flag, "", "--max-tokens", "2")
    assert out.returncode == 2 and f"{flag} is empty" in out.stderr, out.stderr


def test_a_json_schema_file_that_is_not_a_schema_is_named(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    out = run("generate", "smollm2-135m", "x", "--json-schema", str(tmp_path / "list.json"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "list.json: a JSON Schema is an object (or true or false), the file holds [1, 2]" in (
        out.stderr
    )


# generate: --chat, stdin, escapes, the speed summary, inline grammars ----------------------
SUMMARY = re.compile(
    r"^lcgen: prompt (\d+) tokens, [\d.]+ tokens/s \| generated (\d+) tokens, ([\d.]+|-) tokens/s$",
    re.M,
)


def test_generate_chat_reads_the_prompt_from_stdin(model: lcgen.Model) -> None:
    question = "Name three colors."
    out = run("generate", "smollm2-135m", "-", "--chat", *ARGS, stdin=question + "\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout == model.chat([{"role": "user", "content": question}], max_tokens=12) + "\n"
    system = "You answer in French."
    out = run("generate", "smollm2-135m", question, "--chat", "--system", system, *ARGS)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    assert out.returncode == 0 and out.stdout == model.chat(messages, max_tokens=12) + "\n"
    out = run("generate", "smollm2-135m", question, "--system", system, *ARGS)
    assert out.returncode == 2 and "--system needs --chat" in out.stderr


@pytest.mark.parametrize(
    ("given", "meant"),
    [(r"\n", "\n"), (r"a\tb", "a\tb"), (r"\\n", "\\n"), (r"C:\path", "C:\\path"), ("\n", "\n")],
)
def test_stop_escapes(given: str, meant: str) -> None:
    assert cli.unescape(given) == meant


def test_generate_stop_escape_and_speed_summary(model: lcgen.Model) -> None:
    prompt = "Write a haiku:"
    out = run("generate", "smollm2-135m", prompt, "--max-tokens", "40", "--stop", r"\n")
    assert out.returncode == 0, out.stderr
    expected = model.generate(prompt, max_tokens=40, stop="\n")
    assert expected.stop == "\n" and out.stdout == expected + "\n"
    (summary,) = SUMMARY.findall(out.stderr)
    assert (int(summary[0]), int(summary[1])) == (len(model.tokenize(prompt)), len(expected.tokens))
    # With llama.cpp's log on stderr the summary is still a line of its own; --quiet drops it.
    loud = run("generate", "smollm2-135m", prompt, "--max-tokens", "2", "--verbose")
    assert loud.returncode == 0 and len(SUMMARY.findall(loud.stderr)) == 1
    assert len(loud.stderr.splitlines()) > 10  # llama.cpp's log is there too
    quiet = run("generate", "smollm2-135m", prompt, "--max-tokens", "2", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_generate_with_inline_grammar(model: lcgen.Model) -> None:
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    out = run("generate", "smollm2-135m", "Is the sky green? Answer:", "--grammar", gbnf)
    assert out.returncode == 0, out.stderr
    expected = model.generate("Is the sky green? Answer:", grammar=lcgen.Grammar(gbnf))
    assert out.stdout == expected + "\n" and expected in {"yes", "no", "maybe"}
    bad = run("generate", "smollm2-135m", "x", "--grammar", "root ::= (")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# constrained output cut short: a non-zero exit (issue 13) ----------------------------------
CHOICES = ["absolutely not at all", "certainly yes indeed"]


@pytest.mark.parametrize(
    ("flags", "grammar"),
    [
        (["--grammar", "json"], lambda: lcgen.Grammar.from_file("json")),
        (["--regex", r"\d{3}-\d{4}"], lambda: lcgen.Grammar.regex(r"\d{3}-\d{4}")),
        (["--choice", ",".join(CHOICES)], lambda: lcgen.Grammar.choice(CHOICES)),
        (["--grammar", 'root ::= [a-z]+ "!"'], lambda: lcgen.Grammar('root ::= [a-z]+ "!"')),
    ],
)
def test_incomplete_constrained_output_exits_non_zero(
    model: lcgen.Model, flags: list[str], grammar: Callable[[], lcgen.Grammar]
) -> None:
    prompt = "Answer:"
    out = run("generate", "smollm2-135m", prompt, "--max-tokens", "2", *flags)
    assert out.returncode == 1, out.stdout
    assert "the output is incomplete" in out.stderr and flags[0] in out.stderr
    assert "--max-tokens 2" in out.stderr and "Traceback" not in out.stderr
    partial = "".join(c.text for c in model.stream(prompt, max_tokens=2, grammar=grammar()))
    assert out.stdout == partial + "\n"  # the partial text is still printed
    assert not grammar().accepts(model, partial)


def test_incomplete_json_schema_and_a_complete_cut(model: lcgen.Model, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    prompt = "A cat as JSON:"
    out = run("generate", "smollm2-135m", prompt, "--json-schema", str(tmp_path / "s.json"),
              "--max-tokens", "3")  # fmt: skip
    assert out.returncode == 1 and "incomplete" in out.stderr and "--json-schema" in out.stderr
    with pytest.raises(lcgen.IncompleteOutputError):
        model.generate(prompt, max_tokens=3, schema=schema)
    # Cut by max_tokens, yet a complete match of a grammar (not a value): success. A value
    # cut where it could go on: status 1.
    (tmp_path / "n.json").write_text(json.dumps({"type": "integer"}))
    number = run("generate", "smollm2-135m", "JSON:\n", "--json-schema",
                 str(tmp_path / "n.json"), "--max-tokens", "2")  # fmt: skip
    assert number.returncode == 1 and "incomplete" in number.stderr, number.stderr
    digits = run("generate", "smollm2-135m", "Numbers: 1, 2,", "--grammar", "root ::= [0-9]+",
                 "--max-tokens", "1")  # fmt: skip
    assert digits.returncode == 0, digits.stderr
    assert re.fullmatch(r"[0-9]+\n", digits.stdout)


# chat ----------------------------------------------------------------------------------------
def _chat(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "lcgen.cli", "chat", "smollm2-135m", *args, *THREADS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        # A shell runs background jobs with SIGINT ignored, and children inherit that; the
        # chat must see Ctrl-C as a terminal user's would.
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_reply_not_the_chat() -> None:
    proc = _chat("--max-tokens", "400")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"Write a long story about a dragon and a knight.\n")
    first = proc.stdout.read(1)  # the reply has started
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(b"Name three colors.\n/exit\n", timeout=300)
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    assert first and stderr.count("reply stopped (Ctrl-C)") == 1
    assert "error" not in stderr and "Traceback" not in stderr
    # the interrupted reply, its newline, then the whole next reply
    stdout = (first + out).decode()
    assert stdout.count("\n") >= 2 and stdout.strip()


def test_ctrl_d_leaves_the_terminal_on_a_new_line() -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: lcgen chat on a terminal
        os.execv(
            sys.executable, [sys.executable, "-m", "lcgen.cli", "chat", "smollm2-135m", *THREADS]
        )
    output = _read_until(fd, b"> ")
    os.write(fd, b"\x04")  # Ctrl-D
    output += _read_until(fd, None)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, output
    assert b"/help" in output  # the greeting names the commands
    assert b"\n" in output[output.rindex(b"> ") :]


def _read_until(fd: int, marker: bytes | None, timeout: float = 120) -> bytes:
    """Read a terminal until ``marker`` shows up (None: until the child closes it)."""
    data = b""
    deadline = time.monotonic() + timeout
    while marker is None or marker not in data:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"timed out waiting for {marker!r}; got {data!r}"
        try:
            piece = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not piece:
            break
        data += piece
    return data


def test_chat_commands(
    cold_model: lcgen.Model, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chat = cli.ChatSession(cold_model, {"max_tokens": 8}, "You are terse.")
    system = {"role": "system", "content": "You are terse."}
    assert chat.messages == [system]
    assert chat.handle("Hi!") is True
    expected = cold_model.chat([system, {"role": "user", "content": "Hi!"}], max_tokens=8)
    assert capsys.readouterr().out == expected + "\n"
    assert chat.messages[1:] == [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": expected},
    ]
    chat.handle("/system Be kind.")
    assert chat.messages[0] == {"role": "system", "content": "Be kind."} and len(chat.messages) == 3
    chat.handle("/save " + str(tmp_path / "c.json"))
    assert (tmp_path / "c.json.kv").exists()
    saved = list(chat.messages)
    chat.handle("/system")
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    chat.handle("/clear")
    assert chat.messages == []
    chat.handle("/load " + str(tmp_path / "c.json"))
    assert chat.messages == saved
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "user"}]}')
    for line in ["/load " + str(tmp_path / "bad.json"), "/load " + str(tmp_path / "none"),
                 "/load", "/save", "/nope", "/help"]:  # fmt: skip
        assert chat.handle(line) is True
    assert chat.messages == saved
    err = capsys.readouterr().err
    assert "not a saved lcgen chat" in err and "No such file" in err and "/load needs" in err
    assert "unknown command /nope" in err and "/system TEXT" in err
    # messages the chat cannot take: refused at /load, the conversation kept (it was replaced,
    # and every turn after failed)
    (tmp_path / "tool.json").write_text('{"messages": [{"role": "tool", "content": "x"}]}')
    for kv in (False, True):
        if kv:
            (tmp_path / "tool.json.kv").write_bytes((tmp_path / "c.json.kv").read_bytes())
        assert chat.handle("/load " + str(tmp_path / "tool.json")) is True
        assert chat.messages == saved
        assert "tool_call_id" in capsys.readouterr().err
    assert chat.handle("/exit") is False and chat.handle("/quit") is False
    assert chat.failed  # (a piped chat then exits 1)
    failing = cli.ChatSession(cold_model, {"max_tokens": 4, "temperature": -1.0}, None)
    assert not failing.failed
    assert failing.handle("Hi!") is True and failing.messages == []  # the turn failed, not the chat
    assert "temperature must be >= 0" in capsys.readouterr().err and failing.failed


def test_chat_file_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # These fail before the model is used: a stand-in with its file name does.
    chat = cli.ChatSession(cast(lcgen.Model, SimpleNamespace(path=Path("m.gguf"))), {}, None)
    (tmp_path / "latin1.json").write_bytes(b'{"messages": ["\xd5"]}')
    missing = tmp_path / "no-such-folder" / "c.json"
    for line in [f"/load {tmp_path / 'latin1.json'}", f"/save {missing}", f"/load {missing}"]:
        assert chat.handle(line) is True
    assert capsys.readouterr().err.splitlines() == [
        f"lcgen: error: {tmp_path / 'latin1.json'} is not a saved lcgen chat: not UTF-8 text "
        "(invalid continuation byte at byte 15)",
        f"lcgen: error: cannot write chat file {str(missing)!r}: No such file or directory",
        f"lcgen: error: /load {missing}: No such file or directory",
    ]
    assert chat.messages == []


def test_chat_files_expand_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    chat = cli.ChatSession(cast(lcgen.Model, SimpleNamespace(path=Path("m.gguf"))), {}, None)
    (tmp_path / "old.json").write_bytes(b"[1]")
    assert chat.handle("/load ~/old.json") is True
    assert chat.handle("/save ~/no-such-folder/c.json") is True
    assert capsys.readouterr().err.splitlines() == [
        f"lcgen: error: {tmp_path / 'old.json'} is not a saved lcgen chat (no list of role/content "
        "messages)",
        f"lcgen: error: cannot write chat file {str(tmp_path / 'no-such-folder' / 'c.json')!r}: "
        "No such file or directory",
    ]


def test_a_saved_chat_resumes_in_another_process(tmp_path: Path) -> None:
    path = str(tmp_path / "chat.json")
    first = run("chat", "smollm2-135m", *ARGS, stdin=f"Name three colors.\n/save {path}\n/exit\n")
    assert first.returncode == 0 and "saved 2 messages" in first.stderr, first.stderr
    second = run("chat", "smollm2-135m", *ARGS, stdin=f"/load {path}\nAnd three animals?\n")
    assert second.returncode == 0, second.stderr
    found = re.search(r"loaded 2 messages from .*; (\d+) of its (\d+) tokens cached", second.stderr)
    assert found and 0 < int(found[1]) <= int(found[2]), second.stderr
    assert second.stdout.strip()


def test_fit_history_drops_the_oldest_turns(model: lcgen.Model) -> None:
    def n_tokens(messages: list[dict[str, str]]) -> int:
        return len(model.chat_tokens(messages))

    system = {"role": "system", "content": "You are terse."}
    turns = [
        {"role": role, "content": f"{role} message number {i}"}
        for i in range(6)
        for role in ("user", "assistant")
    ]
    messages = [system, *turns, {"role": "user", "content": "last question"}]
    everything = n_tokens(messages)
    assert cli.fit_history(messages, n_tokens, everything) == (messages, 0)
    for budget in range(everything - 60, everything, 7):
        kept, dropped = cli.fit_history(messages, n_tokens, budget)
        assert n_tokens(kept) <= budget and dropped > 0 and len(kept) == len(messages) - dropped
        assert kept[0] == system and kept[-1] == messages[-1] and kept[1]["role"] == "user"
        assert kept[1:] == messages[1 + dropped :]  # the oldest went first, whole turns
        assert n_tokens([system, *messages[dropped - 1 :]]) > budget  # none dropped needlessly
    with pytest.raises(lcgen.ContextFullError, match="shorten it"):
        cli.fit_history(messages, n_tokens, n_tokens([system, messages[-1]]) - 1)


def test_a_full_context_does_not_end_the_chat() -> None:
    long_turn = "Repeat these words: " + "alpha beta gamma delta " * 20 + "\n"
    out = run("chat", "smollm2-135m", "--max-tokens", "8", "--n-ctx", "256", stdin=long_turn * 4)
    assert out.returncode == 0, out.stderr
    assert "dropped the oldest 2 messages" in out.stderr and "error" not in out.stderr
    assert out.stdout.count("\n") >= 4  # every turn was answered
    # A turn that failed (a message over the context) lets the chat go on, and a piped chat
    # exits 1 at its end, so a script can tell (it exited 0).
    too_long = "Repeat: " + "alpha beta gamma delta " * 80 + "\n"
    failed = run(
        "chat", "smollm2-135m", "--max-tokens", "8", "--n-ctx", "256", stdin=too_long + "Hi\n"
    )
    assert failed.returncode == 1 and "lcgen: error:" in failed.stderr, failed.stderr
    assert failed.stdout.strip()  # the turn after it was answered


# models, info ----------------------------------------------------------------------------------
def test_info_shows_the_real_size_and_the_backend(model: lcgen.Model) -> None:
    out = run("info", "smollm2-135m")
    assert out.returncode == 0, out.stderr
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines() if " " in line)
    assert rows["parameters"] == f"{model.n_params:,}"
    assert rows["model"] == model.description and "135M" in model.description
    assert rows["backend"] == model.backend
    models = run("models")
    assert models.returncode == 0 and "llama.cpp backend: " in models.stdout


def test_serve_is_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    from lcgen.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert "OpenAI-compatible" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["generate", "--temperature", "abc", "m", "p"], "invalid float value: 'abc'"),
        (
            ["generate", "m", "p", "--no-such-flag"],  # the command's help lists its flags
            "lcgen generate: error: unrecognized arguments: --no-such-flag (see lcgen generate",
        ),
        (["serve", "m", "--portt", "1"], "unrecognized arguments: --portt 1 (see lcgen serve"),
        (["generate"], "the following arguments are required"),
        (["serve", "m", "--port", "x"], "invalid int value: 'x'"),
        (["serve", "m", "--port", "70000"], "--port: the port must be in 0-65535, got 70000"),
        (["serve", "m", "--port", "-1"], "--port: the port must be in 0-65535, got -1"),
        (["serve", "m", "--max-queue", "0"], "--max-queue: the queue must hold at least 1"),
        (["serve", "m", "--max-queue", "-2"], "at least 1 choice, got -2"),
        (["generate", "m", "p", "--n-ctx", "-5"], "--n-ctx: must be in [0, 2147483647], got -5"),
        (["generate", "m", "p", "--threads", "0"], "--threads: must be in [1, 512], got 0"),
        (["generate", "m", "p", "--gpu-layers", "4294967296"], "--gpu-layers: must be in [-1,"),
        (["chat", "m", "--threads", "x"], "--threads: invalid int value: 'x'"),
        (["generate", "m", "p", "--max-retries", "-1"], "--max-retries: must be in"),
        (["serve", "m", "--n-seq-max", "0"], "--n-seq-max: must be in [1, 256], got 0"),
        (["serve", "m", "--n-ctx", "-1"], "--n-ctx: must be in [0, 2147483647], got -1"),
        (["serve", "m", "--threads", "0"], "--threads: must be in [1, 512], got 0"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lcgen.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and err.startswith("lcgen")


# usage errors found before the model loads: status 2, one line ------------------------------
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["hi", "--grammar", "json", "--regex", "a"], "give at most one of --grammar, --json"),
        (["hi", "--system", "Be terse."], "--system needs --chat"),
        # an option's keyword as its flag
        (["hi", "--max-tokens", "-1"], "--max-tokens must be >= 0, got -1"),
        (["hi", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
        (["hi", "--seed", "-1"], "--seed must be"),
        (["hi", "--stop", ""], "--stop string '' is empty"),
        (["hi", "--speculate", "--draft", "x.gguf"], "not both"),
        (["hi", "--regex", "("], "--regex '(': invalid regex"),
        (["hi", "--grammar", "/no/such.gbnf"], "--grammar /no/such.gbnf: No such file"),
        ([""], "the prompt is empty: give the text to continue"),
        (["hi", "--max-retries", "3"], "--max-retries needs --ban, --ban-regex or --json-schema"),
        (["hi", "--ban-ignore-case"], "--ban-ignore-case needs --ban or --ban-regex"),
    ],
)
def test_option_errors_are_usage_errors(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", "no-such-model", *argv]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.startswith("lcgen: error: ") and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("generate", "--temperature", "inf"),
        ("generate", "--temperature", "nan"),
        ("generate", "--top-p", "nan"),
        ("generate", "--min-p", "inf"),
        ("generate", "--repeat-penalty", "inf"),
        ("generate", "--frequency-penalty", "-inf"),
        ("chat", "--presence-penalty", "inf"),
        ("chat", "--temperature", "infinity"),
    ],
)
def test_a_float_option_that_is_not_finite_is_a_usage_error(
    command: str, flag: str, value: str
) -> None:
    # --temperature inf was taken (nan was refused): it sampled from a flat distribution
    prompt = ["hi"] if command == "generate" else []
    out = run(command, "smollm2-135m", *prompt, f"{flag}={value}")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        f"lcgen {command}: error: argument {flag}: must be a finite number, got {value} "
        f"(see lcgen {command} --help)\n"
    )


def test_chat_option_errors_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["chat", "no-such-model", "--temperature", "-1"]) == 2
    assert capsys.readouterr().err == (
        "lcgen: error: --temperature must be >= 0 and finite, got -1.0\n"
    )


def test_chat_with_no_room_for_a_message_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # every turn failed, saying the context left -744 tokens beside the reply
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    argv = ["chat", "smollm2-135m", "--threads", "1", "--max-tokens", "1000", "--n-ctx", "256"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 1000 leaves no room for a message in the context of 256" in err


def test_chat_s_default_reply_length_fits_a_small_context(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default --max-tokens (512) is at most half the context: a chat in 256 tokens
    # replies with up to 128 tokens, as the library would with max_tokens=128.
    monkeypatch.setattr("sys.stdin", io.StringIO("Name three colors.\n"))
    argv = ["chat", "smollm2-135m", "--threads", "1", "--n-ctx", "256", "--cache-type-v", "f16"]
    assert cli.main(argv) == 0
    expected = model.chat([{"role": "user", "content": "Name three colors."}], max_tokens=128)
    assert capsys.readouterr().out == expected + "\n"


def test_an_empty_prompt_on_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert cli.main(["generate", "no-such-model", "-"]) == 2
    assert capsys.readouterr().err == "lcgen: error: the prompt is empty: stdin held no text\n"


@pytest.mark.parametrize("ident", [None, "https://example.com/s/person.json"])
def test_a_json_schema_file_refers_to_the_files_beside_it(
    ident: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "common").mkdir()
    address = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
               "required": ["city"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "common" / "address.json").write_text(json.dumps(address))
    person = {"type": "object", "properties": {"home": {"$ref": "common/address.json"}},
              "required": ["home"], "additionalProperties": False}  # fmt: skip
    if ident is not None:
        person["$id"] = ident
    (tmp_path / "person.json").write_text(json.dumps(person))
    args = ["generate", "smollm2-135m", "A person as JSON:", "--json-schema"]
    assert cli.main([*args, str(tmp_path / "person.json"), *THREADS]) == 0
    assert json.loads(capsys.readouterr().out)["home"]["city"] in {"Paris", "Oslo"}
    (tmp_path / "common" / "address.json").unlink()
    assert cli.main([*args, str(tmp_path / "person.json"), *THREADS]) == 2
    file = tmp_path / "common" / "address.json"
    said = "$ref 'common/address.json' (at #/properties/home): "
    assert f"{said}{file} (the document " in capsys.readouterr().err
    file.write_text("{")
    assert cli.main([*args, str(tmp_path / "person.json"), *THREADS]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_references_between_files_resolve_from_each_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """common/address.json's ../../shared/city.json is beside the project's schemas folder;
    a copy one folder down (schemas/shared) must not be read instead."""
    for folder in ("schemas/common", "schemas/shared", "shared"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "schemas/order.json").write_text('{"$ref": "common/address.json"}')
    (tmp_path / "schemas/common/address.json").write_text('{"$ref": "../../shared/city.json"}')
    (tmp_path / "shared/city.json").write_text('{"const": "RIGHT"}')
    (tmp_path / "schemas/shared/city.json").write_text('{"const": "WRONG"}')
    args = [
        "generate",
        "smollm2-135m",
        "JSON:",
        "--json-schema",
        str(tmp_path / "schemas/order.json"),
    ]
    assert cli.main([*args, *THREADS]) == 0
    assert json.loads(capsys.readouterr().out) == "RIGHT"


def test_a_json_schema_file_reads_no_document_outside_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    (tmp_path / "outside.json").write_text('{"const": "OUTSIDE"}')
    os.mkfifo(folder / "fifo.json")  # (no writer: reading it would wait for ever)
    (folder / "deep.json").write_text('{"items": ' * 100_000 + "{}" + "}" * 100_000)
    cases = {
        '{"$id": "https://ex.com/d/r.json", "$ref": "%2e%2e/outside.json"}': "no file beside",
        '{"$id": "https://ex.com/d/r.json", "$ref": "../outside.json"}': "no file beside",
        # (no $id: references are files by the file's URI; %2F is no folder separator there)
        '{"$ref": "%2F' + str(tmp_path / "outside.json").lstrip("/") + '"}': "No such file",
        '{"$id": "https://ex.com/d/r.json", "$ref": "https://other.com/x.json"}': "no file",
        '{"$ref": "fifo.json"}': "not a regular file",
        '{"$ref": "deep.json"}': "nests too deeply",
    }
    for i, (text, said) in enumerate(cases.items()):
        (folder / f"s{i}.json").write_text(text)
        args = ["generate", "smollm2-135m", "x", "--json-schema", str(folder / f"s{i}.json")]
        assert cli.main(args) == 2, text
        err = capsys.readouterr().err
        assert said in err and "\n" not in err.rstrip("\n"), (text, err)
    assert (
        cli.main(["generate", "smollm2-135m", "x", "--json-schema", str(folder / "deep.json")]) == 2
    )
    assert "the JSON nests too deeply to read" in capsys.readouterr().err


def test_a_json_schema_file_that_is_not_json_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{a: 1}")
    assert cli.main(["generate", "smollm2-135m", "x", "--json-schema", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lcgen: error: --json-schema {path}: not valid JSON: Expecting property")
    assert cli.main(["generate", "smollm2-135m", "x", "--json-schema", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"lcgen: error: --json-schema {tmp_path}: Is a directory\n"


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_a_file_option_is_read_with_a_bound(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /dev/zero was read without end until the process was killed (out of memory).
    big = tmp_path / "big.json"
    with big.open("wb") as file:
        file.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk taken
    assert cli.main(["generate", "no-such-model", "hi", flag, str(big)]) == 2
    assert capsys.readouterr().err == (
        f"lcgen: error: {flag} {big}: the file is over 16 MiB, the most lcgen reads\n"
    )
    if os.path.exists("/dev/zero"):
        assert cli.main(["generate", "no-such-model", "hi", flag, "/dev/zero"]) == 2
        assert capsys.readouterr().err == (
            f"lcgen: error: {flag} /dev/zero: not a regular file (a device or a socket): give "
            "a file's path\n"
        )


def test_a_file_option_may_be_a_pipe(capsys: pytest.CaptureFixture[str]) -> None:
    read, write = os.pipe()  # as `--json-schema <(...)` gives it: /dev/fd/N
    os.write(write, b'{"type": "integer"}')
    os.close(write)
    try:
        schema = cli.read_file(Path(f"/dev/fd/{read}"))
    finally:
        os.close(read)
    assert json.loads(schema) == {"type": "integer"}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    ("module", "flag"), [("lcgen", "--help"), ("lcgen", "--version"), ("lcgen.server", "--help")]
)
def test_help_that_cannot_be_written_is_an_error(module: str, flag: str) -> None:
    # argparse drops a write that fails: `lcgen --help > /dev/full` exited 0, the help lost
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", module, flag],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1 and "No space left on device" in done.stderr, done.stderr


# a reader that goes away (`| head`): a quiet exit with status 141 ----------------------------
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_closed_stdout_ends_quietly(command: str) -> None:
    # Greedy replies of some 400 tokens (measured): the reader leaves long before their end.
    if command == "generate":
        prompt, args = "Once upon a time", ["-", "--quiet"]
    else:
        prompt, args = "Write a long story about a dragon and a knight.", []
    proc = subprocess.Popen(
        [sys.executable, "-m", "lcgen.cli", command, "smollm2-135m", *args, *THREADS,
         "--max-tokens", "400"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(prompt.encode() + b"\n")
    proc.stdin.close()
    assert proc.stdout.read(1)  # the output has started; the reader leaves
    proc.stdout.close()
    assert proc.wait(timeout=300) == cli.EXIT_BROKEN_PIPE
    assert proc.stderr.read() == b""
    proc.stderr.close()


# a stream closed as the command starts (`<&-`, `>&-`): a usage error, before the model loads -
def _run_redirected(redirect: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``lcgen ARGS`` run by a shell with ``redirect`` (Python's sys.stdin, sys.stdout or
    sys.stderr is None for a stream that is closed)."""
    command = [sys.executable, "-m", "lcgen.cli", *args, *THREADS]
    return subprocess.run(
        ["sh", "-c", f'"$@" {redirect}', "sh", *command],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    ("redirect", "args", "says"),
    [
        ("<&-", ["chat"], "stdin is closed: lcgen chat reads the messages from it"),
        ("<&-", ["generate", "-"], "stdin is closed: the prompt - is read from it"),
        (">&-", ["generate", "hi"], "stdout is closed: lcgen generate writes its output there"),
        (">&-", ["chat"], "stdout is closed: lcgen chat writes its output there"),
    ],
)  # fmt: skip
def test_a_closed_stdin_or_stdout_is_a_usage_error(
    redirect: str, args: list[str], says: str
) -> None:
    # AttributeError: 'NoneType' object has no attribute 'isatty' (or 'read', or 'write'),
    # status 1, after the model loaded
    command, *rest = args
    out = _run_redirected(redirect, command, "smollm2-135m", *rest)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"lcgen: error: {says}") and out.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("redirect", "args"),
    [
        ("<&- 2>&-", ["generate", "smollm2-135m", "-"]),
        ("2>&-", ["generate", "smollm2-135m", "hi", "--temperature", "inf"]),
        ("2>&-", ["generate", "smollm2-135m", ""]),
    ],
)
def test_errors_with_stderr_closed_keep_the_status_and_leave_stdout_alone(
    redirect: str, args: list[str]
) -> None:
    # print(file=sys.stderr) with sys.stderr None writes on stdout: the error was the output
    out = _run_redirected(redirect, *args)
    assert out.returncode == 2 and out.stdout == "" and out.stderr == ""


def test_a_prompt_on_stdin_is_read_with_a_bound(tmp_path: Path) -> None:
    # `- < /dev/zero` grew without bound until the process was killed (out of memory)
    command = [sys.executable, "-m", "lcgen.cli", "generate", "no-such-model", "-"]
    at_bound = tmp_path / "prompt.txt"
    at_bound.write_bytes(b"a" * MAX_FILE_BYTES)
    outs = []
    # The bound is in bytes: 8 Mi + 1 two-byte characters were read whole.
    over_in_bytes = tmp_path / "wide.txt"
    over_in_bytes.write_bytes("é".encode() * (MAX_FILE_BYTES // 2 + 1))
    for source in ("/dev/zero", at_bound, over_in_bytes):
        with open(source, "rb") as stdin:
            outs.append(
                subprocess.run(command, stdin=stdin, capture_output=True, text=True, timeout=300)
            )
    over, at, wide = outs
    for refused in (over, wide):
        assert refused.returncode == 2 and refused.stderr == (
            "lcgen: error: the prompt on stdin is over 16 MiB, the most lcgen reads\n"
        )
    assert at.returncode == 1 and at.stderr.startswith("lcgen: error: unknown model")


def test_a_chat_line_on_stdin_is_read_with_a_bound() -> None:
    # a line of `lcgen chat MODEL < /dev/zero` has no end: it grew until the process was killed
    with open("/dev/zero", "rb") as stdin:
        out = subprocess.run(
            [sys.executable, "-m", "lcgen", "chat", "smollm2-135m", *ARGS, *THREADS],
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert out.returncode == 2 and out.stderr.endswith(
        "lcgen: error: a line on stdin is over 16 MiB, the most lcgen reads\n"
    ), out.stderr[-2000:]


# lcgen serve ---------------------------------------------------------------------------------
needs_server = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("starlette", "uvicorn")),
    reason="the server extra is not installed",
)


@needs_server
def test_serve_checks_its_options_before_loading() -> None:
    from lcgen import server

    with pytest.raises(ValueError, match="at least 1 choice, got 0"):
        server.serve("no-such-model", max_queue=0)
    with pytest.raises(ValueError, match="0-65535, got 65536"):
        server.serve("no-such-model", port=65536)
    with pytest.raises(SystemExit) as exit_info:
        server.main(["m", "--max-queue", "0"])
    assert exit_info.value.code == 2


def test_a_cors_origin_that_is_not_one_is_a_usage_error() -> None:
    # status 1, where --port 70000 and --max-queue 0 are usage errors (status 2)
    out = run("serve", "smollm2-135m", "--cors-origin", "example.com")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "lcgen serve: error: argument --cors-origin: CORS origin 'example.com' is not '*' or a "
        "web origin such as 'https://example.com' or 'http://localhost:3000' (no path, no "
        "trailing /) (see lcgen serve --help)\n"
    )


@needs_server
def test_serve_says_when_it_is_ready_and_when_its_port_is_taken() -> None:
    serve = [sys.executable, "-m", "lcgen.cli", "serve", "smollm2-135m", "--n-ctx", "512"]
    serve += ["--n-seq-max", "2", *THREADS]
    proc = subprocess.Popen([*serve, "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        ready = proc.stderr.readline()  # the first line, once it listens (port 0: a free one)
        found = re.fullmatch(
            r"lcgen serve: smollm2-135m on (http://127\.0\.0\.1:(\d+)) \(OpenAI API at /v1\)\n",
            ready,
        )
        assert found, ready
        with urllib.request.urlopen(found[1] + "/health", timeout=30) as response:
            assert response.status == 200
        port = found[2]
        for taken in (serve, [sys.executable, "-m", "lcgen.server", "smollm2-135m"]):
            out = subprocess.run(
                [*taken, "--port", port], capture_output=True, text=True, timeout=60, check=False
            )
            assert out.returncode == 1
            assert out.stderr.startswith(
                f"lcgen serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
            )
            assert out.stderr.count("\n") == 1, out.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_chat_with_a_model_without_a_chat_template_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the bundled Gemma 3 270M is a base model: every turn failed, and the chat exited 0
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert cli.main(["chat", "gemma3-270m", "--threads", "1"]) == 1
    assert "has no chat template" in capsys.readouterr().err


def test_an_empty_chat_template_is_no_chat_template(
    cold_model: lcgen.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `lcgen info` said "no", and `lcgen chat` failed every turn and exited 0
    monkeypatch.setattr(cold_model._handle, "chat_template", lambda: "")
    assert not cold_model.has_chat_template
    with pytest.raises(ValueError, match="has no chat template"):
        cli._check_chat_template(cold_model, "use generate")
    with pytest.raises(ValueError, match="has no chat template"):
        cold_model.chat([{"role": "user", "content": "Hi"}])


# from a tester's pass through the README ------------------------------------------------------
@needs_server
@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_api_key_is_a_usage_error_before_the_model_loads(
    blank: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `lcgen serve M --api-key ""` loaded the model, then exited 1 with "give a key, or None"
    from lcgen import server

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "no-such-model", "--api-key", blank])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key: the API key is blank" in err, err
    assert "None" not in err
    monkeypatch.setenv("LCGEN_API_KEY", blank or " ")  # set but empty is no key; blank is not
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "no-such-model"])
    assert exit_info.value.code == 2 and "LCGEN_API_KEY" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is blank"):  # from Python too, before any lookup
        server.serve("no-such-model", api_key=blank)


def test_models_does_not_ask_to_install_what_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # with chunk wheels installed but not yet assembled (a fresh LCGEN_CACHE), `lcgen models`
    # said "not local" and told to `pip install` the package that was installed
    from lcgen.registry import is_assembly_pending, registry

    monkeypatch.setenv("LCGEN_CACHE", str(tmp_path))
    pending = [entry for entry in registry().values() if is_assembly_pending(entry)]
    assert pending, "the Gemma 3 chunk wheels are installed in the test environment"
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for entry in pending:
        line = next(line for line in out.splitlines()[1:] if f"{entry.filename}" in line)
        assert "installed; assembled into" in line and str(tmp_path) in line, line
        assert f"  {entry.name}: " not in out  # not among the models to get
    assert not any(tmp_path.iterdir())  # listing assembles nothing


def test_no_chat_template_says_what_to_do_on_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the library's "use generate() instead" is no advice for a command line user
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert cli.main(["chat", "gemma3-270m", "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "generate()" not in err
    assert "has no chat template" in err and "lcgen generate gemma3-270m PROMPT" in err, err
    assert cli.main(["generate", "gemma3-270m", "Hi", "--chat", "--threads", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "has no chat template" in captured.err and "without --chat" in captured.err


def test_warnings_are_one_line(tmp_path: Path) -> None:
    # a likely misspelt schema keyword printed Python's warning and a line of lcgen's source
    schema = tmp_path / "typo.json"
    schema.write_text('{"type": "object", "proprties": {}}')
    out = run("generate", "no-such-model", "hi", "--json-schema", str(schema))
    warning, error = out.stderr.splitlines()
    assert warning == (
        "lcgen: warning: unknown JSON Schema keyword 'proprties' at # is ignored "
        "(did you mean 'properties'?)"
    )
    assert error.startswith("lcgen: error: unknown model") and out.returncode == 1


def _run_bytes(*args: bytes | str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """``lcgen ARGS`` with bytes in and out, stdin decoded strictly (as in a UTF-8 locale other
    than C.UTF-8, where Python reads stdin with errors='strict')."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    command: list[bytes | str] = [sys.executable, "-m", "lcgen.cli", *args]
    return subprocess.run(command, input=stdin, capture_output=True, env=env, timeout=300)


@pytest.mark.parametrize(
    ("args", "stdin"),
    [
        (["generate", "-"], b"caf\xe9\n"),
        (["generate", b"caf\xe9"], b""),
        (["generate", "hi", "--chat", "--system", b"caf\xe9"], b""),
        (["generate", "hi", "--suffix", b"caf\xe9"], b""),
        (["chat", "--system", b"caf\xe9"], b""),
    ],
)
def test_a_prompt_that_is_not_utf8_is_a_usage_error(args: list[bytes | str], stdin: bytes) -> None:
    # stdin: "'utf-8' codec can't decode byte 0xe9 in position 3" (status 1); an argument:
    # "can't encode character '\udce9' ... surrogates not allowed" after the model loaded
    command, *rest = args
    out = _run_bytes(command, "no-such-model", *rest, stdin=stdin)
    err = out.stderr.decode()
    assert out.returncode == 2 and err.count("\n") == 1, err
    assert "is not UTF-8 text (the byte 0xe9 at character 3)" in err and "codec" not in err


def test_a_chat_line_that_is_not_utf8_does_not_end_the_chat() -> None:
    # with a strict stdin, reading the line raised and ended the chat with status 1; now the
    # chat goes on, and exits 1 at its end, as a piped chat where a line failed
    out = _run_bytes("chat", "smollm2-135m", *THREADS, *ARGS, stdin=b"caf\xe9 au lait\nHello\n")
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert "lcgen: error: the line is not UTF-8 text (the byte 0xe9 at character 3)" in err
    assert out.stdout.strip() and "codec" not in err  # the next line was answered


def test_serve_help_says_the_threads_adapt(capsys: pytest.CaptureFixture[str]) -> None:
    # it said "default: cores, <= 8", but the count adapts to the load as in generate and chat
    for command in (["serve", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(command)
        help_text = " ".join(capsys.readouterr().out.split())
        assert "--threads THREADS CPU threads, fixed (default: adapts to the load" in help_text


BANS = ["--ban", "e", "--ban", "a", "--ban", "o", "--max-retries", "2", "--max-tokens", "40"]
RETRIES_NOTE = "lcgen: warning: the banned phrases used up the retries (--max-retries 2)"


def test_retries_used_up_are_not_silent(model: lcgen.Model) -> None:
    # the output ended early with status 0 and nothing said why (--verbose alone showed it)
    prompt = "Tell me about the sea"
    text = model.generate(prompt, max_tokens=40, banned=["e", "a", "o"], max_retries=2)
    assert text.finish_reason == "retries"  # measured: the bans end it early
    out = run("generate", "smollm2-135m", prompt, "--quiet", *BANS)
    assert out.returncode == 0 and out.stdout == text + "\n"
    assert out.stderr == RETRIES_NOTE + ": the output ends early\n"
    chat = run("chat", "smollm2-135m", *BANS, stdin=prompt + "\n")
    assert chat.returncode == 0 and RETRIES_NOTE + ": the reply ends early" in chat.stderr
    plain = run("generate", "smollm2-135m", prompt, "--quiet", "--max-tokens", "4")
    assert plain.returncode == 0 and plain.stderr == ""


def test_a_prompt_over_the_context_names_the_options() -> None:
    # "... + max_tokens=5000 ... or load the model with a larger n_ctx": the library's words
    out = run("generate", "smollm2-135m", "Hi", "--max-tokens", "5000")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        "lcgen: error: the prompt's 1 tokens and --max-tokens 5000 need 5001, over the context "
        "of 4096 tokens: shorten the prompt, lower --max-tokens or raise --n-ctx\n"
    )


def test_a_chat_saved_without_its_cache_says_the_messages_were_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The messages file is written first: an error naming only the .kv read as if nothing was
    # saved, while the file held the new messages.
    (tmp_path / "c.json.kv").mkdir()

    def save(path: str) -> int:
        raise lcgen.StateFileError(f"cannot write cache file {path!r}: it is a directory")

    stand_in = SimpleNamespace(path=Path("m.gguf"), cache=SimpleNamespace(save=save))
    chat = cli.ChatSession(cast(lcgen.Model, stand_in), {}, None)
    chat.set_system("Be brief.")
    assert chat.handle(f"/save {tmp_path / 'c.json'}") is True
    kv = str(tmp_path / "c.json.kv")
    assert capsys.readouterr().err.splitlines() == [
        f"lcgen: error: saved 1 messages to {tmp_path / 'c.json'}, but not the KV cache: "
        f"cannot write cache file {kv!r}: it is a directory"
    ]
    assert cli.load_messages(tmp_path / "c.json") == chat.messages
