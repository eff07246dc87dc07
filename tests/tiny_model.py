"""Build a tiny random-weight GGUF that tokenizes like the bundled SmolLM2-135M.

The file is a 2-layer llama (n_embd 64) with seeded random weights and every ``tokenizer.*``
key copied from the source GGUF, so tokenize / detokenize / special tokens / the chat template
behave exactly as with the real model while a decode costs almost nothing. Its text is
gibberish: tests that assume a trained model's output (say " 7," after "1, 2, 3, 4,") fail on it.
Made for carrying lcgen's tests to a machine where the 98 MB bundled model does not fit (a GPU
box), and usable in place of it through ``LCGEN_TEST_MODEL`` (see ``conftest.py``)::

    python tests/tiny_model.py OUT.gguf [--source SRC.gguf] [--seed N]
    LCGEN_TEST_MODEL=OUT.gguf pytest tests/test_generate.py

Tensor types: f32 norms, f16 layer matrices and token embedding, Q8_0 output matrix (untied: a
tied random embedding makes the current token by far the likeliest next one, so greedy text
would repeat one token forever). About 11 MB, nearly all of it the 49,152-row vocabulary.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ARCH = "llama"
N_LAYER = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 192
N_CTX_TRAIN = 8192
ROPE_BASE = 100000.0
RMS_EPS = 1e-5
# Output logits have a standard deviation of about 8 * OUT_STD (the final RMS norm gives unit
# entries, dotted with N_EMBD = 64 weights): peaked enough that greedy near-ties are rare,
# flat enough that seeded sampling at temperature 0.9 varies with the seed.
OUT_STD = 0.5


def _source_path() -> Path:
    from lcgen.models import resolve

    return resolve("smollm2-135m", download=False)


def _copy_tokenizer(writer: object, source: Path) -> int:
    """Copy every ``tokenizer.*`` key, with its exact GGUF types; return the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, value, vtype, sub_type)  # type: ignore[attr-defined]
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if not n_vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return n_vocab


def build(out: Path | str, source: Path | str | None = None, seed: int = 0) -> Path:
    """Write the tiny model to ``out`` (tokenizer from ``source``, default the bundled model)."""
    import gguf

    out = Path(out)
    src = Path(source) if source is not None else _source_path()
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD

    writer = gguf.GGUFWriter(str(out), ARCH)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("lcgen tiny random llama (SmolLM2 tokenizer)")
    writer.add_block_count(N_LAYER)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(writer, src)
    writer.add_vocab_size(n_vocab)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        # numpy (rows, cols) is GGUF shape [cols, rows]: rows outputs, each over cols inputs.
        return (rng.standard_normal((rows, cols)) * std).astype(np.float16)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32)

    writer.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD, 1.0))
    for i in range(N_LAYER):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", norm())
        writer.add_tensor(p + "attn_q.weight", mat(N_EMBD, N_EMBD, N_EMBD**-0.5))
        writer.add_tensor(p + "attn_k.weight", mat(N_HEAD_KV * head_dim, N_EMBD, N_EMBD**-0.5))
        writer.add_tensor(p + "attn_v.weight", mat(N_HEAD_KV * head_dim, N_EMBD, N_EMBD**-0.5))
        writer.add_tensor(p + "attn_output.weight", mat(N_EMBD, N_EMBD, N_EMBD**-0.5))
        writer.add_tensor(p + "ffn_norm.weight", norm())
        writer.add_tensor(p + "ffn_gate.weight", mat(N_FF, N_EMBD, N_EMBD**-0.5))
        writer.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD, N_EMBD**-0.5))
        writer.add_tensor(p + "ffn_down.weight", mat(N_EMBD, N_FF, N_FF**-0.5))
    writer.add_tensor("output_norm.weight", norm())
    q8 = gguf.GGMLQuantizationType.Q8_0
    out_w = (rng.standard_normal((n_vocab, N_EMBD)) * OUT_STD).astype(np.float32)
    writer.add_tensor("output.weight", gguf.quants.quantize(out_w, q8), raw_dtype=q8)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", type=Path, default=None, help="GGUF to copy the tokenizer from")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build(args.out, args.source, args.seed)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
