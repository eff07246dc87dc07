"""An owned ``llama_context``: a reusable batch whose arrays are numpy buffers, its memory (the
KV cell pool shared by all sequence ids) and its per-sequence state."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence

import llama_cpp as C
import numpy as np

from lcgen._native.log import log_errors_since, log_mark, take_interrupt
from lcgen._native.model import ModelHandle
from lcgen.errors import ClosedError, ContextFullError, DecodeError, ModelLoadError, StateFileError

# What llama.cpp keeps for each cell besides its K and V: position, shift, sequence-id bits.
_CELL_BOOKKEEPING = 40

# The KV cache element types llama.cpp takes (its --cache-type-k/-v names): ggml type id and
# bytes per element (a quantized type's blocks of 32 carry a 2-byte scale, and q4_1/q5_1 a
# 2-byte minimum too).
KV_TYPES: dict[str, tuple[int, float]] = {
    "f32": (0, 4.0),
    "f16": (1, 2.0),
    "bf16": (30, 2.0),
    "q8_0": (8, 34 / 32),
    "q5_1": (7, 24 / 32),
    "q5_0": (6, 22 / 32),
    "q4_1": (3, 20 / 32),
    "q4_0": (2, 18 / 32),
    "iq4_nl": (20, 18 / 32),
}


def machine_memory() -> int:
    """This machine's RAM and swap in bytes (0 where the system does not say)."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0
    swap = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("SwapTotal:"):
                    swap = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return ram + swap


def check_memory(model: ModelHandle, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> None:
    """Refuse a context whose KV cache cannot fit in this machine's memory, before llama.cpp
    spends a minute failing to allocate it (or the process is killed touching it).

    Raises:
        ModelLoadError: naming ``n_ctx``, the bytes it needs and the bytes there are.
    """
    k, v = model.kv_elements_per_cell() if model.n_offloaded == 0 else (0, 0)
    on_host = round(k * KV_TYPES[type_k][1] + v * KV_TYPES[type_v][1])
    need, have = n_ctx * (on_host + _CELL_BOOKKEEPING), machine_memory()
    if have and need > have:
        raise ModelLoadError(
            f"n_ctx={n_ctx} needs about {need / 2**30:,.1f} GiB for its KV cache, more than "
            f"this machine's {have / 2**30:,.1f} GiB of memory: load the model with a smaller "
            "n_ctx"
        )


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
        spare_seq: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
    ) -> None:
        check_memory(model, n_ctx, type_k, type_v)
        params = C.llama_context_default_params()
        if flash_attn is not None:
            params.flash_attn_type = (
                C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max + spare_seq  # the spare id: n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.no_perf = True
        params.type_k, params.type_v = KV_TYPES[type_k][0], KV_TYPES[type_v][0]
        # One cell pool shared by all sequences: a fork shares prefix cells instead of copying.
        params.kv_unified = True
        # The whole sliding-window cache (the default) keeps every partial seq_rm exact.
        params.swa_full = swa_full
        mark = log_mark()
        take_interrupt()  # (one from before: not this call's)
        ptr = C.llama_init_from_model(model.live(), params)
        if take_interrupt():  # Ctrl-C while it logged (see lcgen._native.log)
            if ptr:
                C.llama_free(ptr)
            raise KeyboardInterrupt
        if not ptr:
            reason = log_errors_since(mark) or "no reason logged"
            raise ModelLoadError(f"llama.cpp could not create a context (n_ctx={n_ctx}): {reason}")
        self.ptr: ctypes.c_void_p | None = ptr
        self._model = model  # freed after this context (see ModelHandle.close)
        model.contexts.append(self)
        self.mem = C.llama_get_memory(ptr)
        self.name = model.name
        self.n_vocab = model.n_vocab
        self.n_ctx = int(C.llama_n_ctx(ptr))
        self.n_ctx_seq = int(C.llama_n_ctx_seq(ptr))
        self.n_batch = int(C.llama_n_batch(ptr))
        self.n_seq_max = n_seq_max
        # The sliding window the model's layers attend through (0: none), full-size cache or
        # not: a state restored from bytes holds only each window's last positions.
        self.n_swa = model.n_swa
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
        self._batch = C.llama_batch(
            n_tokens=0,
            token=self._tok.ctypes.data_as(i32p),
            embd=ctypes.POINTER(ctypes.c_float)(),
            pos=self._pos.ctypes.data_as(i32p),
            n_seq_id=self._nseq.ctypes.data_as(i32p),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p)),
            logits=self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def live(self) -> ctypes.c_void_p:
        """The context pointer.

        Raises:
            ClosedError: the context (its model) was closed.
        """
        if self.ptr is None:
            raise ClosedError(f"the model {self.name} is closed; load it again with lcgen.load()")
        return self.ptr

    def set_threads(self, n_threads: int) -> None:
        """The CPU threads of the next decodes (single tokens and batches alike)."""
        C.llama_set_n_threads(self.live(), n_threads, n_threads)

    _free = C.llama_free  # held here: still callable while the interpreter exits

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None:  # (not where __init__ raised)
            self.close()

    def close(self) -> None:
        """Free the context (idempotent)."""
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._free(ptr)
            with contextlib.suppress(ValueError):
                self._model.contexts.remove(self)

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
        return self._decode(n, int(np.count_nonzero(out)))

    def decode_seq(self, tokens: Sequence[int], pos: int, seq: int, n_out: int) -> np.ndarray:
        """Decode tokens of one sequence id at positions ``pos, pos + 1, ...`` (at most
        ``n_batch``), with the logits after the last ``n_out`` of them: :meth:`decode` without
        building its arrays (the common step: one sequence, one token).

        Returns:
            The logits, shape (n_out, n_vocab): a view into llama.cpp's buffer.
        """
        n = len(tokens)
        assert 0 < n <= self.n_batch and 0 <= n_out <= n, (n, n_out)
        self._tok[:n] = tokens
        self._pos[:n] = np.arange(pos, pos + n, dtype=np.int32)
        self._seq[:n] = seq
        self._out[: n - n_out] = 0
        self._out[n - n_out : n] = 1
        return self._decode(n, n_out)

    def _decode(self, n: int, n_out: int) -> np.ndarray:
        """``llama_decode`` of the batch's first ``n`` tokens, ``n_out`` of them with logits."""
        ptr = self.live()
        self._batch.n_tokens = n
        mark = log_mark()
        rc = C.llama_decode(ptr, self._batch)
        if rc == 1:
            raise ContextFullError(
                f"the KV cache has no free cells for {n} more tokens (context of {self.n_ctx} "
                "cells shared by all live sequences): close sequences or load with a larger n_ctx"
            )
        if rc != 0:
            reason = log_errors_since(mark) or "no reason logged"
            raise DecodeError(f"llama_decode failed with code {rc}: {reason}")
        logits = C.llama_get_logits(ptr)
        return np.ctypeslib.as_array(logits, shape=(n_out, self.n_vocab))

    # memory ----------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        self.live()
        return bool(C.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.live()
        C.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """(min, max) position held for ``seq``; (-1, -1) when empty."""
        self.live()
        return (
            int(C.llama_memory_seq_pos_min(self.mem, seq)),
            int(C.llama_memory_seq_pos_max(self.mem, seq)),
        )

    # state -----------------------------------------------------------------------------
    def state_size(self) -> int:
        """The size of the whole context's state (every sequence's cells), in bytes."""
        return int(C.llama_state_get_size(self.live()))

    def seq_state_size(self, seq: int) -> int:
        return int(C.llama_state_seq_get_size(self.live(), seq))

    def seq_state_into(self, seq: int, out: bytearray, offset: int, size: int) -> int:
        """Copy the state of ``seq`` into ``out[offset:offset + size]`` (no other copy).

        Returns:
            The bytes written.
        """
        ptr = self.live()
        view = (ctypes.c_uint8 * size).from_buffer(out, offset)
        n = int(C.llama_state_seq_get_data(ptr, view, size, seq))
        del view  # release the buffer export, so ``out`` may be resized again
        if n == 0 and size != 0:
            raise StateFileError(f"llama.cpp could not copy the state of sequence {seq}")
        return n

    def set_seq_state(self, seq: int, data: bytes | bytearray | memoryview) -> None:
        """Load a state copied by :meth:`seq_state_into` into ``seq`` (read in place)."""
        ptr = self.live()
        arr = np.frombuffer(data, dtype=np.uint8)
        mark = log_mark()
        data_ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if C.llama_state_seq_set_data(ptr, data_ptr, arr.size, seq) == 0:
            reason = log_errors_since(mark) or "no reason logged"
            if "available cells" in reason:  # a full memory, not a bad file
                raise ContextFullError(f"no room in the KV cache for the saved state: {reason}")
            raise StateFileError(f"llama.cpp rejected the saved sequence state: {reason}")
