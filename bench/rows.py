"""The rows that compare lcgen with the limit and with llama-cpp-python: prefill and decode."""

from __future__ import annotations

from bench.harness import Check, Row, RowFactory, at_least, interleaved
from bench.runners import Workload

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


FACTORIES: dict[str, RowFactory] = {
    "prefill": prefill_row,
    "decode": decode_row,
    "stream": stream_row,
}
