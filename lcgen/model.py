"""``Model``: a loaded GGUF, its vocabulary, and the generation entry points.

A model owns one llama.cpp context with ``n_seq_max`` sequence slots; every generation call
(and every live :class:`~lcgen.Sequence`) holds one slot while it runs. A list of prompts runs
through the one :class:`~lcgen.runtime.Scheduler`, decoded together one batch per step.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Unpack, overload

import numpy as np

from lcgen._native.context import KV_TYPES
from lcgen._native.cpu import performance_cores
from lcgen._native.log import init, supports_gpu_offload, system_info
from lcgen._native.model import ModelHandle, render_chat_template
from lcgen._numbers import MAX_SEQ, check_bool
from lcgen._unshared import Unshared
from lcgen._version import __version__
from lcgen.decoding import Chunk, GenerateOptions, Plan, Text, make_plan
from lcgen.decoding.generator import logprobs_of
from lcgen.decoding.options import shown
from lcgen.decoding.results import SchemaLike, TokenLogprob, check_parsed, parse_structured
from lcgen.decoding.sampling import check_seed
from lcgen.errors import ContextFullError, ModelLoadError, warn
from lcgen.runtime import Context, Run, Scheduler, Sequence
from lcgen.runtime.kvstore import KVStore, check_slot_timeout, shared_prefixes
from lcgen.runtime.run import decode
from lcgen.tools import (
    ToolLike,
    ToolPlan,
    check_messages,
    check_options,
    make_tool_plan,
    prompt_messages,
)
from lcgen.vocab import Vocab

# A chat message: role and content, and OpenAI's tool_calls / tool_call_id (see lcgen.tools).
Message = Mapping[str, Any]
_M = TypeVar("_M")


# Slots are cheap with one unified cell pool (measured: decode speed alike at 8 and 32) and
# every parked prefix needs one: 32 by default.
DEFAULT_SLOTS = 32
_MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS
_MAX_SIZE = 2**31 - 1  # llama.cpp takes sizes as uint32; larger values would wrap


# A prefix that several prompts of one batch share is decoded once, ahead of them, from this
# many tokens (a shorter one costs about as much to decode with each prompt).
_MIN_SHARED = 4
# Tokens scored per decode by prompt_logprobs: each needs a row of logits (n_vocab floats).
_SCORE_CHUNK = 64


def check_load_options(
    *,
    n_ctx: int,
    n_batch: int,
    n_seq_max: int | None,
    n_gpu_layers: int | None,
    n_threads: int | None,
    flash_attn: bool | None,
    type_k: str,
    type_v: str,
    swa_full: bool,
    cache: bool | int,
    slot_timeout: float | None,
    pad_batches: bool,
    verbose: bool,
) -> tuple[int, str, str]:
    """Check :class:`Model`'s options before anything loads (what ``lcgen.load`` does before
    it resolves, and may download, the model).

    Returns:
        ``n_seq_max`` (its default filled in), ``type_k`` and ``type_v`` (as llama.cpp names
        them).
    """
    n_seq_max = _check_sizes(n_ctx, n_batch, n_seq_max)
    type_k = _check_kv_type("type_k", type_k)
    type_v = _check_kv_type("type_v", type_v, "auto")
    check_bool("swa_full", swa_full)
    check_slot_timeout(slot_timeout)
    check_bool("flash_attn", flash_attn, none=True)
    check_bool("verbose", verbose)
    check_bool("pad_batches", pad_batches)
    if not isinstance(cache, bool):
        if not isinstance(cache, int):
            raise TypeError(f"cache must be True, False or a number of cells, got {cache!r}")
        _check_int("cache", cache, 0, 2**31 - 1)
    if n_threads is not None:
        _check_threads(n_threads)
    if n_gpu_layers is not None:
        _check_int("n_gpu_layers", n_gpu_layers, -1, 2**31 - 1)  # -1: every layer
    return n_seq_max, type_k, type_v


def _check_sizes(n_ctx: int, n_batch: int, n_seq_max: int | None) -> int:
    """Refuse sizes llama.cpp would abort on (or silently wrap); returns ``n_seq_max``
    (None: :data:`DEFAULT_SLOTS` within what the sizes allow)."""
    _check_int("n_ctx", n_ctx, 0, _MAX_SIZE)
    _check_int("n_batch", n_batch, 1, _MAX_SIZE)
    if n_seq_max is None:
        n_seq_max = min(DEFAULT_SLOTS, n_batch, n_ctx or DEFAULT_SLOTS)
    _check_int("n_seq_max", n_seq_max, 1, MAX_SEQ)
    # Every slot may output a row in one batch: llama.cpp asserts room for n_seq_max outputs.
    for name, value in (("n_batch", n_batch), ("n_ctx", n_ctx)):
        if value and value < n_seq_max:
            raise ValueError(
                f"{name}={value} is below n_seq_max={n_seq_max}: give {name} >= n_seq_max "
                "or fewer slots"
            )
    return n_seq_max


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")
    return value


# The KV cache element types ``type_k`` and ``type_v`` take (llama.cpp's names).
KV_CACHE_TYPES = tuple(KV_TYPES)


def _check_kv_type(name: str, value: object, *more: str) -> str:
    allowed = (*KV_TYPES, *more)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _check_threads(n_threads: int) -> int:
    return _check_int("n_threads", n_threads, 1, _MAX_THREADS)


def _default_threads() -> int:
    """The physical cores this process may really use (CPU affinity, a cgroup CPU quota; on
    macOS the performance cores), at most 8: more threads than cores slow llama.cpp many times
    over, and two threads on one core's hardware threads gain little."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = performance_cores() or physical_cores(cpus)
    return max(1, min(8, cores, _cgroup_quota() or cores))


def physical_cores(cpus: list[int], root: Path = Path("/sys/devices/system/cpu")) -> int:
    """How many physical cores the logical CPUs ``cpus`` are on (Linux's CPU topology);
    ``len(cpus)`` where the topology cannot be read."""
    cores = set()
    for cpu in cpus:
        topology = root / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text(encoding="ascii").strip()
            core = (topology / "core_id").read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def _cgroup_quota() -> int | None:
    """The CPUs a cgroup v2 ``cpu.max`` quota allows, rounded up; None without a quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return max(1, -(-int(quota) // int(period)))


def params_label(n_params: int) -> str:
    """A parameter count to three significant digits: ``135M``, ``1.54B``."""
    rounded = float(f"{n_params:.3g}")
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if rounded >= scale:
            return f"{rounded / scale:.3g}{unit}"
    return str(n_params)


def describe(llama_description: str, n_params: int) -> str:
    """llama.cpp's "architecture size-class file-type" with the real parameter count."""
    parts = llama_description.split(" ", 2)
    if len(parts) < 3:
        return f"{llama_description}, {params_label(n_params)} parameters"
    return f"{parts[0]} {params_label(n_params)} {parts[2]}"


def backend_summary(devices: Seq[tuple[str, str]], n_offloaded: int, n_layers: int) -> str:
    """``"CPU"``, ``"CUDA: 31/31 layers offloaded"``, or ``"CPU (Metal built in, 0/31 layers
    offloaded)"``: where a model's layers run."""
    backends = ", ".join(dict.fromkeys(backend for backend, _ in devices))
    if not devices:
        return "CPU"
    if not n_offloaded:
        return f"CPU ({backends} built in, 0/{n_layers} layers offloaded)"
    return f"{backends}: {n_offloaded}/{n_layers} layers offloaded"


class Model(Unshared):
    """A GGUF model loaded through llama.cpp, ready to generate.

    Args:
        path: the .gguf file (use :func:`lcgen.load` to load by registry name or ``hf:`` ref).
        n_ctx: context size in tokens, shared by all live sequences (0: the model's own).
        n_batch: the most tokens decoded in one ``llama_decode`` call (prefill chunk size).
        n_seq_max: how many sequence slots the context has: live sequences and cached
            prefixes share them (at most 256, ``n_ctx`` and ``n_batch``; None: 32 within those
            bounds; each slot costs one row of logits, n_vocab floats).
        n_gpu_layers: layers to offload (-1: all); None offloads all when a GPU/Metal backend
            is built in.
        n_threads: CPU threads, fixed; None adapts the count to the machine's load (on a
            model without GPU layers): at most the physical cores this process may use (CPU
            affinity, a cgroup quota; at most 8), fewer while other programs keep cores busy
            (measured as it decodes; below 512 KV cells the logits do not depend on the count,
            from there a single token's do in their last bits: give a count for runs
            reproducible bit for bit at any length).
        flash_attn: use flash attention; None lets llama.cpp decide (on where supported).
            Keep it on for exact rewinds: without it, a token's logits depend on the batch
            and on where its cells sit in the pool (measured). Off decodes faster on some CPUs
            at long contexts (1.4-2x at 500-3,000 tokens on the test machine).
        type_k: the KV cache's element type for keys: ``"f16"`` (llama.cpp's default),
            ``"bf16"``, ``"f32"``, or quantized ``"q8_0"``, ``"q5_1"``, ``"q5_0"``, ``"q4_1"``,
            ``"q4_0"``, ``"iq4_nl"`` (less memory, slightly different logits).
        type_v: the same for values (a quantized one needs flash attention), or ``"auto"``:
            bf16 where every layer runs on the CPU with flash attention, f16 elsewhere. On the
            CPU, ``"bf16"`` prefills long prompts slower (about half the speed) and decodes
            faster on some CPUs, slower on others (SmolLM2 after 2,000 tokens: 1.6x on an
            Intel server CPU, 0.68x on an AMD Zen 4; ``make bench``, row kv-bf16): llama.cpp's
            CPU flash attention accumulates an f16 cache's values in f16 row by row, and tiles
            rows only with an f16 cache. Its logits are as close to an f32 reference as f16's.
        swa_full: keep the full sliding-window cache (sliding-window models such as Gemma 3);
            False saves memory, but then rewinding far back re-decodes the kept tokens.
        cache: keep the KV cells of closed sequences and start every sequence from the
            longest cached prefix (True); an int caps the cells kept (least recently used
            prefixes are evicted beyond it); False keeps nothing of closed sequences (each call
            decodes its prompt; live sequences and pinned prefixes are still shared).
        slot_timeout: how long a thread waits for a slot other threads hold (None: as long
            as it takes; a thread never waits for slots only it holds: it gets
            :class:`~lcgen.SlotsExhaustedError`).
        pad_batches: pad a short batch after a long cache to 64 tokens where that is
            predicted faster (on the CPU with flash attention: see the README's notes on the KV
            cache). The prediction learns this machine's decode times where the thread count
            adapts; with a fixed ``n_threads`` a laptop's fitted rule decides, which loses on
            some CPUs (a 2-core AVX-512 one): False never pads, fast there and reproducible.
        verbose: show llama.cpp's log on stderr (errors are always captured into exceptions).

    Raises:
        ModelLoadError: the file is missing, not a GGUF, truncated or unsupported.
        ValueError: a size argument is out of range.
        TypeError: an argument is of the wrong type (swa_full="x": a flag takes True or False).
    """

    instead: ClassVar[str] = (
        "share it (it is safe to use from several threads), or load the file again"
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_seq_max: int | None = None,
        n_gpu_layers: int | None = None,
        n_threads: int | None = None,
        flash_attn: bool | None = None,
        type_k: str = "f16",
        type_v: str = "f16",
        swa_full: bool = True,
        cache: bool | int = True,
        slot_timeout: float | None = None,
        pad_batches: bool = True,
        verbose: bool = False,
    ) -> None:
        n_seq_max, type_k, type_v = check_load_options(
            n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, n_gpu_layers=n_gpu_layers,
            n_threads=n_threads, flash_attn=flash_attn, type_k=type_k, type_v=type_v,
            swa_full=swa_full, cache=cache, slot_timeout=slot_timeout, pad_batches=pad_batches,
            verbose=verbose,
        )  # fmt: skip
        # The most threads; with adaptive_threads, decodes use the count measured fastest.
        self.n_threads = n_threads if n_threads is not None else _default_threads()
        init()
        self.path = Path(path)
        if n_gpu_layers is None:
            n_gpu_layers = -1 if supports_gpu_offload() else 0
        elif n_gpu_layers and not supports_gpu_offload():
            warn(
                f"n_gpu_layers={n_gpu_layers}: this build of llama-cpp-python has no GPU "
                "backend, so every layer runs on the CPU (README: GPU and Metal)"
            )
        self._handle = ModelHandle(str(self.path), n_gpu_layers, verbose=verbose)
        try:  # a load that fails frees what it loaded (a retry with a smaller n_ctx leaked it)
            self.vocab = Vocab(self._handle)
            self.n_vocab = self.vocab.n_vocab
            self.bos, self.eos, self.eot, self.add_bos = (
                self.vocab.bos,
                self.vocab.eos,
                self.vocab.eot,
                self.vocab.add_bos,
            )
            # llama.cpp's description names a size class ("256M" for 135M parameters): the real
            # count replaces it.
            self.n_params = self._handle.n_params
            self.description = describe(self._handle.description(), self.n_params)
            # Where the layers run: "CPU", or the GPU backend and how many layers it holds.
            self.n_gpu_layers = self._handle.n_offloaded
            # With layers on a GPU, the CPU threads wait for it: their share of a decode's time
            # says nothing about free cores.
            self.adaptive_threads = n_threads is None and self.n_gpu_layers == 0
            self.backend = backend_summary(
                self._handle.devices, self.n_gpu_layers, self._handle.n_offloadable
            )
            # Whether llama.cpp's extra CPU buffers (AMX, repacked weights) are used: off where
            # the CPU reports AMX that crashes (see lcgen._native.cpu).
            self.extra_cpu_buffers = self._handle.extra_cpu_buffers
            if not n_ctx:
                n_ctx = self._handle.n_ctx_train
                if not 0 < n_ctx <= _MAX_SIZE:  # (llama.cpp reads 2**31 and more as negative)
                    raise ModelLoadError(
                        f"{self.path.name} gives a training context of {n_ctx} tokens (its "
                        "GGUF context_length), which is no context size: give n_ctx"
                    )
            self.flash_attn = flash_attn  # None: llama.cpp decides
            if type_v == "auto":  # bf16 where llama.cpp's CPU flash attention reads the values
                type_v = "bf16" if self.n_gpu_layers == 0 and flash_attn is not False else "f16"
            self.context = Context(
                self._handle,
                n_ctx,
                n_batch,
                n_seq_max,
                self.n_threads,
                flash_attn,
                swa_full,
                adaptive_threads=self.adaptive_threads,
                # Flash attention on the CPU: short batches are padded where that is faster (see
                # Context._padding).
                pad_batches=pad_batches and self.n_gpu_layers == 0 and flash_attn is not False,
                type_k=type_k,
                type_v=type_v,
            )
            self.cache = KVStore(
                self.context,
                self.vocab,
                lambda: self.fingerprint,
                enabled=cache is not False,
                budget=None if isinstance(cache, bool) else cache,
                slot_timeout=slot_timeout,
            )
        except BaseException:
            self._handle.close()
            raise

    @property
    def n_ctx(self) -> int:
        """The most tokens one sequence can hold."""
        return self.context.n_ctx

    @property
    def type_k(self) -> str:
        """The KV cache's element type for keys."""
        return self.context.kv_types[0]

    @property
    def type_v(self) -> str:
        """The KV cache's element type for values (``"auto"`` resolved)."""
        return self.context.kv_types[1]

    @property
    def threads_now(self) -> int:
        """The threads decodes use now: ``n_threads``, or fewer while an adaptive count finds
        cores busy."""
        tuner = self.context.threads
        return self.n_threads if tuner is None else tuner.n

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the GGUF metadata and sizes; saved sequences carry it."""
        return self._handle.fingerprint()

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """A hash of what a seeded output depends on besides the request: the model's
        fingerprint, lcgen's and llama.cpp's versions, the CPU features llama.cpp's kernels use
        (AVX2 and AVX-512 round differently), the backend and the settings that change the
        numbers (flash attention, KV types, ``n_batch``, padded batches, the thread count and
        whether it adapts: from 512 cells on, one token's attention is split between the
        threads). The server sends it as OpenAI's ``system_fingerprint``."""
        parts = (
            __version__,
            system_info(),
            self.fingerprint,
            self.backend,
            self.flash_attn,
            self.type_k,
            self.type_v,
            self.context.n_batch,
            self.context.pad_batches,
            self.n_threads,
            self.adaptive_threads,
        )
        return "fp_" + hashlib.sha256(repr(parts).encode()).hexdigest()[:16]

    @property
    def is_closed(self) -> bool:
        return not self._handle.is_open

    def __repr__(self) -> str:
        state = ", closed" if self.is_closed else ""
        return (
            f"<lcgen.Model {self.path.name} ({self.description}), {self.backend}, "
            f"n_ctx={self.n_ctx}{state}>"
        )

    # vocabulary (see :class:`~lcgen.vocab.Vocab`) -------------------------------------
    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = False
    ) -> list[int]:
        """Text to token ids (see :meth:`lcgen.vocab.Vocab.tokenize`)."""
        return self.vocab.tokenize(text, add_bos=add_bos, special=special)

    def infill_tokens(self, prefix: str, suffix: str) -> list[int]:
        """The prompt asking a fill-in-the-middle model for the text between ``prefix`` and
        ``suffix`` (see :meth:`lcgen.vocab.Vocab.infill`); ``generate(prefix, suffix=...)``
        uses it, and so can :meth:`sequence`.

        Raises:
            ValueError: the model declares no fill-in-the-middle tokens.
        """
        return self.vocab.infill(prefix, suffix)

    def _prompt(self, prompt: str, suffix: str | None) -> str | list[int]:
        return prompt if suffix is None else self.infill_tokens(prompt, suffix)

    def detokenize(self, tokens: Iterable[int], *, special: bool = False) -> str:
        """Token ids to text (invalid UTF-8 becomes U+FFFD)."""
        return self.vocab.detokenize(tokens, special=special)

    def token_piece(self, token: int) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character); cached."""
        return self.vocab.piece(token)

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT and the like)."""
        return self.vocab.is_eog(token)

    def tokens_extending(self, prefix: bytes) -> np.ndarray:
        """Ids of the tokens whose text starts with ``prefix`` or starts it (token healing).

        Raises:
            TypeError: ``prefix`` is not bytes (a str: encode it).
        """
        if isinstance(prefix, str):
            raise TypeError(
                f"tokens_extending takes bytes, got the str {prefix!r:.80}: use "
                f"{prefix.encode()!r:.80}"
            )
        if not isinstance(prefix, bytes | bytearray):
            raise TypeError(
                f"tokens_extending takes bytes, got {type(prefix).__name__} {prefix!r:.80}"
            )
        return self.vocab.tokens_extending(bytes(prefix))

    def check_tokens(self, tokens: Iterable[int]) -> list[int]:
        """The tokens as a list, each checked to be a valid id (see :class:`Vocab`)."""
        return self.vocab.check_tokens(tokens)

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value (e.g. ``"general.name"``), or None when absent.

        Raises:
            TypeError: ``key`` is not a str.
            ValueError: it holds a NUL character (llama.cpp would read the key only up to it).
        """
        if not isinstance(key, str):
            raise TypeError(
                f"metadata takes a key as a str (e.g. 'general.name'), got {type(key).__name__} "
                f"{key!r:.80}"
            )
        if "\0" in key:
            raise ValueError(f"a metadata key holds no NUL character, got {key!r:.80}")
        if not key.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in key):
            raise ValueError(f"a metadata key holds no lone surrogate, got {key!r:.80}")
        return self._handle.meta(key)

    # chat ------------------------------------------------------------------------------
    # Every chat entry point takes the tool options as keywords (see :meth:`chat`) and makes
    # them into one ToolPlan at once. ``tools`` items are typed ``ToolLike | Any``: mypy types
    # a list of two different functions as list[builtins.function], which is no Callable to it.
    def format_chat(
        self,
        messages: Seq[Message],
        *,
        tools: Seq[ToolLike | Any] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render messages with the GGUF's own chat template: the prompt :meth:`chat` gives
        the model (with ``tools``, the functions told in the system message; see
        :meth:`chat`).

        Raises:
            ValueError: the model has no chat template, the template rejects the messages, or
                a tool option is refused (see :meth:`chat`).
            TypeError: a message or tool option of the wrong type.
        """
        check_bool("add_generation_prompt", add_generation_prompt)
        plan = make_tool_plan(tools, tool_choice, parallel_tool_calls)
        return self._render_chat(messages, plan, add_generation_prompt)

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a chat template (an empty one counts as none)."""
        return bool(self._handle.chat_template())

    def _render_chat(
        self, messages: Seq[Message], plan: ToolPlan | None, add_generation_prompt: bool = True
    ) -> str:
        return self._render_written(self._written(messages, plan), add_generation_prompt)

    def _written(self, messages: Seq[Message], plan: ToolPlan | None) -> list[dict[str, Any]]:
        """The messages as the template gets them: checked, tools and calls written as text."""
        checked = check_messages(messages)
        return plan.messages(checked) if plan else prompt_messages(checked)

    def _render_written(self, written: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        template = self._handle.chat_template()
        if not template:
            raise ValueError(f"{self.path.name} has no chat template; use generate() instead")
        # (a piece that is not UTF-8, a byte token: as the text decoding would give it)
        bos = self.vocab.special_piece(self.bos).decode(errors="replace") if self.bos >= 0 else ""
        eos = self.vocab.special_piece(self.eos).decode(errors="replace") if self.eos >= 0 else ""
        try:
            return render_chat_template(template, written, bos, eos, add_generation_prompt)
        except Exception as exc:  # jinja2's errors: the template fails on these messages
            raise ValueError(
                f"the chat template of {self.path.name} failed on these messages: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def chat_tokens(
        self,
        messages: Seq[Message],
        *,
        tools: Seq[ToolLike | Any] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
    ) -> list[int]:
        """The prompt tokens for ``messages``, ending where the assistant's reply starts (see
        :meth:`format_chat`)."""
        plan = make_tool_plan(tools, tool_choice, parallel_tool_calls)
        return self._chat_prompt(messages, plan)

    def _chat_prompt(self, messages: Seq[Message], plan: ToolPlan | None) -> list[int]:
        """The rendered chat's tokens: the template's own control-token text (``<|im_end|>``)
        as those tokens, the same text anywhere in the messages (a content, a role, a call's
        arguments) as plain text (a message could otherwise write a turn of another role, as
        OpenAI's API never lets it)."""
        written = self._written(messages, plan)
        texts = list(_strings(written))
        found = [c for c in self.vocab.control_texts if any(c in text for text in texts)]
        if not found:
            return self.tokenize(self._render_written(written, True), special=True)
        # Each control text is replaced by a mark: two characters that no message holds
        # around its index; the rendered text is split at the marks.
        used = set().union(*map(set, texts))
        open_, close = itertools.islice((c for c in map(chr, _PRIVATE_USE) if c not in used), 2)
        pattern = re.compile("|".join(map(re.escape, found)))
        index = {c: f"{open_}{i}{close}" for i, c in enumerate(found)}
        masked = _map_strings(written, lambda text: pattern.sub(lambda m: index[m[0]], text))
        rendered = self._render_written(masked, True)
        parts = re.split(f"{open_}([0-9]+){close}", rendered)
        if len(parts) == 1:  # the template wrote the content otherwise (escaped): as it is
            return self.tokenize(self._render_written(written, True), special=True)
        tokens = self.tokenize(parts[0], special=True)
        for i, part in enumerate(parts[1:]):
            text, special = (found[int(part)], False) if i % 2 == 0 else (part, True)
            tokens += self.tokenize(text, add_bos=False, special=special)
        return tokens

    def chat(
        self,
        messages: Seq[Message],
        *,
        schema: SchemaLike | None = None,
        tools: Seq[ToolLike | Any] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        **options: Unpack[GenerateOptions],
    ) -> Any:
        """The assistant's reply to ``messages``: its text, or with ``schema`` the parsed
        value, or with ``tools`` the functions it calls.

        Args:
            messages: OpenAI's chat messages: ``{"role", "content"}``; an assistant message
                may carry ``tool_calls`` (:class:`~lcgen.ToolCall` s or OpenAI's dicts) and
                content None, a ``"tool"`` message gives a call's result by its
                ``tool_call_id``.
            schema: constrain the reply to JSON valid for this JSON Schema / pydantic model
                and return it parsed.
            tools: functions the reply may call: Python functions, pydantic model classes,
                OpenAI tool dicts or :class:`~lcgen.Tool` s (see :meth:`lcgen.Tool.of`).
            tool_choice: ``"auto"`` (calls or text), ``"required"`` (calls), ``"none"``
                (text; the tools are not told), or a function's name (calls of it; also as
                ``{"type": "function", "function": {"name": ...}}``).
            parallel_tool_calls: a reply may call several functions at once.
            **options: see :meth:`generate`.

        Returns:
            The reply as :class:`~lcgen.Text`; with tools, a reply that calls functions is
            ``""`` with the calls in its ``tool_calls`` (each an :class:`~lcgen.ToolCall`
            whose arguments are valid for its function's parameters; :meth:`lcgen.Tool.invoke`
            runs one) and ``finish_reason`` ``"tool_calls"``. With ``schema``, the parsed
            value.

        Raises:
            ValueError: ``schema``, ``grammar``, ``choice`` or ``regex`` with tools (the
                tools constrain the reply), two tools of one name, a bad name, or a
                tool_choice that names no tool.
            TypeError: a tool that is not one (named).
            IncompleteOutputError: a constrained reply (calls, too) stopped before it was
                complete (raise ``max_tokens``).
            GrammarError: a tool's parameters are not a JSON Schema lcgen supports.
            (and see :meth:`generate`)
        """
        plan = make_tool_plan(tools, tool_choice, parallel_tool_calls)
        prompt = self._chat_start(messages, plan, schema, options)
        with Sequence(self, prompt) as seq:
            if plan is None:
                return seq.generate(schema=schema, **options)
            return plan.reply(seq.generate(**options))

    def chat_stream(
        self,
        messages: Seq[Message],
        *,
        tools: Seq[ToolLike | Any] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[Chunk]:
        """Stream the assistant's reply to ``messages`` chunk by chunk (see :meth:`chat`).

        With ``tools``, a reply that is text streams as it comes; a reply that calls functions
        streams no text (its JSON is not prose): its chunks have ``text`` ``""`` (their tokens
        and log-probabilities kept) and the last carries the calls in ``tool_calls`` with
        ``finish_reason`` ``"tool_calls"``. Joined with :meth:`lcgen.Text.of`, the chunks are
        the reply :meth:`chat` returns.

        Yields:
            One :class:`~lcgen.Chunk` per generated token; the last has ``finish_reason``
            set (and a reply's calls in ``tool_calls``).

        Raises:
            IncompleteOutputError: the reply's calls were cut short (raise ``max_tokens``).
            (and see :meth:`chat` for the tool options, :meth:`stream` for the rest)
        """
        plan = make_tool_plan(tools, tool_choice, parallel_tool_calls)
        prompt = self._chat_start(messages, plan, None, options)
        with Sequence(self, prompt) as seq:
            chunks = seq.stream(**options)
            yield from chunks if plan is None else plan.stream(chunks)

    def _chat_start(
        self,
        messages: Seq[Message],
        plan: ToolPlan | None,
        schema: SchemaLike | None,
        options: GenerateOptions,
    ) -> list[int]:
        """The prompt of a chat reply; with tools, ``options`` checked to give no other
        constraint and given the tools' grammar."""
        check_options(plan, schema, options)
        if plan is not None:
            options["grammar"] = plan.grammar(options.get("json_whitespace", "flexible"))
        return self._chat_prompt(messages, plan)

    # generation ------------------------------------------------------------------------
    def sequence(
        self, prompt: str | Seq[int] = "", *, special: bool = False, seed: int | None = None
    ) -> Sequence:
        """A live sequence holding ``prompt`` (text, or token ids); it owns one KV slot.

        Args:
            prompt: the prompt text, or token ids.
            special: parse special-token text in ``prompt`` (e.g. ``<|im_start|>``).
            seed: seeds the sequence's sampler RNG (checkpoints and rewinds restore it).

        Raises:
            SlotsExhaustedError: all ``n_seq_max`` slots are held by live sequences.
            TypeError: the prompt is neither text nor token ids.
            ValueError: a token id is outside the vocabulary, or ``seed`` is not an int >= 0.
        """
        check_seed(seed)  # before a slot is taken
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt, special=special) if prompt else []
        elif isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Seq | np.ndarray):
            raise TypeError(f"a prompt is a str or a list of token ids, got {shown(prompt)}")
        else:
            tokens = self.vocab.check_tokens(prompt)  # type: ignore[arg-type]
        return Sequence(self, tokens, seed=seed)

    def stream(
        self,
        prompt: str,
        *,
        schema: SchemaLike | None = None,
        suffix: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[Chunk]:
        """Generate from ``prompt``, yielding a :class:`Chunk` per token.

        Args:
            prompt: the prompt text.
            suffix: fill in the middle: generate the text between ``prompt`` and ``suffix``
                (a model with fill-in-the-middle tokens; see :meth:`infill_tokens`).
            schema: constrain the output to JSON valid for this JSON Schema / pydantic model.
            **options: max_tokens (256; None: to the context's end), stop, include_stop,
                stop_tokens, sampler, temperature (0: greedy), top_k, top_p, min_p, repeat_penalty,
                frequency_penalty, presence_penalty, repeat_last_n, seed,
                logit_bias, logprobs, token_healing, grammar, choice, regex; see
                :class:`lcgen.Generator`.

        Raises:
            ContextFullError: the prompt plus ``max_tokens`` does not fit the context.
            SlotsExhaustedError: every sequence slot is in use.
            GrammarError: the constraint cannot be built or enforced.
        """
        if isinstance(prompt, list | tuple) and any(isinstance(p, str) for p in prompt):
            raise TypeError(
                f"stream takes one prompt, got {shown(prompt)}: generate() takes a list of "
                "prompts (a batch), or stream each"
            )
        with self.sequence(self._prompt(prompt, suffix)) as seq:
            yield from seq.stream(schema=schema, **options)

    @overload
    def generate(
        self,
        prompt: str,
        *,
        schema: type[_M],
        suffix: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> _M: ...
    @overload
    def generate(
        self,
        prompt: str,
        *,
        schema: Mapping[str, Any],
        suffix: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Any: ...
    @overload
    def generate(
        self, prompt: str, *, suffix: str | None = None, **options: Unpack[GenerateOptions]
    ) -> Text: ...
    @overload
    def generate(
        self, prompt: list[str], *, suffix: str | None = None, **options: Unpack[GenerateOptions]
    ) -> list[Any]: ...
    def generate(
        self,
        prompt: str | list[str],
        *,
        schema: SchemaLike | None = None,
        suffix: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Any:
        """Generate text; a list of prompts is decoded together, one batch per step.

        Args:
            prompt: a prompt, or a list of prompts (queued when there are more than free slots).
            schema: a JSON Schema dict or a pydantic model class: the output is constrained to
                it and returned parsed (a dict, or a validated instance).
            suffix: fill in the middle: generate the text between each prompt and ``suffix``
                (a model with fill-in-the-middle tokens; see :meth:`infill_tokens`).
            **options: see :meth:`stream`.

        Returns:
            The generated text, or the parsed value with ``schema`` (a list for a list of
            prompts).

        Raises:
            IncompleteOutputError: with a constraint (schema, grammar, choice, regex),
                generation stopped before the output matched it (raise ``max_tokens``); the
                partial text is on the exception.
            SchemaValidationError: with a pydantic ``schema``, the output matched its JSON
                Schema but the model's own validation refused it.
            ValueError: ``logprobs`` with ``schema`` (the parsed value has no place for them).
        """
        if isinstance(prompt, str):
            with self.sequence(self._prompt(prompt, suffix)) as seq:
                return seq.generate(schema=schema, **options)
        if not isinstance(prompt, list | tuple) or not all(isinstance(p, str) for p in prompt):
            ids = isinstance(prompt, list | tuple) and all(isinstance(p, int) for p in prompt)
            hint = " (token ids: model.sequence(tokens).generate(...))" if ids else ""
            raise TypeError(f"a prompt is a str or a list of str, got {shown(prompt)}{hint}")
        plan = make_plan(schema=schema, **options)
        check_parsed(schema, plan.logprobs)
        tokens = [
            self.tokenize(p) if suffix is None else self.infill_tokens(p, suffix) for p in prompt
        ]
        self._check_batch(prompt, tokens, plan, infill=suffix is not None)
        texts, healed = self._generate_batch(tokens, plan)
        for text, heal in zip(texts, healed, strict=True):
            plan.check_complete(text, self.vocab, heal)
        if schema is None:
            return texts
        return [parse_structured(t, schema, h) for t, h in zip(texts, healed, strict=True)]

    def prompt_logprobs(self, prompt: str | Seq[int], *, top: int = 0) -> list[TokenLogprob]:
        """The log-probability of each token of ``prompt`` given the tokens before it (the
        first token has none: the list starts at the second; with a BOS token, at the first of
        the text). For scoring, ranking continuations, perplexity.

        Args:
            prompt: text (tokenized as :meth:`generate` would) or token ids.
            top: also give the ``top`` most likely tokens at each position.

        Returns:
            One :class:`TokenLogprob` per token after the first; their texts join to the text
            after the characters the first token completes (a character it only begins is
            the text of the token that ends it).

        Raises:
            ValueError: the prompt is empty, or ``top`` or a token id is out of range.
            ContextFullError: the prompt is longer than the context.
        """
        top = _check_int("top", top, 0, self.n_vocab)
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else self.check_tokens(prompt)
        if not tokens:
            raise ValueError("the prompt is empty: there is nothing to score")
        if len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"the prompt has {len(tokens)} tokens; this model's context is {self.n_ctx}: "
                "score a shorter one, or load the model with a larger n_ctx"
            )
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text.decode(self.vocab.piece(tokens[0]))  # (a character it begins, a later one ends)
        out: list[TokenLogprob] = []
        with Sequence(self, tokens[:1]) as seq:
            # The logits after the last token scored: after the first, where the store kept them.
            kept = seq.kept_logits()
            before = None if kept is None else kept.copy()
            for start in range(1, len(tokens), _SCORE_CHUNK):
                chunk = tokens[start : start + _SCORE_CHUNK]
                seq.draft(chunk)
                rows = decode([seq])[0]
                # The rows follow the pending token (the first chunk: the first token) and
                # each draft token: with none pending, the one before the chunk came last time.
                rows = rows if before is None else np.vstack([before[None], rows])
                for i, token in enumerate(chunk):
                    fields = logprobs_of(rows[i], token, top, self.vocab)
                    piece = text.decode(self.vocab.piece(token))
                    out.append(
                        TokenLogprob(token, piece, fields["logprob"], fields["top_logprobs"])
                    )
                    seq.append_tokens([token])
                    confirmed = seq.confirm_draft()
                    assert confirmed, "a draft token was not kept"
                before = rows[len(chunk)].copy()
        return out

    def _check_batch(
        self, texts: Seq[str], prompts: list[list[int]], plan: Plan, *, infill: bool
    ) -> None:
        """Refuse a batch with a prompt no generation can start from before any is decoded
        (the others' work was lost, and the error named no prompt). An empty text is refused
        as ``generate("")`` refuses it, whether or not the model adds a BOS token."""
        room = 1 if plan.max_tokens is None else plan.max_tokens
        for i, (text, tokens) in enumerate(zip(texts, prompts, strict=True)):
            if not tokens or (not text and not infill):
                raise ValueError(f"prompt {i} of the batch is empty: nothing to generate from")
            if len(tokens) + room > self.n_ctx:
                raise ContextFullError(
                    f"prompt {i} of the batch has {len(tokens)} tokens; with max_tokens="
                    f"{plan.max_tokens} it exceeds the context of {self.n_ctx} tokens: shorten "
                    "it, lower max_tokens or load the model with a larger n_ctx"
                )

    def _generate_batch(self, prompts: list[list[int]], plan: Plan) -> tuple[list[Text], list[str]]:
        """Every prompt through the scheduler: as many at once as slots allow, the rest queued,
        each slot given back as soon as its generation ends. Returns the texts, and the prompt
        text token healing had each re-create (see :func:`parse_structured`)."""
        chunks: list[list[Chunk]] = [[] for _ in prompts]
        healed = [""] * len(prompts)
        opened: list[Sequence] = []

        def start(i: int, tokens: list[int]) -> Run:
            seq = Sequence(self, tokens)
            opened.append(seq)
            run = seq.run_plan(plan)
            healed[i] = run.generator.healed
            return run

        scheduler = Scheduler(self.cache)
        for i, tokens in enumerate(prompts):
            scheduler.submit(functools.partial(start, i, tokens))
        try:
            self._share_prefixes(prompts, opened)
            for event in scheduler:
                if event.chunk is not None:
                    chunks[event.ticket].append(event.chunk)
                if event.is_last:
                    for seq in event.run.sequences():
                        seq.close()
        finally:
            for seq in opened:
                seq.close()
        return [Text.of(parts, plan.logprobs is not None) for parts in chunks], healed

    def _share_prefixes(self, prompts: list[list[int]], opened: list[Sequence]) -> None:
        """Decode the prefixes two or more of ``prompts`` share, once, each in a live sequence
        appended to ``opened``: every prompt then starts from their cells (shared, not copied)
        instead of decoding them again (8 copies of one 500-token prompt: 500 prompt tokens
        decoded and the cells of one, not 4,000). At most half the free slots go to them, the
        longest prefixes first; where none is free, or a prefix finds no room, the prompts
        decode it themselves."""
        for prefix in shared_prefixes(prompts, _MIN_SHARED)[: self.cache.available_slots() // 2]:
            with self.cache.uncounted():
                seq = Sequence(self, prefix)
            opened.append(seq)
            try:
                seq.prefill()
            except ContextFullError:
                seq.close()
                return

    # lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the context, then the weights. Idempotent; live sequences become unusable."""
        with self.context.lock:  # no decode is running; a later one raises ClosedError
            self.context.start_closing()
            self.cache.wake()  # threads waiting for a slot (in a step too) raise ClosedError
            self.context.close()
            self._handle.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Planes 15 and 16: private use; the chat's marks are taken from them (see Model._chat_prompt).
_PRIVATE_USE = range(0xF0000, 0x10FFFE)


def _strings(value: object) -> Iterator[str]:
    """Every string inside ``value`` (dicts' values, lists, tuples)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """``value`` with ``change`` applied to every string inside it (dict values, lists)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(item, change) for item in value]
    return value
