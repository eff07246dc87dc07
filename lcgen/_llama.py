"""The one module that talks to llama.cpp.

Every ``llama_*`` call goes through here: return codes are checked, buffers grow and retry,
llama.cpp's log is captured (and shown only when verbose), and failures become lcgen errors.
Nothing above this module sees ctypes; nothing here knows lcgen's higher-level types.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence

import llama_cpp as C
import numpy as np

from lcgen.errors import ContextFullError, DecodeError, ModelLoadError, StateFileError

_LOG_LEVEL_ERROR = 4
_LOG_LEVEL_CONT = 5
_GGUF_MAGIC = b"GGUF"

_log_tail: deque[tuple[int, str]] = deque(maxlen=200)
_log_count = 0
_verbose = False
_init_lock = threading.Lock()
_initialized = False


@C.llama_log_callback  # type: ignore[untyped-decorator]
def _on_log(level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
    global _log_count
    msg = (text or b"").decode("utf-8", "replace")
    if level == _LOG_LEVEL_CONT and _log_tail:
        prev_level, prev = _log_tail.pop()
        _log_tail.append((prev_level, prev + msg))
    else:
        _log_tail.append((level, msg))
        _log_count += 1
    if _verbose:
        sys.stderr.write(msg)


# The callback object must outlive every call into llama.cpp (a collected callback segfaults):
# it is referenced here, at module level, for the life of the process.
_LOG_CALLBACK = _on_log


def init(verbose: bool = False) -> None:
    """Initialize the backend once per process and route llama.cpp's log through lcgen."""
    global _initialized, _verbose
    _verbose = _verbose or verbose
    with _init_lock:
        if _initialized:
            return
        C.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        C.llama_backend_init()
        _initialized = True


def log_mark() -> int:
    """A position in the log; pass it to :func:`log_errors_since`."""
    return _log_count


def log_errors_since(mark: int) -> str:
    """The error (and, failing that, warning) lines llama.cpp logged since ``mark``."""
    n_new = min(_log_count - mark, len(_log_tail))
    recent = list(_log_tail)[len(_log_tail) - n_new :] if n_new > 0 else []
    errors = [m.strip() for level, m in recent if level >= _LOG_LEVEL_ERROR - 1 and m.strip()]
    return "; ".join(errors[-4:])


def supports_gpu_offload() -> bool:
    return bool(C.llama_supports_gpu_offload())


def system_info() -> str:
    return bytes(C.llama_print_system_info()).decode("utf-8", "replace").strip()


def _check_gguf_file(path: str) -> None:
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file {path!r} does not exist")
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


class ModelHandle:
    """An owned ``llama_model`` pointer and its vocabulary."""

    def __init__(self, path: str, n_gpu_layers: int, use_mmap: bool = True) -> None:
        init()
        _check_gguf_file(path)
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_mmap = use_mmap
        mark = log_mark()
        ptr = C.llama_model_load_from_file(path.encode(), params)
        if not ptr:
            reason = log_errors_since(mark) or "no reason logged"
            raise ModelLoadError(f"llama.cpp could not load {path!r}: {reason}")
        self.ptr = ptr
        self.vocab = C.llama_model_get_vocab(ptr)
        self.n_vocab = int(C.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(C.llama_model_n_ctx_train(ptr))
        self.n_layer = int(C.llama_model_n_layer(ptr))
        self.n_swa = int(C.llama_model_n_swa(ptr))
        self.is_recurrent = bool(C.llama_model_is_recurrent(ptr) or C.llama_model_is_hybrid(ptr))

    def close(self) -> None:
        if self.ptr:
            C.llama_model_free(self.ptr)
            self.ptr = None

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when the key is absent."""
        return _read_str(lambda buf, n: C.llama_model_meta_val_str(self.ptr, key.encode(), buf, n))

    def fingerprint(self) -> str:
        """A sha256 over the GGUF metadata, sizes and parameter count: tells models apart."""
        digest = hashlib.sha256()
        for i in range(int(C.llama_model_meta_count(self.ptr))):
            key = _read_str(functools.partial(C.llama_model_meta_key_by_index, self.ptr, i))
            val = _read_str(functools.partial(C.llama_model_meta_val_str_by_index, self.ptr, i))
            digest.update(f"{key}={val}\n".encode())
        sizes = (self.n_vocab, C.llama_model_n_params(self.ptr), C.llama_model_size(self.ptr))
        digest.update(repr(sizes).encode())
        return digest.hexdigest()

    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        C.llama_model_desc(self.ptr, buf, 256)
        return buf.value.decode("utf-8", "replace")

    def chat_template(self) -> str | None:
        tmpl = C.llama_model_chat_template(self.ptr, None)
        return tmpl.decode("utf-8", "replace") if tmpl else None

    # vocabulary -------------------------------------------------------------------------
    def special_tokens(self) -> tuple[int, int, int, bool]:
        """(bos, eos, eot, add_bos); a missing token is -1."""
        v = self.vocab
        return (
            int(C.llama_vocab_bos(v)),
            int(C.llama_vocab_eos(v)),
            int(C.llama_vocab_eot(v)),
            bool(C.llama_vocab_get_add_bos(v)),
        )

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        n_max = len(data) + 8
        while True:
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(
                self.vocab, data, len(data), buf, n_max, add_special, parse_special
            )
            if n == -(2**31):
                raise ValueError(f"text of {len(data)} bytes is too long to tokenize")
            if n >= 0:
                return list(buf[:n])
            n_max = -n

    def token_to_piece(self, token: int, special: bool) -> bytes:
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = C.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def detokenize(self, tokens: Sequence[int], special: bool) -> bytes:
        arr = (C.llama_token * len(tokens))(*tokens)
        size = max(16, 8 * len(tokens))
        while True:
            buf = ctypes.create_string_buffer(size)
            n = C.llama_detokenize(self.vocab, arr, len(tokens), buf, size, False, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n


class ContextHandle:
    """An owned ``llama_context`` with a reusable batch whose arrays are numpy buffers."""

    def __init__(
        self,
        model: ModelHandle,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int,
        n_threads: int,
        flash_attn: bool | None = None,
        swa_full: bool = True,
    ) -> None:
        params = C.llama_context_default_params()
        if flash_attn is not None:
            params.flash_attn_type = (
                C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        # One cell pool shared by all sequences: a fork shares prefix cells instead of copying.
        params.kv_unified = True
        # The whole sliding-window cache (the default) keeps every partial seq_rm exact.
        params.swa_full = swa_full
        mark = log_mark()
        ptr = C.llama_init_from_model(model.ptr, params)
        if not ptr:
            reason = log_errors_since(mark) or "no reason logged"
            raise ModelLoadError(f"llama.cpp could not create a context (n_ctx={n_ctx}): {reason}")
        self.ptr = ptr
        self.mem = C.llama_get_memory(ptr)
        self.n_vocab = model.n_vocab
        self.n_ctx = int(C.llama_n_ctx(ptr))
        self.n_ctx_seq = int(C.llama_n_ctx_seq(ptr))
        self.n_batch = int(C.llama_n_batch(ptr))
        self.n_seq_max = n_seq_max
        self.n_swa = model.n_swa if not swa_full else 0
        self._init_batch(self.n_batch)

    def _init_batch(self, n: int) -> None:
        self._tok = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._nseq = np.ones(n, dtype=np.int32)
        self._seq = np.zeros(n, dtype=np.int32)
        self._out = np.zeros(n, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self._seq.ctypes.data
        self._seq_ptrs = (i32p * n)(*[ctypes.cast(base + 4 * i, i32p) for i in range(n)])
        batch = C.llama_batch(
            n_tokens=0,
            token=self._tok.ctypes.data_as(i32p),
            embd=ctypes.POINTER(ctypes.c_float)(),
            pos=self._pos.ctypes.data_as(i32p),
            n_seq_id=self._nseq.ctypes.data_as(i32p),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p)),
            logits=self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self._batch = batch

    def close(self) -> None:
        if self.ptr:
            C.llama_free(self.ptr)
            self.ptr = None

    def decode(
        self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, out: np.ndarray
    ) -> np.ndarray:
        """Decode one batch of at most ``n_batch`` tokens.

        Returns:
            The logits of the tokens marked in ``out``, shape (n_out, n_vocab): a view into
            llama.cpp's buffer, valid until the next decode.
        """
        n = len(tokens)
        assert 0 < n <= self.n_batch, n
        self._tok[:n] = tokens
        self._pos[:n] = pos
        self._seq[:n] = seq
        self._out[:n] = out
        self._batch.n_tokens = n
        mark = log_mark()
        rc = C.llama_decode(self.ptr, self._batch)
        if rc == 1:
            raise ContextFullError(
                f"the KV cache has no free cells for {n} more tokens (context of {self.n_ctx} "
                "cells shared by all live sequences): close sequences or load with a larger n_ctx"
            )
        if rc != 0:
            reason = log_errors_since(mark) or "no reason logged"
            raise DecodeError(f"llama_decode failed with code {rc}: {reason}")
        n_out = int(np.count_nonzero(out))
        ptr = C.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    # memory ----------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        return bool(C.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        C.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """(min, max) position held for ``seq``; (-1, -1) when empty."""
        return (
            int(C.llama_memory_seq_pos_min(self.mem, seq)),
            int(C.llama_memory_seq_pos_max(self.mem, seq)),
        )

    def clear(self) -> None:
        C.llama_memory_clear(self.mem, True)

    # state -----------------------------------------------------------------------------
    def seq_state(self, seq: int) -> bytes:
        size = int(C.llama_state_seq_get_size(self.ptr, seq))
        buf = (ctypes.c_uint8 * size)()
        n = int(C.llama_state_seq_get_data(self.ptr, buf, size, seq))
        if n == 0 and size != 0:
            raise StateFileError(f"llama.cpp could not copy the state of sequence {seq}")
        return bytes(buf)[:n]

    def set_seq_state(self, seq: int, data: bytes) -> None:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        mark = log_mark()
        if C.llama_state_seq_set_data(self.ptr, buf, len(data), seq) == 0:
            reason = log_errors_since(mark) or "no reason logged"
            raise StateFileError(f"llama.cpp rejected the saved sequence state: {reason}")


def render_chat_template(
    template: str, messages: list[dict[str, str]], bos: str, eos: str, add_generation_prompt: bool
) -> str:
    """Render a GGUF's Jinja chat template (llama-cpp-python's sandboxed renderer)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template, eos, bos, add_generation_prompt)
    return str(formatter(messages=messages).prompt)  # type: ignore[arg-type]
