"""The KV cache's element types (``type_k``/``type_v``): they reach llama.cpp, keep lcgen's
invariants, are checked before loading, and saved states name them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lcgen
from lcgen import cli
from lcgen._native.context import check_memory
from tests.helpers import first_logits, llama_cpp_python

PROMPT = "The lighthouse keeper climbed the stairs and"


@pytest.fixture(scope="module")
def bf16(model_path: Path) -> Iterator[lcgen.Model]:
    with lcgen.Model(model_path, type_v="bf16", n_threads=2) as m:
        yield m


def test_bad_names_are_refused_before_loading(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"  # never opened: the names are checked first
    for kw, bad in (("type_k", "q4"), ("type_v", "F16"), ("type_v", None)):
        with pytest.raises(ValueError, match=f"{kw} must be one of f32, f16, bf16.*{bad!r}"):
            options: dict[str, Any] = {kw: bad}
            lcgen.Model(missing, **options)
    assert lcgen.KV_CACHE_TYPES[:3] == ("f32", "f16", "bf16")
    with pytest.raises(ValueError, match=r"type_k must be one of .*iq4_nl, got 'auto'"):
        lcgen.Model(missing, type_k="auto")  # values only


def test_auto_values_are_bf16_on_the_cpu_with_flash_attention(model_path: Path) -> None:
    on_cpu = {"n_gpu_layers": 0, "n_ctx": 256, "n_threads": 1}
    fingerprints = []
    with lcgen.Model(model_path, type_v="auto", **on_cpu) as m:
        assert (m.type_v, m.context.kv_types) == ("bf16", ("f16", "bf16"))
        fingerprints.append(m.system_fingerprint)
    with lcgen.Model(model_path, type_v="auto", flash_attn=False, **on_cpu) as m:
        assert (m.type_v, m.context.kv_types) == ("f16", ("f16", "f16"))
        fingerprints.append(m.system_fingerprint)
    with lcgen.Model(model_path, n_ctx=256, n_threads=1) as m:
        assert m.type_v == "f16"  # the library's default stays llama.cpp's
        fingerprints.append(m.system_fingerprint)
    with lcgen.Model(model_path, n_ctx=256, n_threads=1, n_seq_max=4) as m:  # no number changes
        fingerprints.append(m.system_fingerprint)
    with lcgen.Model(model_path, n_ctx=256, n_threads=2) as m:  # attention split otherwise
        fingerprints.append(m.system_fingerprint)
    # the set-ups whose numbers differ have their own system fingerprints
    assert len(set(fingerprints)) == 4 and fingerprints[2] == fingerprints[3]


def test_quantized_values_need_flash_attention(model_path: Path) -> None:
    with pytest.raises(lcgen.ModelLoadError, match="requires flash_attn"):
        lcgen.Model(model_path, type_v="q8_0", flash_attn=False, n_threads=1)


def test_the_types_reach_llama_cpp(model_path: Path, model: lcgen.Model) -> None:
    """With bf16 values lcgen decodes llama-cpp-python's greedy tokens with bf16 values (same
    KV layout: no prefix cache); its logits differ from f16's in their last bits; no padding
    (llama.cpp tiles rows only with an f16 cache)."""
    with lcgen.Model(model_path, n_ctx=512, type_v="bf16", flash_attn=True, cache=False) as ours:
        llm = llama_cpp_python(ours, model_path, n_ctx=512, flash_attn=True, type_v=30)
        try:
            theirs: list[int] = []
            for tok in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0, top_k=1):
                if llm.token_eos() == tok or len(theirs) == 32:
                    break
                theirs.append(tok)
        finally:
            llm.close()
        assert len(theirs) > 10
        assert list(ours.generate(PROMPT, max_tokens=len(theirs)).tokens) == theirs
        assert ours.context.kv_types == ("f16", "bf16") and not ours.context.pad_batches
        with_bf16 = first_logits(ours, PROMPT)
    with_f16 = first_logits(model, PROMPT)
    assert np.abs(with_bf16 - with_f16).max() > 0
    assert _kl(with_f16, with_bf16) < 0.02  # as far as f16 and flash attention off are
    assert int(with_bf16.argmax()) == int(with_f16.argmax())
    assert model.context.kv_types == ("f16", "f16")


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp, lq = (x.astype(np.float64) - x.max() for x in (p_logits, q_logits))
    lp, lq = lp - np.log(np.exp(lp).sum()), lq - np.log(np.exp(lq).sum())
    return float((np.exp(lp) * (lp - lq)).sum())


def test_bf16_values_keep_the_invariants(bf16: lcgen.Model) -> None:
    with bf16.sequence(PROMPT, seed=5) as seq:
        seq.generate(max_tokens=4, temperature=0.8)
        cp = seq.checkpoint()
        a = seq.generate(max_tokens=20, temperature=0.8)
        seq.rewind(cp)
        assert seq.generate(max_tokens=20, temperature=0.8) == a
    first = bf16.generate(PROMPT + " looked", max_tokens=12)
    again = bf16.generate(PROMPT + " looked", max_tokens=12)  # from the parked prefix
    assert again == first and again.stats.decoded < first.stats.decoded


def test_saved_states_name_their_types(
    model: lcgen.Model, bf16: lcgen.Model, tmp_path: Path
) -> None:
    with bf16.sequence(PROMPT) as seq:
        seq.generate(max_tokens=3)
        seq.save(tmp_path / "seq.lcg")
    bf16.cache.pin("You are a careful assistant.")
    bf16.cache.save(tmp_path / "cache.lcg", pinned_only=True)
    bf16.cache.clear()
    said = "saved from a KV cache of type_k='f16', type_v='bf16'; this model's is type_k='f16', "
    with pytest.raises(lcgen.StateFileError, match=re.escape(said + "type_v='f16'")):
        lcgen.Sequence.load(model, tmp_path / "seq.lcg")
    with pytest.raises(lcgen.StateFileError, match=re.escape(said + "type_v='f16'")):
        model.cache.load(tmp_path / "cache.lcg")
    with lcgen.Sequence.load(bf16, tmp_path / "seq.lcg") as seq:  # its own types load
        assert seq.text.startswith(PROMPT)
    assert bf16.cache.load(tmp_path / "cache.lcg") == 1


def test_memory_check_counts_the_element_size(model: lcgen.Model) -> None:
    """A context too large for the machine is refused with its bytes: f32 takes twice f16's,
    q4_0 18 bytes per 32 elements."""
    need = {}
    for kind in ("f32", "f16", "q4_0"):
        with pytest.raises(lcgen.ModelLoadError) as err:
            check_memory(model._handle, 2**31 - 1, kind, kind)
        found = re.search(r"needs about ([\d,.]+) GiB", str(err.value))
        assert found is not None
        need[kind] = float(found.group(1).replace(",", ""))
    assert need["f32"] / need["f16"] == pytest.approx(2, rel=0.02)
    assert need["q4_0"] / need["f16"] == pytest.approx(18 / 64, rel=0.05)


def test_command_line_flags(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", str(model_path), "Hello", "--max-tokens", "3", "--threads", "1"]
    assert cli.main([*argv, "--cache-type-v", "bf16", "--cache-type-k", "q8_0"]) == 0
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--cache-type-v", "bf17"])
    assert exit_.value.code == 2
    assert "invalid choice: 'bf17'" in capsys.readouterr().err
    parse = cli.build_parser().parse_args
    # f16 by default everywhere (bf16 decodes faster on some CPUs, slower on others)
    for command in (["serve", "m"], ["chat", "m"], ["generate", "m", "x"]):
        assert parse(command).cache_type_v == "f16"
        assert parse([*command, "--cache-type-v", "auto"]).cache_type_v == "auto"
