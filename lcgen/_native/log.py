"""Backend set-up and llama.cpp's log, captured so its error lines end up in lcgen's errors."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator

import llama_cpp as C

_LOG_LEVEL_ERROR = 4
_LOG_LEVEL_CONT = 5

_log_tail: deque[tuple[int, str]] = deque(maxlen=200)
_log_count = 0
_verbose = 0  # verbose models open (llama.cpp's log is one for the process)
_init_lock = threading.Lock()
_initialized = False
_stderr_lock = threading.Lock()


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


def init() -> None:
    """Initialize the backend once per process and route llama.cpp's log through lcgen."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        C.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        C.llama_backend_init()
        _initialized = True


def is_verbose() -> bool:
    """Whether llama.cpp's log goes to stderr: while a model loaded with ``verbose=True`` is
    open (it stayed on for the rest of the process)."""
    return _verbose > 0


def set_verbose(on: bool) -> None:
    """Count a verbose model in (``on``) or out, as it is loaded and closed."""
    global _verbose
    with _init_lock:
        _verbose = max(0, _verbose + (1 if on else -1))


def log_mark() -> int:
    """A position in the log; pass it to :func:`log_errors_since`."""
    return _log_count


def log_errors_since(mark: int) -> str:
    """The error (and, failing that, warning) lines llama.cpp logged since ``mark``."""
    n_new = min(_log_count - mark, len(_log_tail))
    recent = list(_log_tail)[len(_log_tail) - n_new :] if n_new > 0 else []
    errors = [m.strip() for level, m in recent if level >= _LOG_LEVEL_ERROR - 1 and m.strip()]
    return "; ".join(errors[-4:])


@contextlib.contextmanager
def capture_stderr_fd() -> Iterator[list[bytes]]:
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


def supports_gpu_offload() -> bool:
    return bool(C.llama_supports_gpu_offload())


def system_info() -> str:
    """llama.cpp's version and the CPU features its kernels were built for and found."""
    info = bytes(C.llama_print_system_info()).decode("utf-8", "replace").strip()
    return f"llama-cpp-python {getattr(C, '__version__', '?')}: {info}"
