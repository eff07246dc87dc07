"""What the rows drive: the workload, and the three implementations that do it.

lcgen is driven through its public API only; ``llama_cpp`` is imported here because the raw C
loop and ``llama_cpp.Llama`` are the baselines being measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as C
import llama_cpp.llama_cpp as low_level
import numpy as np
from llama_cpp.llama_grammar import LlamaGrammar

import lcgen

PROSE = (
    "The river came down from the hills in early spring, brown with snowmelt and loud enough "
    "to hear from the square. Every year the town argued about the bridge. The old men said it "
    "had stood for a hundred years and would stand for a hundred more; the engineer from the "
    "capital, who had measured the piers twice and written a careful report, said it would not "
    "see another flood. Nobody read the report. The baker, who crossed the bridge each morning "
    "before dawn with a cart of bread for the farms on the far bank, said only that the planks "
    "had begun to sing under his wheels, a low note that had not been there the year before. "
    "His daughter kept a notebook of the river's height, marked against a white stone at the "
    "water's edge, and she noticed that the marks were climbing earlier each spring. When she "
    "showed the notebook to the mayor, he thanked her, praised her handwriting, and put it in "
    "a drawer with the engineer's report. That April the rain did not stop for nine days. "
)
REWIND_KS = (1, 32, 512)
REGENERATE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class ContextConfig:
    """Context settings shared by all three implementations (lcgen's own defaults)."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 8
    n_threads: int = 1
    n_gpu_layers: int = 0
    # lcgen turns llama.cpp's extra CPU buffers off where AMX crashes, and leaves flash
    # attention to llama.cpp (None: on where supported); the others follow it.
    extra_cpu_buffers: bool = True
    flash_attn: bool | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """What the rows ask for.

    Attributes:
        prompt: decoded by every implementation, then ``n_tokens`` greedy tokens more.
        n_schemas: how many of the constrained rows' JSON Schemas they use (the first ones).
        banned: the end-of-generation tokens, banned so that every run makes all its tokens.
        bias: the ban as a logit_bias: every banned token at -inf.
        long_prompt: the checkpoint rows' sequence before its first greedy token (so the
            sequence holds ``len(long_prompt) + 1`` tokens).
        rewind_ks: the rewind lengths, each shorter than that sequence.
        n_regenerate: tokens generated, and rewound then regenerated, by ``regenerate``.
    """

    prompt: tuple[int, ...]
    n_tokens: int
    banned: tuple[int, ...]
    bias: Mapping[int, float]
    long_prompt: tuple[int, ...]
    rewind_ks: tuple[int, ...]
    n_regenerate: int = REGENERATE_TOKENS
    n_schemas: int = 3

    @property
    def n_context(self) -> int:
        """Tokens the checkpoint rows' sequence holds."""
        return len(self.long_prompt) + 1


def build_workload(
    model: lcgen.Model, n_prompt: int, n_tokens: int, n_context: int, n_schemas: int = 3
) -> Workload:
    """Prompts of exactly ``n_prompt`` and ``n_context - 1`` tokens of prose; the ban."""
    text = PROSE
    tokens = model.tokenize(text)
    while len(tokens) < max(n_prompt, n_context - 1):
        text += PROSE
        tokens = model.tokenize(text)
    banned = tuple(t for t in range(model.n_vocab) if model.is_eog(t))
    bias = {tok: float("-inf") for tok in banned}
    ks = tuple(k for k in REWIND_KS if k < n_context)
    return Workload(
        tuple(tokens[:n_prompt]),
        n_tokens,
        banned,
        bias,
        tuple(tokens[: n_context - 1]),
        ks,
        n_schemas=n_schemas,
    )


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed run: ``count`` units of work (tokens, operations, bytes) in ``seconds``;
    ``tokens`` it produced (compared across implementations)."""

    seconds: float
    count: float
    tokens: tuple[int, ...] = ()


def _check_decode(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"llama_decode failed with code {rc}")


def check_count(what: str, got: int, expected: int) -> None:
    """Raise when lcgen did other work than the row claims to measure."""
    if got != expected:
        raise RuntimeError(f"lcgen {what}: {got} tokens, expected {expected}")


class RawLoop:
    """The limit: the least Python that drives llama.cpp to do the same work as lcgen."""

    name = "limit"

    def __init__(self, path: Path, cfg: ContextConfig) -> None:
        C.llama_backend_init()
        params = C.llama_model_default_params()
        params.n_gpu_layers = cfg.n_gpu_layers
        params.use_extra_bufts = cfg.extra_cpu_buffers
        self._model = C.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._ctx = C.llama_init_from_model(self._model, _context_params(cfg))
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._mem = C.llama_get_memory(self._ctx)
        self.n_vocab = int(C.llama_vocab_n_tokens(C.llama_model_get_vocab(self._model)))
        self.n_batch = cfg.n_batch

    def _prefill(self, prompt: ctypes.Array[ctypes.c_int32], banned: np.ndarray) -> int:
        """Clear the memory, decode the prompt in n_batch chunks, return the greedy token."""
        C.llama_memory_clear(self._mem, True)
        for at in range(0, len(prompt), self.n_batch):
            size = min(self.n_batch, len(prompt) - at)
            address = ctypes.addressof(prompt) + at * ctypes.sizeof(C.llama_token)
            chunk = ctypes.cast(address, ctypes.POINTER(C.llama_token))
            _check_decode(C.llama_decode(self._ctx, C.llama_batch_get_one(chunk, size)))
        return self._next_token(banned)

    def _next_token(self, banned: np.ndarray) -> int:
        ptr = C.llama_get_logits_ith(self._ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        logits[banned] = -np.inf  # llama.cpp's buffer: overwritten by the next decode anyway
        return int(logits.argmax())

    def prefill(self, work: Workload) -> Sample:
        prompt = (C.llama_token * len(work.prompt))(*work.prompt)
        banned = np.array(work.banned, dtype=np.int64)
        start = time.perf_counter()
        token = self._prefill(prompt, banned)
        return Sample(time.perf_counter() - start, len(work.prompt), (token,))

    def decode(self, work: Workload) -> Sample:
        prompt = (C.llama_token * len(work.prompt))(*work.prompt)
        banned = np.array(work.banned, dtype=np.int64)
        tokens = [self._prefill(prompt, banned)]
        one = (C.llama_token * 1)(tokens[0])
        batch = C.llama_batch_get_one(one, 1)
        start = time.perf_counter()
        for _ in range(work.n_tokens):
            one[0] = tokens[-1]
            _check_decode(C.llama_decode(self._ctx, batch))
            tokens.append(self._next_token(banned))
        return Sample(time.perf_counter() - start, work.n_tokens, tuple(tokens))

    def close(self) -> None:
        if self._ctx:
            C.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            C.llama_model_free(self._model)
            self._model = None


def _context_params(cfg: ContextConfig) -> Any:
    """The context parameters lcgen's native layer sets, field for field."""
    params = C.llama_context_default_params()
    params.n_ctx = cfg.n_ctx
    params.n_batch = cfg.n_batch
    params.n_ubatch = cfg.n_batch
    params.n_seq_max = cfg.n_seq_max
    params.n_threads = cfg.n_threads
    params.n_threads_batch = cfg.n_threads
    params.no_perf = True
    params.kv_unified = True
    params.swa_full = True
    if cfg.flash_attn is not None:
        params.flash_attn_type = (
            C.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
    return params


@contextlib.contextmanager
def extra_cpu_buffers(enabled: bool) -> Iterator[None]:
    """``Llama`` builds its model parameters from ``llama_model_default_params()`` and takes no
    extra-buffer option: set the option there while it loads."""
    default = low_level.llama_model_default_params

    def params() -> C.llama_model_params:
        p: C.llama_model_params = default()
        p.use_extra_bufts = enabled
        return p

    low_level.llama_model_default_params = params
    try:
        yield
    finally:
        low_level.llama_model_default_params = default


def load_lcgen(path: Path, cfg: ContextConfig, **options: Any) -> lcgen.Model:
    """lcgen's model of ``path`` with the benchmark's context settings (``options`` added or
    put in their place)."""
    settings: dict[str, Any] = {
        "n_threads": cfg.n_threads,
        "n_gpu_layers": cfg.n_gpu_layers,
        "n_ctx": cfg.n_ctx,
        "n_batch": cfg.n_batch,
        "flash_attn": cfg.flash_attn,
    }
    return lcgen.load(path, **{**settings, **options})


class LlamaCppPython:
    """llama-cpp-python's high-level ``Llama``, used the way its users call it."""

    name = "llama-cpp-python"

    def __init__(self, path: Path, cfg: ContextConfig, **options: Any) -> None:
        """``options``: more ``Llama`` arguments (a draft model, say)."""
        self.cfg = cfg
        with extra_cpu_buffers(cfg.extra_cpu_buffers):
            self.llm = C.Llama(
                model_path=str(path),
                n_ctx=cfg.n_ctx,
                n_batch=cfg.n_batch,
                n_ubatch=cfg.n_batch,
                n_threads=cfg.n_threads,
                n_threads_batch=cfg.n_threads,
                n_gpu_layers=cfg.n_gpu_layers,
                flash_attn=cfg.flash_attn is not False,  # its auto: on, as llama.cpp's
                swa_full=True,
                no_perf=True,
                verbose=False,
                **options,
            )

    def _exact(self, work: Workload, max_tokens: int) -> tuple[float, tuple[int, ...]]:
        """:meth:`complete` of the workload's prompt, checked to make exactly ``max_tokens``."""
        seconds, n_generated, decoded = self.complete(work.prompt, max_tokens, bias=work.bias)
        if n_generated != max_tokens:
            raise RuntimeError(
                f"llama-cpp-python made {n_generated} tokens, {max_tokens} were asked for"
            )
        return seconds, decoded

    def prefill(self, work: Workload) -> Sample:
        seconds, decoded = self._exact(work, 1)
        return Sample(seconds, len(work.prompt), decoded)

    def decode(self, work: Workload) -> Sample:
        # The extra time of n_tokens more tokens: its decode loop cannot be timed from inside.
        first, _ = self._exact(work, 1)
        total, decoded = self._exact(work, work.n_tokens + 1)
        return Sample(total - first, work.n_tokens, decoded)

    def complete(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        *,
        grammar: LlamaGrammar | None = None,
        bias: Mapping[int, float] | None = None,
    ) -> tuple[float, int, tuple[int, ...]]:
        """Seconds for one greedy ``create_completion`` of ``prompt`` from an empty cache, the
        number of tokens it generated (ended by ``max_tokens`` or, with a grammar, by the
        end-of-generation token, which is not counted), and those of them it decoded (all but
        a last one that ended the run by length), read from its input ids."""
        self.llm.reset()  # type: ignore[no-untyped-call]
        # n_tokens == 0 turns off Llama.generate's prefix reuse; no LlamaCache is attached.
        if self.llm.n_tokens != 0 or self.llm.cache is not None:
            raise RuntimeError("llama-cpp-python would reuse a cached prompt prefix")
        start = time.perf_counter()
        out = self.llm.create_completion(
            list(prompt),
            max_tokens=max_tokens,
            temperature=0.0,
            grammar=grammar,
            logit_bias=dict(bias) if bias else None,
        )
        seconds = time.perf_counter() - start
        usage = out["usage"]  # type: ignore[index]
        if usage["prompt_tokens"] != len(prompt):
            raise RuntimeError(f"llama-cpp-python did not decode the whole prompt: {usage}")
        n_prompt, n_generated = len(prompt), int(usage["completion_tokens"])
        end = min(self.llm.n_tokens, n_prompt + n_generated)
        return seconds, n_generated, tuple(int(t) for t in self.llm.input_ids[n_prompt:end])

    def after_first(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        *,
        grammar: LlamaGrammar | None = None,
        bias: Mapping[int, float] | None = None,
    ) -> Sample:
        """The tokens after the first one, per second: ``create_completion`` of up to
        ``max_tokens`` minus ``create_completion`` of 1 token (its loop cannot be timed from
        inside), both greedy from an empty cache; the tokens are those the longer run decoded."""
        first, _, _ = self.complete(prompt, 1, grammar=grammar, bias=bias)
        total, n_generated, decoded = self.complete(prompt, max_tokens, grammar=grammar, bias=bias)
        return Sample(total - first, n_generated - 1, decoded)

    def close(self) -> None:
        self.llm.close()


def check_json(text: str, finish: str | None, what: str) -> None:
    """A constrained run that ended because its grammar was complete (``finish`` "stop") must
    have made JSON: a ``RuntimeError`` naming ``what`` and showing the text otherwise (a run cut
    at its token limit is timed as it is)."""
    if finish != "stop":
        return
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"{what} is not JSON ({exc}): {text!r}") from None


class Lcgen:
    """lcgen through its public API; also holds the checkpoint rows' long sequence."""

    name = "lcgen"

    def __init__(self, model: lcgen.Model) -> None:
        self.model = model
        self._long: lcgen.Sequence | None = None

    def prefill(self, work: Workload) -> Sample:
        n_before = self.model.context.n_decoded
        start = time.perf_counter()
        with self.model.sequence(work.prompt) as seq:
            seq.generate(max_tokens=1, temperature=0.0, logit_bias=work.bias)
            seconds = time.perf_counter() - start
            generated = seq.tokens[len(work.prompt) :]
        check_count("prefill", self.model.context.n_decoded - n_before, len(work.prompt))
        return Sample(seconds, len(work.prompt), tuple(generated))

    def decode(self, work: Workload) -> Sample:
        with self.model.sequence(work.prompt) as seq:
            seq.generate(max_tokens=1, temperature=0.0, logit_bias=work.bias)
            n_before = self.model.context.n_decoded
            start = time.perf_counter()
            seq.generate(max_tokens=work.n_tokens, temperature=0.0, logit_bias=work.bias)
            seconds = time.perf_counter() - start
            generated = seq.tokens[len(work.prompt) :]
        check_count("decode", self.model.context.n_decoded - n_before, work.n_tokens)
        check_count("generated", len(generated), work.n_tokens + 1)
        return Sample(seconds, work.n_tokens, tuple(generated))

    def decode_text(self, work: Workload, *, stream: bool, stops: tuple[str, ...]) -> Sample:
        """Greedy decode of ``n_tokens`` through ``generate`` or by iterating ``stream``, with
        stop strings that never occur (so every token goes through the stop matcher)."""
        with self.model.sequence(work.prompt) as seq:
            seq.generate(max_tokens=1, temperature=0.0, logit_bias=work.bias)
            stop = list(stops)
            start = time.perf_counter()
            if stream:
                chunks = seq.stream(max_tokens=work.n_tokens, logit_bias=work.bias, stop=stop)
                text = "".join(chunk.text for chunk in chunks)
            else:
                text = seq.generate(max_tokens=work.n_tokens, logit_bias=work.bias, stop=stop)
            seconds = time.perf_counter() - start
            generated = seq.tokens[len(work.prompt) :]
        check_count("generated", len(generated), work.n_tokens + 1)
        assert not any(stop in text for stop in stops), "a benchmark stop string occurred"
        return Sample(seconds, work.n_tokens, tuple(generated))

    def after_first(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        *,
        grammar: lcgen.Grammar | None = None,
        bias: Mapping[int, float] | None = None,
        speculate: Any = None,
        fast_forward: bool = True,
    ) -> tuple[Sample, str, str | None]:
        """Greedy ``seq.stream`` of up to ``max_tokens`` after ``prompt``, timed from the first
        chunk to the last, so over the tokens after the first chunk's (end-of-generation ones
        not counted; the first chunk holds more than one where a grammar forced text before
        the first step), with ``speculate`` and ``fast_forward`` as given. Also returns the
        text and the finish reason."""
        with self.model.sequence(prompt) as seq:
            chunks = seq.stream(
                grammar=grammar,
                max_tokens=max_tokens,
                temperature=0.0,
                logit_bias=bias,
                speculate=speculate,
                fast_forward=fast_forward,
            )
            first = next(chunks)
            n_before, kept_before = self.model.context.n_decoded, seq.n_decoded
            start = time.perf_counter()
            rest = list(chunks)
            seconds = time.perf_counter() - start
            generated = seq.tokens[len(prompt) :]
            kept_after = seq.n_decoded
        last = rest[-1] if rest else first
        # Each step after the first decodes the tokens the step before added (the sampled
        # one, any forced ones) and its draft: nothing is decoded twice but the rejected
        # draft tokens.
        stats = last.stats or lcgen.GenerationStats()
        expected = kept_after - kept_before + stats.drafted - stats.accepted
        check_count("after first", self.model.context.n_decoded - n_before, expected)
        kept = tuple(t for t in generated if not self.model.is_eog(t))
        text = first.text + "".join(chunk.text for chunk in rest)
        return Sample(seconds, len(kept) - len(first.tokens), kept), text, last.finish_reason

    def long_sequence(self, work: Workload) -> lcgen.Sequence:
        """The ``n_context``-token sequence (its last token pending), decoded on first use."""
        if self._long is None:
            seq = self.model.sequence(work.long_prompt)
            seq.generate(max_tokens=1, temperature=0.0, logit_bias=work.bias)
            check_count("long sequence", len(seq), work.n_context)
            self._long = seq
        return self._long

    def close_long_sequence(self) -> None:
        """Free the long sequence's cells: other sequences' attention would span them."""
        if self._long is not None:
            self._long.close()
            self._long = None

    def context_state_size(self) -> int:
        """Bytes of the whole context's serialized state: every used KV cell once, with the
        ids of the sequences that share it (lcgen exposes no count of used cells)."""
        return self.model.context.state_size()

    def close(self) -> None:
        self.close_long_sequence()
        self.model.close()
