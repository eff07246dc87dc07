"""The rows that compare lcgen with the limit and with llama-cpp-python: prefill and decode."""

from __future__ import annotations

from dataclasses import replace

from bench.harness import Bench, Check, Lazy, Row, RowFactory, at_least, interleaved
from bench.runners import Lcgen, Sample, Workload, load_lcgen

THREE_WAY = ("limit", "llama-cpp-python", "lcgen")


def prefill_row(work: Workload) -> Row:
    return Row(
        "prefill",
        "prompt tokens / time to decode the prompt (n_batch chunks) and sample 1 greedy token",
        dict.fromkeys(THREE_WAY, "tokens/s"),
        interleaved(
            {
                "limit": lambda b: b.limit.prefill(b.work),
                "llama-cpp-python": lambda b: b.llama_cpp_python.prefill(b.work),
                "lcgen": lambda b: b.lcgen.prefill(b.work),
            }
        ),
        (Check("lcgen", "limit", at_least(0.97)), Check("lcgen", "llama-cpp-python")),
    )


def decode_row(work: Workload) -> Row:
    return Row(
        "decode",
        "greedy tokens / time, after the prompt and the first token (llama-cpp-python: "
        "create_completion(1 + N tokens) minus create_completion(1 token))",
        dict.fromkeys(THREE_WAY, "tokens/s"),
        interleaved(
            {
                "limit": lambda b: b.limit.decode(b.work),
                "llama-cpp-python": lambda b: b.llama_cpp_python.decode(b.work),
                "lcgen": lambda b: b.lcgen.decode(b.work),
            }
        ),
        (
            Check("lcgen", "limit", at_least(0.97)),
            Check("lcgen", "llama-cpp-python", at_least(1.0)),
        ),
    )


# Stop strings the prose never contains: every token still goes through the matcher.
STOPS = ("<|unused|>", "\n\n\n\n", "ZZZZ")


def stream_row(work: Workload) -> Row:
    return Row(
        "stream",
        f"greedy tokens / time for N tokens with three stop strings {list(STOPS)}: iterating "
        "seq.stream() against seq.generate(), and generate() without stop strings",
        {"generate": "tokens/s", "stream": "tokens/s", "generate, no stops": "tokens/s"},
        interleaved(
            {
                "generate": lambda b: b.lcgen.decode_text(b.work, stream=False, stops=STOPS),
                "stream": lambda b: b.lcgen.decode_text(b.work, stream=True, stops=STOPS),
                "generate, no stops": lambda b: b.lcgen.decode_text(b.work, stream=False, stops=()),
            }
        ),
        (Check("stream", "generate", at_least(0.98)), Check("stream", "generate, no stops")),
    )


def kv_bf16_row(work: Workload) -> Row:
    """lcgen with bf16 values in its KV cache (``type_v="bf16"``) against the default f16:
    decode after the prompt and after the long prompt, and the long prompt's prefill."""
    bf16 = Lazy(
        lambda b: Lcgen(
            load_lcgen(b.lcgen.model.path, b.llama_cpp_python.cfg, type_v="bf16", cache=False)
        ),
        Lcgen.close,
    )
    long = replace(work, prompt=work.long_prompt, n_tokens=max(1, work.n_tokens // 4))

    def side(b: Bench, kind: str) -> Lcgen:
        return bf16.get(b) if kind == "bf16" else b.lcgen

    def untokened(sample: Sample) -> Sample:  # the types may pick other tokens: not compared
        return Sample(sample.seconds, sample.count)

    measures = {}
    for kind in ("f16", "bf16"):
        measures[f"decode {kind}"] = lambda b, k=kind: untokened(side(b, k).decode(work))
        measures[f"long decode {kind}"] = lambda b, k=kind: untokened(side(b, k).decode(long))
        measures[f"long prefill {kind}"] = lambda b, k=kind: untokened(side(b, k).prefill(long))
    return Row(
        "kv-bf16",
        f"lcgen's tokens/s with the KV cache's values in bf16 (type_v='bf16') against f16 (the "
        f"default): greedy decode after the {len(work.prompt)}-token prompt and after the "
        f"{len(work.long_prompt)}-token long prompt, and that long prompt's prefill (on a CPU, "
        "llama.cpp's flash attention accumulates f16 values in f16 row by row and tiles rows "
        "only for f16)",
        dict.fromkeys(measures, "tokens/s"),
        interleaved(measures),
        tuple(
            Check(f"{what} bf16", f"{what} f16")
            for what in ("decode", "long decode", "long prefill")
        ),
        close=bf16.close,
    )


FACTORIES: dict[str, RowFactory] = {
    "prefill": prefill_row,
    "decode": decode_row,
    "stream": stream_row,
    "kv-bf16": kv_bf16_row,
}
