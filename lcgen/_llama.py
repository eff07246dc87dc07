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
    def seq_state_size(self, seq: int) -> int:
        return int(C.llama_state_seq_get_size(self.ptr, seq))

    def seq_state_into(self, seq: int, out: bytearray, offset: int, size: int) -> int:
        """Copy the state of ``seq`` into ``out[offset:offset + size]`` (no other copy).

        Returns:
            The bytes written.
        """
        view = (ctypes.c_uint8 * size).from_buffer(out, offset)
        n = int(C.llama_state_seq_get_data(self.ptr, view, size, seq))
        del view  # release the buffer export, so ``out`` may be resized again
        if n == 0 and size != 0:
            raise StateFileError(f"llama.cpp could not copy the state of sequence {seq}")
        return n

    def set_seq_state(self, seq: int, data: bytes | bytearray | memoryview) -> None:
        """Load a state copied by :meth:`seq_state_into` into ``seq`` (read in place)."""
        arr = np.frombuffer(data, dtype=np.uint8)
        ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        mark = log_mark()
        if C.llama_state_seq_set_data(self.ptr, ptr, arr.size, seq) == 0:
            reason = log_errors_since(mark) or "no reason logged"
            raise StateFileError(f"llama.cpp rejected the saved sequence state: {reason}")


def render_chat_template(
    template: str, messages: list[dict[str, str]], bos: str, eos: str, add_generation_prompt: bool
) -> str:
    """Render a GGUF's Jinja chat template (llama-cpp-python's sandboxed renderer)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template, eos, bos, add_generation_prompt)
    return str(formatter(messages=messages).prompt)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# grammar: llama.cpp's GBNF sampler (used by lcgen.grammar)
# ---------------------------------------------------------------------------------------------

import contextlib  # noqa: E402
import tempfile  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Iterator  # noqa: E402

from lcgen.errors import GrammarError  # noqa: E402

# Tokens printed as nothing when special=False: the grammar sees their text, the user would not.
_HIDDEN_ATTRS = int(C.LLAMA_TOKEN_ATTR_UNKNOWN) | int(C.LLAMA_TOKEN_ATTR_CONTROL)
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(C.llama_token_data)
_stderr_lock = threading.Lock()


@contextlib.contextmanager
def _capture_stderr_fd() -> Iterator[list[bytes]]:
    """Collect what C code writes to file descriptor 2 (the grammar parser prints its errors
    there, not to the log); yields a list that holds the bytes once the block ends."""
    captured: list[bytes] = []
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to redirect: run uncaptured
            yield captured
            return
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.append(tmp.read())


def _parse_error_reason(stderr_text: str, gbnf: str) -> str:
    """llama.cpp's parse error (``parse: error parsing grammar: WHAT\\n\\nGRAMMAR\\n``), with the
    position given as line and column instead of the rest of the grammar text."""
    head = "error parsing grammar: "
    start = stderr_text.find(head)
    if start < 0:
        return ""
    what = stderr_text[start + len(head) :]
    tail = "\n\n" + gbnf + "\n"
    if what.endswith(tail):
        what = what[: -len(tail)]
    if what.strip() == "unexpected end of input":
        return "unexpected end of input (an unclosed string, class or group at the end?)"
    at = what.find(" at ")
    while at >= 0:
        rest = what[at + 4 :]
        if gbnf.endswith(rest):
            offset = len(gbnf) - len(rest)
            line = gbnf.count("\n", 0, offset) + 1
            column = offset - (gbnf.rfind("\n", 0, offset) + 1) + 1
            snippet = rest.split("\n", 1)[0][:40]
            return f"{what[:at]} at line {line}, column {column} ({snippet!r})"
        at = what.find(" at ", at + 1)
    return what.strip()


def _new_grammar_sampler(vocab: ctypes.c_void_p | None, gbnf: str, root: str) -> ctypes.c_void_p:
    init()
    mark = log_mark()
    with _capture_stderr_fd() as captured:
        ptr = C.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
    printed = b"".join(captured).decode("utf-8", "replace")
    if not ptr:
        reason = _parse_error_reason(printed, gbnf) or log_errors_since(mark) or "no reason given"
        if _verbose:
            sys.stderr.write(printed)
        raise GrammarError(f"llama.cpp rejected the grammar: {reason}")
    if printed:  # not ours: give it back to stderr
        os.write(2, printed.encode("utf-8"))
    return ptr  # type: ignore[no-any-return]


def check_gbnf(gbnf: str, root: str) -> bool:
    """Parse ``gbnf`` without a vocabulary.

    Returns:
        True when it parses; False when it needs a vocabulary to tell (it names tokens).

    Raises:
        GrammarError: the parse error, with llama.cpp's reason and the position.
    """
    try:
        ptr = _new_grammar_sampler(None, gbnf, root)
    except GrammarError as exc:
        if "no vocab to parse token" in str(exc):
            return False
        raise
    C.llama_sampler_free(ptr)
    return True


class GrammarVocab:
    """What the grammar sampler needs to know about one model's vocabulary, built once."""

    def __init__(self, model: ModelHandle) -> None:
        self.model = model
        self.vocab = model.vocab
        self.n_vocab = model.n_vocab
        candidates = (int(C.llama_vocab_eos(self.vocab)), int(C.llama_vocab_eot(self.vocab)))
        self.eog_tokens = tuple(t for t in dict.fromkeys(candidates) if t >= 0)
        hidden = np.zeros(self.n_vocab, dtype=bool)
        eog = set(self.eog_tokens)
        for token in range(self.n_vocab):
            if int(C.llama_vocab_get_attr(self.vocab, token)) & _HIDDEN_ATTRS:
                if C.llama_vocab_is_eog(self.vocab, token):
                    eog.add(token)
                else:
                    hidden[token] = True
        self.hidden = hidden
        self.hidden_set = frozenset(int(t) for t in np.flatnonzero(hidden))
        self.eog_set = frozenset(eog)
        self.visible_ids = np.flatnonzero(~hidden).astype(np.int32)
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._byte_tokens: dict[int, int] | None = None
        self.cache: dict[str, object] = {}  # for the layer above: per-vocabulary tables

    def piece(self, token: int) -> bytes:
        """The bytes the grammar sees for ``token`` (its piece with special tokens shown)."""
        piece = self._pieces[token]
        if piece is None:
            piece = self._pieces[token] = self.model.token_to_piece(token, True)
        return piece

    def all_pieces(self) -> list[bytes]:
        """Every token's piece (as :meth:`piece`), fetched in one pass."""
        buf = ctypes.create_string_buffer(256)
        pieces = self._pieces
        for token in range(self.n_vocab):
            if pieces[token] is None:
                n = int(C.llama_token_to_piece(self.vocab, token, buf, 256, 0, True))
                pieces[token] = buf.raw[:n] if n >= 0 else self.piece(token)
        return pieces  # type: ignore[return-value]

    def byte_tokens(self) -> dict[int, int]:
        """byte value -> a token whose piece is that one byte (built on first use)."""
        if self._byte_tokens is None:
            found: dict[int, int] = {}
            for token in self.visible_ids.tolist():
                piece = self.piece(token)
                if len(piece) == 1 and token not in self.eog_set:
                    found.setdefault(piece[0], token)
            self._byte_tokens = found
        return self._byte_tokens


_grammar_vocabs: weakref.WeakKeyDictionary[ModelHandle, GrammarVocab] = weakref.WeakKeyDictionary()
_grammar_vocabs_lock = threading.Lock()


def grammar_vocab(model: ModelHandle) -> GrammarVocab:
    """The model's :class:`GrammarVocab`, built on first use (a pass over the vocabulary)."""
    with _grammar_vocabs_lock:
        info = _grammar_vocabs.get(model)
        if info is None:
            info = _grammar_vocabs[model] = GrammarVocab(model)
        return info


class GrammarSampler:
    """An owned llama.cpp grammar sampler: the parse state of one grammar over one vocabulary.

    ``accept`` checks the token first: llama.cpp terminates the process when a grammar sampler
    accepts a token it does not allow. Not thread-safe.
    """

    _free = C.llama_sampler_free  # held here: still callable while the interpreter exits

    def __init__(self, info: GrammarVocab, ptr: ctypes.c_void_p) -> None:
        self.info = info
        self.ptr: ctypes.c_void_p | None = ptr
        self._one: ctypes.Structure | None = None  # a one-token array, made on first use

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._free(ptr)

    @classmethod
    def new(cls, info: GrammarVocab, gbnf: str, root: str) -> GrammarSampler:
        if not info.model.ptr:
            raise GrammarError("the model was closed")
        return cls(info, _new_grammar_sampler(info.vocab, gbnf, root))

    def clone(self) -> GrammarSampler:
        ptr = C.llama_sampler_clone(self._live())
        if not ptr:
            raise GrammarError("llama.cpp could not clone the grammar state")
        return GrammarSampler(self.info, ptr)

    def _live(self) -> ctypes.c_void_p:
        if not self.ptr:
            raise GrammarError("the grammar state was closed")
        if not self.info.model.ptr:
            raise GrammarError("the model of this grammar state was closed")
        return self.ptr

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.info.n_vocab:
            raise ValueError(
                f"token {token!r} is outside the vocabulary (0..{self.info.n_vocab - 1})"
            )
        if token in self.info.hidden_set:
            return False
        if self._one is None:
            data = C.llama_token_data(0, 0.0, 0.0)
            self._one = C.llama_token_data_array(ctypes.pointer(data), 1, -1, False)
            self._one_data = data
            self._one_p = ctypes.pointer(self._one)
        data = self._one_data
        data.id = token  # type: ignore[assignment]
        data.logit = 0.0
        C.llama_sampler_apply(self._live(), self._one_p)
        return bool(data.logit == 0.0)

    def accept(self, token: int) -> bool:
        """Advance past ``token`` if the grammar allows it; False (and no change) if not."""
        if not self.allows(token):
            return False
        C.llama_sampler_accept(self._live(), token)
        return True

    def allowed(self, ids: np.ndarray | None = None) -> np.ndarray:
        """A bool array over the vocabulary: which tokens the grammar allows next.

        Args:
            ids: check only these tokens (int32; the others count as not allowed); default:
                every token that is not hidden.
        """
        if ids is None:
            ids = self.info.visible_ids
        data = np.zeros(len(ids), dtype=_TOKEN_DATA)
        data["id"] = ids
        array = C.llama_token_data_array(
            data.ctypes.data_as(ctypes.POINTER(C.llama_token_data)), len(ids), -1, False
        )
        C.llama_sampler_apply(self._live(), ctypes.byref(array))
        result = np.zeros(self.info.n_vocab, dtype=bool)
        result[ids] = data["logit"] == 0.0
        return result

    def close(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._free(ptr)
