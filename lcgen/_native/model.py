"""An owned ``llama_model`` and the calls on its vocabulary."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import llama_cpp as C

from lcgen._native.cpu import extra_buffers_usable
from lcgen._native.gguf import check_hyperparameters
from lcgen._native.log import (
    PROGRESS_CALLBACK,
    init,
    log_errors_since,
    log_mark,
    set_verbose,
    take_interrupt,
)
from lcgen.errors import ClosedError, ModelLoadError

_GGUF_MAGIC = b"GGUF"
# Token attributes whose text is printed only when special tokens are shown.
SPECIAL_ATTRS = int(C.LLAMA_TOKEN_ATTR_UNKNOWN) | int(C.LLAMA_TOKEN_ATTR_CONTROL)


def _check_gguf_file(path: str) -> None:
    if os.path.isdir(path):
        raise ModelLoadError(f"{path!r} is a folder, not a model file: give a .gguf file's path")
    if not os.path.exists(path):
        raise ModelLoadError(f"model file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path!r} is not a regular file (a device or a pipe): not a model")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(
            f"{path!r} is not a GGUF file (starts with {magic!r}, expected {_GGUF_MAGIC!r}; "
            f"{size} bytes)"
        )


def _read_str(call: Callable[[ctypes.Array[ctypes.c_char], int], int]) -> str | None:
    """Call a C function that fills a char buffer, growing the buffer until the text fits."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = int(call(buf, size))
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", "replace")
        size = n + 1


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _int_or(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _locked(
    method: Callable[Concatenate[ModelHandle, _P], _R],
) -> Callable[Concatenate[ModelHandle, _P], _R]:
    """Run a method holding the handle's lock: :meth:`ModelHandle.close` cannot free the model
    while it calls into it (from another thread)."""

    def held(handle: ModelHandle, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with handle.lock:
            return method(handle, *args, **kwargs)

    held.__doc__, held.__name__ = method.__doc__, method.__name__
    return held


class Closeable(Protocol):
    def close(self) -> None: ...


class ModelHandle:
    """An owned ``llama_model`` pointer and its vocabulary.

    Every call checks that the model is still open, holding the handle's lock: the vocabulary
    pointer dies with the model, and using it afterwards would crash the process.
    """

    _free = C.llama_model_free  # held here: still callable while the interpreter exits

    def __init__(
        self, path: str, n_gpu_layers: int, use_mmap: bool = True, verbose: bool = False
    ) -> None:
        init()
        self.lock = threading.RLock()
        self.ptr: ctypes.c_void_p | None = None
        # The contexts made on it, freed before it (by whichever of them is collected first).
        self.contexts: list[Closeable] = []
        # llama.cpp's log goes to stderr while a model loaded verbose is open.
        self._verbose = verbose
        if verbose:
            set_verbose(True)
        _check_gguf_file(path)
        check_hyperparameters(path)
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_mmap = use_mmap
        params.use_extra_bufts = self.extra_cpu_buffers = extra_buffers_usable(path)
        params.progress_callback = PROGRESS_CALLBACK  # (it stops the load after Ctrl-C)
        mark = log_mark()
        take_interrupt()  # (one from before: not this load's)
        ptr = C.llama_model_load_from_file(os.fsencode(path), params)
        if take_interrupt():
            if ptr:
                C.llama_model_free(ptr)
            raise KeyboardInterrupt
        if not ptr:
            reason = log_errors_since(mark) or "no reason logged"
            raise ModelLoadError(f"llama.cpp could not load {path!r}: {reason}")
        self.ptr = ptr
        self._vocab = C.llama_model_get_vocab(ptr)
        if C.llama_vocab_type(self._vocab) == C.LLAMA_VOCAB_TYPE_NONE:
            C.llama_model_free(ptr)  # (tokenizing would abort the process)
            self.ptr = None
            raise ModelLoadError(f"{path!r} has no tokenizer (tokenizer.ggml.model = no_vocab)")
        self.name = os.path.basename(path)
        self.n_vocab = int(C.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(C.llama_model_n_ctx_train(ptr))
        self.n_layer = int(C.llama_model_n_layer(ptr))
        self.n_swa = int(C.llama_model_n_swa(ptr))
        self.is_recurrent = bool(C.llama_model_is_recurrent(ptr) or C.llama_model_is_hybrid(ptr))
        self.n_params = int(C.llama_model_n_params(ptr))
        self.size_bytes = int(C.llama_model_size(ptr))
        self.devices = gpu_devices()
        self.n_offloadable, self.n_offloaded = _offloaded_layers(
            n_gpu_layers, self.n_layer + int(C.llama_model_n_layer_nextn(ptr)), self.devices
        )

    @property
    def is_open(self) -> bool:
        return self.ptr is not None

    def live(self) -> ctypes.c_void_p:
        """The model pointer.

        Raises:
            ClosedError: the model was closed.
        """
        if self.ptr is None:
            raise ClosedError(f"the model {self.name} is closed; load it again with lcgen.load()")
        return self.ptr

    def vocab(self) -> ctypes.c_void_p:
        """The vocabulary pointer (checked like :meth:`live`)."""
        self.live()
        return self._vocab  # type: ignore[no-any-return]

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None or getattr(self, "_verbose", False):
            self.close()  # (not where __init__ raised early)

    @_locked
    def close(self) -> None:
        """Free the contexts made on the model, then the model (idempotent)."""
        for context in list(self.contexts):
            context.close()
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._free(ptr)
        if self._verbose:
            self._verbose = False
            set_verbose(False)

    @_locked
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when the key is absent."""
        ptr = self.live()
        return _read_str(lambda buf, n: C.llama_model_meta_val_str(ptr, key.encode(), buf, n))

    def kv_elements_per_cell(self) -> tuple[int, int]:
        """The K and the V elements one KV cell holds over every layer (0 for a recurrent
        model, whose state is not per cell)."""
        if self.is_recurrent:
            return 0, 0
        ptr = self.live()
        arch = self.meta("general.architecture") or ""
        n_head = max(int(C.llama_model_n_head(ptr)), 1)
        head = int(C.llama_model_n_embd(ptr)) // n_head
        k = _int_or(self.meta(f"{arch}.attention.key_length"), head)
        v = _int_or(self.meta(f"{arch}.attention.value_length"), head)
        n = self.n_layer * int(C.llama_model_n_head_kv(ptr))
        return n * k, n * v

    @_locked
    def fingerprint(self) -> str:
        """A sha256 over the GGUF metadata, sizes and parameter count: tells models apart."""
        ptr = self.live()
        digest = hashlib.sha256()
        for i in range(int(C.llama_model_meta_count(ptr))):
            key = _read_str(functools.partial(C.llama_model_meta_key_by_index, ptr, i))
            val = _read_str(functools.partial(C.llama_model_meta_val_str_by_index, ptr, i))
            digest.update(f"{key}={val}\n".encode())
        sizes = (self.n_vocab, C.llama_model_n_params(ptr), C.llama_model_size(ptr))
        digest.update(repr(sizes).encode())
        return digest.hexdigest()

    @_locked
    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        C.llama_model_desc(self.live(), buf, 256)
        return buf.value.decode("utf-8", "replace")

    @_locked
    def chat_template(self) -> str | None:
        tmpl = C.llama_model_chat_template(self.live(), None)
        return tmpl.decode("utf-8", "replace") if tmpl else None

    # vocabulary -------------------------------------------------------------------------
    @_locked
    def special_tokens(self) -> tuple[int, int, int, bool]:
        """(bos, eos, eot, add_bos); a missing token is -1."""
        v = self.vocab()
        return (
            int(C.llama_vocab_bos(v)),
            int(C.llama_vocab_eos(v)),
            int(C.llama_vocab_eot(v)),
            bool(C.llama_vocab_get_add_bos(v)),
        )

    @_locked
    def fim_tokens(self) -> tuple[int, int, int]:
        """(prefix, suffix, middle) fill-in-the-middle markers; a missing one is -1."""
        v = self.vocab()
        return (
            int(C.llama_vocab_fim_pre(v)),
            int(C.llama_vocab_fim_suf(v)),
            int(C.llama_vocab_fim_mid(v)),
        )

    @_locked
    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab(), token))

    @_locked
    def token_attr(self, token: int) -> int:
        return int(C.llama_vocab_get_attr(self.vocab(), token))

    @_locked
    def tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        vocab = self.vocab()
        n_max = len(data) + 8
        while True:
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
            if n == -(2**31):
                raise ValueError(f"text of {len(data)} bytes is too long to tokenize")
            if n >= 0:
                return list(buf[:n])
            n_max = -n

    @_locked
    def token_to_piece(self, token: int) -> bytes:
        """The token's bytes, special tokens shown (hide them by their attributes)."""
        vocab = self.vocab()
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = C.llama_token_to_piece(vocab, token, buf, size, 0, True)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    @_locked
    def all_pieces(self) -> list[bytes]:
        """Every token's piece (as :meth:`token_to_piece`), fetched in one pass."""
        vocab = self.vocab()
        buf = ctypes.create_string_buffer(256)
        pieces = []
        for token in range(self.n_vocab):
            n = int(C.llama_token_to_piece(vocab, token, buf, 256, 0, True))
            pieces.append(buf.raw[:n] if n >= 0 else self.token_to_piece(token))
        return pieces

    @_locked
    def all_attrs(self) -> list[int]:
        vocab = self.vocab()
        return [int(C.llama_vocab_get_attr(vocab, token)) for token in range(self.n_vocab)]

    @_locked
    def detokenize(self, tokens: Sequence[int], special: bool) -> bytes:
        vocab = self.vocab()
        arr = (C.llama_token * len(tokens))(*tokens)
        size = max(16, 8 * len(tokens))
        while True:
            buf = ctypes.create_string_buffer(size)
            n = C.llama_detokenize(vocab, arr, len(tokens), buf, size, False, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n


# ggml's device types (ggml-backend.h) that llama.cpp offloads layers to.
_DEVICE_GPU, _DEVICE_IGPU = 1, 2


def tokenize_address() -> int:
    """The address of llama.cpp's ``llama_tokenize`` (llguidance tokenizes through it)."""
    address = ctypes.cast(C.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    assert address is not None
    return address


@functools.cache
def gpu_devices() -> tuple[tuple[str, str], ...]:
    """The GPU devices llama.cpp would offload layers to, as ``(backend, description)`` pairs
    such as ``("CUDA", "NVIDIA H100 80GB HBM3")`` or ``("Metal", "Apple M2")``; empty on a
    CPU-only build. Dedicated GPUs are used when there are any, else integrated ones."""
    init()
    try:
        by_type = _devices_by_type()
    except (ImportError, AttributeError, OSError):  # a build without ggml's device registry
        return (("GPU", "unknown device"),) if C.llama_supports_gpu_offload() else ()
    return tuple(by_type.get(_DEVICE_GPU) or by_type.get(_DEVICE_IGPU) or ())


def _devices_by_type() -> dict[int, list[tuple[str, str]]]:
    """ggml's registered devices, grouped by device type."""
    from llama_cpp._ggml import libggml as G

    G.ggml_backend_dev_count.restype = ctypes.c_size_t
    G.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    G.ggml_backend_dev_get.restype = ctypes.c_void_p
    for name in ("ggml_backend_dev_type", "ggml_backend_dev_description"):
        getattr(G, name).argtypes = [ctypes.c_void_p]
    G.ggml_backend_dev_type.restype = ctypes.c_int
    G.ggml_backend_dev_description.restype = ctypes.c_char_p
    G.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    G.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    G.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    G.ggml_backend_reg_name.restype = ctypes.c_char_p
    found: dict[int, list[tuple[str, str]]] = {}
    for i in range(int(G.ggml_backend_dev_count())):
        dev = G.ggml_backend_dev_get(i)
        backend = G.ggml_backend_reg_name(G.ggml_backend_dev_backend_reg(dev)) or b"?"
        description = G.ggml_backend_dev_description(dev) or b""
        found.setdefault(int(G.ggml_backend_dev_type(dev)), []).append(
            (backend.decode("utf-8", "replace"), description.decode("utf-8", "replace"))
        )
    return found


def _offloaded_layers(
    n_gpu_layers: int, n_layers: int, devices: tuple[tuple[str, str], ...]
) -> tuple[int, int]:
    """``(offloadable, offloaded)`` layers as llama.cpp counts them when it loads a model: the
    repeating layers plus the output layer; a negative request means all of them."""
    n_total = n_layers + 1
    if not devices:
        return n_total, 0
    return n_total, min(n_total if n_gpu_layers < 0 else n_gpu_layers, n_total)


# A chat template comes with the model file, which may come from anyone: its rendering is
# bounded in time and in what one operation may build ('x' * 10**10), never a hang.
MAX_TEMPLATE_SECONDS = 10.0
MAX_TEMPLATE_ITEMS = 1 << 24  # characters of a text, or items of a list, made by * or **


class ChatTemplateError(ValueError):
    """A chat template went beyond the bounds of a rendering."""


def render_chat_template(
    template: str, messages: list[dict[str, str]], bos: str, eos: str, add_generation_prompt: bool
) -> str:
    """Render a GGUF's Jinja chat template (llama-cpp-python's sandboxed renderer), within
    :data:`MAX_TEMPLATE_SECONDS` and :data:`MAX_TEMPLATE_ITEMS`.

    Raises:
        ChatTemplateError: the template ran past those bounds.
    """
    formatter = _chat_formatter(template, bos, eos, add_generation_prompt)
    return str(_within_time(lambda: formatter(messages=messages).prompt))


@functools.lru_cache(maxsize=16)
def _chat_formatter(template: str, bos: str, eos: str, add_generation_prompt: bool) -> Any:
    """The renderer of a template, compiled once (compiling took ~2.7 ms a chat call): as
    llama-cpp-python's, in an environment that bounds ``*`` and ``**`` (compiled so from the
    start: compiling folds constant expressions, ``'x' * 10**10`` among them)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    class Formatter(Jinja2ChatFormatter):
        def __init__(self) -> None:  # Jinja2ChatFormatter's, in the bounded environment
            self.template, self.eos_token, self.bos_token = template, eos, bos
            self.add_generation_prompt, self.stop_token_ids = add_generation_prompt, None
            env = Bounded(
                loader=jinja2.BaseLoader(),
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = self.tojson
            self._environment = env.from_string(template)

    return Formatter()


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for items, n in ((left, right), (right, left)):
            sized = isinstance(items, str | list | tuple) and isinstance(n, int)
            if sized and len(items) * n > MAX_TEMPLATE_ITEMS:
                raise ChatTemplateError(
                    f"the chat template makes {len(items) * n:,} items with * (at most "
                    f"{MAX_TEMPLATE_ITEMS:,})"
                )
    if operator == "**" and isinstance(left, int | float) and isinstance(right, int | float):
        bits = max(abs(int(left)).bit_length(), 1) * abs(right)
        if bits > MAX_TEMPLATE_ITEMS:
            raise ChatTemplateError(f"the chat template raises {left} to the power {right}")


def _within_time(render: Callable[[], Any]) -> Any:
    """``render()``, stopped with :class:`ChatTemplateError` once it has run the template's
    code for :data:`MAX_TEMPLATE_SECONDS` (a trace of this thread counts the template's lines;
    the thread's trace function before is put back)."""
    deadline = time.monotonic() + MAX_TEMPLATE_SECONDS
    lines = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += 1
        if lines % 4096 == 0 and time.monotonic() > deadline:
            raise ChatTemplateError(
                f"the chat template did not finish within {MAX_TEMPLATE_SECONDS:g} s"
            )
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        return render()
    finally:
        sys.settrace(before)
