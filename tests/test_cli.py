"""The ``lcgen`` command end to end, in subprocesses, on the bundled model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lcgen

ARGS = ["--max-tokens", "12"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lcgen.cli", *args],
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
        banned=["tapestry", re.compile(r"\bmosaic\b")],
        banned_ignore_case=True,
    )
    assert out.stdout == expected + "\n" and "tapestry" not in out.stdout
    bad = run("generate", "smollm2-135m", prompt, *ARGS, "--ban-regex", "(")
    assert bad.returncode != 0 and "--ban-regex '('" in bad.stderr


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


@pytest.mark.parametrize("command", ["generate", "chat", "models", "demo"])
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
    assert out.returncode == 1 and "temperature must be >= 0, got -1.0" in out.stderr


def test_generate_with_token_healing(model: lcgen.Model) -> None:
    out = run("generate", "smollm2-135m", '<a href="http:', *ARGS, "--token-healing")
    assert out.returncode == 0, out.stderr
    expected = model.generate('<a href="http:', max_tokens=12, token_healing=True)
    assert out.stdout == expected + "\n" and expected.startswith("//")


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
    out = run("generate", "smollm2-135m", "Date:", "--grammar", "iso_date", "--max-tokens", "16")
    assert out.returncode == 0 and re.fullmatch(r"\d{4}-\d{2}-\d{2}\n", out.stdout), out.stdout
    out = run("generate", "smollm2-135m", "x", "--grammar", "nope")
    assert out.returncode == 1 and "no bundled grammar" in out.stderr
    out = run("generate", "smollm2-135m", "x", "--choice", "a", "--regex", "b")
    assert out.returncode == 1 and "at most one of" in out.stderr


@pytest.mark.parametrize("flag", ["--grammar", "--choice", "--regex", "--json-schema"])
def test_an_empty_constraint_is_an_error_not_unconstrained(flag: str) -> None:
    out = run("generate", "smollm2-135m", "x", flag, "", "--max-tokens", "2")
    assert out.returncode == 1 and f"{flag} is empty" in out.stderr, out.stderr
