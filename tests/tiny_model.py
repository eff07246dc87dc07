"""Build a tiny random-weight GGUF that tokenizes like the bundled SmolLM2-135M.

The file is a 2-layer llama (n_embd 64) with seeded random weights and every ``tokenizer.*``
key copied from the source GGUF, so tokenize / detokenize / special tokens / the chat template
behave exactly as with the real model while a decode costs almost nothing. Its text is
gibberish: tests that assume a trained model's output (say " 7," after "1, 2, 3, 4,") fail on it.
Made for carrying lcgen's tests to a machine where the 98 MB bundled model does not fit (a GPU
box), and usable in place of it through ``LCGEN_TEST_MODEL`` (see ``conftest.py``)::

    python tests/tiny_model.py OUT.gguf [--source SRC.gguf] [--seed N] [--quant f16|q4_1]
    LCGEN_TEST_MODEL=OUT.gguf pytest tests/test_generate.py

Shape: 2 query heads sharing 1 KV head (grouped-query attention), head size 64 (one that
llama.cpp's CUDA flash-attention kernels support; n_embd 64 with 4 heads of 16 makes llama.cpp
turn flash attention off). Tensor types: f32 norms; ``--quant f16`` (default): f16 layer
matrices and token embedding; ``--quant q4_1``: Q4_1 layer matrices and a Q8_0 token embedding,
the types of the bundled SmolLM2-135M Q4_1 (so the same quantized kernels run). The output
matrix is Q8_0 and untied: a tied random embedding makes the current token by far the likeliest
next one, so greedy text would repeat one token forever. About 12 MB (f16) or 9 MB (q4_1),
nearly all of it the 49,152-row vocabulary.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ARCH = "llama"
N_LAYER = 2
N_EMBD = 64
N_HEAD = 2
N_HEAD_KV = 1
HEAD_DIM = 64
N_FF = 192
N_CTX_TRAIN = 8192
ROPE_BASE = 100000.0
RMS_EPS = 1e-5
# Output logits have a standard deviation of about 8 * OUT_STD (the final RMS norm gives unit
# entries, dotted with N_EMBD = 64 weights): peaked enough that greedy near-ties are rare,
# flat enough that seeded sampling at temperature 0.9 varies with the seed.
OUT_STD = 0.5


def _source_path() -> Path:
    from lcgen.registry import resolve

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


def build(
    out: Path | str, source: Path | str | None = None, seed: int = 0, quant: str = "f16"
) -> Path:
    """Write the tiny model to ``out`` (tokenizer from ``source``, default the bundled model).

    ``quant`` is ``"f16"`` or ``"q4_1"`` (see the module's docstring).
    """
    import gguf

    if quant not in ("f16", "q4_1"):
        raise ValueError(f"quant must be 'f16' or 'q4_1', got {quant!r}")
    out = Path(out)
    src = Path(source) if source is not None else _source_path()
    rng = np.random.default_rng(seed)
    head_dim = HEAD_DIM
    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1

    writer = gguf.GGUFWriter(str(out), ARCH)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("lcgen tiny random llama (SmolLM2 tokenizer)")
    writer.add_block_count(N_LAYER)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    ftype = gguf.LlamaFileType.MOSTLY_F16 if quant == "f16" else gguf.LlamaFileType.MOSTLY_Q4_1
    writer.add_file_type(ftype)
    n_vocab = _copy_tokenizer(writer, src)
    writer.add_vocab_size(n_vocab)

    def add(name: str, rows: int, cols: int, std: float, qtype: object = None) -> None:
        # numpy (rows, cols) is GGUF shape [cols, rows]: rows outputs, each over cols inputs.
        w = rng.standard_normal((rows, cols)) * std
        if qtype is None:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            data = gguf.quants.quantize(w.astype(np.float32), qtype)  # type: ignore[arg-type]
            writer.add_tensor(name, data, raw_dtype=qtype)  # type: ignore[arg-type]

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32))

    layer_q = None if quant == "f16" else q4
    add("token_embd.weight", n_vocab, N_EMBD, 1.0, None if quant == "f16" else q8)
    n_q, n_kv = N_HEAD * head_dim, N_HEAD_KV * head_dim
    for i in range(N_LAYER):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        add(p + "attn_q.weight", n_q, N_EMBD, N_EMBD**-0.5, layer_q)
        add(p + "attn_k.weight", n_kv, N_EMBD, N_EMBD**-0.5, layer_q)
        add(p + "attn_v.weight", n_kv, N_EMBD, N_EMBD**-0.5, layer_q)
        add(p + "attn_output.weight", N_EMBD, n_q, n_q**-0.5, layer_q)
        norm(p + "ffn_norm.weight")
        add(p + "ffn_gate.weight", N_FF, N_EMBD, N_EMBD**-0.5, layer_q)
        add(p + "ffn_up.weight", N_FF, N_EMBD, N_EMBD**-0.5, layer_q)
        add(p + "ffn_down.weight", N_EMBD, N_FF, N_FF**-0.5, layer_q)
    norm("output_norm.weight")
    add("output.weight", n_vocab, N_EMBD, OUT_STD, q8)

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
    parser.add_argument("--quant", choices=("f16", "q4_1"), default="f16")
    args = parser.parse_args(argv)
    path = build(args.out, args.source, args.seed, args.quant)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
