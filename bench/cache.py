"""The prefix-cache rows: calls that share a prefix, a chat loop, two prefixes alternating, the
time to the first token with a cached prefix, and the cells the cache holds.

lcgen runs with its KV cache on (a model of its own; the other rows time cold work) and its
threads as the bench's lcgen has them (by default adapting to the machine: on an idle one the
count the others use, and short batches are padded by its measured decode times);
llama-cpp-python's ``Llama`` keeps the KV of its last prompt and reuses the common prefix, and
with a ``LlamaRAMCache`` it also restores whole saved states. Every round starts from empty
caches on all sides; greedy, end-of-generation banned, so all make the same number of tokens.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_cache import LlamaRAMCache

import lcgen
from bench.harness import Bench, Check, Lazy, Row, RowFactory, at_least, at_most
from bench.runners import ContextConfig, LlamaCppPython, Sample, Workload, load_lcgen

NEW_TOKENS = 8
N_CALLS = 5
N_INTERLEAVED = 8
N_TURNS = 6
FEW_SHOT_TOKENS = 1500
INTERLEAVED_TOKENS = 1100
TTFT_MIN_RATIO = 50.0
INTERLEAVED_MIN_RATIO = 3.0


def _qa(i: int, topic: str) -> str:
    a, b = 3 * i + 2, 7 * i + 5
    return f"Q: In the {topic} ledger, what is {a} plus {b}?\nA: {a + b}.\n\n"


def _prefix(model: lcgen.Model, topic: str, n_tokens: int) -> str:
    """Few-shot text of about ``n_tokens`` tokens (whole question-answer pairs)."""
    text, i = "", 0
    while len(model.tokenize(text)) < n_tokens:
        text += _qa(i, topic)
        i += 1
    return text


@dataclass(slots=True)
class _Sides:
    """What the rows load once, on first use: lcgen with its cache, and two Llamas."""

    model: lcgen.Model
    plain: LlamaCppPython
    ram: LlamaCppPython
    bias: dict[int, float]

    def close(self) -> None:
        self.plain.close()
        self.ram.close()
        self.model.close()


def _loader() -> Lazy[_Sides]:
    """lcgen with its KV cache on and two llama-cpp-pythons, loaded on first use."""

    def make(bench: Bench) -> _Sides:
        cfg: ContextConfig = bench.llama_cpp_python.cfg
        path = bench.lcgen.model.path
        # Its KV cache on; its threads as the bench's lcgen has them (by default adapting to
        # the machine: on an idle one, the same count as the others).
        threads = None if bench.lcgen.model.adaptive_threads else cfg.n_threads
        model = load_lcgen(path, cfg, n_threads=threads)
        plain, ram = LlamaCppPython(path, cfg), LlamaCppPython(path, cfg)
        return _Sides(model, plain, ram, dict(bench.work.bias))

    return Lazy(make, _Sides.close)


def _timed(calls: list[Callable[[], Any]]) -> float:
    start = time.perf_counter()
    for call in calls:
        call()
    return time.perf_counter() - start


def _lcgen_calls(sides: _Sides, prompts: list[str]) -> list[Callable[[], Any]]:
    generate = functools.partial(sides.model.generate, max_tokens=NEW_TOKENS, logit_bias=sides.bias)
    return [functools.partial(generate, p) for p in prompts]


def _llama_calls(side: LlamaCppPython, sides: _Sides, prompts: list[str]) -> list[Any]:
    complete = functools.partial(
        side.llm.create_completion, max_tokens=NEW_TOKENS, temperature=0.0, logit_bias=sides.bias
    )
    # The same token ids on every side.
    return [functools.partial(complete, sides.model.tokenize(p)) for p in prompts]


def _fresh(sides: _Sides, *, ram: bool = False) -> None:
    """Empty caches on every side (a new RAM cache for the Llama that has one)."""
    sides.model.cache.clear()
    sides.plain.llm.reset()  # type: ignore[no-untyped-call]
    sides.ram.llm.reset()  # type: ignore[no-untyped-call]
    sides.ram.llm.set_cache(LlamaRAMCache(capacity_bytes=8 << 30) if ram else None)


# few-shot ---------------------------------------------------------------------------------------
def few_shot_row(work: Workload) -> Row:
    loader = _loader()
    n_prefix = min(FEW_SHOT_TOKENS, 3 * len(work.prompt))

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        sides = loader.get(bench)
        prefix = _prefix(sides.model, "harbour", n_prefix)
        prompts = [
            prefix + _qa(100 + 7 * k, "harbour").split("\nA:")[0] + "\nA:" for k in range(N_CALLS)
        ]
        n_prompts = sum(len(sides.model.tokenize(p)) for p in prompts)
        _fresh(sides)
        order = ["lcgen", "llama-cpp-python"] if r % 2 == 0 else ["llama-cpp-python", "lcgen"]
        out: dict[str, Sample] = {}
        for name in order:
            if name == "lcgen":
                before = sides.model.cache.stats
                seconds = _timed(_lcgen_calls(sides, prompts))
                after = sides.model.cache.stats
                if after.hits - before.hits < N_CALLS - 1:
                    raise RuntimeError("lcgen did not reuse the shared prefix")
                out["cells held"] = Sample(1.0, after.cells_held)
            else:
                seconds = _timed(_llama_calls(sides.plain, sides, prompts))
            out[name] = Sample(seconds, 1)
        out["prompt tokens"] = Sample(1.0, n_prompts)
        return out

    return Row(
        "prefix-fewshot",
        f"{N_CALLS} greedy calls of {NEW_TOKENS} tokens whose prompts share a few-shot prefix of "
        f"about {n_prefix} tokens (each adds its own question), from empty caches: lcgen's "
        "model.generate with its KV cache against llama-cpp-python's create_completion, which "
        "keeps its last prompt's KV; ms per round of all calls. 'cells held': the KV cells "
        "lcgen's cache holds afterwards, against the prompts' tokens summed",
        {"lcgen": "ms", "llama-cpp-python": "ms", "cells held": "count", "prompt tokens": "count"},
        run,
        (
            Check("lcgen", "llama-cpp-python", at_most(1.0)),
            Check("cells held", "prompt tokens"),
        ),
        close=loader.close,
    )


# chat ---------------------------------------------------------------------------------------------
QUESTIONS = [
    "Tell me about the history of Rome.",
    "Who founded the city?",
    "What was the Senate?",
    "How did the Republic end?",
    "Who was the first emperor?",
    "Why did the Western Empire fall?",
]


def chat_row(work: Workload) -> Row:
    loader = _loader()

    def histories(sides: _Sides) -> list[list[dict[str, str]]]:
        """Six turns; each assistant reply in the history is the same fixed text on both
        sides, so both see the same prompts."""
        messages: list[dict[str, str]] = [{"role": "system", "content": "You are a historian."}]
        out = []
        for i, question in enumerate(QUESTIONS[:N_TURNS]):
            messages = [*messages, {"role": "user", "content": question}]
            out.append(messages)
            reply = f"Here is a short answer about point {i + 1}: " + "it is a long story. " * 6
            messages = [*messages, {"role": "assistant", "content": reply}]
        return out

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        sides = loader.get(bench)
        turns = histories(sides)
        _fresh(sides)
        model, bias, llm = sides.model, sides.bias, sides.plain.llm
        chat = functools.partial(model.chat, max_tokens=NEW_TOKENS * 2, logit_bias=bias)
        theirs = functools.partial(
            llm.create_chat_completion, max_tokens=NEW_TOKENS * 2, temperature=0.0, logit_bias=bias
        )
        calls: dict[str, list[Callable[[], Any]]] = {
            "lcgen": [functools.partial(chat, m) for m in turns],
            "llama-cpp-python": [functools.partial(theirs, m) for m in turns],
        }
        names = list(calls) if r % 2 == 0 else list(reversed(calls))
        return {name: Sample(_timed(calls[name]), 1) for name in names}

    return Row(
        "prefix-chat",
        f"a {N_TURNS}-turn chat, {NEW_TOKENS * 2} greedy tokens a turn, the history growing by "
        "the same fixed replies on both sides: lcgen's model.chat(messages) against "
        "llama-cpp-python's create_chat_completion on the same messages; ms per round",
        {"lcgen": "ms", "llama-cpp-python": "ms"},
        run,
        (Check("lcgen", "llama-cpp-python", at_most(1.0)),),
        close=loader.close,
    )


# two prefixes alternating ------------------------------------------------------------------
def interleaved_row(work: Workload) -> Row:
    loader = _loader()
    n_prefix = min(INTERLEAVED_TOKENS, 2 * len(work.prompt) + 100)

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        sides = loader.get(bench)
        a, b = _prefix(sides.model, "orchard", n_prefix), _prefix(sides.model, "quarry", n_prefix)
        prompts = [
            (a if k % 2 == 0 else b) + f"Q: What is {k} plus {k + 1}?\nA:"
            for k in range(N_INTERLEAVED)
        ]
        calls = {
            "lcgen": lambda: _timed(_lcgen_calls(sides, prompts)),
            "llama-cpp-python": lambda: _timed(_llama_calls(sides.plain, sides, prompts)),
            "llama-cpp-python + RAM cache": lambda: _timed(_llama_calls(sides.ram, sides, prompts)),
        }
        names = list(calls)
        shift = r % len(names)
        out = {}
        for name in names[shift:] + names[:shift]:
            _fresh(sides, ram=True)
            out[name] = Sample(calls[name](), 1)
        return out

    return Row(
        "prefix-interleaved",
        f"two few-shot prefixes of about {n_prefix} tokens used alternately over "
        f"{N_INTERLEAVED} greedy calls of {NEW_TOKENS} tokens, each from empty caches: lcgen "
        "(both prefixes stay cached), llama-cpp-python (keeps only its last prompt: every switch "
        "decodes the prefix again) and llama-cpp-python with a LlamaRAMCache (restores a saved "
        "whole state); ms per round",
        {"lcgen": "ms", "llama-cpp-python": "ms", "llama-cpp-python + RAM cache": "ms"},
        run,
        (
            Check("llama-cpp-python", "lcgen", at_least(INTERLEAVED_MIN_RATIO)),
            Check("llama-cpp-python + RAM cache", "lcgen", at_least(1.0)),
        ),
        close=loader.close,
    )


# time to first token -----------------------------------------------------------------------
def ttft_row(work: Workload) -> Row:
    loader = _loader()
    n_prefix = min(FEW_SHOT_TOKENS, 3 * len(work.prompt))

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        sides = loader.get(bench)
        model, bias = sides.model, sides.bias
        prefix = _prefix(model, "lighthouse", n_prefix)
        questions = [prefix + f"Q: What is {r} plus {k}?\nA:" for k in range(2)]
        model.cache.clear()
        start = time.perf_counter()
        model.generate(questions[0], max_tokens=1, logit_bias=bias)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(questions[1], max_tokens=1, logit_bias=bias)
        cached = time.perf_counter() - start
        if out.stats.decoded > 32:
            raise RuntimeError(f"the cached call decoded {out.stats.decoded} tokens")
        start = time.perf_counter()
        again = model.generate(questions[1], max_tokens=1, logit_bias=bias)
        repeated = time.perf_counter() - start
        if again.stats.decoded or str(again) != str(out):
            raise RuntimeError("the same prompt again did not start from its kept logits")
        return {
            "cold": Sample(cold, 1),
            "cached": Sample(cached, 1),
            "same prompt": Sample(repeated, 1),
        }

    return Row(
        "prefix-ttft",
        f"lcgen's time to the first token of a prompt that starts with a {n_prefix}-token "
        "prefix: cold (empty cache: the whole prompt is decoded) against cached (the prefix "
        "came from the call before; only the new question is decoded), and the cached call's "
        "prompt once more (the store kept the logits after it: nothing is decoded); ms",
        {"cold": "ms", "cached": "ms", "same prompt": "ms"},
        run,
        (Check("cold", "cached", at_least(TTFT_MIN_RATIO)), Check("cold", "same prompt")),
        close=loader.close,
    )


# crowded cache ---------------------------------------------------------------------------------
CROWD_TOPICS = ("garden", "river", "mountain", "harbour", "forest", "market")


def crowded_row(work: Workload) -> Row:
    model_of = Lazy(
        lambda b: load_lcgen(b.lcgen.model.path, b.llama_cpp_python.cfg), lcgen.Model.close
    )
    n_other, n_new = len(work.prompt), max(8, work.n_tokens // 4)

    def run(bench: Bench, r: int) -> dict[str, Sample]:
        model = model_of.get(bench)
        out: dict[str, Sample] = {}
        for name, topics in (("empty cache", ()), ("other prompts cached", CROWD_TOPICS)):
            model.cache.clear()
            for topic in topics:
                model.generate(_prefix(model, topic, n_other), max_tokens=1)
            start = time.perf_counter()
            text = model.generate(
                f"Say hello to visitor number {r}.", max_tokens=n_new, logit_bias=bench.work.bias
            )
            out[name] = Sample(time.perf_counter() - start, len(text.tokens))
        return out

    return Row(
        "prefix-crowded",
        f"a short prompt and {n_new} greedy tokens, tokens/s: with an empty cache against "
        f"with {len(CROWD_TOPICS)} other prompts of about {n_other} tokens parked in it (what "
        "a long-running process holds; without flash attention every decode attends over "
        "all the cells in use, with it only over its own)",
        {"empty cache": "tokens/s", "other prompts cached": "tokens/s"},
        run,
        (Check("other prompts cached", "empty cache"),),
        close=model_of.close,
    )


FACTORIES: dict[str, RowFactory] = {
    "prefix-fewshot": few_shot_row,
    "prefix-chat": chat_row,
    "prefix-interleaved": interleaved_row,
    "prefix-ttft": ttft_row,
    "prefix-crowded": crowded_row,
}
