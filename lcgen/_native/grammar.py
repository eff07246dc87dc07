"""llama.cpp's GBNF grammar sampler: parse errors captured, tokens checked one at a time or over
the whole vocabulary, and never a token accepted that the grammar does not allow (llama.cpp
terminates the process on that)."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import llama_cpp as C
import numpy as np

from lcgen._native.log import capture_stderr_fd, init, is_verbose, log_errors_since, log_mark
from lcgen._native.model import ModelHandle
from lcgen.errors import ClosedError, GrammarError

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(C.llama_token_data)


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


def _new_sampler(vocab: ctypes.c_void_p | None, gbnf: str, root: str) -> ctypes.c_void_p:
    init()
    mark = log_mark()
    with capture_stderr_fd() as captured:
        ptr = C.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
    printed = b"".join(captured).decode("utf-8", "replace")
    if not ptr:
        reason = _parse_error_reason(printed, gbnf) or log_errors_since(mark) or "no reason given"
        if is_verbose():
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
        ptr = _new_sampler(None, gbnf, root)
    except GrammarError as exc:
        if "no vocab to parse token" in str(exc):
            return False
        raise
    C.llama_sampler_free(ptr)
    return True


# Seconds of work before a projection may end a check early (a shorter one is noise).
_MIN_PROJECTED = 0.1


class MaskDeadlineError(Exception):
    """Checking a set of tokens would end past its deadline (caught, and explained, by
    :class:`lcgen.GrammarState`)."""

    def __init__(self, per_token: float, n_tokens: int) -> None:
        super().__init__(f"{n_tokens} tokens at {per_token * 1e3:.1f} ms each")
        self.per_token, self.n_tokens = per_token, n_tokens


class GrammarSampler:
    """An owned llama.cpp grammar sampler: the parse state of one grammar over one model's
    vocabulary. Not thread-safe."""

    _free = C.llama_sampler_free  # held here: still callable while the interpreter exits

    def __init__(self, model: ModelHandle, ptr: ctypes.c_void_p) -> None:
        self.model = model
        self.ptr: ctypes.c_void_p | None = ptr
        self._one: ctypes.Structure | None = None  # a one-token array, made on first use

    def __del__(self) -> None:
        self.close()

    @classmethod
    def new(cls, model: ModelHandle, gbnf: str, root: str) -> GrammarSampler:
        with model.lock:
            return cls(model, _new_sampler(model.vocab(), gbnf, root))

    def clone(self) -> GrammarSampler:
        with self.model.lock:
            ptr = C.llama_sampler_clone(self._live())
        if not ptr:
            raise GrammarError("llama.cpp could not clone the grammar state")
        return GrammarSampler(self.model, ptr)

    def _live(self) -> ctypes.c_void_p:
        if not self.ptr:
            raise ClosedError("the grammar state was closed")
        if not self.model.is_open:
            raise ClosedError("the model of this grammar state was closed")
        return self.ptr

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next (by its text)."""
        if not 0 <= token < self.model.n_vocab:
            raise ValueError(
                f"token {token!r} is outside the vocabulary (0..{self.model.n_vocab - 1})"
            )
        if self._one is None:
            data = C.llama_token_data(0, 0.0, 0.0)
            self._one = C.llama_token_data_array(ctypes.pointer(data), 1, -1, False)
            self._one_data = data
            self._one_p = ctypes.pointer(self._one)
        data = self._one_data
        data.id = token  # type: ignore[assignment]
        data.logit = 0.0
        with self.model.lock:
            C.llama_sampler_apply(self._live(), self._one_p)
        return bool(data.logit == 0.0)

    def accept(self, token: int) -> bool:
        """Advance past ``token`` if the grammar allows it; False (and no change) if not."""
        if not self.allows(token):
            return False
        with self.model.lock:
            C.llama_sampler_accept(self._live(), token)
        return True

    def allowed(self, ids: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """A bool array over the vocabulary: which of ``ids`` (int32) the grammar allows next;
        tokens not in ``ids`` count as not allowed. See :meth:`allowed_among` for
        ``deadline``."""
        result = np.zeros(self.model.n_vocab, dtype=bool)
        result[ids] = self.allowed_among(ids, deadline)
        return result

    def allowed_among(self, ids: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """Which of ``ids`` (int32, in the vocabulary) the grammar allows next: a bool array
        beside them, in one call; with a ``deadline`` (``time.monotonic()``), in parts of
        growing size.

        Raises:
            MaskDeadlineError: checking them all would end past ``deadline``, projected from
                the parts checked (after a tenth of a second's work, or once past it).
        """
        if deadline is None:
            return self._allowed_among(ids)
        allowed = np.zeros(len(ids), dtype=bool)
        start, done, size = time.monotonic(), 0, 16
        while done < len(ids):
            allowed[done : done + size] = self._allowed_among(ids[done : done + size])
            done, size = done + size, min(size * 2, 4096)
            now = time.monotonic()
            per_token = (now - start) / done
            if done < len(ids) and (
                now > deadline
                or (now - start > _MIN_PROJECTED and now + per_token * (len(ids) - done) > deadline)
            ):
                raise MaskDeadlineError(per_token, len(ids))
        return allowed

    def _allowed_among(self, ids: np.ndarray) -> np.ndarray:
        data = np.zeros(len(ids), dtype=_TOKEN_DATA)
        data["id"] = ids
        array = C.llama_token_data_array(
            data.ctypes.data_as(ctypes.POINTER(C.llama_token_data)), len(ids), -1, False
        )
        with self.model.lock:
            C.llama_sampler_apply(self._live(), ctypes.byref(array))
        allowed: np.ndarray = data["logit"] == 0.0
        return allowed

    def close(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._free(ptr)
