"""Fill in the middle: ``generate(prefix, suffix=...)``, ``model.infill_tokens`` and the
server's ``suffix`` on ``/v1/completions``.

Neither bundled model declares fill-in-the-middle tokens, so the model here is the bundled
SmolLM2 with three of its control tokens declared as the markers (GGUF header keys added; the
weights are the same). It was not trained for infilling: the tests check the prompt layout and
that every path generates from it alike, not the quality of the middle.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers import gguf_with_keys, running

import lcgen
from lcgen.server.app import create_app

PRE, SUF, MID = 11, 12, 13  # <jupyter_start>, <jupyter_text>, <jupyter_code>
BEFORE, AFTER = "def add(a, b):\n    ", "\n    return c\n"


@pytest.fixture(scope="module")
def fim_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[lcgen.Model]:
    keys = {
        "tokenizer.ggml.fim_pre_token_id": PRE,
        "tokenizer.ggml.fim_suf_token_id": SUF,
        "tokenizer.ggml.fim_mid_token_id": MID,
    }
    path = gguf_with_keys(model_path, tmp_path_factory.mktemp("fim") / "fim.gguf", keys)
    with lcgen.load(str(path)) as m:
        yield m


def test_the_prompt_is_prefix_suffix_middle(fim_model: lcgen.Model) -> None:
    m = fim_model
    assert (m.vocab.fim_prefix, m.vocab.fim_suffix, m.vocab.fim_middle) == (PRE, SUF, MID)
    assert m.vocab.has_infill
    tokens = m.infill_tokens(BEFORE, AFTER)
    expected = [PRE, *m.tokenize(BEFORE), SUF, *m.tokenize(AFTER), MID]
    assert not m.vocab.add_bos  # SmolLM2 adds no BOS: nothing goes before the prefix marker
    assert tokens == expected
    assert m.infill_tokens("", "") == [PRE, SUF, MID]


def test_generate_with_a_suffix_generates_from_the_infill_prompt(fim_model: lcgen.Model) -> None:
    m = fim_model
    options = {"max_tokens": 12, "temperature": 0.0}
    text = m.generate(BEFORE, suffix=AFTER, **options)  # type: ignore[arg-type]
    with m.sequence(m.infill_tokens(BEFORE, AFTER)) as seq:
        reference = seq.generate(**options)  # type: ignore[arg-type]
    assert text == reference and text.tokens == reference.tokens
    assert len(text.tokens) > 0
    streamed = list(m.stream(BEFORE, suffix=AFTER, **options))  # type: ignore[arg-type]
    assert "".join(c.text for c in streamed) == str(text)
    both = m.generate([BEFORE, "x = "], suffix=AFTER, **options)  # type: ignore[arg-type]
    assert both[0] == str(text)


def test_a_model_without_infill_tokens_says_so(model: lcgen.Model) -> None:
    assert not model.vocab.has_infill
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        model.generate(BEFORE, suffix=AFTER, max_tokens=4)
    with pytest.raises(ValueError, match="fim_pre_token_id"):
        model.infill_tokens(BEFORE, AFTER)


def test_infill_parts_must_be_text(fim_model: lcgen.Model) -> None:
    with pytest.raises(TypeError, match="suffix"):
        fim_model.infill_tokens(BEFORE, 5)  # type: ignore[arg-type]


def test_the_server_fills_in_the_middle(fim_model: lcgen.Model) -> None:
    with running(create_app(fim_model, model_name="fim")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        out = client.completions.create(
            model="fim", prompt=BEFORE, suffix=AFTER, max_tokens=12, temperature=0
        )
        expected = fim_model.generate(BEFORE, suffix=AFTER, max_tokens=12, temperature=0)
        assert out.choices[0].text == str(expected)
        assert out.usage is not None
        assert out.usage.prompt_tokens == len(fim_model.infill_tokens(BEFORE, AFTER))
        stream = client.completions.create(
            model="fim", prompt=BEFORE, suffix=AFTER, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == str(expected)


def test_the_server_refuses_a_suffix_it_cannot_use(model: lcgen.Model) -> None:
    with running(create_app(model, model_name="plain")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="plain", prompt=BEFORE, suffix=AFTER, max_tokens=4)
        body = json.loads(info.value.response.text)["error"]
        assert body["param"] == "suffix" and "fill-in-the-middle" in body["message"]
        with pytest.raises(openai.BadRequestError, match="echo cannot be used with suffix"):
            client.completions.create(
                model="plain", prompt=BEFORE, suffix=AFTER, echo=True, max_tokens=4
            )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lcgen.cli", "generate", *args, "--threads", "1", "--quiet"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_the_command_line_fills_in_the_middle(fim_model: lcgen.Model) -> None:
    out = _cli(str(fim_model.path), BEFORE, "--suffix", AFTER, "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    expected = fim_model.generate(BEFORE, suffix=AFTER, max_tokens=12, temperature=0)
    assert out.stdout == str(expected) + "\n"
    out = _cli("smollm2-135m", BEFORE, "--suffix", AFTER, "--max-tokens", "2")
    assert out.returncode == 1 and "fill-in-the-middle" in out.stderr, out.stderr
    out = _cli(str(fim_model.path), BEFORE, "--suffix", AFTER, "--chat")
    assert out.returncode == 2 and "does not take --chat" in out.stderr, out.stderr  # usage
